//! The workers of a phase and the channels between them: one worker per
//! stage replica, its share of the batch, its activation channels to the
//! overlapping replicas of the neighbouring stages, and its role in the
//! replica group's gradient exchange.

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use crossbeam_channel::bounded;
use pipebd_core::{Block, StudentModule};
use pipebd_kernels::DistillBackend;

use super::context::PhaseContext;
use super::messages::{ActivationMsg, GradientMsg, ModuleMsg, Peer, Sink, Source, Window};
use super::transport::Transport;
use crate::error::{Error, Result};
use crate::plan::{Phase, Stage};
use crate::train::BlockTrainer;

/// Both ends of a link between two workers: channels if both are in this
/// process, else each end names the other's rank.
fn link<M>(
    transport: Option<&Arc<dyn Transport>>,
    from_rank: usize,
    to_rank: usize,
    capacity: usize,
) -> (Sink<M>, Source<M>) {
    match transport {
        Some(t) if from_rank != to_rank => (
            Sink::Remote(
                Peer { transport: t.clone(), rank: to_rank },
                Window { capacity: capacity.max(1), in_flight: Default::default() },
            ),
            Source::Remote(Peer { transport: t.clone(), rank: from_rank }),
        ),
        _ => {
            let (tx, rx) = bounded(capacity);
            (Sink::Local(tx), Source::Local(rx))
        }
    }
}

/// A worker's part in its replica group's gradient exchange.
pub(super) enum Role<IB: Backend, S> {
    Solo,
    Leader { from_followers: Vec<Source<GradientMsg<IB>>>, to_followers: Vec<Sink<ModuleMsg<S>>> },
    Follower { to_leader: Sink<GradientMsg<IB>>, from_leader: Source<ModuleMsg<S>> },
}

/// An activation channel from a replica of the previous stage.
pub(super) struct Inbound<IB: Backend> {
    pub(super) rx: Source<ActivationMsg<IB>>,
    pub(super) from: String,
}

/// An activation channel to a replica of the next stage.
pub(super) struct Outbound<IB: Backend> {
    pub(super) tx: Sink<ActivationMsg<IB>>,
    /// Sub-range of this worker's share to send, relative to the share.
    pub(super) start: usize,
    pub(super) len: usize,
    pub(super) to: String,
}

/// One stage replica of a phase, bound to a device slot.
pub(super) struct Worker<B: DistillBackend, S: StudentModule<B>> {
    pub(super) id: usize,
    pub(super) stage: usize,
    pub(super) replica: usize,
    pub(super) slot: usize,
    pub(super) stage_spec: Stage,
    pub(super) share: Range<usize>,
    pub(super) inbound: Vec<Inbound<B::InnerBackend>>,
    pub(super) outbound: Vec<Outbound<B::InnerBackend>>,
    pub(super) role: Role<B::InnerBackend, S>,
    pub(super) trainers: Vec<BlockTrainer<B, S>>,
}

impl<B: DistillBackend, S: StudentModule<B>> Worker<B, S> {
    pub(super) fn name(&self) -> String {
        format!("stage {} replica {}", self.stage + 1, self.replica)
    }
    pub(super) fn is_leader(&self) -> bool {
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

/// Builds the workers of a phase and the channels between them. In a
/// multi-process run (`runtime.transport`), the worker of device slot `r`
/// runs on rank `r`: only this rank's workers are returned, links to the
/// others go through the transport, and the trainers of the other ranks'
/// stage leaders stay in `trainers` (as the copies their state is loaded
/// into at the end of the phase).
pub(super) fn build_workers<B, T, S>(
    context: &PhaseContext<'_, B, T>,
    trainers: &mut [Option<BlockTrainer<B, S>>],
) -> Result<Vec<Worker<B, S>>>
where
    B: DistillBackend,
    T: Block<B::InnerBackend>,
    S: StudentModule<B>,
{
    let batch = context.settings.batch_size;
    let capacity = context.runtime.channel_capacity.max(1);
    let transport = context.runtime.transport.as_ref();
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
            let leader_rank = workers[ids[0]].slot;
            for &w in &ids[1..] {
                let rank = workers[w].slot;
                let (grad_tx, grad_rx) = link(transport, rank, leader_rank, 1);
                let (module_tx, module_rx) = link(transport, leader_rank, rank, 1);
                from_followers.push(grad_rx);
                to_followers.push(module_tx);
                workers[w].role = Role::Follower { to_leader: grad_tx, from_leader: module_rx };
            }
            workers[ids[0]].role = Role::Leader { from_followers, to_followers };
        }
        stage_workers.push(ids);
    }
    link_stages(context.phase, &stage_workers, &mut workers, transport, capacity);
    let Some(transport) = transport else {
        return Ok(workers);
    };
    let mut local = Vec::new();
    for mut worker in workers {
        if worker.slot == transport.rank() {
            local.push(worker);
        } else if worker.is_leader() {
            for trainer in worker.trainers.drain(..) {
                let k = trainer.index;
                trainers[k] = Some(trainer);
            }
        }
    }
    Ok(local)
}

/// The activation channels of a phase: from each worker of stage `s` to
/// each worker of stage `s + 1` whose batch share overlaps its own, unless
/// stage `s + 1` loads its data itself. `stage_workers[s]` lists the indices
/// in `workers` of stage `s`'s replicas.
fn link_stages<B: DistillBackend, S: StudentModule<B>>(
    phase: &Phase,
    stage_workers: &[Vec<usize>],
    workers: &mut [Worker<B, S>],
    transport: Option<&Arc<dyn Transport>>,
    capacity: usize,
) {
    for s in 1..phase.stages.len() {
        if phase.stages[s].loads_data {
            continue;
        }
        for &down in &stage_workers[s] {
            for &up in &stage_workers[s - 1] {
                let Some(common) = overlap(&workers[up].share, &workers[down].share) else {
                    continue;
                };
                let (tx, rx) = link(transport, workers[up].slot, workers[down].slot, capacity);
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
}
