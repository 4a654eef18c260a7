//! A whole job from a config: load data and teacher, build students, train
//! under the configured schedule, stitch, evaluate, save, report.
//!
//! This is the layer the CLI calls; the backend is picked here from the
//! device string, everything below is generic over burn's backend.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::{AutodiffModule, Module};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use pipebd_kernels::DistillBackend;
use pipebd_students::StudentBlock;

use pipebd_core::Block;
use pipebd_core::{BlockSpec, Students};
use crate::config::RunConfig;
use crate::device::{parse_slots, DeviceSpec};
use crate::error::{Error, Result};
use crate::plan::{flops_cost, Plan, Schedule, StageSpec};
use crate::planner::{Candidate, CostTable};
use crate::report::{write_metrics, BlockReport, RunReport, StitchedReport};
use crate::runtime::{concurrent_workers, threads_per_worker, Distillation};
use crate::stitch::StitchedPass;
use crate::simulate::simulate_shared;
use crate::text::{mean_and_min_cosine, sentence_embeddings, ProbeReport, TextReport};
use crate::trace::write_chrome_trace;
use crate::train::{accuracy, inference_blocks, Progress};
use crate::zoo::{
    build_students, init_student_blocks, load_workload, student_specs, teacher_specs, Evaluation, Workload,
};

/// Test images per evaluation chunk.
const EVAL_CHUNK: usize = 1000;

/// Checks a config before any heavy work: devices usable, student shapes
/// matching the teacher's, schedule buildable, and the files it names there
/// and readable ([`check_inputs`]). Returns the device slots and the plan
/// (`None` for `schedule = "auto"`, planned from a profile later).
pub fn preflight(config: &RunConfig) -> Result<(Vec<DeviceSpec>, Option<Plan>)> {
    let slots = config.device_slots();
    let devices =
        parse_slots(&slots).map_err(|message| Error::Device { device: slots.join(","), message })?;
    for device in &devices {
        device.check_available()?;
    }
    let teacher = teacher_specs(config);
    let students = student_specs(&config.students, &teacher)?;
    for (k, student) in config.students.iter().enumerate() {
        crate::zoo::check_teacher_init(k, student)?;
    }
    let plan = match config.schedule()? {
        Schedule::Auto => None,
        _ => Some(plan_for(config, &teacher, &students, devices.len())?),
    };
    check_inputs(config)?;
    Ok((devices, plan))
}

/// Checks that the files a config names are there and what they should be,
/// without reading what training reads: the MNIST files' headers and sizes
/// and the MNIST teacher's weights (loaded on the CPU: 1.5 MB), or the
/// Brown corpus, the probe's folder, MiniLM's safetensors header and its
/// tokenizer. Every error names the file.
pub fn check_inputs(config: &RunConfig) -> Result<()> {
    let data = &config.data;
    if !data.is_text() {
        crate::data::check_mnist_files(&data.dir)?;
        pipebd_teachers::mnist_cnn::MnistCnn::<burn::backend::Flex>::load_pytorch(
            &config.teacher.weights,
            &Default::default(),
        )?;
        return Ok(());
    }
    crate::text::read_brown(&data.dir)?;
    if let Some(probe) = &data.probe {
        if !probe.dir.is_dir() {
            return Err(crate::data::data_error(
                &probe.dir,
                "folder not found (run scripts/setup-data.sh, or fix `data.probe.dir` in the config)",
            ));
        }
    }
    check_safetensors_header(&config.teacher.weights)?;
    pipebd_teachers::minilm::MiniLmTokenizer::load(&config.teacher.tokenizer_path())?;
    Ok(())
}

/// Checks that `path` is laid out as a safetensors file (an 8-byte header
/// length, a JSON header, tensor data up to the last offset it announces)
/// without reading the tensors.
fn check_safetensors_header(path: &Path) -> Result<()> {
    use pipebd_teachers::TeacherError;
    use std::io::Read;
    let bad =
        |message: String| Error::Teacher(TeacherError::BadWeights { path: path.to_path_buf(), message });
    if path.is_dir() {
        return Err(bad("is a folder, expected the `model.safetensors` file".into()));
    }
    if !path.is_file() {
        return Err(Error::Teacher(TeacherError::MissingWeights { path: path.to_path_buf() }));
    }
    let mut file = std::fs::File::open(path).map_err(|e| bad(format!("cannot read: {e}")))?;
    let size = file.metadata().map_err(|e| bad(format!("cannot read: {e}")))?.len();
    let not_safetensors = |what: String| bad(format!("not a safetensors file: {what}"));
    let mut word = [0u8; 8];
    file.read_exact(&mut word)
        .map_err(|_| not_safetensors(format!("{size} bytes, too short for the header length")))?;
    let header_len = u64::from_le_bytes(word);
    if header_len > size.saturating_sub(8) {
        return Err(not_safetensors(format!(
            "the header length {header_len} exceeds the file's {size} bytes"
        )));
    }
    let mut header = Vec::new();
    file.take(header_len).read_to_end(&mut header).map_err(|e| bad(format!("cannot read: {e}")))?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|e| not_safetensors(format!("the header is not a JSON object ({e})")))?;
    let tensors: Vec<&serde_json::Value> =
        header.iter().filter(|(name, _)| name.as_str() != "__metadata__").map(|(_, t)| t).collect();
    if tensors.is_empty() {
        return Err(not_safetensors("the header lists no tensors".into()));
    }
    let data_end = tensors
        .iter()
        .filter_map(|tensor| tensor.get("data_offsets")?.get(1)?.as_u64())
        .max()
        .unwrap_or(0);
    let needed = header_len.saturating_add(data_end).saturating_add(8);
    if needed > size {
        return Err(bad(format!("truncated: the tensors end at byte {needed}, the file has {size}")));
    }
    Ok(())
}

/// Fails, before any work, when the output folder of a run (`--out`), or a
/// folder it would be created in, is an existing file.
pub fn check_out_dir(out_dir: &Path) -> Result<()> {
    let Some(existing) = out_dir.ancestors().find(|p| p.exists()) else {
        return Ok(());
    };
    if existing.is_dir() {
        return Ok(());
    }
    let message = if existing == out_dir {
        format!("{} is a file, expected a directory", out_dir.display())
    } else {
        format!("{}: {} is a file, expected a directory", out_dir.display(), existing.display())
    };
    Err(Error::Config { path: "--out".into(), line: None, field: None, message })
}

/// The plan a config asks for, over `slots` device slots.
pub fn plan_for(
    config: &RunConfig,
    teacher: &[BlockSpec],
    students: &[BlockSpec],
    slots: usize,
) -> Result<Plan> {
    let cost = flops_cost(teacher, students);
    Plan::named(&config.schedule, teacher.len(), slots, &cost, &config.stages)
        .map_err(|e| Error::Plan { plan: config.schedule.clone(), message: e.0 })
}

/// Where `schedule = "auto"` keeps profiles, keyed by what they depend on.
pub const PROFILE_CACHE: &str = "runs/.profile-cache";

/// A stable key for the profile of a config: teacher, students, batch size,
/// device slots, optimizer and threads (FNV-1a over their JSON).
pub fn profile_key(config: &RunConfig) -> String {
    let parts = serde_json::json!({
        "teacher": config.teacher,
        "students": config.students,
        "batch": config.train.batch_size,
        "tokens": config.data.is_text().then(|| config.data.max_tokens()),
        "devices": config.device_slots(),
        "optimizer": config.optimizer,
        "threads": config.runtime.threads_per_worker,
    });
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in parts.to_string().bytes() {
        hash ^= byte as u64;
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{}-{hash:016x}", config.name)
}

/// The profile for `config`: read from [`PROFILE_CACHE`] if one with the
/// same key exists, else measured and cached.
pub fn cached_profile(config: &RunConfig, say: &mut dyn FnMut(&str)) -> Result<crate::profile::Profile> {
    let path = Path::new(PROFILE_CACHE).join(format!("{}.json", profile_key(config)));
    if path.is_file() {
        if let Ok(profile) = crate::profile::Profile::read(&path) {
            say(&format!("using the cached profile {}", path.display()));
            return Ok(profile);
        }
    }
    say(&format!("profiling the blocks (cached in {})", path.display()));
    crate::profile::profile(config, config.device_slots().len(), &path, say)
}

/// Plans `schedule = "auto"`: the best hybrid plan for the config's device
/// slots from its (cached) profile, within `runtime.memory_per_device`.
pub fn auto_plan(config: &RunConfig, say: &mut dyn FnMut(&str)) -> Result<(Plan, CostTable)> {
    let slots = config.device_slots().len();
    let profile = cached_profile(config, say)?;
    let costs = profile.cost_table(slots);
    let blocks = costs.blocks();
    let candidates = crate::planner::plan(&costs, slots, config.runtime.memory_per_device, 3);
    let best = candidates.first().ok_or_else(|| Error::Plan {
        plan: Schedule::Auto.name().into(),
        message: format!(
            "no way to place the {blocks} blocks on {slots} slots fits (memory per device {:?})",
            config.runtime.memory_per_device
        ),
    })?;
    for (i, c) in candidates.iter().enumerate() {
        say(&format!(
            "{} {} (planner bottleneck {:.1} ms)",
            if i == 0 { "chosen" } else { "runner-up" },
            c.describe(),
            1e3 * c.step_seconds
        ));
    }
    Ok((plan_from_candidate(best, blocks, slots)?, costs))
}

/// The runtime's plan for a planner candidate (named `auto`).
pub fn plan_from_candidate(candidate: &Candidate, blocks: usize, slots: usize) -> Result<Plan> {
    let specs: Vec<StageSpec> = candidate
        .stages
        .iter()
        .map(|s| StageSpec { blocks: (s.blocks.start + 1..=s.blocks.end).collect(), replicas: s.replicas })
        .collect();
    let mut plan =
        Plan::hybrid(&specs, blocks, slots).map_err(|e| Error::Plan { plan: Schedule::Auto.name().into(), message: e.0 })?;
    plan.name = Schedule::Auto.name().into();
    Ok(plan)
}

/// Options of a run that are not part of its config.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Write `trace.json` (Chrome trace events of every worker).
    pub trace: bool,
    /// Continue from the newest complete checkpoint of each block in this
    /// run folder (or checkpoint folder).
    pub resume: Option<PathBuf>,
    /// Override `runtime.max_failures`.
    pub max_failures: Option<usize>,
}

/// The config fields a checkpoint must match to be resumed from (the
/// runtime adds each block's shapes, parameters, steps, seed and optimizer).
pub fn checkpoint_identity(config: &RunConfig) -> std::collections::BTreeMap<String, serde_json::Value> {
    use serde_json::json;
    let mut identity = std::collections::BTreeMap::new();
    identity.insert("data.dataset".into(), json!(config.data.dataset));
    identity.insert("data.train_limit".into(), json!(config.data.train_limit));
    identity.insert("data.max_tokens".into(), json!(config.data.is_text().then(|| config.data.max_tokens())));
    identity.insert("teacher.kind".into(), json!(config.teacher.kind));
    identity.insert("teacher.layers_per_block".into(), json!(config.teacher.layers_per_block));
    identity.insert("train.epochs".into(), json!(config.train.epochs));
    identity
}

/// The runtime options of a run: the config's, with checkpoints in
/// `out_dir/checkpoints`, the resume folder, faults from [`crate::fault::ENV`]
/// and the cost table for re-planning.
pub fn runtime_options_for(
    config: &RunConfig,
    out_dir: &Path,
    options: &RunOptions,
    costs: Option<&CostTable>,
) -> Result<crate::runtime::RuntimeOptions> {
    let mut runtime = config.runtime_options();
    runtime.checkpoints = Some(crate::checkpoint::CheckpointPolicy {
        dir: out_dir.join("checkpoints"),
        every_steps: config.checkpoint.every_steps,
        every_seconds: config.checkpoint.every_minutes * 60.0,
        keep: config.checkpoint.keep,
        identity: checkpoint_identity(config),
    });
    runtime.resume_from = options.resume.clone();
    runtime.faults.extend(crate::fault::from_env()?);
    if let Some(max) = options.max_failures {
        runtime.max_failures = max;
    }
    runtime.costs = costs.cloned();
    Ok(runtime)
}

/// Runs the job described by `config`, writing `report.json`,
/// `metrics.csv`, the trained student (`student/block-K.mpk`) and, with
/// `options.trace`, `trace.json` into `out_dir`. `observer` sees every
/// training step (for progress bars).
pub fn run(
    config: &RunConfig,
    out_dir: &Path,
    options: &RunOptions,
    observer: &mut dyn FnMut(&Progress),
) -> Result<RunReport> {
    check_out_dir(out_dir)?;
    let (devices, plan) = preflight(config)?;
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io("creating directory", out_dir, e))?;
    let (plan, costs) = match plan {
        Some(plan) => (plan, None),
        None => {
            let mut say = |line: &str| eprintln!("auto: {line}");
            let (plan, costs) = auto_plan(config, &mut say)?;
            (plan, Some(costs))
        }
    };
    dispatch(&devices, Job { config, plan: &plan, costs: costs.as_ref(), out_dir, options, observer })
}

/// Work that runs on whichever burn backend the device slots name.
pub trait BackendJob {
    /// What the job returns.
    type Output;
    /// Runs the job on backend `B` with one device per slot.
    fn run<B: DistillBackend>(self, devices: &[B::Device]) -> Result<Self::Output>;
}

/// Picks the burn backend for `devices` (all of one kind) and runs `job` on it.
pub fn dispatch<J: BackendJob>(devices: &[DeviceSpec], job: J) -> Result<J::Output> {
    let first = *devices
        .first()
        .ok_or_else(|| Error::Device { device: String::new(), message: "no device slots".into() })?;
    match first {
        DeviceSpec::Cpu => {
            job.run::<burn::backend::Autodiff<burn::backend::Flex>>(&vec![Default::default(); devices.len()])
        }
        #[cfg(feature = "cuda")]
        DeviceSpec::Cuda(_) => {
            let slots: Vec<_> = devices
                .iter()
                .map(|d| match d {
                    DeviceSpec::Cuda(i) => burn::backend::cuda::CudaDevice::new(*i),
                    _ => Default::default(),
                })
                .collect();
            job.run::<burn::backend::Autodiff<pipebd_kernels::Cuda>>(&slots)
        }
        #[cfg(feature = "wgpu")]
        DeviceSpec::Wgpu(_) => {
            let slots: Vec<_> = devices
                .iter()
                .map(|d| match d {
                    DeviceSpec::Wgpu(i) => wgpu_device(*i),
                    _ => Default::default(),
                })
                .collect();
            job.run::<burn::backend::Autodiff<pipebd_kernels::Wgpu>>(&slots)
        }
        #[allow(unreachable_patterns)]
        other => Err(Error::Device { device: other.to_string(), message: "not compiled in".into() }),
    }
}

#[cfg(feature = "wgpu")]
fn wgpu_device(index: Option<usize>) -> burn::backend::wgpu::WgpuDevice {
    match index {
        None => burn::backend::wgpu::WgpuDevice::DefaultDevice,
        Some(i) => burn::backend::wgpu::WgpuDevice::DiscreteGpu(i),
    }
}

struct Job<'a> {
    config: &'a RunConfig,
    plan: &'a Plan,
    costs: Option<&'a CostTable>,
    out_dir: &'a Path,
    options: &'a RunOptions,
    observer: &'a mut dyn FnMut(&Progress),
}

impl BackendJob for Job<'_> {
    type Output = RunReport;

    fn run<B: DistillBackend>(self, devices: &[B::Device]) -> Result<RunReport> {
        let config = self.config;
        let start = Instant::now();
        let device = &devices[0];
        let Workload { teacher, train, evaluation } = load_workload::<B::InnerBackend>(config, device, true)?;
        let students = build_students::<B>(config, &teacher.specs, device)?;

        let runtime = runtime_options_for(config, self.out_dir, self.options, self.costs)?;
        let settings = config.train_settings();
        let output = Distillation::new(&teacher, students, train.as_ref())
            .settings(settings.clone())
            .devices(devices.to_vec())
            .options(runtime)
            .observer(&mut *self.observer)
            .run(self.plan)?;
        let mut log = output.log;
        let (students, stitched) = match config.train.stitched_epochs {
            0 => (output.students, None),
            epochs => {
                let mut optimizer = config.optimizer.clone();
                optimizer.lr = config.train.stitched_lr.unwrap_or(config.optimizer.lr / 3.0);
                optimizer.min_lr = optimizer.min_lr.min(optimizer.lr);
                let pass = StitchedPass {
                    epochs,
                    optimizer: optimizer.clone(),
                    first_step: log.steps,
                    gradients: config.train.stitched_gradients,
                };
                let (students, pass) = crate::stitch::stitched_pass(
                    &teacher,
                    output.students,
                    train.as_ref(),
                    &settings,
                    &pass,
                    device,
                    self.observer,
                )?;
                log.rows.extend(pass.rows);
                let report = StitchedReport {
                    epochs,
                    gradients: config.train.stitched_gradients,
                    steps: pass.steps,
                    lr: optimizer.lr,
                    seconds: pass.seconds,
                    final_losses: pass.final_losses,
                };
                (students, Some(report))
            }
        };
        let predicted_step_seconds = self.costs.and_then(|costs| {
            let data_load = costs.input_transfer.first().cloned().unwrap_or_default();
            let threads = threads_per_worker(config.runtime.threads_per_worker, devices.len());
            let processors = concurrent_workers(threads) as f64;
            simulate_shared(
                self.plan,
                costs,
                &data_load,
                log.steps,
                config.runtime.channel_capacity,
                processors,
            )
            .map(|p| p.step_seconds)
        });

        let trained = inference_blocks(&students);
        let score = score(&evaluation, &teacher.blocks, &trained, device, &teacher.specs, &students.specs)?;
        save_students(self.out_dir, &students)?;
        write_metrics(self.out_dir, &log.rows)?;
        if self.options.trace {
            let roles: Vec<String> = output.workers.iter().map(|w| w.role.clone()).collect();
            write_chrome_trace(&self.out_dir.join("trace.json"), &output.spans, &roles)?;
        }

        let blocks = teacher
            .specs
            .iter()
            .zip(&students.specs)
            .zip(&log.final_losses)
            .enumerate()
            .map(|(k, ((t, s), &final_loss))| block_report(k, t, s, final_loss))
            .collect();
        let report = RunReport {
            name: config.name.clone(),
            schedule: self.plan.name.clone(),
            plan: self.plan.describe(),
            final_plan: output.final_plan.describe(),
            device: config.device_slots().join(","),
            teacher_accuracy: score.teacher_accuracy,
            student_accuracy: score.student_accuracy,
            test_samples: score.test_samples,
            text: score.text,
            train_samples: train.len(),
            steps: log.steps,
            steps_run: log.steps_run,
            wall_seconds: start.elapsed().as_secs_f64(),
            train_seconds: log.seconds,
            samples_per_second: log.samples as f64 / log.seconds.max(1e-9),
            measured_step_seconds: log.seconds / log.steps_run.max(1) as f64,
            predicted_step_seconds,
            measured_over_predicted: predicted_step_seconds
                .map(|p| log.seconds / log.steps_run.max(1) as f64 / p.max(1e-12)),
            blocks,
            workers: output.workers,
            stitched,
            resilience: output.resilience,
            config: config.clone(),
        };
        report.write(self.out_dir)?;
        Ok(report)
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
        flops_reduction: teacher.flops as f64 / student.flops.max(1) as f64,
        final_loss,
    }
}

/// How good a stitched student is, next to its teacher.
#[derive(Debug, Clone)]
pub struct Score {
    /// Teacher accuracy: top-1 on the test images, or the spam probe's.
    pub teacher_accuracy: f64,
    /// Stitched student accuracy, scored like the teacher's.
    pub student_accuracy: f64,
    /// Test images, or test emails of the probe.
    pub test_samples: usize,
    /// Text teachers: embedding cosine, probe, size ratios.
    pub text: Option<TextReport>,
}

/// Scores the teacher and the stitched student on the evaluation data. For
/// text without a probe the two accuracies are 0 (see `text`).
pub fn score<B, T, S>(
    evaluation: &Evaluation<B>,
    teacher: &[T],
    student: &[S],
    device: &B::Device,
    teacher_specs: &[BlockSpec],
    student_specs: &[BlockSpec],
) -> Result<Score>
where
    B: pipebd_kernels::FusedBackend,
    T: Block<B>,
    S: Block<B>,
{
    match evaluation {
        Evaluation::Images(test) => Ok(Score {
            teacher_accuracy: accuracy(teacher, test, device, EVAL_CHUNK)?,
            student_accuracy: accuracy(student, test, device, EVAL_CHUNK)?,
            test_samples: test.len(),
            text: None,
        }),
        Evaluation::Text { embeddings, heldout, max_tokens, probe, mean_tokens } => {
            let chunk = 64;
            let ours = sentence_embeddings(embeddings, student, heldout, *max_tokens, device, chunk)?;
            let theirs = sentence_embeddings(embeddings, teacher, heldout, *max_tokens, device, chunk)?;
            let (embedding_cosine, min_embedding_cosine) = mean_and_min_cosine(&ours, &theirs);
            let probe = match probe {
                None => None,
                Some(data) => {
                    let spam = data.test.1.iter().filter(|&&s| s).count();
                    Some(ProbeReport {
                        train_emails: data.train.0.len(),
                        test_emails: data.test.0.len(),
                        test_spam_fraction: spam as f64 / data.test.0.len().max(1) as f64,
                        teacher_accuracy: data.score(embeddings, teacher, device)?,
                        student_accuracy: data.score(embeddings, student, device)?,
                    })
                }
            };
            let sum = |specs: &[BlockSpec], f: fn(&BlockSpec) -> f64| specs.iter().map(f).sum::<f64>();
            let params_ratio =
                sum(student_specs, |s| s.params as f64) / sum(teacher_specs, |s| s.params as f64);
            let flops_ratio = sum(student_specs, |s| s.flops as f64) / sum(teacher_specs, |s| s.flops as f64);
            Ok(Score {
                teacher_accuracy: probe.as_ref().map_or(0.0, |p| p.teacher_accuracy),
                student_accuracy: probe.as_ref().map_or(0.0, |p| p.student_accuracy),
                test_samples: probe.as_ref().map_or(0, |p| p.test_emails),
                text: Some(TextReport {
                    embedding_cosine,
                    min_embedding_cosine,
                    heldout_sentences: heldout.len(),
                    max_tokens: *max_tokens,
                    mean_tokens: *mean_tokens,
                    params_ratio,
                    flops_ratio,
                    probe,
                }),
            })
        }
    }
}

/// Path of block `k`'s (zero-based) saved weights inside a run folder.
pub fn student_record_path(run_dir: &Path, k: usize) -> PathBuf {
    run_dir.join("student").join(format!("block-{}.mpk", k + 1))
}

fn recorder() -> NamedMpkFileRecorder<FullPrecisionSettings> {
    NamedMpkFileRecorder::<FullPrecisionSettings>::new()
}

/// Saves every trained student block (inference copy) as a burn record.
pub fn save_students<B: DistillBackend>(
    run_dir: &Path,
    students: &Students<B, StudentBlock<B>>,
) -> Result<()> {
    let dir = run_dir.join("student");
    std::fs::create_dir_all(&dir).map_err(|e| Error::io("creating directory", &dir, e))?;
    for (k, block) in students.blocks.iter().enumerate() {
        let path = student_record_path(run_dir, k);
        // The recorder appends the extension itself.
        block
            .valid()
            .save_file(path.with_extension(""), &recorder())
            .map_err(|e| Error::Record { path: path.clone(), message: e.to_string() })?;
    }
    Ok(())
}

/// The student blocks saved in `run_dir` by `pipebd run` with `config`,
/// and their specs.
pub fn load_students<B: pipebd_kernels::FusedBackend>(
    run_dir: &Path,
    config: &RunConfig,
    teacher: &[BlockSpec],
    device: &B::Device,
) -> Result<(Vec<StudentBlock<B>>, Vec<BlockSpec>)> {
    let (blocks, specs) = init_student_blocks::<B>(&config.students, teacher, device)?;
    let mut loaded = Vec::with_capacity(blocks.len());
    for (k, block) in blocks.into_iter().enumerate() {
        let path = student_record_path(run_dir, k);
        if !path.is_file() {
            return Err(Error::Record {
                path,
                message: "missing: was this run folder written by `pipebd run`?".into(),
            });
        }
        let block = block
            .load_file(path.with_extension(""), &recorder(), device)
            .map_err(|e| Error::Record { path: path.clone(), message: e.to_string() })?;
        loaded.push(block);
    }
    Ok((loaded, specs))
}

/// Figures from re-scoring a saved run.
#[derive(Debug, Clone)]
pub struct EvalResult {
    /// Accuracy of the reloaded stitched student on the test split (text:
    /// the probe's accuracy).
    pub student_accuracy: f64,
    /// The accuracy `report.json` recorded at the end of training.
    pub recorded_accuracy: f64,
    /// Test samples scored.
    pub test_samples: usize,
    /// Text teachers: the embedding cosine and probe, re-measured.
    pub text: Option<TextReport>,
}

/// Reloads the student saved in `run_dir` (by `pipebd run`) and scores it
/// on the evaluation data named in the run's config (on the CPU).
pub fn eval_run(run_dir: &Path) -> Result<EvalResult> {
    type B = burn::backend::Flex;
    let report = RunReport::read(run_dir)?;
    let config = &report.config;
    let device = Default::default();
    let workload = load_workload::<B>(config, &device, true)?;
    let teacher = &workload.teacher.specs;
    let (loaded, student_specs) = load_students::<B>(run_dir, config, teacher, &device)?;
    let scored =
        score(&workload.evaluation, &workload.teacher.blocks, &loaded, &device, teacher, &student_specs)?;
    Ok(EvalResult {
        student_accuracy: scored.student_accuracy,
        recorded_accuracy: report.student_accuracy,
        test_samples: scored.test_samples,
        text: scored.text,
    })
}

/// Scores the configured teacher on the test split (on the CPU): top-1
/// accuracy, or for text the probe's accuracy with the teacher's embeddings.
pub fn eval_teacher(config: &RunConfig) -> Result<(f64, usize)> {
    type B = burn::backend::Flex;
    let device = Default::default();
    let workload = load_workload::<B>(config, &device, true)?;
    let blocks = &workload.teacher.blocks;
    // The teacher alone: no student to compare, so no embedding cosine.
    match &workload.evaluation {
        Evaluation::Images(test) => Ok((accuracy(blocks, test, &device, EVAL_CHUNK)?, test.len())),
        Evaluation::Text { probe: None, .. } => Ok((0.0, 0)),
        Evaluation::Text { embeddings, probe: Some(data), .. } => {
            Ok((data.score(embeddings, blocks, &device)?, data.test.0.len()))
        }
    }
}

/// What `pipebd kernels` measured: the fused ops against burn's ops.
#[derive(Debug, Default)]
pub struct KernelsReport {
    /// The device the ops ran on.
    pub device: String,
    /// Correctness rows (when checked).
    pub checks: Vec<pipebd_kernels::check::CheckRow>,
    /// Timing rows (when benchmarked).
    pub timings: Vec<pipebd_kernels::bench::BenchRow>,
}

struct KernelsJob {
    check_seed: Option<u64>,
    bench_repeats: Option<usize>,
}

impl BackendJob for KernelsJob {
    type Output = KernelsReport;

    fn run<B: DistillBackend>(self, devices: &[B::Device]) -> Result<KernelsReport> {
        let device = &devices[0];
        let mut report = KernelsReport::default();
        if let Some(seed) = self.check_seed {
            pipebd_kernels::set_poison_outputs(true);
            report.checks = pipebd_kernels::check::run::<B>(device, seed);
            pipebd_kernels::set_poison_outputs(false);
        }
        if let Some(repeats) = self.bench_repeats {
            report.timings = pipebd_kernels::bench::run::<B>(device, repeats);
        }
        Ok(report)
    }
}

/// Checks the fused ops against burn's unfused ops on `device` (random inputs
/// from `check_seed`, outputs NaN-poisoned) and/or times both sides with
/// `bench_repeats` calls each. On `cpu` the fused ops are their burn-op
/// fallback, so this checks the custom backward passes.
pub fn kernels(device: &str, check_seed: Option<u64>, bench_repeats: Option<usize>) -> Result<KernelsReport> {
    let spec =
        DeviceSpec::parse(device).map_err(|message| Error::Device { device: device.into(), message })?;
    spec.check_available()?;
    let mut report = dispatch(&[spec], KernelsJob { check_seed, bench_repeats })?;
    report.device = device.to_string();
    Ok(report)
}
