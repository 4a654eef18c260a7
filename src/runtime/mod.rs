//! The pipeline runtime: one interpreter for every [`Plan`].
//!
//! Each phase of a plan runs as a set of worker threads, one per stage
//! replica, each bound to a device slot. A worker owns clones of the teacher
//! blocks it runs and the student blocks it trains. Per step it:
//!
//! 1. gets its share of the batch: from the data (stages that load data) or
//!    from the previous stage's workers over bounded crossbeam channels
//!    (split or concatenated in sample order where replica counts differ);
//! 2. runs its teacher blocks (inner backend, no graph) and sends the last
//!    activation on at once, so the next stage can start;
//! 3. for each own block: student forward + backward on the teacher's input
//!    and output of that block (the gradient stops at the block boundary);
//! 4. replicated stages: followers send their gradients to the stage leader,
//!    which sums them (each replica's loss is pre-scaled by its share of the
//!    batch), steps, and sends the updated blocks back;
//! 5. waits at the global barrier if the phase has one (`tr`), then steps.
//!
//! Failure: every wait (channel, barrier) polls a shared stop signal and has
//! a timeout; a worker that fails or panics raises the signal with its
//! error, every other worker returns within one poll interval, and the run
//! returns the first error, naming the stage, device slot and block.
//!
//! Multi-GPU and multi-node: activations cross devices with `to_device` on
//! the receiving side, and gradient averaging is a leader/follower exchange
//! of `GradientsParams` summed by burn's `step_multi`. Across processes
//! (`RuntimeSettings::transport`, e.g. MPI), slot `r` runs on rank `r` and
//! the links between ranks carry the same messages as bytes
//! ([`transport`]); the worker loop stays as it is.
//!
//! Code map: `sync` (stop signal, heartbeats, barrier, channel waits),
//! `topology` (the workers of a phase and their channels), `phase` (a
//! phase's threads and watchdog), `worker` (one worker's training loop),
//! `resume` (checkpoint identity and restore), [`recovery`] (what a lost
//! device changes), [`transport`], `wire`, `cluster` and `mpi` (runs
//! across processes).

mod cluster;
#[cfg(feature = "mpi")]
pub mod mpi;
mod phase;
pub mod recovery;
mod resume;
mod sync;
mod topology;
pub mod transport;
pub(crate) mod wire;
mod worker;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use phase::{run_phase, PhaseContext};
use pipebd_core::{Block, Dataset, StudentModule, Students, Teacher};
use pipebd_kernels::DistillBackend;
use recovery::{recover, RecoveryContext, ResilienceLog};
use resume::{block_identity, restore_newest};

use crate::data::DataOrder;
use crate::error::{Error, Result};
use crate::fault::Fault;
use crate::plan::Plan;
use crate::planning::planner::CostTable;
use crate::trace::{Span, WorkerSummary};
use crate::train::checkpoint::{self, CheckpointPolicy};
use crate::train::{detached_copy, steps_per_epoch, BlockTrainer, Progress, TrainLog, TrainSettings};

/// Knobs of the runtime itself (not of the mathematics).
#[derive(Debug, Clone)]
pub struct RuntimeSettings {
    /// Capacity of each activation channel between stages (batches in flight).
    pub channel_capacity: usize,
    /// A worker that makes no progress for this long (not counting waits
    /// for its peers) has failed; a wait for a peer gives up after twice this.
    pub timeout: Duration,
    /// Intra-op threads per worker; 0 = the machine's cores divided by the
    /// number of workers of the phase (at least 1).
    pub threads_per_worker: usize,
    /// Worker failures survived by re-routing or re-planning; one more stops
    /// the run (with its checkpoints intact).
    pub max_failures: usize,
    /// Per-block checkpoints (none: no checkpoints).
    pub checkpoints: Option<CheckpointPolicy>,
    /// Resume every block from its newest usable checkpoint in this folder.
    pub resume_from: Option<PathBuf>,
    /// Injected faults (tests).
    pub faults: Vec<Fault>,
    /// Costs for re-planning after a lost stage (none: from FLOPs).
    pub costs: Option<CostTable>,
    /// Memory per device slot for re-planning.
    pub memory_per_device: Option<u64>,
    /// A run spread over processes: this process is one rank and runs the
    /// workers of device slot `rank` (none: every worker is a thread here).
    /// A failure anywhere ends the run on every rank (no re-plan within the
    /// run; `resume_from` continues it, on any number of ranks).
    pub transport: Option<Arc<dyn transport::Transport>>,
}

impl Default for RuntimeSettings {
    fn default() -> Self {
        Self {
            channel_capacity: 2,
            timeout: Duration::from_secs(120),
            threads_per_worker: 0,
            max_failures: 0,
            checkpoints: None,
            resume_from: None,
            faults: Vec::new(),
            costs: None,
            memory_per_device: None,
            transport: None,
        }
    }
}

/// This machine's cores (1 if unknown).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Intra-op threads of each of `workers` workers: `configured`, or for 0 the
/// cores divided evenly (at least 1).
pub fn threads_per_worker(configured: usize, workers: usize) -> usize {
    match configured {
        0 => (cores() / workers.max(1)).max(1),
        n => n,
    }
}

/// How many workers of `threads` threads each the cores run at once (at least 1).
pub fn concurrent_workers(threads: usize) -> usize {
    (cores() / threads.max(1)).max(1)
}

/// What a plan's training produced.
pub struct PlanOutput<B: DistillBackend, S: StudentModule<B>> {
    /// The trained student blocks.
    pub students: Students<B, S>,
    /// Metric rows, final losses, steps, time.
    pub log: TrainLog,
    /// Every span of every worker (all phases; worker ids are global).
    pub spans: Vec<Span>,
    /// Busy / idle summary per worker.
    pub workers: Vec<WorkerSummary>,
    /// Resume, failures survived, checkpoints written.
    pub resilience: ResilienceLog,
    /// The plan the run ended on (differs from the given one after a re-plan).
    pub final_plan: Plan,
}

/// One distillation to run under a [`Plan`]: the frozen teacher, the
/// students, the data, and (each with a default) the training settings, the
/// devices, the runtime settings and a progress observer. For example
/// (`examples/custom_student.rs` runs it whole):
///
/// ```text
/// let output = Distillation::new(&teacher, students, &data)
///     .settings(TrainSettings { epochs: 2, batch_size: 64, ..Default::default() })
///     .devices(vec![device.clone(), device])
///     .run(&Plan::tr(&[1.0; 4], 2, true))?;
/// ```
pub struct Distillation<'a, B: DistillBackend, T: Block<B::InnerBackend>, S: StudentModule<B>> {
    teacher: &'a Teacher<B::InnerBackend, T>,
    students: Students<B, S>,
    data: &'a dyn Dataset<B::InnerBackend>,
    held_out: Option<&'a dyn Dataset<B::InnerBackend>>,
    settings: TrainSettings,
    devices: Vec<B::Device>,
    runtime: RuntimeSettings,
    observer: Option<&'a mut dyn FnMut(&Progress)>,
}

impl<'a, B, T, S> Distillation<'a, B, T, S>
where
    B: DistillBackend,
    T: Block<B::InnerBackend> + Sync,
    S: StudentModule<B>,
{
    /// Trains `students` against `teacher` on `data`, with
    /// [`TrainSettings::default`], [`RuntimeSettings::default`] and every
    /// device slot of the plan on `B`'s default device.
    pub fn new(
        teacher: &'a Teacher<B::InnerBackend, T>,
        students: Students<B, S>,
        data: &'a dyn Dataset<B::InnerBackend>,
    ) -> Self {
        Self {
            teacher,
            students,
            data,
            held_out: None,
            settings: TrainSettings::default(),
            devices: Vec::new(),
            runtime: RuntimeSettings::default(),
            observer: None,
        }
    }

    /// The training hyper-parameters.
    pub fn settings(mut self, settings: TrainSettings) -> Self {
        self.settings = settings;
        self
    }

    /// The held-out samples of a single-path search
    /// ([`TrainSettings::single_path`]): its architecture steps take their
    /// batches from here, in a seeded order, relayed through the same
    /// pipeline as the training batches. At least one batch.
    pub fn held_out(mut self, held_out: &'a dyn Dataset<B::InnerBackend>) -> Self {
        self.held_out = Some(held_out);
        self
    }

    /// The device of each slot: the plan's slot `i` runs on `devices[i]`.
    pub fn devices(mut self, devices: Vec<B::Device>) -> Self {
        self.devices = devices;
        self
    }

    /// Channel capacity, timeouts, threads, checkpoints, resume, faults.
    pub fn runtime(mut self, runtime: RuntimeSettings) -> Self {
        self.runtime = runtime;
        self
    }

    /// Called after every completed step (all blocks of the phase done).
    pub fn observer(mut self, observer: &'a mut dyn FnMut(&Progress)) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Trains under `plan` and returns the trained students with what was
    /// measured.
    pub fn run(self, plan: &Plan) -> Result<PlanOutput<B, S>> {
        let devices = if self.devices.is_empty() {
            vec![Default::default(); plan.slots().max(1)]
        } else {
            self.devices
        };
        let mut ignore = |_: &Progress| {};
        let observer = match self.observer {
            Some(observer) => observer,
            None => &mut ignore,
        };
        train_plan(
            plan,
            self.teacher,
            self.students,
            (self.data, self.held_out),
            &self.settings,
            &devices,
            &self.runtime,
            observer,
        )
    }
}

/// Trains `students` against `teacher` on `data` under `plan`, with device
/// slot `i` of the plan on `devices[i]`. `observer` sees every completed
/// step (all blocks of the phase done).
#[allow(clippy::too_many_arguments)]
fn train_plan<B, T, S>(
    plan: &Plan,
    teacher: &Teacher<B::InnerBackend, T>,
    students: Students<B, S>,
    (data, held_out): (&dyn Dataset<B::InnerBackend>, Option<&dyn Dataset<B::InnerBackend>>),
    settings: &TrainSettings,
    devices: &[B::Device],
    options: &RuntimeSettings,
    observer: &mut dyn FnMut(&Progress),
) -> Result<PlanOutput<B, S>>
where
    B: DistillBackend,
    T: Block<B::InnerBackend> + Sync,
    S: StudentModule<B>,
{
    let batch = settings.batch_size;
    let per_epoch = steps_per_epoch(data.len(), batch);
    let plan_error = |message: String| Error::Plan { plan: plan.name.clone(), message };
    if batch == 0 || per_epoch == 0 {
        return Err(plan_error(format!(
            "batch size {batch} does not fit the {} training samples",
            data.len()
        )));
    }
    if plan.slots() > devices.len() {
        return Err(plan_error(format!("needs {} device slots, {} given", plan.slots(), devices.len())));
    }
    if let Some(transport) = options.transport.as_ref().filter(|t| plan.slots() > t.ranks()) {
        return Err(transport::rank_mismatch(plan, transport.ranks()));
    }
    let blocks = students.blocks.len();
    for phase in &plan.phases {
        for stage in &phase.stages {
            if stage.blocks.end > blocks || stage.blocks.is_empty() {
                return Err(plan_error(format!(
                    "stage with blocks {:?} but there are {blocks} blocks",
                    stage.blocks
                )));
            }
            if stage.replicas() > batch {
                return Err(plan_error(format!(
                    "{} replicas cannot share a batch of {batch}",
                    stage.replicas()
                )));
            }
        }
    }
    let total_steps = per_epoch * settings.epochs;
    let supernets = students.blocks.iter().filter(|b| b.arch_logits().is_some()).count();
    let arch_steps = match &settings.single_path {
        Some(single_path) if supernets > 0 => single_path.arch_steps(total_steps),
        _ => 0,
    };
    let held_out = match held_out {
        _ if arch_steps == 0 => None,
        Some(held) if held.len() >= batch => Some(held),
        found => {
            return Err(plan_error(format!(
            "a single-path search takes its {arch_steps} architecture steps on held-out batches of {batch}, \
                 but {} held-out samples were given",
            found.map_or(0, |h| h.len())
        )))
        }
    };
    let Students { blocks: modules, specs, .. } = students;
    let order = DataOrder::new(settings.generator, settings.seed, specs.iter().map(|s| s.params).sum());
    let identities: Vec<BTreeMap<String, serde_json::Value>> =
        specs.iter().map(|spec| block_identity(options, settings, spec, total_steps)).collect();
    // Fresh copies, for blocks lost before their first checkpoint.
    let initial: Vec<S> = modules.iter().map(detached_copy).collect();
    let fresh = |k: usize| {
        BlockTrainer::new(k, specs[k].clone(), detached_copy(&initial[k]), &settings.optimizer, total_steps)
            .configured(settings)
    };
    let mut trainers: Vec<Option<BlockTrainer<B, S>>> = modules
        .into_iter()
        .zip(specs.iter().cloned())
        .enumerate()
        .map(|(k, (m, spec))| {
            Some(BlockTrainer::new(k, spec, m, &settings.optimizer, total_steps).configured(settings))
        })
        .collect();

    let mut resilience = ResilienceLog::default();
    if let Some(dir) = &options.resume_from {
        let dir = checkpoint::resolve_dir(dir);
        let any = (1..=blocks).any(|b| !checkpoint::list(&dir, b).is_empty());
        if !any {
            return Err(Error::Checkpoint {
                path: dir,
                message: "no checkpoints to resume from (expected block-NN/step-NNNNNNNN folders)".into(),
            });
        }
        for k in 0..blocks {
            let trainer = trainers[k].as_mut().ok_or_else(|| plan_error("block missing".into()))?;
            let resumed = restore_newest(trainer, &dir, &identities[k], &devices[0], true)?;
            resilience.resumed.push(resumed);
        }
    }

    let resumed_from = trainers.iter().flatten().map(|t| t.step).min().unwrap_or(0).min(total_steps);
    let origin = Instant::now();
    let mut log = TrainLog::default();
    let mut spans = Vec::new();
    let mut workers = Vec::new();
    let mut plan = plan.clone();
    let recovery: RecoveryContext<'_, B, S> = RecoveryContext {
        options,
        teacher_specs: &teacher.specs,
        student_specs: &specs,
        identities: &identities,
        devices,
        fresh: &fresh,
    };
    // After a failure: when it was detected, and the step every stage must
    // complete again for the run to have regained what it lost.
    let mut awaiting_recovery: Option<(Instant, usize)> = None;
    let mut phase_index = 0;
    while phase_index < plan.phases.len() {
        let description = plan.describe();
        let context = PhaseContext {
            phase: &plan.phases[phase_index],
            phase_index,
            phases: plan.phases.len(),
            plan_description: &description,
            teacher,
            data,
            held_out,
            settings,
            devices,
            options,
            per_epoch,
            order,
            total_steps,
            origin,
            first_worker: workers.len(),
            identities: &identities,
            recovery_target: awaiting_recovery.map(|(_, target)| target),
        };
        let outcome = run_phase(&context, &mut trainers, observer)?;
        log.rows.extend(outcome.rows);
        spans.extend(outcome.spans);
        workers.extend(outcome.workers);
        resilience.checkpoints_written += outcome.checkpoints_written;
        if let (Some((detected, _)), Some(regained)) = (awaiting_recovery, outcome.target_reached_at) {
            if let Some(last) = resilience.failures.last_mut() {
                last.recovery_seconds = regained.saturating_duration_since(detected).as_secs_f64();
            }
            awaiting_recovery = None;
        }
        let Some(failure) = outcome.failure else {
            phase_index += 1;
            continue;
        };
        if options.transport.is_some() {
            // Across processes a lost rank cannot be replaced within the
            // run: every rank stops; the checkpoints resume it.
            return Err(failure.error);
        }
        let recovered = recover(failure, &plan, phase_index, &resilience.failures, &recovery)?;
        for trainer in recovered.trainers {
            let k = trainer.index;
            trainers[k] = Some(trainer);
        }
        resilience.failures.push(recovered.record);
        awaiting_recovery = Some((recovered.detected_at, recovered.target.min(total_steps)));
        plan = recovered.plan;
    }
    resilience.final_plan = plan.describe();
    // Steps redone after a failure or resume log twice; keep the last row.
    log.rows.sort_by_key(|r| (r.step, r.block));
    log.rows.dedup_by_key(|r| (r.step, r.block));
    log.seconds = origin.elapsed().as_secs_f64();
    log.steps = total_steps;
    log.steps_run = total_steps - resumed_from;
    log.samples = log.steps_run * batch;
    let mut trained = Vec::with_capacity(blocks);
    for (k, t) in trainers.into_iter().enumerate() {
        let t = t.ok_or_else(|| plan_error(format!("block {} was not trained by any stage", k + 1)))?;
        log.final_losses.push(t.recent_loss());
        let index = t.index;
        trained.push(t.into_module().ok_or(Error::Training {
            block: index + 1,
            step: total_steps,
            message: "module missing after training".into(),
        })?);
    }
    Ok(PlanOutput {
        students: Students::new(trained, specs.clone(), &specs)?,
        log,
        spans,
        workers,
        resilience,
        final_plan: plan,
    })
}
