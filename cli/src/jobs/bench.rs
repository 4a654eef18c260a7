//! `pipebd bench`: the same workload under several schedules, side by side
//! in one process, with the speedup each one should get according to the
//! per-block costs measured on one device.

use std::path::Path;
use std::time::Instant;

use pipebd_core::{Samples, StudentModule, Students};
use pipebd_kernels::DistillBackend;
use serde::{Deserialize, Serialize};

use crate::config::RunConfig;
use crate::jobs::check::{plan_for, preflight};
use crate::jobs::plot::timeline::{draw_timelines, Timeline, TimelineGroup};
use crate::jobs::profile::plan_from_candidate;
use crate::jobs::profile::{reset_peak_resident, resident_bytes};
use crate::zoo::{Workload, Zoo};
use pipe_bd::data::held_out_split;
use pipe_bd::device::{dispatch, BackendJob};
use pipe_bd::error::{Error, Result};
use pipe_bd::fsio::write_atomic;
use pipe_bd::plan::{Plan, Schedule};
use pipe_bd::planning::planner::CostTable;
use pipe_bd::planning::simulate::simulate_shared;
use pipe_bd::runtime::{concurrent_workers, threads_per_worker, Distillation, RuntimeSettings};
use pipe_bd::trace::{Span, WorkerSummary};
use pipe_bd::train::{detached_copy, steps_per_epoch};

/// One schedule's timing: seconds, spans, workers, peak memory.
type Timed = (f64, Vec<Span>, Vec<WorkerSummary>, Option<u64>);

/// Single-replica cost of one block at the full batch, from the profile.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BlockCost {
    /// One-based block.
    pub block: usize,
    /// Teacher forward, seconds per step.
    pub teacher_forward: f64,
    /// Student forward + backward + optimizer step, seconds per step.
    pub student_step: f64,
}

/// One schedule's line of the bench table.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchRow {
    /// Schedule name.
    pub schedule: String,
    /// Its plan, e.g. `{1-2 | 3-4}`.
    pub plan: String,
    /// Wall time of the training.
    pub seconds: f64,
    /// Training samples per second (each sample through every block).
    pub samples_per_second: f64,
    /// Measured speedup over `dp` (when `dp` was benched).
    pub speedup_over_dp: Option<f64>,
    /// Speedup over `dp` that the simulator predicts from the profile.
    pub predicted_speedup_over_dp: Option<f64>,
    /// Speedup over `dp` of the simple cost model: single-replica block costs,
    /// each phase as slow as its slowest stage, replicas dividing the work.
    pub cost_model_speedup_over_dp: Option<f64>,
    /// Predicted seconds per step (simulator).
    pub predicted_step_seconds: f64,
    /// Measured seconds per step.
    pub measured_step_seconds: f64,
    /// Measured over predicted step time.
    pub measured_over_predicted: f64,
    /// Predicted idle fraction of each worker.
    pub predicted_idle_fractions: Vec<f64>,
    /// Single-device work divided by the slots, over the measured time.
    pub pipeline_efficiency: f64,
    /// Idle fraction of each worker (waiting or untracked time).
    pub idle_fractions: Vec<f64>,
    /// Peak resident memory of the process during this schedule, bytes.
    pub peak_rss_bytes: Option<u64>,
}

/// The whole bench.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchReport {
    /// Config name.
    pub name: String,
    /// Device slots.
    pub devices: Vec<String>,
    /// Intra-op threads per worker.
    pub threads_per_worker: usize,
    /// Global batch size.
    pub batch_size: usize,
    /// Steps per block per schedule.
    pub steps: usize,
    /// Per-block single-device costs (from the `ideal` run).
    pub block_costs: Vec<BlockCost>,
    /// Data loading, seconds per step, at each replica count's batch share.
    pub data_load: Vec<f64>,
    /// Training time of the `ideal` schedule on one slot.
    pub ideal_seconds: f64,
    /// One row per benched schedule.
    pub rows: Vec<BenchRow>,
}

/// Runs `schedules` on the config's workload and device slots; writes
/// `bench.json`, `bench.csv` and `bench.png` (each schedule's workers over
/// a few steady steps) into `out_dir`. `say` receives progress lines.
pub fn bench<Z: Zoo>(
    zoo: &Z,
    config: &RunConfig,
    schedules: &[String],
    out_dir: &Path,
    say: &mut dyn FnMut(&str),
) -> Result<BenchReport> {
    let (devices, _) = preflight(zoo, config)?;
    // Fail early, before any timing, on a schedule that cannot be built (the
    // rest of the config passed the preflight once).
    let teacher = zoo.teacher_specs(config)?;
    let students = zoo.student_specs(config, &teacher)?;
    for name in schedules {
        let mut c = config.clone();
        c.schedule = name.clone();
        if c.schedule()? != Schedule::Auto {
            plan_for(&c, &teacher, &students, devices.len())?;
        }
    }
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io("creating directory", out_dir, e))?;
    say("profiling every block at the batch share of 1..W replicas");
    let profile = crate::jobs::profile::measure(zoo, config, devices.len(), say)?;
    let costs = profile.cost_table(devices.len());
    let (report, timelines) = dispatch(&devices, BenchJob { zoo, config, schedules, say: &mut *say, costs })?;
    let json = serde_json::to_string_pretty(&report)
        .map_err(|e| Error::Data { path: out_dir.join("bench.json"), message: e.to_string() })?;
    write_atomic(&out_dir.join("bench.json"), json.as_bytes())?;
    crate::metrics::write_table(&out_dir.join("bench.csv"), &BENCH_COLUMNS, bench_rows(&report))?;
    // The figures are written; a picture that cannot be drawn (no font) is
    // said, not an error.
    if let Err(e) = draw_timelines(&out_dir.join("bench.png"), &timelines) {
        say(&format!("bench.png not drawn: {e}"));
    }
    Ok(report)
}

/// `bench.csv`'s columns, one row per schedule.
const BENCH_COLUMNS: [&str; 9] = [
    "schedule",
    "plan",
    "seconds",
    "samples_per_second",
    "speedup_over_dp",
    "predicted_speedup_over_dp",
    "pipeline_efficiency",
    "max_idle_fraction",
    "peak_rss_bytes",
];

fn bench_rows(report: &BenchReport) -> Vec<Vec<String>> {
    let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.4}"));
    report
        .rows
        .iter()
        .map(|r| {
            let max_idle = r.idle_fractions.iter().copied().fold(0.0, f64::max);
            vec![
                r.schedule.to_string(),
                r.plan.clone(),
                format!("{:.3}", r.seconds),
                format!("{:.1}", r.samples_per_second),
                opt(r.speedup_over_dp),
                opt(r.predicted_speedup_over_dp),
                format!("{:.4}", r.pipeline_efficiency),
                format!("{max_idle:.4}"),
                r.peak_rss_bytes.map_or(String::new(), |b| b.to_string()),
            ]
        })
        .collect()
}

/// Seconds per step of `plan` in the simple cost model: each phase takes
/// as long as its slowest stage; a stage's cost is its teacher blocks and
/// student steps at the full batch, divided among its replicas.
pub fn cost_model_step_seconds(plan: &Plan, costs: &[BlockCost]) -> f64 {
    plan.phases
        .iter()
        .map(|phase| {
            phase
                .stages
                .iter()
                .map(|stage| {
                    let teacher: f64 = costs[stage.teacher_start()..stage.blocks.end]
                        .iter()
                        .map(|c| c.teacher_forward)
                        .sum();
                    let students: f64 = costs[stage.blocks.clone()].iter().map(|c| c.student_step).sum();
                    (teacher + students) / stage.replicas() as f64
                })
                .fold(0.0, f64::max)
        })
        .sum()
}

struct BenchJob<'a, Z> {
    zoo: &'a Z,
    config: &'a RunConfig,
    schedules: &'a [String],
    say: &'a mut dyn FnMut(&str),
    costs: CostTable,
}

impl<Z: Zoo> BackendJob for BenchJob<'_, Z> {
    /// The report and each schedule's timeline.
    type Output = (BenchReport, Vec<TimelineGroup>);

    fn run<B: DistillBackend>(self, devices: &[B::Device]) -> Result<Self::Output> {
        let config = self.config;
        let say = self.say;
        let device = &devices[0];
        let Workload { teacher, train: data, .. } =
            self.zoo.workload::<B::InnerBackend>(config, device, false)?;
        let students = self.zoo.students::<B>(config, &teacher.specs, device)?;
        let slots = devices.len();
        let threads = threads_per_worker(config.runtime.threads_per_worker, slots);
        let runtime = RuntimeSettings { threads_per_worker: threads, ..config.runtime_settings() };
        let settings = config.train_settings();
        // A search trains on what its run trains on (a single-path search
        // takes its architecture steps on the held-out rest).
        let (data, held_out) =
            held_out_split(data.as_ref(), config.has_candidates().then_some(config.search.held_out));
        let steps = steps_per_epoch(data.len(), settings.batch_size) * settings.epochs;
        let blocks = teacher.blocks.len();

        let time = |plan: &Plan, say: &mut dyn FnMut(&str)| -> Result<Timed> {
            say(&format!("{:<8} {}", plan.name, plan.describe()));
            reset_peak_resident();
            let start = Instant::now();
            let fresh = copy_students(&students)?;
            let mut distillation = Distillation::new(&teacher, fresh, &data)
                .settings(settings.clone())
                .devices(devices.to_vec())
                .runtime(runtime.clone());
            if let Some(held_out) = &held_out {
                distillation = distillation.held_out(held_out);
            }
            let out = distillation.run(plan)?;
            let seconds = start.elapsed().as_secs_f64();
            Ok((seconds, out.spans, out.workers, resident_bytes("VmHWM:")))
        };

        // The single-device reference: teacher once, every block on one slot.
        let (ideal_seconds, _, _, _) = time(&Plan::ideal(blocks), say)?;
        let costs = &self.costs;
        let block_costs = first_slot_costs(costs, blocks);
        let data_load: Vec<f64> = costs.input_transfer[0].clone();
        let plans = bench_plans(config, self.schedules, costs, &block_costs, slots)?;
        let capacity = runtime.channel_capacity;
        let predictions = plans
            .iter()
            .map(|p| {
                simulate_shared(p, costs, &data_load, steps, capacity, concurrent_workers(threads) as f64)
                    .ok_or_else(|| Error::Plan {
                        plan: p.name.clone(),
                        message: "uses a block the profile marks infeasible".into(),
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        let dp_index = plans.iter().position(|p| p.name == Schedule::Dp.name());
        let cost_model: Vec<f64> = plans.iter().map(|p| cost_model_step_seconds(p, &block_costs)).collect();

        let mut rows = Vec::new();
        let mut timelines = Vec::new();
        for ((plan, predicted), modelled) in plans.iter().zip(&predictions).zip(&cost_model) {
            let (seconds, spans, workers, peak_rss_bytes) = time(plan, say)?;
            let measured_step_seconds = seconds / steps as f64;
            timelines.push(timeline_group(
                plan,
                measured_step_seconds,
                predicted.step_seconds,
                &spans,
                &workers,
            ));
            let idle_fractions = workers.iter().map(|w| w.idle_fraction).collect();
            rows.push(BenchRow {
                schedule: plan.name.clone(),
                plan: plan.describe(),
                seconds,
                samples_per_second: (steps * settings.batch_size) as f64 / seconds,
                speedup_over_dp: None,
                predicted_speedup_over_dp: dp_index
                    .map(|i| predictions[i].step_seconds / predicted.step_seconds),
                cost_model_speedup_over_dp: dp_index.map(|i| cost_model[i] / modelled),
                predicted_step_seconds: predicted.step_seconds,
                measured_step_seconds,
                measured_over_predicted: measured_step_seconds / predicted.step_seconds,
                predicted_idle_fractions: predicted.idle_fractions.clone(),
                pipeline_efficiency: ideal_seconds / slots as f64 / seconds,
                idle_fractions,
                peak_rss_bytes,
            });
        }
        set_speedups_over_dp(&mut rows, dp_index);
        let report = BenchReport {
            name: config.name.clone(),
            devices: config.device_slots(),
            threads_per_worker: threads,
            batch_size: settings.batch_size,
            steps,
            block_costs,
            data_load,
            ideal_seconds,
            rows,
        };
        Ok((report, timelines))
    }
}

/// A schedule's row group of `bench.png`, titled with its measured and
/// simulated seconds per step.
fn timeline_group(
    plan: &Plan,
    measured_step_seconds: f64,
    simulated_step_seconds: f64,
    spans: &[Span],
    workers: &[WorkerSummary],
) -> TimelineGroup {
    TimelineGroup {
        title: format!(
            "{} {}: measured {:.1} ms per step, simulated {:.1}",
            plan.name,
            plan.describe(),
            1e3 * measured_step_seconds,
            1e3 * simulated_step_seconds
        ),
        timeline: Timeline::new(spans, workers),
    }
}

/// Every row's measured speedup over the `dp` row (`dp_index`), if benched.
fn set_speedups_over_dp(rows: &mut [BenchRow], dp_index: Option<usize>) {
    if let Some(i) = dp_index {
        let dp_seconds = rows[i].seconds;
        for row in rows {
            row.speedup_over_dp = Some(dp_seconds / row.seconds);
        }
    }
}

/// The plans of `schedules` for `config`: `auto` is the planner's best for
/// the profiled `costs`; the stage cuts of `ls`, `tr` and `tr-dpu` balance
/// the measured costs of `block_costs`.
fn bench_plans(
    config: &RunConfig,
    schedules: &[String],
    costs: &CostTable,
    block_costs: &[BlockCost],
    slots: usize,
) -> Result<Vec<Plan>> {
    let blocks = block_costs.len();
    let measured: Vec<f64> = block_costs.iter().map(|c| c.teacher_forward + c.student_step).collect();
    let memory = config.runtime.memory_per_device;
    let plan = |name: &String| {
        if name == Schedule::Auto.name() {
            let best = pipe_bd::planning::planner::plan(costs, slots, memory, 1);
            let best = best.first().ok_or_else(|| Error::Plan {
                plan: Schedule::Auto.name().into(),
                message: "no feasible plan for the profiled costs".into(),
            })?;
            return plan_from_candidate(best, blocks, slots);
        }
        Plan::named(name, blocks, slots, &measured, &config.stages)
            .map_err(|e| Error::Plan { plan: name.clone(), message: e.0 })
    };
    schedules.iter().map(plan).collect()
}

/// Each block's profiled costs on the first device slot (NaN where the
/// profile has none).
fn first_slot_costs(costs: &CostTable, blocks: usize) -> Vec<BlockCost> {
    (0..blocks)
        .map(|k| BlockCost {
            block: k + 1,
            teacher_forward: costs.teacher_forward[k][0].unwrap_or(f64::NAN),
            student_step: costs.student_step[k][0].unwrap_or(f64::NAN),
        })
        .collect()
}

/// Independent copies of the initial students, so every schedule starts
/// from the same weights.
fn copy_students<B: DistillBackend, S: StudentModule<B>>(
    students: &Students<B, S>,
) -> Result<Students<B, S>> {
    let blocks = students.blocks.iter().map(detached_copy).collect();
    Ok(Students::new(blocks, students.specs.clone(), &students.specs)?)
}
