//! What the workers of a phase hand each other: boundary activations,
//! replicas' gradients and updated blocks, and the leaders' progress; and
//! the ends of the links they travel on (a channel in this process, or a
//! worker of another rank).

use std::sync::Arc;

use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use crossbeam_channel::{Receiver, Sender};
use pipebd_core::Activation;

use super::transport::Transport;
use crate::train::StepLoss;

/// A boundary activation of one step, on its way to the next stage.
pub(super) struct ActivationMsg<IB: Backend> {
    pub(super) step: usize,
    /// True for a held-out batch of an architecture tick.
    pub(super) arch: bool,
    pub(super) activation: Activation<IB>,
}

/// A follower's gradients of one step, for its stage leader, with its
/// losses (still on its device where they are read once per logged step).
pub(super) struct GradientMsg<IB: Backend> {
    pub(super) step: usize,
    pub(super) grads: Vec<GradientsParams>,
    pub(super) weighted_losses: Vec<StepLoss<IB>>,
}

/// The leader's updated blocks after one step, for a follower.
pub(super) struct ModuleMsg<S> {
    pub(super) step: usize,
    pub(super) modules: Vec<S>,
}

/// A worker in another process (rank) of a multi-process run.
#[derive(Clone)]
pub(super) struct Peer {
    pub(super) transport: Arc<dyn Transport>,
    pub(super) rank: usize,
}

/// Where a worker sends one kind of message: a channel to a worker of this
/// process, or a worker of another rank (the message is encoded for the
/// transport).
pub(super) enum Sink<M> {
    Local(Sender<M>),
    Remote(Peer, Window),
}

/// How many boundary activations a sender may have posted to another rank
/// that its receiver has not yet taken: the channel capacity of a link in
/// one process, kept across processes with a credit message per activation
/// taken, so that a fast stage cannot run ahead of a slow one on another
/// rank and fill that rank's memory with queued activations.
pub(super) struct Window {
    pub(super) capacity: usize,
    pub(super) in_flight: std::cell::Cell<usize>,
}

/// Where a worker receives one kind of message from.
pub(super) enum Source<M> {
    Local(Receiver<M>),
    Remote(Peer),
}

/// A stage leader's step done, with its blocks' losses, for the watchdog.
pub(super) struct ProgressMsg {
    pub(super) stage: usize,
    pub(super) step: usize,
    pub(super) losses: Vec<(usize, f32)>,
}
