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
use pipebd_core::{Activation, Block, StudentModule};
use pipebd_kernels::DistillBackend;

use super::phase::{PhaseContext, ProgressMsg};
use super::sync::{receive, send, Flow, Halt, Heartbeat, StepBarrier, Stop, POLL};
use super::topology::{ActivationMsg, GradientMsg, ModuleMsg, Role, Worker};
use crate::error::{relabel, Error};
use crate::fault::FaultKind;
use crate::trace::{SpanKind, SpanRecorder};
use crate::train::{checkpoint, detached_copy, MetricRow};

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
    let mut held_order: Vec<usize> = Vec::new();
    let mut held_epoch = usize::MAX;
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
        let arch_tick = match (context.held_out, &settings.single_path) {
            (Some(_), Some(single_path)) => single_path.arch_step_at(step, context.total_steps),
            _ => None,
        };
        let ticks = arch_tick.map(Tick::Arch).into_iter().chain([Tick::Train]);
        for tick in ticks {
            let is_arch = matches!(tick, Tick::Arch(_));
            // A block ahead of this step (resumed from a newer checkpoint) only
            // relays; an architecture tick trains the supernet blocks only.
            let active: Vec<bool> =
                worker.trainers.iter().map(|t| t.step == step && (!is_arch || t.searches_paths())).collect();
            let any_active = active.iter().any(|&a| a);

            // 1. Input: data or the previous stage's activation.
            let mut x = if stage.loads_data {
                let (data, indices) = match (tick, context.held_out) {
                    (Tick::Arch(index), Some(held)) => {
                        let per_pass = held.len() / batch;
                        let pass = index / per_pass.max(1);
                        if pass != held_epoch {
                            held_order = context.order.epoch(held.len(), pass);
                            held_epoch = pass;
                        }
                        let base = (index % per_pass.max(1)) * batch;
                        (held, &held_order[base + worker.share.start..base + worker.share.end])
                    }
                    _ => {
                        if epoch != order_epoch {
                            order = context.order.epoch(context.data.len(), epoch);
                            order_epoch = epoch;
                        }
                        let base = in_epoch * batch;
                        (context.data, &order[base + worker.share.start..base + worker.share.end])
                    }
                };
                state
                    .recorder
                    .time(SpanKind::DataLoad, None, || data.batch(indices, device))
                    .map_err(|e| Halt::Failed(relabel(e, stage.blocks.start + 1)))?
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
                    // Stages out of step are a bug in the runtime, not a lost
                    // device: an `Error::Training` ends the run instead of
                    // triggering a recovery (`Error::is_device_failure`).
                    if msg.step != step || msg.arch != is_arch {
                        return Err(Halt::Failed(Error::Training {
                        block: stage.blocks.start + 1,
                        step,
                        message: format!(
                            "{name} expected the {} activation of step {step} from {} but received the {} one of step {}",
                            tick.name(),
                            inbound.from,
                            if msg.arch { "architecture" } else { "training" },
                            msg.step
                        ),
                    }));
                    }
                    parts.push(msg.activation.to_device(device));
                }
                state.recorder.record(SpanKind::RecvWait, None, started);
                Activation::cat_batch(parts).ok_or_else(|| {
                    Error::block(stage.blocks.start + 1, "received activations of different kinds")
                })?
            };
            beat.beat();

            // 2. Teacher blocks; keep (input, output) of the blocks trained here.
            let mut pairs = Vec::with_capacity(stage.blocks.len());
            for (offset, block) in teacher_blocks.iter().enumerate() {
                let k = teacher_start + offset;
                state.position.block = Some(k + 1);
                let y =
                    state.recorder.time(SpanKind::TeacherForward, Some(k + 1), || block.forward(x.clone()));
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
                let msg = ActivationMsg {
                    step,
                    arch: is_arch,
                    activation: x.clone().narrow_batch(out.start, out.len),
                };
                let _waiting = beat.waiting();
                send(&out.tx, msg, stop, timeout, || {
                    format!("{name} could not hand step {step} to {}", out.to)
                })?;
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
                    if is_arch {
                        trainer.compute_arch_grads(input, target, weight)
                    } else {
                        trainer.compute_grads(input, target, weight)
                    }
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
                if worker.is_leader() && !is_arch {
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
                        if !is_arch {
                            trainer.advance(f32::NAN);
                        }
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
                    let log_this =
                        !is_arch && (step % settings.log_every == 0 || step + 1 == context.total_steps);
                    let mut report = Vec::with_capacity(worker.trainers.len());
                    let active_trainers = worker.trainers.iter_mut().zip(&active).filter(|(_, &a)| a);
                    for ((trainer, _), &loss) in active_trainers.zip(&losses) {
                        state.position.block = Some(trainer.index + 1);
                        let block_grads: Vec<GradientsParams> =
                            per_replica.iter_mut().map(|g| g.next().unwrap_or_default()).collect();
                        let lr = trainer.current_lr();
                        state.recorder.time(SpanKind::OptimizerStep, Some(trainer.index + 1), || {
                            if is_arch {
                                trainer.apply_arch(block_grads)
                            } else {
                                trainer.apply(block_grads, &[loss])
                            }
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
                                format!(
                                    "{name} could not hand the update of step {step} to replica {}",
                                    i + 1
                                )
                            })?;
                        }
                        state.recorder.record(SpanKind::GradientAverage, None, started);
                    }
                    if !is_arch {
                        write_checkpoints(context, worker, &active, &mut last_checkpoint, state, stop)?;
                        let _ = progress.send(ProgressMsg { stage: worker.stage, step, losses: report });
                    }
                }
            }
        }
    }
    Ok(())
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
