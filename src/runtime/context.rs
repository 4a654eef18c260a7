//! What every worker of a phase reads.

use std::collections::BTreeMap;
use std::time::Instant;

use pipebd_core::{Block, Dataset, Teacher};
use pipebd_kernels::DistillBackend;

use super::RuntimeSettings;
use crate::plan::Phase;
use crate::train::TrainSettings;

/// What every worker of a phase reads: the phase, the run's inputs and
/// settings, and where the phase stands in the run.
pub(super) struct PhaseContext<'a, B: DistillBackend, T: Block<B::InnerBackend>> {
    pub(super) phase: &'a Phase,
    pub(super) teacher: &'a Teacher<B::InnerBackend, T>,
    pub(super) data: &'a dyn Dataset<B::InnerBackend>,
    /// Where a single-path search's architecture steps take their batches
    /// (`None`: the run takes none).
    pub(super) held_out: Option<&'a dyn Dataset<B::InnerBackend>>,
    pub(super) settings: &'a TrainSettings,
    pub(super) devices: &'a [B::Device],
    pub(super) runtime: &'a RuntimeSettings,
    pub(super) per_epoch: usize,
    /// Where each epoch's sample order comes from.
    pub(super) order: crate::data::DataOrder,
    pub(super) total_steps: usize,
    pub(super) origin: Instant,
    pub(super) first_worker: usize,
    pub(super) phase_index: usize,
    pub(super) phases: usize,
    pub(super) plan_description: &'a str,
    pub(super) identities: &'a [BTreeMap<String, serde_json::Value>],
    /// Note when every stage has completed this many steps.
    pub(super) recovery_target: Option<usize>,
    /// Where the phase stops when the run is interrupted.
    pub(super) gate: &'a super::sync::StepGate,
}
