//! Training one student block: its optimizer step, learning rate and
//! loss history; and scoring stitched networks.
//!
//! Where a gradient stops: [`BlockTrainer::step`] lifts the teacher's input
//! and target activations into the autodiff backend as constants
//! ([`Activation::from_inner`]), so the backward pass of block k reaches only
//! block k's parameters.

pub mod arch;
pub mod checkpoint;
mod losses;
pub mod optim;
pub mod stitch;
#[cfg(test)]
mod tests;
mod trainer;

use pipebd_core::{StudentModule, Students};
use pipebd_kernels::DistillBackend;
use serde::{Deserialize, Serialize};

use crate::train::arch::SinglePath;
use crate::train::optim::OptimizerConfig;

pub use losses::{read_losses, StepLoss, FINAL_LOSS_WINDOW};
pub use trainer::{detached_copy, BlockTrainer, TrainerState};
pub(crate) use trainer::{load_module_bytes, module_bytes};

/// The training hyper-parameters of a distillation: what the runtime, the
/// stitched pass and a checkpoint's identity need to know.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainSettings {
    /// Passes over the data.
    pub epochs: usize,
    /// Global batch size.
    pub batch_size: usize,
    /// Seed of the data order.
    pub seed: u64,
    /// The generator of the data order (and of the initial weights, drawn
    /// before the run by the zoo).
    pub generator: crate::rng::Generator,
    /// Metric row every this many steps.
    pub log_every: usize,
    /// Per-block optimizer.
    pub optimizer: OptimizerConfig,
    /// Softmax temperature of the soft-target cross-entropy (1: plain
    /// softmax; see [`pipebd_core::Loss`]).
    pub temperature: f64,
    /// Single-path architecture search: supernet blocks (those with
    /// [`Block::arch_logits`]) train one sampled candidate per step and
    /// their logits on held-out batches. `None`: every candidate of a
    /// block trains on every step (search mode `all`).
    pub single_path: Option<SinglePath>,
}

impl Default for TrainSettings {
    /// One epoch at batch 128, seed 0, a metric row every 10 steps, the
    /// default optimizer (Adam, cosine), temperature 1.
    fn default() -> Self {
        Self {
            epochs: 1,
            batch_size: 128,
            seed: 0,
            generator: crate::rng::Generator::Native,
            log_every: 10,
            optimizer: OptimizerConfig::default(),
            temperature: 1.0,
            single_path: None,
        }
    }
}

/// One row of `metrics.csv`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MetricRow {
    /// Zero-based epoch.
    pub epoch: usize,
    /// Zero-based global step (batches seen so far).
    pub step: usize,
    /// One-based block number; 0: the stitched student's output loss
    /// (`stitched_output_loss`, unweighted), logged by a stitched pass that
    /// has one.
    pub block: usize,
    /// The block's loss on that step.
    pub loss: f32,
    /// The learning rate used on that step.
    pub lr: f64,
}

/// What a training run produced besides the weights.
#[derive(Debug, Clone, Default)]
pub struct TrainLog {
    /// Logged metric rows.
    pub rows: Vec<MetricRow>,
    /// Per block, mean loss over its last steps.
    pub final_losses: Vec<f32>,
    /// Optimizer steps per block.
    pub steps: usize,
    /// Steps this process ran (fewer than `steps` after a resume).
    pub steps_run: usize,
    /// Training samples processed by this process (per block).
    pub samples: usize,
    /// Wall time of the training loop.
    pub seconds: f64,
}

impl TrainLog {
    /// Completes the log of a run that took `seconds` and ran from step
    /// `resumed_from` to `total_steps` at `batch` samples per step: rows of
    /// steps redone after a failure or resume are logged twice, and only the
    /// last is kept.
    pub fn finish(
        &mut self,
        seconds: f64,
        (resumed_from, total_steps): (usize, usize),
        batch: usize,
        final_losses: Vec<f32>,
    ) {
        self.rows.sort_by_key(|r| (r.step, r.block));
        self.rows.dedup_by_key(|r| (r.step, r.block));
        self.seconds = seconds;
        self.steps = total_steps;
        self.steps_run = total_steps - resumed_from;
        self.samples = self.steps_run * batch;
        self.final_losses = final_losses;
    }
}

/// Progress of a run, handed to an observer after every step.
#[derive(Debug, Clone)]
pub struct Progress {
    /// Zero-based phase of the schedule (only `dp` has several).
    pub phase: usize,
    /// Phases of the schedule.
    pub phases: usize,
    /// Zero-based epoch.
    pub epoch: usize,
    /// Epochs in the run.
    pub epochs: usize,
    /// Zero-based step within the epoch.
    pub step_in_epoch: usize,
    /// Steps per epoch.
    pub steps_per_epoch: usize,
    /// Loss of each block on this step.
    pub losses: Vec<f32>,
    /// The stitched pass's output loss on this step (unweighted), if it
    /// has one.
    pub output_loss: Option<f32>,
}

/// Optimizer steps per epoch for a dataset of `len` samples (a trailing
/// partial batch is dropped so that every step has the same batch size).
pub fn steps_per_epoch(len: usize, batch_size: usize) -> usize {
    len / batch_size.max(1)
}

/// The inference copies of trained student blocks (for evaluation).
pub fn inference_blocks<B: DistillBackend, S: StudentModule<B>>(
    students: &Students<B, S>,
) -> Vec<S::InnerModule> {
    students.blocks.iter().map(|b| b.valid()).collect()
}
