//! A whole job from a config: load data and teacher, build students, train
//! under the configured schedule, stitch, evaluate, save, report.
//!
//! This is the layer the CLI calls; the backend is picked here from the
//! device string, everything below is generic over burn's backend.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pipebd_core::{Block, BlockSpec, Dataset, Loss, OutputHead, Samples, StudentModule, Students};
use pipebd_kernels::DistillBackend;

use crate::config::RunConfig;
use crate::jobs::check::{check_out_dir, preflight};
use crate::jobs::eval::load_student_weights;
use crate::jobs::profile::{auto_plan, auto_plan_across_ranks, send_rank_costs};
use crate::jobs::search::SearchScores;
use crate::metrics::write_metrics;
use crate::report::{BlockReport, RunReport, Startup, StitchedReport};
use crate::zoo::{Workload, Zoo};
use pipe_bd::data::held_out_split;
use pipe_bd::device::{dispatch, BackendJob};
use pipe_bd::error::{Error, Result};
use pipe_bd::eval::{candidate_record_path, save_candidates, save_students, score, student_record_path};
use pipe_bd::plan::Plan;
use pipe_bd::planning::planner::CostTable;
use pipe_bd::planning::simulate::simulate_shared;
use pipe_bd::runtime::launch::ranks_on_this_node;
use pipe_bd::runtime::transport::{rank_mismatch, Tag, Transport};
use pipe_bd::runtime::{concurrent_workers, cores, threads_per_worker, Distillation};
use pipe_bd::search::score::{block_scores, measure_candidates};
use pipe_bd::trace::write_chrome_trace;
use pipe_bd::train::stitch::{OutputLoss, OutputLossKind, StitchedPass};
use pipe_bd::train::{inference_blocks, Progress};

/// Command-line flags of a run that are not part of its config (`--trace`,
/// `--resume`, `--max-failures`).
#[derive(Debug, Clone, Default)]
pub struct RunFlags {
    /// Write `trace.json` (Chrome trace events of every worker).
    pub trace: bool,
    /// Continue from the newest complete checkpoint of each block in this
    /// run folder (or checkpoint folder).
    pub resume: Option<PathBuf>,
    /// Override `runtime.max_failures`.
    pub max_failures: Option<usize>,
    /// Stop after the steps in flight when this is requested (the command
    /// line routes SIGINT and SIGTERM here).
    pub interrupt: pipe_bd::runtime::interrupt::Interrupt,
}

/// The runtime settings of a run, built here once: the config's
/// ([`RunConfig::runtime_settings`]), with checkpoints in
/// `out_dir/checkpoints` (resumed only under the same config fields, the
/// zoo's `zoo_identity` among them), the flags' resume folder and failure budget,
/// faults from [`pipe_bd::fault::ENV`], the cost table for re-planning and,
/// across processes, the transport (ranks on one machine share its cores).
pub fn runtime_settings_for(
    config: &RunConfig,
    zoo_identity: std::collections::BTreeMap<String, serde_json::Value>,
    out_dir: &Path,
    flags: &RunFlags,
    costs: Option<&CostTable>,
    transport: Option<&Arc<dyn Transport>>,
) -> Result<pipe_bd::runtime::RuntimeSettings> {
    let mut runtime = config.runtime_settings();
    runtime.checkpoints = Some(config.checkpoint_policy(out_dir.join("checkpoints"), zoo_identity));
    runtime.resume_from =
        flags.resume.clone().filter(|dir| !stopped_before_any_checkpoint(dir, out_dir, config));
    runtime.interrupt = flags.interrupt.clone();
    runtime.faults.extend(pipe_bd::fault::from_env()?);
    if let Some(max) = flags.max_failures {
        runtime.max_failures = max;
    }
    runtime.costs = costs.cloned();
    if let Some(transport) = transport {
        if runtime.threads_per_worker == 0 {
            runtime.threads_per_worker = (cores() / ranks_on_this_node()).max(1);
        }
        runtime.transport = Some(transport.clone());
    }
    Ok(runtime)
}

/// True when `--resume` names this run's own folder and it holds no
/// checkpoint yet (the run was stopped before its first one): the run then
/// starts from the first step, saying so, instead of refusing; the command
/// printed by an interrupted run and a scheduler's requeue work either way.
/// Another folder without checkpoints is still refused (a mistyped path).
fn stopped_before_any_checkpoint(resume: &Path, out_dir: &Path, config: &RunConfig) -> bool {
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    };
    let checkpoints = pipe_bd::train::checkpoint::resolve_dir(resume);
    let blocks = config.students.len();
    let empty = (1..=blocks).all(|b| pipe_bd::train::checkpoint::list(&checkpoints, b).is_empty());
    let fresh = same(resume, out_dir) && empty;
    if fresh {
        let message = format!(
            "nothing to resume in {} yet (stopped before its first checkpoint): starting from the first step",
            resume.display()
        );
        crate::reporter::reporter().info("pipebd", &message);
    }
    fresh
}

/// Runs the job described by `config`, with the teacher, students and data
/// of `zoo`, writing `report.json`, `metrics.csv`, the trained student
/// (`student/block-K.mpk`) and, with `flags.trace`, `trace.json` into
/// `out_dir`. `observer` sees every training step (for progress bars).
pub fn run<Z: Zoo>(
    zoo: &Z,
    config: &RunConfig,
    out_dir: &Path,
    flags: &RunFlags,
    observer: &mut dyn FnMut(&Progress),
) -> Result<RunReport> {
    run_rank(zoo, config, out_dir, flags, None, observer)?
        .ok_or_else(|| Error::Transport { message: "a single-process run ended without a report".into() })
}

/// [`run`] as one rank of a run spread over processes (`transport`; `None`:
/// this process alone). Device slot `r` runs on rank `r`, so the plan must
/// use exactly as many slots as there are ranks; a config with a single
/// `device` gets one slot of it per rank. Every rank trains its workers
/// and writes its stage leaders' checkpoints; rank 0 alone chooses an
/// `auto` plan (and hands it to the others), then evaluates, stitches and
/// writes the outputs, and returns the report (`None` on the other ranks).
pub fn run_rank<Z: Zoo>(
    zoo: &Z,
    config: &RunConfig,
    out_dir: &Path,
    flags: &RunFlags,
    transport: Option<Arc<dyn Transport>>,
    observer: &mut dyn FnMut(&Progress),
) -> Result<Option<RunReport>> {
    check_out_dir(out_dir)?;
    let mut config = config.clone();
    if let Some(t) = &transport {
        let slots = config.device_slots();
        if slots.len() == 1 {
            config.devices = Some(rank_devices(&slots[0], t.ranks(), ranks_on_this_node()));
        }
    }
    let config = &config;
    let (devices, plan) = preflight(zoo, config)?;
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io("creating directory", out_dir, e))?;
    let (plan, costs) = match (plan, &transport) {
        (Some(plan), _) => (plan, None),
        (None, Some(t)) if t.rank() != 0 => {
            send_rank_costs(zoo, config, t.as_ref())?;
            (receive_plan(t.as_ref())?, None)
        }
        (None, _) => {
            let mut say = |line: &str| crate::reporter::reporter().info("auto", line);
            let planned = match &transport {
                Some(t) => auto_plan_across_ranks(zoo, config, t.as_ref(), &mut say),
                None => auto_plan(zoo, config, &mut say),
            };
            if let Some(t) = &transport {
                share_plan(t.as_ref(), planned.as_ref().map(|(plan, _)| plan).map_err(|e| e.to_string()))?;
            }
            let (plan, costs) = planned?;
            (plan, Some(costs))
        }
    };
    if let Some(t) = transport.as_ref().filter(|t| plan.slots() != t.ranks()) {
        return Err(rank_mismatch(&plan, t.ranks()));
    }
    let job = Job { zoo, config, plan: &plan, costs: costs.as_ref(), out_dir, flags, observer, transport };
    dispatch(&devices, job)
}

/// One device slot per rank from a config's single `device`: `cpu` for
/// every rank; a GPU kind without an index (`cuda`, `wgpu`) as the GPU of
/// the rank's index on its node (ranks fill nodes in order, `per_node` each,
/// as `mpirun` and `srun` place them by default).
pub fn rank_devices(device: &str, ranks: usize, per_node: usize) -> Vec<String> {
    if device == "cpu" || device.contains(':') {
        return vec![device.to_string(); ranks];
    }
    (0..ranks).map(|r| format!("{device}:{}", r % per_node.max(1))).collect()
}

/// Rank 0's `auto` plan (or why it has none) for the other ranks.
fn share_plan(transport: &dyn Transport, plan: std::result::Result<&Plan, String>) -> Result<()> {
    let bytes = pipe_bd::runtime::frames::encode_plan(plan);
    for rank in 1..transport.ranks() {
        transport.post(rank, Tag::Plan, bytes.clone())?;
    }
    Ok(())
}

/// How long a rank waits for rank 0 to profile and choose an `auto` plan.
const PLAN_WAIT: Duration = Duration::from_secs(3600);

/// The plan rank 0 chose.
fn receive_plan(transport: &dyn Transport) -> Result<Plan> {
    let bytes = transport.receive(0, Tag::Plan, PLAN_WAIT)?.ok_or_else(|| Error::Timeout {
        message: format!(
            "rank {} waited {} s for rank 0's `auto` plan",
            transport.rank(),
            PLAN_WAIT.as_secs()
        ),
    })?;
    pipe_bd::runtime::frames::decode_plan(&bytes)
}

/// The students of `config`, built (and initialised) by `zoo` with their
/// saved weights loaded, and where the start-up's time went: `loaded`
/// seconds after `start` for the teacher and data, the rest until now for
/// the students.
fn built_students<Z: Zoo, B: DistillBackend>(
    zoo: &Z,
    config: &RunConfig,
    teacher: &[pipebd_core::BlockSpec],
    device: &B::Device,
    (start, loaded): (Instant, f64),
) -> Result<(pipebd_core::Students<B, Z::Student<B>>, Startup)> {
    let students = load_student_weights(config, zoo.students::<B>(config, teacher, device)?, device)?;
    let students_seconds = start.elapsed().as_secs_f64() - loaded;
    Ok((students, Startup { teacher_and_data_seconds: loaded, students_seconds }))
}

struct Job<'a, Z> {
    zoo: &'a Z,
    config: &'a RunConfig,
    plan: &'a Plan,
    costs: Option<&'a CostTable>,
    out_dir: &'a Path,
    flags: &'a RunFlags,
    observer: &'a mut dyn FnMut(&Progress),
    transport: Option<Arc<dyn Transport>>,
}

impl<Z: Zoo> BackendJob for Job<'_, Z> {
    type Output = Option<RunReport>;

    fn run<B: DistillBackend>(self, devices: &[B::Device]) -> Result<Option<RunReport>> {
        let config = self.config;
        let start = Instant::now();
        let device = &devices[0];
        let Workload { teacher, train, evaluation } =
            self.zoo.workload::<B::InnerBackend>(config, device, true)?;
        let loaded = start.elapsed().as_secs_f64();
        let (students, startup) = built_students(self.zoo, config, &teacher.specs, device, (start, loaded))?;
        // A search run holds the last samples out to score its candidates on
        // (and a single-path search to train alpha on).
        let (trained_on, held_out) =
            held_out_split(train.as_ref(), config.has_candidates().then_some(config.search.held_out));
        let identity = self.zoo.checkpoint_identity(config);
        let runtime = runtime_settings_for(
            config,
            identity,
            self.out_dir,
            self.flags,
            self.costs,
            self.transport.as_ref(),
        )?;
        let rank = self.transport.as_ref().map_or(0, |t| t.rank());
        // Loaded before training, so that a missing one fails at once.
        let head = if rank == 0 { stitched_output_head::<Z, B>(self.zoo, config, device)? } else { None };
        let settings = config.train_settings();
        let mut distillation = Distillation::new(&teacher, students, &trained_on)
            .settings(settings.clone())
            .devices(devices.to_vec())
            .runtime(runtime)
            .observer(&mut *self.observer);
        if let Some(held_out) = &held_out {
            // A single-path search's architecture steps; unused otherwise.
            distillation = distillation.held_out(held_out);
        }
        let output = distillation.run(self.plan)?;
        if rank != 0 {
            // Rank 0 holds every block too (each phase ends with the
            // states exchanged) and writes the outputs.
            return Ok(None);
        }
        let mut log = output.log;
        let run =
            (&teacher, &trained_on as &dyn Dataset<B::InnerBackend>, &settings, head.as_deref(), device);
        let (students, stitched) = stitch(config, output.students, &mut log, run, self.observer)?;
        let predicted_step_seconds = self
            .costs
            .and_then(|costs| predicted_step_seconds(config, self.plan, costs, log.steps, devices.len()));
        let trained = inference_blocks(&students);
        let score = score(
            evaluation.as_deref(),
            (&teacher.blocks, &teacher.specs),
            (&trained, &students.specs),
            device,
        )?;
        save_students(self.out_dir, &students)?;
        if let Some(held_out) = &held_out {
            let scores = score_search(self.zoo, config, &teacher, &students, &trained, held_out, device)?;
            scores.write(self.out_dir)?;
            save_candidates(self.out_dir, &students)?;
        }
        write_metrics(self.out_dir, &log.rows)?;
        if self.flags.trace {
            write_chrome_trace(&self.out_dir.join("trace.json"), &output.spans, &output.workers)?;
        }
        let blocks = block_reports(&teacher.specs, &students.specs, &log, stitched.as_ref());

        let report = RunReport {
            name: config.name.clone(),
            schedule: self.plan.name.clone(),
            plan: self.plan.describe(),
            final_plan: output.final_plan.describe(),
            device: config.device_slots().join(","),
            teacher_accuracy: score.teacher_accuracy,
            student_accuracy: score.student_accuracy,
            test_samples: score.test_samples,
            sections: score.sections.iter().map(|s| (s.name.clone(), s.value.clone())).collect(),
            section_lines: score.sections.iter().flat_map(|s| s.lines.clone()).collect(),
            train_samples: trained_on.len(),
            steps: log.steps,
            steps_run: log.steps_run,
            wall_seconds: start.elapsed().as_secs_f64(),
            peak_memory_bytes: crate::report::peak_memory_bytes(),
            startup: Some(startup),
            train_seconds: log.seconds,
            samples_per_second: log.samples as f64 / log.seconds.max(1e-9),
            measured_step_seconds: log.seconds / log.steps_run.max(1) as f64,
            predicted_step_seconds,
            measured_over_predicted: predicted_step_seconds
                .map(|p| log.seconds / log.steps_run.max(1) as f64 / p.max(1e-12)),
            host_reads: output.workers.iter().map(|w| w.host_reads).sum(),
            blocks,
            workers: output.workers,
            stitched,
            resilience: output.resilience,
            config: config.clone(),
        };
        report.write(self.out_dir)?;
        Ok(Some(report))
    }
}

/// The frozen head a `head-kl` stitched pass scores through, when the
/// config asks for one; an error when the zoo has none for its teacher.
fn stitched_output_head<Z: Zoo, B: DistillBackend>(
    zoo: &Z,
    config: &RunConfig,
    device: &B::Device,
) -> Result<Option<Box<dyn OutputHead<B>>>> {
    if config.train.stitched_output_loss != Some(OutputLossKind::HeadKl) || config.train.stitched_epochs == 0
    {
        return Ok(None);
    }
    let head = zoo.output_head::<B>(config, device)?.ok_or_else(|| Error::Config {
        path: format!("config `{}`", config.name).into(),
        line: None,
        field: Some("train.stitched_output_loss".into()),
        message: format!("`head-kl`: the zoo gives no output head for teacher `{}`", config.teacher.kind),
    })?;
    Ok(Some(head))
}

/// The stitched pass after the blockwise epochs, when the config asks for
/// one (`train.stitched_epochs`): its learning rate (the config's, else a
/// third of the blockwise one), its run, its rows appended to `log`'s, and
/// its report. `run` is the teacher, the training samples, the settings,
/// the output head (for `head-kl`) and the device.
#[allow(clippy::type_complexity)]
fn stitch<B: DistillBackend, T: Block<B::InnerBackend>, S: StudentModule<B>>(
    config: &RunConfig,
    students: Students<B, S>,
    log: &mut pipe_bd::train::TrainLog,
    run: (
        &pipebd_core::Teacher<B::InnerBackend, T>,
        &dyn Dataset<B::InnerBackend>,
        &pipe_bd::train::TrainSettings,
        Option<&dyn OutputHead<B>>,
        &B::Device,
    ),
    observer: &mut dyn FnMut(&Progress),
) -> Result<(Students<B, S>, Option<StitchedReport>)> {
    if config.train.stitched_epochs == 0 {
        return Ok((students, None));
    }
    let (teacher, data, settings, head, device) = run;
    let first_step = log.steps;
    let epochs = config.train.stitched_epochs;
    let mut optimizer = config.optimizer.clone();
    optimizer.lr = config.train.stitched_lr.unwrap_or(config.optimizer.lr / 3.0);
    optimizer.min_lr = optimizer.min_lr.min(optimizer.lr);
    let pass = StitchedPass {
        epochs,
        optimizer: optimizer.clone(),
        first_step,
        gradients: config.train.stitched_gradients,
        output_loss: config
            .train
            .stitched_output_loss
            .map(|kind| OutputLoss { kind, weight: config.train.stitched_output_weight }),
        block_weight: config.train.stitched_block_weight,
    };
    let (students, pass) = pipe_bd::train::stitch::StitchedRun::new(teacher, data, settings, device)
        .with_optional_head(head)
        .train(students, &pass, observer)?;
    let report = StitchedReport {
        epochs,
        gradients: config.train.stitched_gradients,
        steps: pass.steps,
        lr: optimizer.lr,
        seconds: pass.seconds,
        samples_per_second: (pass.steps * config.train.batch_size) as f64 / pass.seconds.max(1e-9),
        step_seconds: pass.step_seconds,
        final_losses: pass.final_losses,
        output_loss: config.train.stitched_output_loss.map(|kind| kind.name().to_string()),
        output_weight: config.train.stitched_output_loss.map(|_| config.train.stitched_output_weight),
        block_weight: config.train.stitched_block_weight,
        final_output_loss: pass.final_output_loss,
    };
    log.rows.extend(pass.rows);
    Ok((students, Some(report)))
}

/// What the simulator predicts per step for `plan` on the measured `costs`
/// (`schedule = "auto"`), with the run's threads and channel capacity.
fn predicted_step_seconds(
    config: &RunConfig,
    plan: &Plan,
    costs: &CostTable,
    steps: usize,
    slots: usize,
) -> Option<f64> {
    let data_load = costs.input_transfer.first().cloned().unwrap_or_default();
    let threads = threads_per_worker(config.runtime.threads_per_worker, slots);
    let processors = concurrent_workers(threads) as f64;
    simulate_shared(plan, costs, &data_load, steps, config.runtime.channel_capacity, processors)
        .map(|p| p.step_seconds)
}

/// One report line per block. Without blockwise steps (`train.epochs = 0`)
/// the blocks' last losses are the stitched pass's.
fn block_reports(
    teacher: &[BlockSpec],
    students: &[BlockSpec],
    log: &pipe_bd::train::TrainLog,
    stitched: Option<&StitchedReport>,
) -> Vec<crate::report::BlockReport> {
    let final_losses = match stitched {
        Some(pass) if log.steps == 0 => &pass.final_losses,
        _ => &log.final_losses,
    };
    teacher
        .iter()
        .zip(students)
        .zip(final_losses)
        .enumerate()
        .map(|(k, ((t, s), &final_loss))| block_report(k, t, s, final_loss))
        .collect()
}

/// Scores every block's candidates on the held-out samples (an ordinary
/// block as its own single candidate) for `search.json`.
fn score_search<Z: Zoo, B: DistillBackend, T: Block<B::InnerBackend>, S: StudentModule<B>>(
    zoo: &Z,
    config: &RunConfig,
    teacher: &pipebd_core::Teacher<B::InnerBackend, T>,
    students: &Students<B, S>,
    trained: &[S::InnerModule],
    held_out: &dyn Dataset<B::InnerBackend>,
    device: &B::Device,
) -> Result<SearchScores> {
    let losses: Vec<Loss> =
        teacher.specs.iter().map(|t| Loss::new(t.loss).with_temperature(config.train.temperature)).collect();
    // The replace-one-block score uses the loss the stitched pass would put
    // on the output, else the last block's own.
    // (`head-kl` scores candidates by the last block's own loss.)
    let output_kind = config
        .train
        .stitched_output_loss
        .and_then(|kind| kind.block_loss())
        .or(teacher.specs.last().map(|t| t.loss));
    let output_loss = output_kind.map(|kind| Loss::new(kind).with_temperature(config.train.temperature));
    // A line every half minute at most: scoring 30 blocks' candidates
    // through the rest of the teacher takes minutes.
    let start = std::time::Instant::now();
    let mut throttle = crate::reporter::Throttle::default();
    let mut progress = |done: usize, total: usize| {
        if done < total {
            crate::reporter::reporter().periodic(&mut throttle, "search", || {
                format!(
                    "scored every candidate on {done}/{total} held-out batches after {:.0}s",
                    start.elapsed().as_secs_f64()
                )
            });
        }
    };
    let measured = measure_candidates(
        &teacher.blocks,
        trained,
        &losses,
        output_loss.as_ref(),
        held_out,
        config.train.batch_size,
        device,
        &mut progress,
    )?;
    let candidate_specs = zoo.candidate_specs(config, &teacher.specs)?;
    let mut tables = Vec::new();
    let mut specs = Vec::new();
    let mut weights = Vec::new();
    for (k, table) in config.students.iter().enumerate() {
        let listed = candidate_tables(table);
        if listed.is_empty() {
            let mut own = table.clone();
            own.remove("weights");
            tables.push(vec![own]);
            specs.push(vec![students.specs[k].clone()]);
            weights.push(vec![student_record_path(Path::new(""), k)]);
        } else {
            let count = listed.len();
            tables.push(listed);
            let block_specs = candidate_specs.get(k).cloned().unwrap_or_default();
            if block_specs.len() != count {
                return Err(Error::block(
                    k + 1,
                    format!("{count} candidates configured but the zoo describes {}", block_specs.len()),
                ));
            }
            specs.push(block_specs);
            weights.push((0..count).map(|c| candidate_record_path(k, c)).collect());
        }
    }
    let tables: Vec<Vec<_>> = tables.iter().map(|block| block.iter().map(json_object).collect()).collect();
    let mut blocks = block_scores(&teacher.specs, &measured, &tables, &specs, &weights);
    if config.search.mode == crate::config::SearchMode::SinglePath {
        for (block, module) in blocks.iter_mut().zip(trained) {
            let Some(alpha) = module.arch_logits() else { continue };
            let logits: Vec<f32> = alpha.into_data().iter::<f32>().collect();
            for (candidate, p) in block.candidates.iter_mut().zip(pipe_bd::train::arch::softmax(&logits)) {
                candidate.probability = Some(p);
            }
        }
    }
    Ok(SearchScores {
        config: config.clone(),
        held_out_samples: held_out.len(),
        batch_size: config.train.batch_size,
        blocks,
    })
}

/// A config table as a JSON object (what the scores keep of a candidate).
fn json_object(table: &toml::Table) -> serde_json::Map<String, serde_json::Value> {
    table.iter().filter_map(|(key, value)| Some((key.clone(), serde_json::to_value(value).ok()?))).collect()
}

/// The candidate tables a `[[students]]` entry lists (`candidates = [...]`).
pub fn candidate_tables(table: &toml::Table) -> Vec<toml::Table> {
    match table.get("candidates") {
        Some(toml::Value::Array(items)) => items.iter().filter_map(|v| v.as_table().cloned()).collect(),
        _ => Vec::new(),
    }
}

fn block_report(k: usize, teacher: &BlockSpec, student: &BlockSpec, final_loss: f32) -> BlockReport {
    BlockReport {
        block: k + 1,
        teacher: teacher.name.clone(),
        student: student.name.clone(),
        input_shape: student.input_shape.clone(),
        output_shape: student.output_shape.clone(),
        params: student.params,
        teacher_params: teacher.params,
        flops: student.flops,
        teacher_flops: teacher.flops,
        flops_reduction: (teacher.flops > 0 && student.flops > 0)
            .then(|| teacher.flops as f64 / student.flops as f64),
        final_loss,
        loss: Some(teacher.loss),
    }
}

#[cfg(test)]
mod tests {
    use super::rank_devices;

    #[test]
    fn each_rank_gets_its_gpu_on_its_node() {
        assert_eq!(rank_devices("cpu", 3, 3), vec!["cpu"; 3]);
        assert_eq!(rank_devices("cuda:1", 2, 2), vec!["cuda:1"; 2]);
        assert_eq!(rank_devices("cuda", 4, 2), vec!["cuda:0", "cuda:1", "cuda:0", "cuda:1"]);
    }
}
