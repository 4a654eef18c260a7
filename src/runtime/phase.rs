//! One phase of a plan: its worker threads, the watchdog that forwards
//! progress and declares silent workers lost, and what the phase hands back
//! (the surviving trainers, metric rows, spans, and the failure that ended
//! it early, if any).

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::time::Instant;

use crossbeam_channel::{unbounded, RecvTimeoutError, Sender};
use pipebd_core::{Block, StudentModule};
use pipebd_kernels::DistillBackend;

use super::cluster::{ClusterWatch, PhaseEnd};
use super::context::PhaseContext;
use super::messages::{Peer, ProgressMsg};
use super::sync::{Halt, Heartbeat, StepBarrier, Stop, POLL};
use super::threads_per_worker;
use super::topology::{build_workers, Worker};
use super::worker::{worker_loop, LoopState, Position};
use crate::error::{Error, Result};
use crate::trace::{summarise, Span, SpanRecorder, WorkerSummary};
use crate::train::{BlockTrainer, MetricRow, Progress};

/// What a phase produced, and how it ended.
pub(super) struct PhaseOutcome {
    pub(super) rows: Vec<MetricRow>,
    pub(super) spans: Vec<Span>,
    pub(super) workers: Vec<WorkerSummary>,
    pub(super) checkpoints_written: usize,
    /// When every stage had completed `recovery_target` steps.
    pub(super) target_reached_at: Option<Instant>,
    /// The worker failure that ended the phase early.
    pub(super) failure: Option<PhaseFailure>,
    /// The signal that interrupted the run, when the run must not go on to
    /// its next phase (agreed by every rank in a run over processes).
    pub(super) interrupted: Option<i32>,
}

/// A phase ended by a failed worker; the surviving trainers are back in place.
pub(super) struct PhaseFailure {
    pub(super) error: Error,
    pub(super) detected_at: Instant,
    /// Blocks whose state was on the failed worker (zero-based).
    pub(super) lost_blocks: Vec<usize>,
    /// Steps completed per block, as last reported (zero-based block -> steps).
    pub(super) block_steps: BTreeMap<usize, usize>,
    /// Steps every stage had completed.
    pub(super) completed: usize,
}

/// Runs one phase: one thread per worker, and on this thread the watchdog
/// that forwards progress to `observer` and declares silent workers lost.
/// The trainers of the surviving stage leaders are put back in `trainers`.
pub(super) fn run_phase<B, T, S>(
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
    let barrier = context.phase.barrier.then(|| phase_barrier(context, count));
    let mut watch = context.runtime.transport.clone().map(|t| {
        let silence = context.runtime.timeout.as_secs_f64();
        ClusterWatch::new(t, silence, context.runtime.interrupt.clone(), (context.phase_index, start_step))
    });
    let (progress_tx, progress_rx) = unbounded::<ProgressMsg>();
    let stages = context.phase.stages.len();
    let threads = threads_per_worker(context.runtime.threads_per_worker, count);
    let stall_limit = context.runtime.timeout.as_secs_f64();
    let mut tally = Tally {
        stage_step: vec![start_step; stages],
        losses: vec![f32::NAN; context.phase.stages.iter().map(|s| s.blocks.len()).sum()],
        first_block: context.phase.stages.first().map_or(0, |s| s.blocks.start),
        reported: start_step,
        target_reached_at: None,
    };

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
        let mut forward = |msg| tally.take(msg, context, observer, &mut block_steps);
        let watched = Watched { heartbeats: &heartbeats, who: &who, stall_limit, first_step: start_step };
        watchdog(context, &progress_rx, watch.as_mut(), &watched, &stop, &mut forward);
        handles.into_iter().map(|h| h.join()).collect()
    });

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
    let (mut outcome, lost_blocks) = collect_results(results, failed_worker, trainers)?;
    // Across processes: every rank hands the others its leaders' block
    // states and its records, and takes theirs.
    if let (Some(watch), None) = (watch.as_mut(), &first) {
        let mut on_progress = |msg| tally.take(msg, context, observer, &mut block_steps);
        exchange_with_ranks(context, watch, trainers, &mut outcome, &stop, &mut on_progress)?;
    }
    let first = first.or_else(|| stop.take());
    outcome.target_reached_at = tally.target_reached_at;
    if watch.is_none() {
        outcome.interrupted = context.runtime.interrupt.requested();
    }
    if let Some((error, detected_at)) = first {
        let completed = tally.reported;
        outcome.failure = Some(PhaseFailure { error, detected_at, lost_blocks, block_steps, completed });
    }
    Ok(outcome)
}

/// The barrier of a phase that has one: among its workers, or across the
/// ranks of the phase (one worker per rank) in a run over processes.
fn phase_barrier<B: DistillBackend, T: Block<B::InnerBackend>>(
    context: &PhaseContext<'_, B, T>,
    workers: usize,
) -> StepBarrier {
    let Some(transport) = &context.runtime.transport else {
        return StepBarrier::new(workers);
    };
    let mut ranks: Vec<usize> = context.phase.stages.iter().flat_map(|s| s.slots.clone()).collect();
    ranks.sort_unstable();
    ranks.dedup();
    let peers = ranks
        .into_iter()
        .filter(|&r| r != transport.rank())
        .map(|rank| Peer { transport: transport.clone(), rank })
        .collect();
    StepBarrier::across(peers)
}

/// Forwards progress (this process's, and across ranks the others') to
/// `forward` until every worker has hung up, and raises the stop signal for
/// a worker silent for longer than `stall_limit` seconds.
fn watchdog<B: DistillBackend, T: Block<B::InnerBackend>>(
    context: &PhaseContext<'_, B, T>,
    progress: &crossbeam_channel::Receiver<ProgressMsg>,
    mut watch: Option<&mut ClusterWatch>,
    watched: &Watched<'_>,
    stop: &Stop,
    forward: &mut dyn FnMut(ProgressMsg),
) {
    let Watched { heartbeats, who, stall_limit, first_step } = *watched;
    loop {
        let mut arrived = Vec::new();
        let mut hung_up = false;
        match progress.recv_timeout(POLL * 5) {
            Ok(msg) => arrived.push(msg),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => hung_up = true,
        }
        if let Some(watch) = watch.as_deref_mut() {
            for msg in arrived.iter().filter(|_| watch.rank() != 0) {
                if let Err(e) = watch.forward(msg) {
                    stop.raise(e);
                }
            }
            arrived.extend(watch.tick(stop, context.gate));
        } else if context.runtime.interrupt.requested().is_some() && !context.gate.is_closed() {
            // Within one process the stop step is known at once.
            context.gate.stop_at(context.gate.close(first_step));
        }
        for msg in arrived {
            forward(msg);
        }
        if hung_up {
            break;
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
}

/// What the watchdog watches: the workers' heartbeats and who they are
/// (stage, replica, slot), how long one may stay silent, and the phase's
/// first step.
#[derive(Clone, Copy)]
struct Watched<'a> {
    heartbeats: &'a [Heartbeat],
    who: &'a [(usize, usize, usize)],
    stall_limit: f64,
    first_step: usize,
}

/// The phase's outcome from its workers' results: their rows, spans and
/// summaries, and their trainers back in `trainers`, but for the failed
/// worker's, whose blocks are returned as lost.
fn collect_results<B: DistillBackend, S: StudentModule<B>>(
    results: Vec<std::thread::Result<WorkerResult<B, S>>>,
    failed_worker: Option<usize>,
    trainers: &mut [Option<BlockTrainer<B, S>>],
) -> Result<(PhaseOutcome, Vec<usize>)> {
    let mut outcome = PhaseOutcome {
        rows: Vec::new(),
        spans: Vec::new(),
        workers: Vec::new(),
        checkpoints_written: 0,
        target_reached_at: None,
        failure: None,
        interrupted: None,
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
            result.host_reads,
        ));
        outcome.spans.extend(result.spans);
    }
    Ok((outcome, lost_blocks))
}

/// At the end of a phase across processes: hands the other ranks this
/// rank's leaders' block states and its records, and takes theirs into
/// `trainers` and `outcome`. A failed exchange raises the stop signal (the
/// phase failed); a state that does not load is an error.
fn exchange_with_ranks<B, T, S>(
    context: &PhaseContext<'_, B, T>,
    watch: &mut ClusterWatch,
    trainers: &mut [Option<BlockTrainer<B, S>>],
    outcome: &mut PhaseOutcome,
    stop: &Stop,
    on_progress: &mut dyn FnMut(ProgressMsg),
) -> Result<()>
where
    B: DistillBackend,
    T: Block<B::InnerBackend>,
    S: StudentModule<B>,
{
    let local_leaders: Vec<usize> = context
        .phase
        .stages
        .iter()
        .filter(|s| s.slots.first() == Some(&watch.rank()))
        .flat_map(|s| s.blocks.clone())
        .collect();
    let mine = PhaseEnd::collect(
        trainers,
        &local_leaders,
        outcome.rows.clone(),
        outcome.spans.clone(),
        outcome.workers.clone(),
        outcome.checkpoints_written,
        context.runtime.interrupt.requested(),
    )?;
    let ends = match watch.finish_phase(&mine, stop, context.gate, on_progress) {
        Ok(Some(ends)) => ends,
        Ok(None) => return Ok(()),
        Err(e) => {
            stop.raise(e);
            return Ok(());
        }
    };
    let device = &context.devices[watch.rank().min(context.devices.len() - 1)];
    // Every rank reads the same ends (its own and the others'), in rank order.
    let mut signals = ends.iter().map(|end| end.interrupted).collect::<Vec<_>>();
    signals.insert(watch.rank().min(signals.len()), mine.interrupted);
    outcome.interrupted = signals.into_iter().find(|&s| s > 0);
    if let Some(signal) = outcome.interrupted {
        context.runtime.interrupt.request(signal);
    }
    for end in ends {
        for (k, state) in end.states {
            let trainer = trainers.get_mut(k).and_then(|t| t.as_mut()).ok_or_else(|| Error::Transport {
                message: format!("received the state of block {}, which this rank does not hold", k + 1),
            })?;
            trainer.load_state(state, device).map_err(|message| Error::Transport {
                message: format!("the state of block {} received at the end of the phase: {message}", k + 1),
            })?;
        }
        outcome.rows.extend(end.rows);
        outcome.spans.extend(end.spans);
        outcome.workers.extend(end.workers);
        outcome.checkpoints_written += end.checkpoints_written;
    }
    outcome.workers.sort_by_key(|w| w.worker);
    Ok(())
}

/// Stage leaders' progress of a phase, turned into one observer call per
/// step that every stage has completed.
struct Tally {
    stage_step: Vec<usize>,
    losses: Vec<f32>,
    first_block: usize,
    reported: usize,
    /// When every stage had completed the phase's recovery target.
    target_reached_at: Option<Instant>,
}

impl Tally {
    fn take<B: DistillBackend, T: Block<B::InnerBackend>>(
        &mut self,
        msg: ProgressMsg,
        context: &PhaseContext<'_, B, T>,
        observer: &mut dyn FnMut(&Progress),
        block_steps: &mut BTreeMap<usize, usize>,
    ) {
        self.stage_step[msg.stage] = self.stage_step[msg.stage].max(msg.step + 1);
        for (block, loss) in msg.losses {
            block_steps.insert(block, msg.step + 1);
            if let Some(slot) = self.losses.get_mut(block.saturating_sub(self.first_block)) {
                *slot = loss;
            }
        }
        let done = self.stage_step.iter().copied().min().unwrap_or(0);
        while self.reported < done {
            observer(&Progress {
                phase: context.phase_index,
                phases: context.phases,
                epoch: self.reported / context.per_epoch,
                epochs: context.settings.epochs,
                step_in_epoch: self.reported % context.per_epoch,
                steps_per_epoch: context.per_epoch,
                losses: self.losses.clone(),
                output_loss: None,
            });
            self.reported += 1;
        }
        if context.recovery_target.is_some_and(|t| self.reported >= t) {
            self.target_reached_at.get_or_insert_with(Instant::now);
        }
    }
}

/// What a worker hands back when it returns.
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
    host_reads: usize,
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
    let reads_before = crate::device::host_reads_on_this_thread();
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
        host_reads: crate::device::host_reads_on_this_thread() - reads_before,
    }
}
