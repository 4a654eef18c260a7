//! One worker's training loop: per step its input (data or the previous
//! stage's activations), its teacher blocks, the hand-off to the next stage,
//! its students, the replica gradient exchange, the optimizer step and the
//! leader's checkpoints; and the injected faults that test it.
//!
//! A single-path search adds an architecture tick before some training
//! steps ([`crate::train::arch::SinglePath::arch_step_at`]): the same
//! relay with a held-out batch, after which the supernet blocks update
//! their architecture logits only. Every worker runs the same ticks, so the
//! messages of the two kinds never cross.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use burn::optim::GradientsParams;
use crossbeam_channel::Sender;
use pipebd_core::{Activation, Block, Stage, StudentModule};
use pipebd_kernels::DistillBackend;

use super::context::PhaseContext;
use super::messages::{ActivationMsg, GradientMsg, ModuleMsg, ProgressMsg, Sink, Source};
use super::sync::{receive_from, send_to, Flow, Halt, Heartbeat, StepBarrier, Stop, POLL};
use super::topology::{Role, Worker};
use super::transport::Tag;
use super::wire;
use crate::error::{relabel, Error};
use crate::fault::FaultKind;
use crate::trace::{SpanKind, SpanRecorder};
use crate::train::{checkpoint, detached_copy, read_losses, BlockTrainer, MetricRow, StepLoss};

/// The block a worker is in, for error messages after a panic (its step is
/// on its heartbeat).
#[derive(Default)]
pub(super) struct Position {
    pub(super) block: Option<usize>,
}

/// What a worker loop writes into besides its worker.
pub(super) struct LoopState<'a> {
    pub(super) recorder: &'a mut SpanRecorder,
    pub(super) rows: &'a mut Vec<MetricRow>,
    pub(super) position: &'a mut Position,
    pub(super) beat: &'a Heartbeat,
    pub(super) checkpoints_written: &'a mut usize,
}

/// What stays fixed during a worker's loop: its device, the teacher blocks
/// it runs, its share of the batch, and how it waits and reports.
struct Env<'a, B: DistillBackend, T> {
    device: &'a B::Device,
    stage: Stage,
    /// The teacher blocks this worker runs, from `stage.teacher_start()`.
    teacher_blocks: Vec<T>,
    /// This replica's share of the batch (its loss weight).
    weight: f32,
    name: String,
    /// The backstop of a wait for a peer (the watchdog acts first).
    timeout: Duration,
    stop: &'a Stop,
    barrier: Option<&'a StepBarrier>,
    progress: &'a Sender<ProgressMsg>,
}

/// Where a worker is in its data: the sample order of the current training
/// epoch and held-out pass (computed once per pass), and when it last wrote
/// a checkpoint.
struct Cursor {
    order: Vec<usize>,
    order_epoch: usize,
    held_order: Vec<usize>,
    held_pass: usize,
    last_checkpoint: Instant,
}

/// Trains `worker`'s blocks from `start_step` to the end of the run, or
/// until it fails (`Halt::Failed`) or another worker does (`Halt::Stopped`).
#[allow(clippy::too_many_arguments)]
pub(super) fn worker_loop<B, T, S>(
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
    let stage = worker.stage_spec.clone();
    let teacher_blocks = context.teacher.blocks[stage.teacher_start()..stage.blocks.end]
        .iter()
        .map(|b| b.clone().to_device(device))
        .collect();
    for trainer in &mut worker.trainers {
        if let Some(module) = trainer.module().cloned() {
            trainer.replace_module(module.fork(device));
        }
    }
    let env = Env {
        device,
        stage,
        teacher_blocks,
        weight: worker.share.len() as f32 / context.settings.batch_size as f32,
        name: worker.name(),
        timeout: context.runtime.timeout * 2,
        stop,
        barrier,
        progress,
    };
    let mut cursor = Cursor {
        order: Vec::new(),
        order_epoch: usize::MAX,
        held_order: Vec::new(),
        held_pass: usize::MAX,
        last_checkpoint: Instant::now(),
    };
    for step in start_step..context.total_steps {
        state.position.block = None;
        state.beat.step.store(step, Ordering::SeqCst);
        state.beat.beat();
        if stop.is_raised() {
            return Err(Halt::Stopped);
        }
        let go_on = {
            let _waiting = state.beat.waiting();
            context.gate.enter(step, stop)?
        };
        if !go_on {
            // Interrupted: the steps before this one are done everywhere.
            if worker.is_leader() {
                write_interrupted_checkpoints(context, worker, state)?;
            }
            return Ok(());
        }
        inject_fault(context, worker.slot, step, stop)?;
        let arch_tick = match (context.held_out, &context.settings.single_path) {
            (Some(_), Some(single_path)) => single_path.arch_step_at(step, context.total_steps),
            _ => None,
        };
        for tick in arch_tick.map(Tick::Arch).into_iter().chain([Tick::Train]) {
            run_tick(context, &env, worker, state, &mut cursor, step, tick)?;
        }
    }
    Ok(())
}

/// One tick of `step`: the input, the teacher blocks, the relay to the next
/// stage, the students' gradients, then the exchange with the other replicas
/// and the optimizer step (and, after a training tick, the checkpoints and
/// the progress report).
fn run_tick<B, T, S>(
    context: &PhaseContext<'_, B, T>,
    env: &Env<'_, B, T>,
    worker: &mut Worker<B, S>,
    state: &mut LoopState<'_>,
    cursor: &mut Cursor,
    step: usize,
    tick: Tick,
) -> Flow<()>
where
    B: DistillBackend,
    T: Block<B::InnerBackend>,
    S: StudentModule<B>,
{
    let is_arch = tick != Tick::Train;
    // A block ahead of this step (resumed from a newer checkpoint) only
    // relays; an architecture tick trains the supernet blocks only.
    let active: Vec<bool> =
        worker.trainers.iter().map(|t| t.step == step && (!is_arch || t.searches_paths())).collect();

    let x = if env.stage.loads_data {
        load_batch(context, env, worker, state, cursor, step, tick)?
    } else {
        receive_inputs(env, worker, state, step, tick)?
    };
    state.beat.beat();
    let (x, pairs) = teacher_forward(env, &active, state, x)?;
    relay(env, worker, state, step, is_arch, x)?;
    let (grads, weighted_losses) = student_gradients(env, worker, &active, state, is_arch, pairs)?;
    state.position.block = None;

    if !active.iter().any(|&a| a) {
        // Nothing to train here this tick: keep in step with the others.
        if let Some(barrier) = env.barrier {
            let _waiting = state.beat.waiting();
            barrier.wait(env.stop, env.timeout, &env.name)?;
        }
        if worker.is_leader() && !is_arch {
            let _ = env.progress.send(ProgressMsg { stage: worker.stage, step, losses: Vec::new() });
        }
        return Ok(());
    }
    match &worker.role {
        Role::Follower { to_leader, from_leader } => {
            let msg = GradientMsg { step, grads, weighted_losses };
            follower_update(env, &mut worker.trainers, &active, state, (to_leader, from_leader), msg, is_arch)
        }
        role @ (Role::Solo | Role::Leader { .. }) => {
            let epoch = step / context.per_epoch;
            let log_this =
                !is_arch && (step % context.settings.log_every == 0 || step + 1 == context.total_steps);
            let mine = GradientMsg { step, grads, weighted_losses };
            let report = leader_update(
                env,
                &mut worker.trainers,
                role,
                &active,
                state,
                mine,
                is_arch,
                log_this,
                |step, block, loss, lr| log_this.then_some(MetricRow { epoch, step, block, loss, lr }),
            )?;
            if !is_arch {
                write_checkpoints(context, worker, &active, &mut cursor.last_checkpoint, state, env.stop)?;
                let _ = env.progress.send(ProgressMsg { stage: worker.stage, step, losses: report });
            }
            Ok(())
        }
    }
}

/// A stage that reads the data: this replica's share of the tick's batch
/// (a training batch, or an architecture tick's held-out batch).
fn load_batch<B, T, S>(
    context: &PhaseContext<'_, B, T>,
    env: &Env<'_, B, T>,
    worker: &Worker<B, S>,
    state: &mut LoopState<'_>,
    cursor: &mut Cursor,
    step: usize,
    tick: Tick,
) -> Flow<Activation<B::InnerBackend>>
where
    B: DistillBackend,
    T: Block<B::InnerBackend>,
    S: StudentModule<B>,
{
    let batch = context.settings.batch_size;
    let share = &worker.share;
    let (data, indices) = match (tick, context.held_out) {
        (Tick::Arch(index), Some(held)) => {
            let per_pass = (held.len() / batch).max(1);
            let pass = index / per_pass;
            if pass != cursor.held_pass {
                cursor.held_order = context.order.epoch(held.len(), pass);
                cursor.held_pass = pass;
            }
            let base = (index % per_pass) * batch;
            (held, &cursor.held_order[base + share.start..base + share.end])
        }
        _ => {
            let epoch = step / context.per_epoch;
            if epoch != cursor.order_epoch {
                cursor.order = context.order.epoch(context.data.len(), epoch);
                cursor.order_epoch = epoch;
            }
            let base = (step % context.per_epoch) * batch;
            (context.data, &cursor.order[base + share.start..base + share.end])
        }
    };
    let x = state.recorder.time(SpanKind::DataLoad, None, || data.batch(indices, env.device));
    x.map_err(|e| Halt::Failed(relabel(e, env.stage.blocks.start + 1)))
}

/// A stage fed by the previous one: the activations of `step`'s tick from
/// every inbound replica, joined along the batch.
fn receive_inputs<B, T, S>(
    env: &Env<'_, B, T>,
    worker: &Worker<B, S>,
    state: &mut LoopState<'_>,
    step: usize,
    tick: Tick,
) -> Flow<Activation<B::InnerBackend>>
where
    B: DistillBackend,
    S: StudentModule<B>,
{
    let is_arch = tick != Tick::Train;
    let name = &env.name;
    let started = Instant::now();
    let mut parts = Vec::with_capacity(worker.inbound.len());
    for inbound in &worker.inbound {
        let _waiting = state.beat.waiting();
        let decode = |bytes| wire::decode_activation_msg(bytes, env.device);
        let msg = receive_from(&inbound.rx, Tag::Activation, decode, env.stop, env.timeout, || {
            format!("{name} timed out waiting for the activation of step {step} from {}", inbound.from)
        })?;
        // Stages out of step are a bug in the runtime, not a lost device:
        // an `Error::Training` ends the run instead of triggering a recovery
        // (`Error::is_device_failure`).
        if msg.step != step || msg.arch != is_arch {
            let got = if msg.arch { "architecture" } else { "training" };
            return Err(Halt::Failed(Error::Training {
                block: env.stage.blocks.start + 1,
                step,
                message: format!(
                    "{name} expected the {} activation of step {step} from {} but received the {got} one of step {}",
                    tick.name(),
                    inbound.from,
                    msg.step
                ),
            }));
        }
        parts.push(msg.activation.to_device(env.device));
    }
    state.recorder.record(SpanKind::RecvWait, None, started);
    Activation::cat_batch(parts).ok_or_else(|| {
        Halt::Failed(Error::block(env.stage.blocks.start + 1, "received activations of different kinds"))
    })
}

/// The teacher blocks of the stage on `x`: the boundary activation for the
/// next stage, and the (input, output) pair of every active block.
#[allow(clippy::type_complexity)]
fn teacher_forward<B, T>(
    env: &Env<'_, B, T>,
    active: &[bool],
    state: &mut LoopState<'_>,
    mut x: Activation<B::InnerBackend>,
) -> Flow<(Activation<B::InnerBackend>, Vec<(Activation<B::InnerBackend>, Activation<B::InnerBackend>)>)>
where
    B: DistillBackend,
    T: Block<B::InnerBackend>,
{
    let teacher_start = env.stage.teacher_start();
    let mut pairs = Vec::with_capacity(env.stage.blocks.len());
    for (offset, block) in env.teacher_blocks.iter().enumerate() {
        let k = teacher_start + offset;
        state.position.block = Some(k + 1);
        let y = state.recorder.time(SpanKind::TeacherForward, Some(k + 1), || block.forward(x.clone()));
        let y = y.map_err(|e| relabel(e, k + 1))?;
        if k >= env.stage.blocks.start && active[k - env.stage.blocks.start] {
            pairs.push((x, y.clone()));
        }
        x = y;
        state.beat.beat();
    }
    Ok((x, pairs))
}

/// Hands the boundary activation `x` to every replica of the next stage
/// (each its part of this worker's share), at once.
fn relay<B, T, S>(
    env: &Env<'_, B, T>,
    worker: &Worker<B, S>,
    state: &mut LoopState<'_>,
    step: usize,
    arch: bool,
    x: Activation<B::InnerBackend>,
) -> Flow<()>
where
    B: DistillBackend,
    S: StudentModule<B>,
{
    for out in &worker.outbound {
        let started = Instant::now();
        let msg = ActivationMsg { step, arch, activation: x.clone().narrow_batch(out.start, out.len) };
        let _waiting = state.beat.waiting();
        send_to(&out.tx, msg, Tag::Activation, wire::encode_activation_msg, env.stop, env.timeout, || {
            format!("{} could not hand step {step} to {}", env.name, out.to)
        })?;
        state.recorder.record(SpanKind::SendWait, None, started);
    }
    Ok(())
}

/// Forward and backward of every active student on its (input, target)
/// pair: the gradients and the losses weighted by this replica's share.
#[allow(clippy::type_complexity)]
fn student_gradients<B, T, S>(
    env: &Env<'_, B, T>,
    worker: &Worker<B, S>,
    active: &[bool],
    state: &mut LoopState<'_>,
    arch: bool,
    pairs: Vec<(Activation<B::InnerBackend>, Activation<B::InnerBackend>)>,
) -> Flow<(Vec<GradientsParams>, Vec<StepLoss<B::InnerBackend>>)>
where
    B: DistillBackend,
    S: StudentModule<B>,
{
    let mut grads = Vec::with_capacity(pairs.len());
    let mut weighted_losses = Vec::with_capacity(pairs.len());
    let active_trainers = worker.trainers.iter().zip(active).filter(|(_, &a)| a).map(|(t, _)| t);
    for (trainer, (input, target)) in active_trainers.zip(pairs) {
        let block = Some(trainer.index + 1);
        state.position.block = block;
        let (loss, g) = state.recorder.time(SpanKind::StudentForwardBackward, block, || {
            if arch {
                trainer.compute_arch_grads(input, target, env.weight)
            } else {
                trainer.compute_grads(input, target, env.weight)
            }
        })?;
        grads.push(g);
        weighted_losses.push(loss.weighted(env.weight));
        state.beat.beat();
    }
    Ok((grads, weighted_losses))
}

/// A follower replica: hands its gradients to replica 0 and takes the
/// updated modules back.
fn follower_update<B, T, S>(
    env: &Env<'_, B, T>,
    trainers: &mut [BlockTrainer<B, S>],
    active: &[bool],
    state: &mut LoopState<'_>,
    (to_leader, from_leader): (&Sink<GradientMsg<B::InnerBackend>>, &Source<ModuleMsg<S>>),
    mine: GradientMsg<B::InnerBackend>,
    arch: bool,
) -> Flow<()>
where
    B: DistillBackend,
    S: StudentModule<B>,
{
    let (name, step) = (&env.name, mine.step);
    let started = Instant::now();
    let _waiting = state.beat.waiting();
    let modules: Vec<&S> = active_modules(trainers, active);
    let encode = |msg| wire::encode_gradient_msg::<B, S>(msg, &modules);
    send_to(to_leader, mine, Tag::Gradients, encode, env.stop, env.timeout, || {
        format!("{name} could not hand its gradients of step {step} to replica 0")
    })?;
    if let Some(barrier) = env.barrier {
        barrier.wait(env.stop, env.timeout, name)?;
    }
    let decode = |bytes| wire::decode_module_msg::<B, S>(bytes, &modules, env.device);
    let msg = receive_from(from_leader, Tag::Modules, decode, env.stop, env.timeout, || {
        format!("{name} timed out waiting for replica 0's update of step {step}")
    })?;
    state.recorder.record(SpanKind::GradientAverage, None, started);
    debug_assert_eq!(msg.step, step);
    let active_trainers = trainers.iter_mut().zip(active).filter(|(_, &a)| a);
    for ((trainer, _), module) in active_trainers.zip(msg.modules) {
        trainer.replace_module(module.fork(env.device));
        if !arch {
            trainer.advance(StepLoss::Read(f32::NAN));
        }
    }
    Ok(())
}

/// Replica 0 (or the only one): gathers the followers' gradients, waits at
/// the barrier, steps every active block's optimizer (or its architecture
/// logits), and sends the updated modules to the followers. With
/// `read_back`, losses still on the device are read back first (a logged
/// step; elsewhere they were read at once). `row` turns a (step, block,
/// loss, lr) into the metric row to keep, if any. Returns each stepped
/// block's index and summed loss, where it has been read.
#[allow(clippy::too_many_arguments)]
fn leader_update<B, T, S>(
    env: &Env<'_, B, T>,
    trainers: &mut [BlockTrainer<B, S>],
    role: &Role<B::InnerBackend, S>,
    active: &[bool],
    state: &mut LoopState<'_>,
    mine: GradientMsg<B::InnerBackend>,
    arch: bool,
    read_back: bool,
    row: impl Fn(usize, usize, f32, f64) -> Option<MetricRow>,
) -> Flow<Vec<(usize, f32)>>
where
    B: DistillBackend,
    S: StudentModule<B>,
{
    let (name, step) = (&env.name, mine.step);
    let mut per_replica = vec![mine.grads.into_iter()];
    let mut losses = mine.weighted_losses;
    if let Role::Leader { from_followers, .. } = role {
        let started = Instant::now();
        let _waiting = state.beat.waiting();
        let modules: Vec<&S> = active_modules(trainers, active);
        for (i, rx) in from_followers.iter().enumerate() {
            let decode = |bytes| wire::decode_gradient_msg::<B, S>(bytes, &modules, env.device);
            let msg = receive_from(rx, Tag::Gradients, decode, env.stop, env.timeout, || {
                format!("{name} timed out waiting for the gradients of replica {} at step {step}", i + 1)
            })?;
            debug_assert_eq!(msg.step, step);
            per_replica.push(msg.grads.into_iter());
            losses = losses.into_iter().zip(msg.weighted_losses).map(|(total, l)| total.plus(l)).collect();
        }
        state.recorder.record(SpanKind::GradientAverage, None, started);
    }
    if let Some(barrier) = env.barrier {
        let started = Instant::now();
        let _waiting = state.beat.waiting();
        barrier.wait(env.stop, env.timeout, name)?;
        state.recorder.record(SpanKind::BarrierWait, None, started);
    }
    let mut lrs = Vec::with_capacity(trainers.len());
    let active_trainers = trainers.iter_mut().zip(active).filter(|(_, &a)| a);
    for ((trainer, _), loss) in active_trainers.zip(losses) {
        state.position.block = Some(trainer.index + 1);
        let block_grads: Vec<GradientsParams> =
            per_replica.iter_mut().map(|g| g.next().unwrap_or_default()).collect();
        lrs.push(trainer.current_lr());
        state.recorder.time(SpanKind::OptimizerStep, Some(trainer.index + 1), || {
            if arch {
                trainer.apply_arch(block_grads)
            } else {
                trainer.apply(block_grads, loss)
            }
        })?;
    }
    let mut report = Vec::with_capacity(trainers.len());
    if !arch {
        let mut stepped: Vec<&mut BlockTrainer<B, S>> =
            trainers.iter_mut().zip(active).filter(|(_, &a)| a).map(|(t, _)| t).collect();
        if read_back {
            state.position.block = stepped.first().map(|t| t.index + 1);
            read_losses(&mut stepped)?;
        }
        for (trainer, lr) in stepped.iter().zip(lrs) {
            let Some(loss) = trainer.latest_loss() else { continue };
            if let Some(r) = row(step, trainer.index + 1, loss, lr) {
                state.rows.push(r);
            }
            report.push((trainer.index, loss));
        }
    }
    state.beat.beat();
    if let Role::Leader { to_followers, .. } = role {
        let started = Instant::now();
        let _waiting = state.beat.waiting();
        for (i, tx) in to_followers.iter().enumerate() {
            let modules: Vec<S> = active_modules(trainers, active).into_iter().map(detached_copy).collect();
            let msg = ModuleMsg { step, modules };
            send_to(tx, msg, Tag::Modules, wire::encode_module_msg::<B, S>, env.stop, env.timeout, || {
                format!("{name} could not hand the update of step {step} to replica {}", i + 1)
            })?;
        }
        state.recorder.record(SpanKind::GradientAverage, None, started);
    }
    Ok(report)
}

/// The modules of the active blocks, in order (what a gradient or module
/// message of this step holds).
fn active_modules<'a, B: DistillBackend, S: StudentModule<B>>(
    trainers: &'a [BlockTrainer<B, S>],
    active: &[bool],
) -> Vec<&'a S> {
    trainers.iter().zip(active).filter(|(_, &a)| a).filter_map(|(t, _)| t.module()).collect()
}

/// What a worker does within one step: an architecture tick (a held-out
/// batch for the supernet blocks' logits; its index among the run's
/// architecture steps) and always a training tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tick {
    Arch(usize),
    Train,
}

impl Tick {
    fn name(self) -> &'static str {
        match self {
            Tick::Arch(_) => "architecture",
            Tick::Train => "training",
        }
    }
}

/// Fires an injected fault for the worker on `slot` at `step`, if any.
fn inject_fault<B: DistillBackend, T: Block<B::InnerBackend>>(
    context: &PhaseContext<'_, B, T>,
    slot: usize,
    step: usize,
    stop: &Stop,
) -> Flow<()> {
    let Some(fault) = context.runtime.faults.iter().find(|f| f.hits_worker(slot, step)) else {
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
    let Some(policy) = &context.runtime.checkpoints else {
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
        let pause = context.runtime.faults.iter().any(|f| f.hits_checkpoint(block, step));
        save_block(context, policy, trainer, state, if pause { Some(&stall) } else { None })?;
        wrote = true;
    }
    if wrote || timed {
        *last_checkpoint = Instant::now();
    }
    Ok(())
}

/// A stage leader's checkpoints when the run is interrupted before a step:
/// every block it trains that is neither done nor already saved at its step.
fn write_interrupted_checkpoints<B, T, S>(
    context: &PhaseContext<'_, B, T>,
    worker: &Worker<B, S>,
    state: &mut LoopState<'_>,
) -> Flow<()>
where
    B: DistillBackend,
    T: Block<B::InnerBackend>,
    S: StudentModule<B>,
{
    let Some(policy) = &context.runtime.checkpoints else {
        return Ok(());
    };
    for trainer in &worker.trainers {
        let (block, step) = (trainer.index + 1, trainer.step);
        if step == 0 || step >= context.total_steps || checkpoint::has_step(&policy.dir, block, step) {
            continue;
        }
        save_block(context, policy, trainer, state, None)?;
    }
    Ok(())
}

/// Writes `trainer`'s checkpoint at its step under `policy` (`pause`: the
/// injected stall of a test), recording the span and the count.
fn save_block<B, T, S>(
    context: &PhaseContext<'_, B, T>,
    policy: &checkpoint::CheckpointPolicy,
    trainer: &BlockTrainer<B, S>,
    state: &mut LoopState<'_>,
    pause: Option<checkpoint::WritePause<'_>>,
) -> Flow<()>
where
    B: DistillBackend,
    T: Block<B::InnerBackend>,
    S: StudentModule<B>,
{
    let block = trainer.index + 1;
    state.position.block = Some(block);
    let started = Instant::now();
    let saved = trainer.save_state()?;
    let identity = context.identities[trainer.index].clone();
    let position = checkpoint_position(context, trainer.step, trainer.current_lr());
    checkpoint::write(policy, block, &saved, context.plan_description, identity, position, pause)?;
    state.recorder.record(SpanKind::Checkpoint, Some(block), started);
    *state.checkpoints_written += 1;
    state.beat.beat();
    Ok(())
}

/// Where a checkpoint written after `step` steps stands in the data, for
/// its manifest.
fn checkpoint_position<B: DistillBackend, T: Block<B::InnerBackend>>(
    context: &PhaseContext<'_, B, T>,
    step: usize,
    next_lr: f64,
) -> BTreeMap<String, serde_json::Value> {
    BTreeMap::from([
        ("epoch".to_string(), serde_json::json!(step / context.per_epoch)),
        ("batch_in_epoch".to_string(), serde_json::json!(step % context.per_epoch)),
        ("next_lr".to_string(), serde_json::json!(next_lr)),
        ("data_seed".to_string(), serde_json::json!(context.settings.seed)),
    ])
}
