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
//! device changes), [`transport`], [`launch`] (the transport a run opens
//! and what the MPI launcher says), `wire`, `cluster` and `mpi` (runs
//! across processes).

mod cluster;
mod context;
#[doc(hidden)]
pub mod frames;
pub mod interrupt;
pub mod launch;
mod messages;
#[cfg(feature = "mpi")]
pub mod mpi;
mod phase;
pub mod recovery;
mod resume;
mod sync;
mod topology;
pub mod transport;
pub mod wire;
mod worker;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use context::PhaseContext;
use phase::{run_phase, PhaseFailure, PhaseOutcome};
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
    /// Ask the run to stop after the steps in flight (Ctrl-C, SIGTERM): every
    /// block's checkpoint is written and the run returns
    /// [`Error::Interrupted`]; `resume_from` continues it.
    pub interrupt: interrupt::Interrupt,
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
            interrupt: interrupt::Interrupt::new(),
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
    runtime: &RuntimeSettings,
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
    let blocks = students.blocks.len();
    check_plan(plan, blocks, batch, data.len(), devices.len(), runtime)?;
    let total_steps = per_epoch * settings.epochs;
    let supernets = students.blocks.iter().filter(|b| b.arch_logits().is_some()).count();
    let held_out = arch_batches(plan, settings, supernets, total_steps, held_out)?;
    let Students { blocks: modules, specs, .. } = students;
    let order = DataOrder::new(settings.generator, settings.seed, specs.iter().map(|s| s.params).sum());
    let identities: Vec<BTreeMap<String, serde_json::Value>> =
        specs.iter().map(|spec| block_identity(runtime, settings, spec, total_steps)).collect();
    // Fresh copies, for blocks lost before their first checkpoint.
    let initial: Vec<S> = modules.iter().map(detached_copy).collect();
    let fresh = |k: usize| {
        BlockTrainer::new(k, specs[k].clone(), detached_copy(&initial[k]), &settings.optimizer, total_steps)
            .configured(settings)
    };
    let mut trainers = new_trainers(modules, &specs, settings, total_steps);

    let mut record = RunRecord::default();
    if let Some(dir) = &runtime.resume_from {
        record.resilience.resumed = resume_all(dir, &mut trainers, &identities, &devices[0])?;
    }

    let resumed_from = trainers.iter().flatten().map(|t| t.step).min().unwrap_or(0).min(total_steps);
    let origin = Instant::now();
    let mut plan = plan.clone();
    let recovery: RecoveryContext<'_, B, S> = RecoveryContext {
        runtime,
        teacher_specs: &teacher.specs,
        student_specs: &specs,
        total_steps,
        identities: &identities,
        devices,
        fresh: &fresh,
    };
    let mut phase_index = 0;
    while phase_index < plan.phases.len() {
        let description = plan.describe();
        let gate = sync::StepGate::new();
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
            runtime,
            per_epoch,
            order,
            total_steps,
            origin,
            first_worker: record.workers.len(),
            identities: &identities,
            recovery_target: record.awaiting_recovery.map(|(_, target)| target),
            gate: &gate,
        };
        let outcome = run_phase(&context, &mut trainers, observer)?;
        let interrupted = outcome.interrupted;
        let Some(failure) = record.absorb(outcome) else {
            if let Some(error) = interruption(interrupted, &trainers, total_steps, runtime) {
                return Err(error);
            }
            phase_index += 1;
            continue;
        };
        plan = record.recover(failure, &plan, phase_index, &recovery, &mut trainers)?;
    }
    let RunRecord { mut log, spans, workers, mut resilience, .. } = record;
    resilience.final_plan = plan.describe();
    let (trained, final_losses) = trained_modules(trainers, &plan_error, total_steps)?;
    log.finish(origin.elapsed().as_secs_f64(), (resumed_from, total_steps), batch, final_losses);
    Ok(PlanOutput {
        students: Students::new(trained, specs.clone(), &specs)?,
        log,
        spans,
        workers,
        resilience,
        final_plan: plan,
    })
}

/// One trainer per student module, at step 0.
fn new_trainers<B: DistillBackend, S: StudentModule<B>>(
    modules: Vec<S>,
    specs: &[pipebd_core::BlockSpec],
    settings: &TrainSettings,
    total_steps: usize,
) -> Vec<Option<BlockTrainer<B, S>>> {
    modules
        .into_iter()
        .zip(specs.iter().cloned())
        .enumerate()
        .map(|(k, (m, spec))| BlockTrainer::new(k, spec, m, &settings.optimizer, total_steps))
        .map(|trainer| Some(trainer.configured(settings)))
        .collect()
}

/// After a phase the run was interrupted in (`interrupted`: the signal):
/// the error that ends the run, with the steps its blocks had completed and
/// where their checkpoints are; none when every block is done anyway.
fn interruption<B: DistillBackend, S: StudentModule<B>>(
    interrupted: Option<i32>,
    trainers: &[Option<BlockTrainer<B, S>>],
    total_steps: usize,
    runtime: &RuntimeSettings,
) -> Option<Error> {
    let signal = interrupted?;
    if trainers.iter().flatten().all(|t| t.step >= total_steps) {
        return None;
    }
    let steps = trainers.iter().flatten().map(|t| t.step);
    Some(Error::Interrupted {
        signal,
        completed_steps: steps.clone().min().unwrap_or(0),
        most_steps: steps.max().unwrap_or(0),
        total_steps,
        checkpoints: runtime.checkpoints.as_ref().map(|policy| policy.dir.clone()),
        resume_command: None,
    })
}

/// What a run has recorded over its phases so far.
#[derive(Default)]
struct RunRecord {
    log: TrainLog,
    spans: Vec<Span>,
    workers: Vec<WorkerSummary>,
    resilience: ResilienceLog,
    /// After a failure: when it was detected, and the step every stage must
    /// complete again for the run to have regained what it lost.
    awaiting_recovery: Option<(Instant, usize)>,
}

impl RunRecord {
    /// Adds a phase's rows, spans, workers and checkpoints, and the recovery
    /// time of the last failure once the phase has regained what it lost;
    /// returns the failure that ended the phase, if one did.
    fn absorb(&mut self, outcome: PhaseOutcome) -> Option<PhaseFailure> {
        self.log.rows.extend(outcome.rows);
        self.spans.extend(outcome.spans);
        self.workers.extend(outcome.workers);
        self.resilience.checkpoints_written += outcome.checkpoints_written;
        if let (Some((detected, _)), Some(regained)) = (self.awaiting_recovery, outcome.target_reached_at) {
            if let Some(last) = self.resilience.failures.last_mut() {
                last.recovery_seconds = regained.saturating_duration_since(detected).as_secs_f64();
            }
            self.awaiting_recovery = None;
        }
        outcome.failure
    }

    /// Recovers from `failure` in phase `phase_index` of `plan`: puts the
    /// lost blocks' restored trainers into `trainers`, records the failure
    /// and returns the plan to go on with. Across processes a lost rank
    /// cannot be replaced within the run: every rank stops (the checkpoints
    /// resume it).
    fn recover<B: DistillBackend, S: StudentModule<B>>(
        &mut self,
        failure: PhaseFailure,
        plan: &Plan,
        phase_index: usize,
        context: &RecoveryContext<'_, B, S>,
        trainers: &mut [Option<BlockTrainer<B, S>>],
    ) -> Result<Plan> {
        if context.runtime.transport.is_some() {
            return Err(failure.error);
        }
        let recovered = recover(failure, plan, phase_index, &self.resilience.failures, context)?;
        for trainer in recovered.trainers {
            let k = trainer.index;
            trainers[k] = Some(trainer);
        }
        self.resilience.failures.push(recovered.record);
        self.awaiting_recovery = Some((recovered.detected_at, recovered.target.min(context.total_steps)));
        Ok(recovered.plan)
    }
}

/// Checks that `plan` can run: a batch that gives at least one step, the
/// device slots (and ranks) it needs, stages within the blocks, replicas
/// no more than the batch's samples.
fn check_plan(
    plan: &Plan,
    blocks: usize,
    batch: usize,
    samples: usize,
    devices: usize,
    runtime: &RuntimeSettings,
) -> Result<()> {
    let plan_error = |message: String| Error::Plan { plan: plan.name.clone(), message };
    if batch == 0 || steps_per_epoch(samples, batch) == 0 {
        return Err(plan_error(format!("batch size {batch} does not fit the {samples} training samples")));
    }
    if plan.slots() > devices {
        return Err(plan_error(format!("needs {} device slots, {devices} given", plan.slots())));
    }
    if let Some(transport) = runtime.transport.as_ref().filter(|t| plan.slots() > t.ranks()) {
        return Err(transport::rank_mismatch(plan, transport.ranks()));
    }
    for stage in plan.phases.iter().flat_map(|p| &p.stages) {
        if stage.blocks.end > blocks || stage.blocks.is_empty() {
            return Err(plan_error(format!(
                "stage with blocks {:?} but there are {blocks} blocks",
                stage.blocks
            )));
        }
        if stage.replicas() > batch {
            return Err(plan_error(format!("{} replicas cannot share a batch of {batch}", stage.replicas())));
        }
    }
    Ok(())
}

/// Where a single-path search's architecture steps take their batches:
/// `None` when the run takes none, else the held-out samples (an error when
/// they are fewer than a batch).
fn arch_batches<'a, B: burn::tensor::backend::Backend>(
    plan: &Plan,
    settings: &TrainSettings,
    supernets: usize,
    total_steps: usize,
    held_out: Option<&'a dyn Dataset<B>>,
) -> Result<Option<&'a dyn Dataset<B>>> {
    let batch = settings.batch_size;
    let arch_steps = match &settings.single_path {
        Some(single_path) if supernets > 0 => single_path.arch_steps(total_steps),
        _ => 0,
    };
    match held_out {
        _ if arch_steps == 0 => Ok(None),
        Some(held) if held.len() >= batch => Ok(Some(held)),
        found => Err(Error::Plan {
            plan: plan.name.clone(),
            message: format!(
                "a single-path search takes its {arch_steps} architecture steps on held-out batches of {batch}, \
                 but {} held-out samples were given",
                found.map_or(0, |h| h.len())
            ),
        }),
    }
}

/// Restores every block from its newest matching checkpoint under `dir`.
fn resume_all<B: DistillBackend, S: StudentModule<B>>(
    dir: &std::path::Path,
    trainers: &mut [Option<BlockTrainer<B, S>>],
    identities: &[BTreeMap<String, serde_json::Value>],
    device: &B::Device,
) -> Result<Vec<crate::train::checkpoint::ResumedBlock>> {
    let dir = checkpoint::resolve_dir(dir);
    if (1..=trainers.len()).all(|b| checkpoint::list(&dir, b).is_empty()) {
        return Err(Error::Checkpoint {
            path: dir,
            message: "no checkpoints to resume from (expected block-NN/step-NNNNNNNN folders)".into(),
        });
    }
    let mut resumed = Vec::with_capacity(trainers.len());
    for (k, trainer) in trainers.iter_mut().enumerate() {
        let trainer = trainer.as_mut().ok_or_else(|| Error::Training {
            block: k + 1,
            step: 0,
            message: "block missing before the resume".into(),
        })?;
        resumed.push(restore_newest(trainer, &dir, &identities[k], device, true)?);
    }
    Ok(resumed)
}

/// The trained modules and their final losses, in block order.
fn trained_modules<B: DistillBackend, S: StudentModule<B>>(
    trainers: Vec<Option<BlockTrainer<B, S>>>,
    plan_error: &dyn Fn(String) -> Error,
    total_steps: usize,
) -> Result<(Vec<S>, Vec<f32>)> {
    let mut trained = Vec::with_capacity(trainers.len());
    let mut losses = Vec::with_capacity(trainers.len());
    for (k, t) in trainers.into_iter().enumerate() {
        let t = t.ok_or_else(|| plan_error(format!("block {} was not trained by any stage", k + 1)))?;
        losses.push(t.recent_loss());
        let index = t.index;
        trained.push(t.into_module().ok_or(Error::Training {
            block: index + 1,
            step: total_steps,
            message: "module missing after training".into(),
        })?);
    }
    Ok((trained, losses))
}
