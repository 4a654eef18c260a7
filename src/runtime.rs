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
//! of `GradientsParams` summed by burn's `step_multi`. A multi-node engine
//! (MPI point-to-point for activations, per-stage all-reduce groups for
//! gradients) replaces the channels and the leader exchange; the worker
//! loop stays as it is.

use std::collections::BTreeMap;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use crossbeam_channel::{bounded, unbounded, Receiver, RecvTimeoutError, SendTimeoutError, Sender};
use pipebd_kernels::DistillBackend;

use crate::block::{relabel, Activation, Block, BlockSpec, StudentModule, Students, Teacher};
use crate::checkpoint::{self, CheckpointPolicy, Refusal, ResumedBlock};
use crate::config::OptimizerConfig;
use crate::data::{epoch_order, Dataset};
use crate::error::{Error, Result};
use crate::fault::{Fault, FaultKind};
use crate::plan::{Phase, Plan, Stage};
use crate::planner::CostTable;
use crate::recovery::{flops_costs, replan, FailureRecord, Replan, ResilienceLog, RestoredBlock};
use crate::trace::{summarise, Span, SpanKind, SpanRecorder, WorkerSummary};
use crate::train::{detached_copy, steps_per_epoch, BlockTrainer, MetricRow, Progress, TrainLog};

/// How often a waiting worker looks at the stop signal.
const POLL: Duration = Duration::from_millis(20);

/// Knobs of the runtime itself (not of the mathematics).
#[derive(Debug, Clone)]
pub struct RuntimeOptions {
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
}

impl Default for RuntimeOptions {
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

/// The training hyper-parameters the runtime needs.
#[derive(Debug, Clone)]
pub struct TrainSettings {
    /// Passes over the data.
    pub epochs: usize,
    /// Global batch size.
    pub batch_size: usize,
    /// Seed of the data order.
    pub seed: u64,
    /// Metric row every this many steps.
    pub log_every: usize,
    /// Per-block optimizer.
    pub optimizer: OptimizerConfig,
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
}

/// Trains `students` against `teacher` on `data` under `plan`, with device
/// slot `i` of the plan on `devices[i]`. `observer` sees every completed
/// step (all blocks of the phase done).
#[allow(clippy::too_many_arguments)]
pub fn train_plan<B, T, S>(
    plan: &Plan,
    teacher: &Teacher<B::InnerBackend, T>,
    students: Students<B, S>,
    data: &dyn Dataset<B::InnerBackend>,
    settings: &TrainSettings,
    devices: &[B::Device],
    options: &RuntimeOptions,
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
    let Students { blocks: modules, specs, .. } = students;
    let identities: Vec<BTreeMap<String, serde_json::Value>> =
        specs.iter().map(|spec| block_identity(options, settings, spec, total_steps)).collect();
    // Fresh copies, for blocks lost before their first checkpoint.
    let initial: Vec<S> = modules.iter().map(detached_copy).collect();
    let fresh = |k: usize| {
        BlockTrainer::new(k, specs[k].clone(), detached_copy(&initial[k]), &settings.optimizer, total_steps)
    };
    let mut trainers: Vec<Option<BlockTrainer<B, S>>> = modules
        .into_iter()
        .zip(specs.iter().cloned())
        .enumerate()
        .map(|(k, (m, spec))| Some(BlockTrainer::new(k, spec, m, &settings.optimizer, total_steps)))
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
    let mut lost_slots: Vec<usize> = Vec::new();
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
            settings,
            devices,
            options,
            per_epoch,
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
        let Error::Worker { stage, replica, slot, .. } = &failure.error else {
            return Err(failure.error);
        };
        let (stage, replica, slot) = (*stage, *replica, *slot);
        if !failure.error.is_device_failure() || resilience.failures.len() >= options.max_failures {
            return Err(failure.error);
        }
        lost_slots.push(slot);
        let survivors: Vec<usize> = (0..plan.slots()).filter(|s| !lost_slots.contains(s)).collect();
        let costs = options.costs.clone().unwrap_or_else(|| {
            let flops = |s: &BlockSpec| s.flops as f64;
            let teacher_flops: Vec<f64> = teacher.specs.iter().map(flops).collect();
            let student_flops: Vec<f64> = specs.iter().map(flops).collect();
            flops_costs(&teacher_flops, &student_flops, survivors.len().max(1))
        });
        let (new_plan, action) =
            match replan(&plan, phase_index, slot, &survivors, &costs, options.memory_per_device) {
                Ok(Replan::Reroute(p)) => {
                    (p, "re-routed its share of each batch to the other replicas".to_string())
                }
                Ok(Replan::Replanned(p)) => {
                    (p, format!("re-planned the blocks over the surviving slots {survivors:?}"))
                }
                Err(why) => {
                    return Err(Error::Plan {
                        plan: plan.name.clone(),
                        message: format!(
                            "cannot continue after losing device slot {slot}: {why}; {}",
                            failure.error
                        ),
                    })
                }
            };
        let mut restored = Vec::new();
        for k in failure.lost_blocks {
            let lost_at = failure.block_steps.get(&k).copied().unwrap_or(0);
            let mut trainer = fresh(k);
            let resumed_at = match &options.checkpoints {
                Some(policy) => {
                    restore_newest(&mut trainer, &policy.dir, &identities[k], &devices[0], false)?.step
                }
                None => 0,
            };
            trainers[k] = Some(trainer);
            restored.push(RestoredBlock { block: k + 1, lost_at, resumed_at });
        }
        restored.sort_by_key(|r| r.block);
        let target = restored.iter().map(|r| r.lost_at).max().unwrap_or(0).max(failure.completed + 1);
        let detection_seconds = match &failure.error {
            Error::Worker { source, .. } => match source.as_ref() {
                Error::Stalled { seconds, .. } => *seconds,
                _ => 0.0,
            },
            _ => 0.0,
        };
        resilience.failures.push(FailureRecord {
            stage,
            replica,
            slot,
            error: failure.error.to_string(),
            action,
            old_plan: description,
            new_plan: new_plan.describe(),
            steps_lost: restored.iter().map(|r| r.lost_at.saturating_sub(r.resumed_at)).sum(),
            restored,
            detection_seconds,
            recovery_seconds: 0.0,
        });
        awaiting_recovery = Some((failure.detected_at, target.min(total_steps)));
        plan = new_plan;
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
    })
}

/// What a block checkpoint must match besides the run's own fields.
fn block_identity(
    options: &RuntimeOptions,
    settings: &TrainSettings,
    spec: &BlockSpec,
    total_steps: usize,
) -> BTreeMap<String, serde_json::Value> {
    use serde_json::json;
    let mut identity = options.checkpoints.as_ref().map(|p| p.identity.clone()).unwrap_or_default();
    identity.insert("block.name".into(), json!(spec.name));
    identity.insert("block.input_shape".into(), json!(spec.input_shape));
    identity.insert("block.output_shape".into(), json!(spec.output_shape));
    identity.insert("block.params".into(), json!(spec.params));
    identity.insert("train.total_steps".into(), json!(total_steps));
    identity.insert("train.batch_size".into(), json!(settings.batch_size));
    identity.insert("seed".into(), json!(settings.seed));
    identity.insert("optimizer".into(), serde_json::to_value(&settings.optimizer).unwrap_or_default());
    identity
}

/// Loads the newest usable checkpoint of `trainer`'s block from `dir`,
/// falling back past damaged ones. A checkpoint of another run is an error.
/// With `required`, a block whose checkpoints are all damaged is an error;
/// a block with none starts from scratch either way.
fn restore_newest<B: DistillBackend, S: StudentModule<B>>(
    trainer: &mut BlockTrainer<B, S>,
    dir: &std::path::Path,
    identity: &BTreeMap<String, serde_json::Value>,
    device: &B::Device,
    required: bool,
) -> Result<ResumedBlock> {
    let block = trainer.index + 1;
    let mut refused = Vec::new();
    for (_, folder) in checkpoint::list(dir, block) {
        match checkpoint::read(&folder, identity) {
            Ok((_, state)) => match trainer.load_state(state, device) {
                Ok(()) => {
                    return Ok(ResumedBlock { block, step: trainer.step, checkpoint: Some(folder), refused })
                }
                Err(why) => refused.push(format!("{}: {why}", folder.display())),
            },
            Err(Refusal::Damaged(e)) => refused.push(e.to_string()),
            Err(Refusal::Mismatch(e)) => return Err(e),
        }
    }
    if required && !refused.is_empty() {
        return Err(Error::Checkpoint {
            path: checkpoint::block_dir(dir, block),
            message: format!("no usable checkpoint of block {block}: {}", refused.join("; ")),
        });
    }
    Ok(ResumedBlock { block, step: 0, checkpoint: None, refused })
}

struct PhaseContext<'a, B: DistillBackend, T: Block<B::InnerBackend>> {
    phase: &'a Phase,
    teacher: &'a Teacher<B::InnerBackend, T>,
    data: &'a dyn Dataset<B::InnerBackend>,
    settings: &'a TrainSettings,
    devices: &'a [B::Device],
    options: &'a RuntimeOptions,
    per_epoch: usize,
    total_steps: usize,
    origin: Instant,
    first_worker: usize,
    phase_index: usize,
    phases: usize,
    plan_description: &'a str,
    identities: &'a [BTreeMap<String, serde_json::Value>],
    /// Note when every stage has completed this many steps.
    recovery_target: Option<usize>,
}

struct PhaseOutcome {
    rows: Vec<MetricRow>,
    spans: Vec<Span>,
    workers: Vec<WorkerSummary>,
    checkpoints_written: usize,
    /// When every stage had completed `recovery_target` steps.
    target_reached_at: Option<Instant>,
    /// The worker failure that ended the phase early.
    failure: Option<PhaseFailure>,
}

/// A phase ended by a failed worker; the surviving trainers are back in place.
struct PhaseFailure {
    error: Error,
    detected_at: Instant,
    /// Blocks whose state was on the failed worker (zero-based).
    lost_blocks: Vec<usize>,
    /// Steps completed per block, as last reported (zero-based block -> steps).
    block_steps: BTreeMap<usize, usize>,
    /// Steps every stage had completed.
    completed: usize,
}

/// The first error of a phase, and the flag every wait polls.
struct Stop {
    raised: AtomicBool,
    first: Mutex<Option<(Error, Instant)>>,
}

impl Stop {
    fn new() -> Self {
        Self { raised: AtomicBool::new(false), first: Mutex::new(None) }
    }
    fn raise(&self, error: Error) {
        let mut first = self.first.lock().unwrap_or_else(|p| p.into_inner());
        if first.is_none() {
            *first = Some((error, Instant::now()));
        }
        self.raised.store(true, Ordering::SeqCst);
    }
    fn is_raised(&self) -> bool {
        self.raised.load(Ordering::SeqCst)
    }
    fn take(&self) -> Option<(Error, Instant)> {
        self.first.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// A worker's sign of life, read by the phase's watchdog: when it last
/// moved, and whether it is waiting for a peer (which is not its fault).
struct Heartbeat {
    origin: Instant,
    last_ms: AtomicU64,
    waiting: AtomicUsize,
    finished: AtomicBool,
    step: AtomicUsize,
}

impl Heartbeat {
    fn new(origin: Instant) -> Self {
        Self {
            origin,
            last_ms: AtomicU64::new(origin.elapsed().as_millis() as u64),
            waiting: AtomicUsize::new(0),
            finished: AtomicBool::new(false),
            step: AtomicUsize::new(0),
        }
    }
    fn beat(&self) {
        self.last_ms.store(self.origin.elapsed().as_millis() as u64, Ordering::SeqCst);
    }
    /// Marks a wait for a peer until the guard is dropped.
    fn waiting(&self) -> WaitGuard<'_> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        WaitGuard(self)
    }
    /// Seconds since the last beat, if the worker is working (not waiting, not done).
    fn silent_for(&self) -> Option<f64> {
        if self.finished.load(Ordering::SeqCst) || self.waiting.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let now = self.origin.elapsed().as_millis() as u64;
        Some(now.saturating_sub(self.last_ms.load(Ordering::SeqCst)) as f64 / 1e3)
    }
}

struct WaitGuard<'a>(&'a Heartbeat);

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        self.0.beat();
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Why a worker stopped early: its own error, or someone else's.
enum Halt {
    Stopped,
    Failed(Error),
}

impl From<Error> for Halt {
    fn from(e: Error) -> Self {
        Halt::Failed(e)
    }
}

type Flow<T> = std::result::Result<T, Halt>;

/// A global barrier with a timeout that also gives way to the stop signal.
struct StepBarrier {
    parties: usize,
    state: Mutex<(u64, usize)>,
    turned: Condvar,
}

impl StepBarrier {
    fn new(parties: usize) -> Self {
        Self { parties, state: Mutex::new((0, 0)), turned: Condvar::new() }
    }

    fn wait(&self, stop: &Stop, timeout: Duration, who: &str) -> Flow<()> {
        let start = Instant::now();
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let generation = state.0;
        state.1 += 1;
        if state.1 == self.parties {
            state.0 += 1;
            state.1 = 0;
            self.turned.notify_all();
            return Ok(());
        }
        loop {
            let (next, _) = self.turned.wait_timeout(state, POLL).unwrap_or_else(|p| p.into_inner());
            state = next;
            if state.0 != generation {
                return Ok(());
            }
            if stop.is_raised() {
                return Err(Halt::Stopped);
            }
            if start.elapsed() > timeout {
                return Err(Halt::Failed(Error::Timeout {
                    message: format!("{who} waited {:.0} s at the step barrier", timeout.as_secs_f64()),
                }));
            }
        }
    }
}

fn receive<M>(rx: &Receiver<M>, stop: &Stop, timeout: Duration, what: impl Fn() -> String) -> Flow<M> {
    let start = Instant::now();
    loop {
        match rx.recv_timeout(POLL) {
            Ok(m) => return Ok(m),
            Err(RecvTimeoutError::Timeout) => {
                if stop.is_raised() {
                    return Err(Halt::Stopped);
                }
                if start.elapsed() > timeout {
                    return Err(Halt::Failed(Error::Timeout {
                        message: format!("{} (waited {:.0} s)", what(), timeout.as_secs_f64()),
                    }));
                }
            }
            Err(RecvTimeoutError::Disconnected) => return Err(Halt::Stopped),
        }
    }
}

fn send<M>(
    tx: &Sender<M>,
    mut message: M,
    stop: &Stop,
    timeout: Duration,
    what: impl Fn() -> String,
) -> Flow<()> {
    let start = Instant::now();
    loop {
        match tx.send_timeout(message, POLL) {
            Ok(()) => return Ok(()),
            Err(SendTimeoutError::Timeout(m)) => {
                if stop.is_raised() {
                    return Err(Halt::Stopped);
                }
                if start.elapsed() > timeout {
                    return Err(Halt::Failed(Error::Timeout {
                        message: format!("{} (blocked {:.0} s)", what(), timeout.as_secs_f64()),
                    }));
                }
                message = m;
            }
            Err(SendTimeoutError::Disconnected(_)) => return Err(Halt::Stopped),
        }
    }
}

struct ActivationMsg<IB: Backend> {
    step: usize,
    activation: Activation<IB>,
}

struct GradientMsg {
    step: usize,
    grads: Vec<GradientsParams>,
    weighted_losses: Vec<f32>,
}

struct ModuleMsg<S> {
    step: usize,
    modules: Vec<S>,
}

struct ProgressMsg {
    stage: usize,
    step: usize,
    losses: Vec<(usize, f32)>,
}

enum Role<S> {
    Solo,
    Leader { from_followers: Vec<Receiver<GradientMsg>>, to_followers: Vec<Sender<ModuleMsg<S>>> },
    Follower { to_leader: Sender<GradientMsg>, from_leader: Receiver<ModuleMsg<S>> },
}

struct Inbound<IB: Backend> {
    rx: Receiver<ActivationMsg<IB>>,
    from: String,
}

struct Outbound<IB: Backend> {
    tx: Sender<ActivationMsg<IB>>,
    /// Sub-range of this worker's share to send, relative to the share.
    start: usize,
    len: usize,
    to: String,
}

struct Worker<B: DistillBackend, S: StudentModule<B>> {
    id: usize,
    stage: usize,
    replica: usize,
    slot: usize,
    stage_spec: Stage,
    share: Range<usize>,
    inbound: Vec<Inbound<B::InnerBackend>>,
    outbound: Vec<Outbound<B::InnerBackend>>,
    role: Role<S>,
    trainers: Vec<BlockTrainer<B, S>>,
}

impl<B: DistillBackend, S: StudentModule<B>> Worker<B, S> {
    fn name(&self) -> String {
        format!("stage {} replica {}", self.stage + 1, self.replica)
    }
    fn is_leader(&self) -> bool {
        !matches!(self.role, Role::Follower { .. })
    }
}

/// Samples `r*B/g .. (r+1)*B/g` of a batch of `batch`.
fn share(batch: usize, replicas: usize, r: usize) -> Range<usize> {
    (r * batch / replicas)..((r + 1) * batch / replicas)
}

fn overlap(a: &Range<usize>, b: &Range<usize>) -> Option<Range<usize>> {
    let start = a.start.max(b.start);
    let end = a.end.min(b.end);
    (start < end).then_some(start..end)
}

/// Builds the workers of a phase and the channels between them.
fn build_workers<B, T, S>(
    context: &PhaseContext<'_, B, T>,
    trainers: &mut [Option<BlockTrainer<B, S>>],
) -> Result<Vec<Worker<B, S>>>
where
    B: DistillBackend,
    T: Block<B::InnerBackend>,
    S: StudentModule<B>,
{
    let batch = context.settings.batch_size;
    let capacity = context.options.channel_capacity.max(1);
    let mut workers: Vec<Worker<B, S>> = Vec::new();
    let mut stage_workers: Vec<Vec<usize>> = Vec::new();
    for (s, stage) in context.phase.stages.iter().enumerate() {
        let g = stage.replicas();
        let mut ids = Vec::new();
        // Replica 0 keeps the optimizers; the others train clones of the blocks.
        let mut owned: Vec<BlockTrainer<B, S>> = Vec::new();
        for k in stage.blocks.clone() {
            let trainer = trainers[k].take().ok_or_else(|| Error::Plan {
                plan: "phase".into(),
                message: format!("block {} is trained by two stages of one phase", k + 1),
            })?;
            owned.push(trainer);
        }
        let mut replica_trainers = vec![owned];
        for _ in 1..g {
            replica_trainers.push(replica_trainers[0].iter().map(BlockTrainer::follower_copy).collect());
        }
        for (r, replica) in replica_trainers.into_iter().enumerate() {
            let id = context.first_worker + workers.len();
            ids.push(workers.len());
            workers.push(Worker {
                id,
                stage: s,
                replica: r,
                slot: stage.slots[r],
                stage_spec: stage.clone(),
                share: share(batch, g, r),
                inbound: Vec::new(),
                outbound: Vec::new(),
                role: Role::Solo,
                trainers: replica,
            });
        }
        // Replica group: followers send gradients to the leader, which answers with the updated blocks.
        if g > 1 {
            let mut from_followers = Vec::new();
            let mut to_followers = Vec::new();
            for &w in &ids[1..] {
                let (grad_tx, grad_rx) = bounded(1);
                let (module_tx, module_rx) = bounded(1);
                from_followers.push(grad_rx);
                to_followers.push(module_tx);
                workers[w].role = Role::Follower { to_leader: grad_tx, from_leader: module_rx };
            }
            workers[ids[0]].role = Role::Leader { from_followers, to_followers };
        }
        stage_workers.push(ids);
    }
    // Activation channels from stage s to stage s+1 when s+1 does not load data.
    for s in 1..context.phase.stages.len() {
        if context.phase.stages[s].loads_data {
            continue;
        }
        for &down in &stage_workers[s] {
            for &up in &stage_workers[s - 1] {
                let Some(common) = overlap(&workers[up].share, &workers[down].share) else {
                    continue;
                };
                let (tx, rx) = bounded(capacity);
                let from = workers[up].name();
                let to = workers[down].name();
                let up_start = workers[up].share.start;
                workers[up].outbound.push(Outbound {
                    tx,
                    start: common.start - up_start,
                    len: common.len(),
                    to,
                });
                workers[down].inbound.push(Inbound { rx, from });
            }
        }
    }
    Ok(workers)
}

fn run_phase<B, T, S>(
    context: &PhaseContext<'_, B, T>,
    trainers: &mut [Option<BlockTrainer<B, S>>],
    observer: &mut dyn FnMut(&Progress),
) -> Result<PhaseOutcome>
where
    B: DistillBackend,
    T: Block<B::InnerBackend> + Sync,
    S: StudentModule<B>,
{
    // Blocks ahead of the others (resumed from a newer checkpoint, or kept
    // through a failure) skip their student work until the rest catch up.
    let phase_blocks_iter = || context.phase.stages.iter().flat_map(|s| s.blocks.clone());
    let mut block_steps: BTreeMap<usize, usize> = BTreeMap::new();
    for k in phase_blocks_iter() {
        if let Some(t) = trainers.get(k).and_then(|t| t.as_ref()) {
            block_steps.insert(k, t.step);
        }
    }
    let start_step = block_steps.values().copied().min().unwrap_or(0).min(context.total_steps);
    let workers = build_workers(context, trainers)?;
    let count = workers.len();
    let who: Vec<(usize, usize, usize)> = workers.iter().map(|w| (w.stage, w.replica, w.slot)).collect();
    let heartbeats: Vec<Heartbeat> = (0..count).map(|_| Heartbeat::new(Instant::now())).collect();
    let stop = Stop::new();
    let barrier = context.phase.barrier.then(|| StepBarrier::new(count));
    let (progress_tx, progress_rx) = unbounded::<ProgressMsg>();
    let stages = context.phase.stages.len();
    let phase_blocks: usize = context.phase.stages.iter().map(|s| s.blocks.len()).sum();
    let threads = threads_per_worker(context.options.threads_per_worker, count);
    let stall_limit = context.options.timeout.as_secs_f64();
    let mut target_reached_at = None;
    let mut completed = start_step;

    let results: Vec<std::thread::Result<WorkerResult<B, S>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = workers
            .into_iter()
            .zip(&heartbeats)
            .map(|(worker, beat)| {
                let progress_tx = progress_tx.clone();
                let stop = &stop;
                let barrier = barrier.as_ref();
                let run = move || run_worker(context, worker, stop, barrier, &progress_tx, beat, start_step);
                scope.spawn(move || {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
                    match pool {
                        Ok(pool) => pool.install(run),
                        Err(_) => run(),
                    }
                })
            })
            .collect();
        drop(progress_tx);
        // Forward progress to the observer until every worker has hung up,
        // and watch for workers that stopped moving.
        let mut stage_step = vec![start_step; stages];
        let mut losses = vec![f32::NAN; phase_blocks];
        let first_block = context.phase.stages.first().map_or(0, |s| s.blocks.start);
        let mut reported = start_step;
        loop {
            match progress_rx.recv_timeout(POLL * 5) {
                Ok(msg) => {
                    stage_step[msg.stage] = stage_step[msg.stage].max(msg.step + 1);
                    for (block, loss) in msg.losses {
                        block_steps.insert(block, msg.step + 1);
                        if let Some(slot) = losses.get_mut(block.saturating_sub(first_block)) {
                            *slot = loss;
                        }
                    }
                    let done = stage_step.iter().copied().min().unwrap_or(0);
                    while reported < done {
                        observer(&Progress {
                            phase: context.phase_index,
                            phases: context.phases,
                            epoch: reported / context.per_epoch,
                            epochs: context.settings.epochs,
                            step_in_epoch: reported % context.per_epoch,
                            steps_per_epoch: context.per_epoch,
                            losses: losses.clone(),
                        });
                        reported += 1;
                    }
                    completed = reported;
                    if context.recovery_target.is_some_and(|t| reported >= t) {
                        target_reached_at.get_or_insert_with(Instant::now);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            if stop.is_raised() {
                continue;
            }
            let stalled = heartbeats
                .iter()
                .enumerate()
                .find_map(|(i, beat)| beat.silent_for().filter(|&s| s > stall_limit).map(|s| (i, s)));
            if let Some((i, seconds)) = stalled {
                let (stage, replica, slot) = who[i];
                let step = heartbeats[i].step.load(Ordering::SeqCst);
                stop.raise(Error::Worker {
                    stage: stage + 1,
                    replica,
                    slot,
                    source: Box::new(Error::Stalled { seconds, step }),
                });
            }
        }
        handles.into_iter().map(|h| h.join()).collect()
    });

    let mut outcome = PhaseOutcome {
        rows: Vec::new(),
        spans: Vec::new(),
        workers: Vec::new(),
        checkpoints_written: 0,
        target_reached_at,
        failure: None,
    };
    // The worker named by the first error is the failed one (its device is
    // gone with the state on it), whether it reported the error itself or
    // the watchdog found it silent.
    let first = stop.take();
    let failed_worker = match &first {
        Some((Error::Worker { stage, replica, .. }, _)) => {
            who.iter().position(|&(s, r, _)| s + 1 == *stage && r == *replica)
        }
        _ => None,
    };
    let mut lost_blocks = Vec::new();
    for (i, result) in results.into_iter().enumerate() {
        let result = result.map_err(|_| Error::Timeout { message: "a worker thread died".into() })?;
        if failed_worker == Some(i) {
            lost_blocks.extend(result.trainers.iter().map(|(k, _)| *k));
        } else {
            for (k, trainer) in result.trainers {
                trainers[k] = Some(trainer);
            }
        }
        outcome.rows.extend(result.rows);
        outcome.checkpoints_written += result.checkpoints_written;
        outcome.workers.push(summarise(
            result.id,
            result.role,
            result.slot,
            &result.spans,
            result.wall_seconds,
        ));
        outcome.spans.extend(result.spans);
    }
    if let Some((error, detected_at)) = first {
        outcome.failure = Some(PhaseFailure { error, detected_at, lost_blocks, block_steps, completed });
    }
    Ok(outcome)
}

struct WorkerResult<B: DistillBackend, S: StudentModule<B>> {
    id: usize,
    role: String,
    slot: usize,
    /// The leader's trainers (a failed worker's are lost with its device).
    trainers: Vec<(usize, BlockTrainer<B, S>)>,
    rows: Vec<MetricRow>,
    spans: Vec<Span>,
    wall_seconds: f64,
    checkpoints_written: usize,
}

/// Runs one worker to completion; any failure or panic raises the stop
/// signal with an error naming the stage, slot and block.
fn run_worker<B, T, S>(
    context: &PhaseContext<'_, B, T>,
    mut worker: Worker<B, S>,
    stop: &Stop,
    barrier: Option<&StepBarrier>,
    progress: &Sender<ProgressMsg>,
    beat: &Heartbeat,
    start_step: usize,
) -> WorkerResult<B, S>
where
    B: DistillBackend,
    T: Block<B::InnerBackend>,
    S: StudentModule<B>,
{
    let start = Instant::now();
    let mut recorder = SpanRecorder::new(worker.id, context.origin);
    let mut rows = Vec::new();
    let mut position = Position::default();
    let mut checkpoints_written = 0;
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let mut state = LoopState {
            recorder: &mut recorder,
            rows: &mut rows,
            position: &mut position,
            beat,
            checkpoints_written: &mut checkpoints_written,
        };
        worker_loop(context, &mut worker, stop, barrier, progress, &mut state, start_step)
    }));
    beat.finished.store(true, Ordering::SeqCst);
    let failure = match outcome {
        Ok(Ok(())) => None,
        Ok(Err(Halt::Stopped)) => None,
        Ok(Err(Halt::Failed(error))) => Some(error),
        Err(panic) => {
            let message = crate::error::panic_message(panic.as_ref());
            let step = beat.step.load(Ordering::SeqCst);
            Some(Error::Panic { block: position.block.unwrap_or(0), step, message })
        }
    };
    if let Some(error) = failure {
        stop.raise(Error::Worker {
            stage: worker.stage + 1,
            replica: worker.replica,
            slot: worker.slot,
            source: Box::new(error),
        });
    }
    let trainers = if worker.is_leader() {
        worker.trainers.drain(..).map(|t| (t.index, t)).collect()
    } else {
        Vec::new()
    };
    WorkerResult {
        id: worker.id,
        role: worker.name(),
        slot: worker.slot,
        trainers,
        rows,
        spans: recorder.spans,
        wall_seconds: start.elapsed().as_secs_f64(),
        checkpoints_written,
    }
}

/// The block a worker is in, for error messages after a panic (its step is
/// on its heartbeat).
#[derive(Default)]
struct Position {
    block: Option<usize>,
}

/// What a worker loop writes into besides its worker.
struct LoopState<'a> {
    recorder: &'a mut SpanRecorder,
    rows: &'a mut Vec<MetricRow>,
    position: &'a mut Position,
    beat: &'a Heartbeat,
    checkpoints_written: &'a mut usize,
}

#[allow(clippy::too_many_arguments)]
fn worker_loop<B, T, S>(
    context: &PhaseContext<'_, B, T>,
    worker: &mut Worker<B, S>,
    stop: &Stop,
    barrier: Option<&StepBarrier>,
    progress: &Sender<ProgressMsg>,
    state: &mut LoopState<'_>,
    start_step: usize,
) -> Flow<()>
where
    B: DistillBackend,
    T: Block<B::InnerBackend>,
    S: StudentModule<B>,
{
    let device = &context.devices[worker.slot];
    let settings = context.settings;
    let batch = settings.batch_size;
    // The watchdog declares a silent worker failed after `timeout`; a wait
    // for a peer is only the backstop behind it.
    let timeout = context.options.timeout * 2;
    let stage = worker.stage_spec.clone();
    let teacher_start = stage.teacher_start();
    let teacher_blocks: Vec<T> = context.teacher.blocks[teacher_start..stage.blocks.end]
        .iter()
        .map(|b| b.clone().to_device(device))
        .collect();
    for trainer in &mut worker.trainers {
        if let Some(module) = trainer.module().cloned() {
            trainer.replace_module(module.fork(device));
        }
    }
    let weight = worker.share.len() as f32 / batch as f32;
    let name = worker.name();
    let mut order: Vec<usize> = Vec::new();
    let mut order_epoch = usize::MAX;
    let mut last_checkpoint = Instant::now();
    let beat = state.beat;

    for step in start_step..context.total_steps {
        state.position.block = None;
        beat.step.store(step, Ordering::SeqCst);
        beat.beat();
        if stop.is_raised() {
            return Err(Halt::Stopped);
        }
        inject_fault(context, worker.slot, step, stop)?;
        let epoch = step / context.per_epoch;
        let in_epoch = step % context.per_epoch;
        // A block ahead of this step (resumed from a newer checkpoint) only relays.
        let active: Vec<bool> = worker.trainers.iter().map(|t| t.step == step).collect();
        let any_active = active.iter().any(|&a| a);

        // 1. Input: data or the previous stage's activation.
        let mut x = if stage.loads_data {
            if epoch != order_epoch {
                order = epoch_order(context.data.len(), settings.seed, epoch);
                order_epoch = epoch;
            }
            let base = in_epoch * batch;
            let indices = &order[base + worker.share.start..base + worker.share.end];
            state.recorder.time(SpanKind::DataLoad, None, || context.data.batch(indices, device))
        } else {
            let started = Instant::now();
            let mut parts = Vec::with_capacity(worker.inbound.len());
            for inbound in &worker.inbound {
                let _waiting = beat.waiting();
                let msg = receive(&inbound.rx, stop, timeout, || {
                    format!(
                        "{name} timed out waiting for the activation of step {step} from {}",
                        inbound.from
                    )
                })?;
                if msg.step != step {
                    return Err(Halt::Failed(Error::Timeout {
                        message: format!(
                            "{name} expected step {step} from {} but got step {}",
                            inbound.from, msg.step
                        ),
                    }));
                }
                parts.push(msg.activation.to_device(device));
            }
            state.recorder.record(SpanKind::RecvWait, None, started);
            Activation::cat_batch(parts).ok_or_else(|| Error::Block {
                block: stage.blocks.start + 1,
                message: "received activations of different kinds".into(),
            })?
        };
        beat.beat();

        // 2. Teacher blocks; keep (input, output) of the blocks trained here.
        let mut pairs = Vec::with_capacity(stage.blocks.len());
        for (offset, block) in teacher_blocks.iter().enumerate() {
            let k = teacher_start + offset;
            state.position.block = Some(k + 1);
            let y = state.recorder.time(SpanKind::TeacherForward, Some(k + 1), || block.forward(x.clone()));
            let y = y.map_err(|e| relabel(e, k + 1))?;
            if k >= stage.blocks.start && active[k - stage.blocks.start] {
                pairs.push((x, y.clone()));
            }
            x = y;
            beat.beat();
        }

        // 3. Relay the boundary activation at once.
        for out in &worker.outbound {
            let started = Instant::now();
            let msg = ActivationMsg { step, activation: x.clone().narrow_batch(out.start, out.len) };
            let _waiting = beat.waiting();
            send(&out.tx, msg, stop, timeout, || format!("{name} could not hand step {step} to {}", out.to))?;
            state.recorder.record(SpanKind::SendWait, None, started);
        }
        drop(x);

        // 4. Students: forward + backward per block.
        let mut grads = Vec::with_capacity(pairs.len());
        let mut weighted_losses = Vec::with_capacity(pairs.len());
        let active_trainers = worker.trainers.iter().zip(&active).filter(|(_, &a)| a).map(|(t, _)| t);
        for (trainer, (input, target)) in active_trainers.zip(pairs) {
            state.position.block = Some(trainer.index + 1);
            let block = Some(trainer.index + 1);
            let (loss, g) = state.recorder.time(SpanKind::StudentForwardBackward, block, || {
                trainer.compute_grads(input, target, weight)
            })?;
            grads.push(g);
            weighted_losses.push(loss * weight);
            beat.beat();
        }
        state.position.block = None;

        // 5. Gradient exchange, barrier, optimizer step.
        if !any_active {
            if let Some(barrier) = barrier {
                let _waiting = beat.waiting();
                barrier.wait(stop, timeout, &name)?;
            }
            if worker.is_leader() {
                let _ = progress.send(ProgressMsg { stage: worker.stage, step, losses: Vec::new() });
            }
            continue;
        }
        match &worker.role {
            Role::Follower { to_leader, from_leader } => {
                let started = Instant::now();
                let _waiting = beat.waiting();
                send(to_leader, GradientMsg { step, grads, weighted_losses }, stop, timeout, || {
                    format!("{name} could not hand its gradients of step {step} to replica 0")
                })?;
                if let Some(barrier) = barrier {
                    barrier.wait(stop, timeout, &name)?;
                }
                let msg = receive(from_leader, stop, timeout, || {
                    format!("{name} timed out waiting for replica 0's update of step {step}")
                })?;
                state.recorder.record(SpanKind::GradientAverage, None, started);
                debug_assert_eq!(msg.step, step);
                let active_trainers = worker.trainers.iter_mut().zip(&active).filter(|(_, &a)| a);
                for ((trainer, _), module) in active_trainers.zip(msg.modules) {
                    trainer.replace_module(module.fork(device));
                    trainer.advance(f32::NAN);
                }
            }
            Role::Solo | Role::Leader { .. } => {
                let mut per_replica = vec![grads.into_iter()];
                let mut losses = weighted_losses;
                if let Role::Leader { from_followers, .. } = &worker.role {
                    let started = Instant::now();
                    let _waiting = beat.waiting();
                    for (i, rx) in from_followers.iter().enumerate() {
                        let msg = receive(rx, stop, timeout, || {
                            format!(
                                "{name} timed out waiting for the gradients of replica {} at step {step}",
                                i + 1
                            )
                        })?;
                        debug_assert_eq!(msg.step, step);
                        per_replica.push(msg.grads.into_iter());
                        for (total, l) in losses.iter_mut().zip(msg.weighted_losses) {
                            *total += l;
                        }
                    }
                    state.recorder.record(SpanKind::GradientAverage, None, started);
                }
                if let Some(barrier) = barrier {
                    let started = Instant::now();
                    let _waiting = beat.waiting();
                    barrier.wait(stop, timeout, &name)?;
                    state.recorder.record(SpanKind::BarrierWait, None, started);
                }
                let log_this = step % settings.log_every == 0 || step + 1 == context.total_steps;
                let mut report = Vec::with_capacity(worker.trainers.len());
                let active_trainers = worker.trainers.iter_mut().zip(&active).filter(|(_, &a)| a);
                for ((trainer, _), &loss) in active_trainers.zip(&losses) {
                    state.position.block = Some(trainer.index + 1);
                    let block_grads: Vec<GradientsParams> =
                        per_replica.iter_mut().map(|g| g.next().unwrap_or_default()).collect();
                    let lr = trainer.current_lr();
                    state.recorder.time(SpanKind::OptimizerStep, Some(trainer.index + 1), || {
                        trainer.apply(block_grads, &[loss])
                    })?;
                    if log_this {
                        state.rows.push(MetricRow { epoch, step, block: trainer.index + 1, loss, lr });
                    }
                    report.push((trainer.index, loss));
                }
                beat.beat();
                if let Role::Leader { to_followers, .. } = &worker.role {
                    let started = Instant::now();
                    let _waiting = beat.waiting();
                    for (i, tx) in to_followers.iter().enumerate() {
                        let modules: Vec<S> = worker
                            .trainers
                            .iter()
                            .zip(&active)
                            .filter(|(_, &a)| a)
                            .filter_map(|(t, _)| t.module().map(detached_copy))
                            .collect();
                        send(tx, ModuleMsg { step, modules }, stop, timeout, || {
                            format!("{name} could not hand the update of step {step} to replica {}", i + 1)
                        })?;
                    }
                    state.recorder.record(SpanKind::GradientAverage, None, started);
                }
                write_checkpoints(context, worker, &active, &mut last_checkpoint, state, stop)?;
                let _ = progress.send(ProgressMsg { stage: worker.stage, step, losses: report });
            }
        }
    }
    Ok(())
}

/// Fires an injected fault for the worker on `slot` at `step`, if any.
fn inject_fault<B: DistillBackend, T: Block<B::InnerBackend>>(
    context: &PhaseContext<'_, B, T>,
    slot: usize,
    step: usize,
    stop: &Stop,
) -> Flow<()> {
    let Some(fault) = context.options.faults.iter().find(|f| f.hits_worker(slot, step)) else {
        return Ok(());
    };
    match fault.kind {
        FaultKind::Error => Err(Halt::Failed(Error::InjectedFault { kind: "error".into(), step })),
        FaultKind::Panic => panic!("injected fault `panic` at step {step}"),
        FaultKind::Hang => loop {
            // Silent until the watchdog gives up on this worker.
            std::thread::sleep(POLL);
            if stop.is_raised() {
                return Err(Halt::Stopped);
            }
        },
        FaultKind::StallCheckpoint => Ok(()),
    }
}

/// The leader's checkpoints after a step: every `every_steps` steps of a
/// block, when `every_seconds` have passed, and at the block's last step.
fn write_checkpoints<B, T, S>(
    context: &PhaseContext<'_, B, T>,
    worker: &Worker<B, S>,
    active: &[bool],
    last_checkpoint: &mut Instant,
    state: &mut LoopState<'_>,
    stop: &Stop,
) -> Flow<()>
where
    B: DistillBackend,
    T: Block<B::InnerBackend>,
    S: StudentModule<B>,
{
    let Some(policy) = &context.options.checkpoints else {
        return Ok(());
    };
    let timed = policy.every_seconds > 0.0 && last_checkpoint.elapsed().as_secs_f64() >= policy.every_seconds;
    let mut wrote = false;
    for (trainer, _) in worker.trainers.iter().zip(active).filter(|(_, &a)| a) {
        let step = trainer.step;
        let by_steps = policy.every_steps > 0 && step % policy.every_steps == 0;
        if !(timed || by_steps || step == context.total_steps) {
            continue;
        }
        let block = trainer.index + 1;
        state.position.block = Some(block);
        let started = Instant::now();
        let saved = trainer.save_state()?;
        let stall = |tmp: &std::path::Path| {
            eprintln!(
                "pipebd: fault: checkpoint write stalled (block {block}, step {step}, {})",
                tmp.display()
            );
            let until = Instant::now() + Duration::from_secs(3600);
            while Instant::now() < until && !stop.is_raised() {
                std::thread::sleep(POLL);
            }
        };
        let pause = context.options.faults.iter().any(|f| f.hits_checkpoint(block, step));
        let identity = context.identities[trainer.index].clone();
        let position = BTreeMap::from([
            ("epoch".to_string(), serde_json::json!(step / context.per_epoch)),
            ("batch_in_epoch".to_string(), serde_json::json!(step % context.per_epoch)),
            ("next_lr".to_string(), serde_json::json!(trainer.current_lr())),
            ("data_seed".to_string(), serde_json::json!(context.settings.seed)),
        ]);
        checkpoint::write(
            policy,
            block,
            &saved,
            context.plan_description,
            identity,
            position,
            if pause { Some(&stall) } else { None },
        )?;
        state.recorder.record(SpanKind::Checkpoint, Some(block), started);
        *state.checkpoints_written += 1;
        state.beat.beat();
        wrote = true;
    }
    if wrote || timed {
        *last_checkpoint = Instant::now();
    }
    Ok(())
}
