//! The workers of a phase and the channels between them: one worker per
//! stage replica, its share of the batch, its activation channels to the
//! overlapping replicas of the neighbouring stages, and its role in the
//! replica group's gradient exchange.

use std::ops::Range;

use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use crossbeam_channel::{bounded, Receiver, Sender};
use pipebd_core::{Activation, Block, StudentModule};
use pipebd_kernels::DistillBackend;

use super::phase::PhaseContext;
use crate::error::{Error, Result};
use crate::plan::Stage;
use crate::train::BlockTrainer;

/// A boundary activation of one step, on its way to the next stage.
pub(super) struct ActivationMsg<IB: Backend> {
    pub(super) step: usize,
    /// True for a held-out batch of an architecture tick.
    pub(super) arch: bool,
    pub(super) activation: Activation<IB>,
}

/// A follower's gradients of one step, for its stage leader.
pub(super) struct GradientMsg {
    pub(super) step: usize,
    pub(super) grads: Vec<GradientsParams>,
    pub(super) weighted_losses: Vec<f32>,
}

/// The leader's updated blocks after one step, for a follower.
pub(super) struct ModuleMsg<S> {
    pub(super) step: usize,
    pub(super) modules: Vec<S>,
}

/// A worker's part in its replica group's gradient exchange.
pub(super) enum Role<S> {
    Solo,
    Leader { from_followers: Vec<Receiver<GradientMsg>>, to_followers: Vec<Sender<ModuleMsg<S>>> },
    Follower { to_leader: Sender<GradientMsg>, from_leader: Receiver<ModuleMsg<S>> },
}

/// An activation channel from a replica of the previous stage.
pub(super) struct Inbound<IB: Backend> {
    pub(super) rx: Receiver<ActivationMsg<IB>>,
    pub(super) from: String,
}

/// An activation channel to a replica of the next stage.
pub(super) struct Outbound<IB: Backend> {
    pub(super) tx: Sender<ActivationMsg<IB>>,
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
    pub(super) role: Role<S>,
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

/// Builds the workers of a phase and the channels between them.
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
