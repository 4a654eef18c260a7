//! Training one student block: its optimizer step, learning rate and
//! loss history; and scoring stitched networks.
//!
//! Where a gradient stops: [`BlockTrainer::step`] lifts the teacher's input
//! and target activations into the autodiff backend as constants
//! ([`Activation::from_inner`]), so the backward pass of block k reaches only
//! block k's parameters.

pub mod arch;
pub mod checkpoint;
pub mod optim;
pub mod stitch;

use std::panic::{catch_unwind, AssertUnwindSafe};

use burn::optim::{GradientsParams, MultiGradientsParams};
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder, RecorderError};
use burn::tensor::backend::{Backend, DeviceOps};
use burn::tensor::{ElementConversion, Tensor, TensorData};
use pipebd_core::{Activation, Block, BlockSpec, Loss, StudentModule, Students};
use pipebd_kernels::{DistillBackend, FusedBackend};
use serde::{Deserialize, Serialize};

use crate::error::{relabel, Error, Result};
use crate::train::arch::{sample_path, softmax, Draw, SinglePath};
use crate::train::optim::{BlockOptimizer, LrPlan, OptimizerConfig};

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

/// Number of trailing steps averaged into a block's `final_loss`.
pub const FINAL_LOSS_WINDOW: usize = 20;

/// A block's loss on one step: read back, or still on the device.
///
/// Reading a value back from an asynchronous device
/// ([`FusedBackend::ASYNC_DEVICE`]: a GPU) waits for all the work queued
/// before it, so there the losses stay on the device and are read once per
/// logged step ([`read_losses`]); elsewhere they are read at once.
#[derive(Debug, Clone)]
pub enum StepLoss<B: Backend> {
    /// The value (already weighted and summed over replicas).
    Read(f32),
    /// Weighted parts still on the device, summed in order when read.
    Pending(Vec<(Tensor<B, 1>, f32)>),
}

impl<B: Backend> StepLoss<B> {
    /// This loss times `weight` (a replica's share of the batch).
    pub fn weighted(self, weight: f32) -> Self {
        match self {
            Self::Read(value) => Self::Read(value * weight),
            Self::Pending(parts) => Self::Pending(parts.into_iter().map(|(t, w)| (t, w * weight)).collect()),
        }
    }

    /// The sum of this loss and `other` (another replica's).
    pub fn plus(self, other: Self) -> Self {
        match (self, other) {
            (Self::Read(a), Self::Read(b)) => Self::Read(a + b),
            (Self::Pending(mut a), Self::Pending(b)) => {
                a.extend(b);
                Self::Pending(a)
            }
            (Self::Pending(mut a), Self::Read(b)) | (Self::Read(b), Self::Pending(mut a)) => {
                // Only replicas of one backend meet; keep the sum exact anyway.
                if let Some(device) = a.first().map(|(t, _)| t.device()) {
                    a.push((Tensor::from_data(TensorData::new(vec![b], [1]), &device), 1.0));
                }
                Self::Pending(a)
            }
        }
    }

    /// The value, read back now if it is still on the device.
    pub fn value(&self) -> f32 {
        match self {
            Self::Read(value) => *value,
            Self::Pending(parts) => {
                sum_parts(parts, &read_back(parts.iter().map(|(t, _)| t.clone()).collect()))
            }
        }
    }
}

/// `sum(value * weight)` of a loss's parts, in order.
fn sum_parts<B: Backend>(parts: &[(Tensor<B, 1>, f32)], values: &[f32]) -> f32 {
    parts.iter().zip(values).fold(0.0, |total, ((_, weight), value)| total + value * weight)
}

/// One-element tensors read back to the host in one read.
fn read_back<B: Backend>(tensors: Vec<Tensor<B, 1>>) -> Vec<f32> {
    if tensors.is_empty() {
        return Vec::new();
    }
    crate::device::count_host_read();
    let values = Tensor::cat(tensors, 0).into_data();
    values.iter::<f32>().collect()
}

/// Reads the last loss of each of `trainers` back in one read, where it is
/// still on the device (a logged step): a non-finite one is an error naming
/// its block and the first step since the last read whose loss is not
/// finite (a divergence poisons every later step, so the last step tells).
pub fn read_losses<B: DistillBackend, S: StudentModule<B>>(
    trainers: &mut [&mut BlockTrainer<B, S>],
) -> Result<()> {
    let latest: Vec<Tensor<B::InnerBackend, 1>> = trainers
        .iter()
        .filter_map(|t| t.losses.unread_latest())
        .flat_map(|parts| parts.iter().map(|(tensor, _)| tensor.clone()))
        .collect();
    let values = read_back(latest);
    let mut offset = 0;
    for trainer in trainers.iter_mut() {
        let Some(parts) = trainer.losses.unread_latest() else { continue };
        let value = sum_parts(parts, &values[offset..offset + parts.len()]);
        offset += parts.len();
        if let Err((step, value)) = trainer.losses.settle_latest(value) {
            return Err(Error::Training {
                block: trainer.index + 1,
                step,
                message: format!(
                    "loss is {value} (read back after step {}: this device's losses are read every `train.log_every` steps)",
                    trainer.step.saturating_sub(1)
                ),
            });
        }
    }
    Ok(())
}

/// A block's losses by step: every one since the last check, and the last
/// [`FINAL_LOSS_WINDOW`] (for its final loss); each read, or still on the
/// device ([`StepLoss`]).
#[derive(Debug, Clone)]
struct LossLog<B: Backend> {
    entries: std::collections::VecDeque<(usize, StepLoss<B>)>,
    /// Steps before this one were checked finite (or read at once).
    checked_to: usize,
}

impl<B: Backend> LossLog<B> {
    fn new() -> Self {
        Self { entries: Default::default(), checked_to: 0 }
    }

    /// Records `step`'s loss (checked already when it was read at once).
    fn push(&mut self, step: usize, loss: StepLoss<B>) {
        let read = matches!(loss, StepLoss::Read(_));
        self.entries.push_back((step, loss));
        if read {
            self.checked(step);
        }
    }

    /// Marks the losses up to `step` checked and drops those the window no
    /// longer needs.
    fn checked(&mut self, step: usize) {
        self.checked_to = step + 1;
        while self.entries.len() > FINAL_LOSS_WINDOW
            && self.entries.front().is_some_and(|(s, _)| *s < self.checked_to)
        {
            self.entries.pop_front();
        }
    }

    /// The last loss's parts, when it is still on the device.
    fn unread_latest(&self) -> Option<&Vec<(Tensor<B, 1>, f32)>> {
        match self.entries.back() {
            Some((_, StepLoss::Pending(parts))) => Some(parts),
            _ => None,
        }
    }

    /// Settles the last loss at `value` (read back). Not finite: the first
    /// step since the last check whose loss is not finite (read back now),
    /// and that loss.
    fn settle_latest(&mut self, value: f32) -> std::result::Result<(), (usize, f32)> {
        let Some(&(step, _)) = self.entries.back() else { return Ok(()) };
        if !value.is_finite() {
            let unchecked: Vec<(usize, f32)> =
                self.values().into_iter().filter(|(s, _)| *s >= self.checked_to).collect();
            return Err(unchecked.into_iter().find(|(_, v)| !v.is_finite()).unwrap_or((step, value)));
        }
        if let Some(last) = self.entries.back_mut() {
            last.1 = StepLoss::Read(value);
        }
        self.checked(step);
        Ok(())
    }

    /// The last loss, when it has been read.
    fn latest(&self) -> Option<f32> {
        match self.entries.back() {
            Some((_, StepLoss::Read(value))) => Some(*value),
            _ => None,
        }
    }

    /// Every kept step's loss, those still on the device read back (one read).
    fn values(&self) -> Vec<(usize, f32)> {
        let pending: Vec<Tensor<B, 1>> = self
            .entries
            .iter()
            .filter_map(|(_, l)| match l {
                StepLoss::Pending(parts) => Some(parts.iter().map(|(t, _)| t.clone())),
                StepLoss::Read(_) => None,
            })
            .flatten()
            .collect();
        let read = read_back(pending);
        let mut offset = 0;
        self.entries
            .iter()
            .map(|(step, loss)| match loss {
                StepLoss::Read(value) => (*step, *value),
                StepLoss::Pending(parts) => {
                    let value = sum_parts(parts, &read[offset..offset + parts.len()]);
                    offset += parts.len();
                    (*step, value)
                }
            })
            .collect()
    }

    /// The last [`FINAL_LOSS_WINDOW`] losses, read back where needed.
    fn window(&self) -> Vec<f32> {
        let mut values: Vec<f32> = self.values().into_iter().map(|(_, v)| v).collect();
        values.split_off(values.len().saturating_sub(FINAL_LOSS_WINDOW))
    }

    /// A log holding `values` as the losses of the steps before `step`.
    fn restored(values: Vec<f32>, step: usize) -> Self {
        let first = step.saturating_sub(values.len());
        let entries = values.into_iter().enumerate().map(|(i, v)| (first + i, StepLoss::Read(v))).collect();
        Self { entries, checked_to: step }
    }
}

/// A student block with its optimizer and learning-rate plan.
pub struct BlockTrainer<B: DistillBackend, S: StudentModule<B>> {
    /// Zero-based block index.
    pub index: usize,
    /// The block's spec.
    pub spec: BlockSpec,
    /// The block's loss: the spec's kind, at temperature 1 unless set with
    /// [`BlockTrainer::with_temperature`].
    pub loss: Loss,
    module: Option<S>,
    optimizer: BlockOptimizer<B, S>,
    lr: LrPlan,
    /// Optimizer steps taken so far.
    pub step: usize,
    losses: LossLog<B::InnerBackend>,
    arch: Option<ArchTrainer<B, S>>,
}

/// A supernet block's single-path settings and the optimizer of its
/// architecture logits.
struct ArchTrainer<B: DistillBackend, S: StudentModule<B>> {
    settings: SinglePath,
    seed: u64,
    optimizer: BlockOptimizer<B, S>,
}

impl<B: DistillBackend, S: StudentModule<B>> Clone for ArchTrainer<B, S> {
    fn clone(&self) -> Self {
        Self { settings: self.settings.clone(), seed: self.seed, optimizer: self.optimizer.clone() }
    }
}

impl<B: DistillBackend, S: StudentModule<B>> BlockTrainer<B, S> {
    /// A trainer for block `index` that will take `total_steps` steps.
    pub fn new(
        index: usize,
        spec: BlockSpec,
        module: S,
        config: &OptimizerConfig,
        total_steps: usize,
    ) -> Self {
        Self {
            index,
            loss: Loss::new(spec.loss),
            spec,
            module: Some(module),
            optimizer: BlockOptimizer::new(config),
            lr: LrPlan::new(config, total_steps),
            step: 0,
            losses: LossLog::new(),
            arch: None,
        }
    }

    /// The same trainer under `settings`: its temperature, and for a
    /// supernet block ([`Block::arch_logits`]) in a single-path search the
    /// path sampling and the architecture optimizer (Adam, betas 0 and
    /// 0.999, epsilon 1e-8).
    pub fn configured(self, settings: &TrainSettings) -> Self {
        let mut trainer = self.with_temperature(settings.temperature);
        let supernet = trainer.module.as_ref().is_some_and(|m| m.arch_logits().is_some());
        if let (Some(single_path), true) = (&settings.single_path, supernet) {
            trainer.arch = Some(ArchTrainer {
                settings: single_path.clone(),
                seed: settings.seed,
                optimizer: BlockOptimizer::adam(0.0, 0.999, 1e-8),
            });
        }
        trainer
    }

    /// True for a supernet block in a single-path search: it takes
    /// architecture steps ([`Self::compute_arch_grads`]).
    pub fn searches_paths(&self) -> bool {
        self.arch.is_some()
    }

    /// A copy for a follower replica: same module, learning-rate plan and
    /// step; its optimizer is never used (the stage leader steps).
    pub fn follower_copy(&self) -> Self {
        Self {
            index: self.index,
            spec: self.spec.clone(),
            loss: self.loss,
            module: self.module.as_ref().map(detached_copy),
            optimizer: self.optimizer.clone(),
            lr: self.lr,
            step: self.step,
            losses: self.losses.clone(),
            arch: self.arch.clone(),
        }
    }

    fn lost(&self) -> Error {
        Error::Training {
            block: self.index + 1,
            step: self.step,
            message: "the block was lost by an earlier failed step".into(),
        }
    }

    /// The same trainer with the soft-target cross-entropy at `temperature`.
    pub fn with_temperature(mut self, temperature: f64) -> Self {
        self.loss = self.loss.with_temperature(temperature);
        self
    }

    /// Learning rate of the next step.
    pub fn current_lr(&self) -> f64 {
        self.lr.at(self.step)
    }

    /// One distillation step on a whole batch: [`Self::compute_grads`] then
    /// [`Self::apply`]. Returns the loss (read back at once).
    pub fn step(
        &mut self,
        input: Activation<B::InnerBackend>,
        target: Activation<B::InnerBackend>,
    ) -> Result<f32> {
        let (loss, grads) = self.compute_grads(input, target, 1.0)?;
        self.apply(vec![grads], loss)?;
        read_losses(&mut [&mut *self])?;
        Ok(self.latest_loss().unwrap_or(f32::NAN))
    }

    /// Student forward on the teacher's input, loss against the teacher's
    /// output, backward. The loss is scaled by `weight` (a replica's share
    /// of the global batch) before the backward pass, so that the replicas'
    /// gradients add up to the full batch's. Returns the unscaled loss (read
    /// at once, or on an asynchronous device left there: [`StepLoss`]) and
    /// the gradients. A non-finite loss read at once is an error naming the
    /// block and step.
    pub fn compute_grads(
        &self,
        input: Activation<B::InnerBackend>,
        target: Activation<B::InnerBackend>,
        weight: f32,
    ) -> Result<(StepLoss<B::InnerBackend>, GradientsParams)> {
        let block = self.index + 1;
        let module = self.module.as_ref().ok_or_else(|| self.lost())?;
        let (input, target) = (Activation::from_inner(input), Activation::from_inner(target));
        // A single-path supernet trains the one candidate sampled for this
        // step (it shares the set's parameters, so the gradients are the set's).
        let sampled = match &self.arch {
            Some(arch) => {
                let path = sample_path(
                    arch.seed,
                    self.index,
                    self.step,
                    Draw::Train,
                    &self.path_probabilities(module)?,
                );
                let candidates = module.candidates();
                Some(candidates.into_iter().nth(path).ok_or_else(|| self.no_candidate(path))?)
            }
            None => None,
        };
        let trained = sampled.as_ref().unwrap_or(module);
        let loss = trained.distill_loss(input, target, &self.loss).map_err(|e| relabel(e, block))?;
        let value = self.loss_value(&loss)?;
        if trained.num_params() == 0 {
            // Nothing to train (a `skip` student): no graph to walk back.
            return Ok((value, GradientsParams::new()));
        }
        Ok((value, scaled_grads(loss, weight, module)))
    }

    /// One architecture step's gradient on a held-out batch (a supernet
    /// block in a single-path search; see [`Self::searches_paths`]). As in
    /// ProxylessNAS, one candidate is sampled (its own draw at this step)
    /// and the block's output is `sum_i g_i * candidate_i(input)` with
    /// binary gates `g = onehot + p - detach(p)`, `p = softmax(alpha)`: the
    /// forward value is the sampled candidate's output, and the backward
    /// pass gives `dL/dalpha_i = sum_j dL/dg_j p_j (delta_ij - p_i)`. The
    /// candidates run on the inner backend, so the gradient reaches the
    /// logits only. Returns the unscaled loss and the gradients (scaled by
    /// `weight`, the replica's share of the batch).
    pub fn compute_arch_grads(
        &self,
        input: Activation<B::InnerBackend>,
        target: Activation<B::InnerBackend>,
        weight: f32,
    ) -> Result<(StepLoss<B::InnerBackend>, GradientsParams)> {
        let block = self.index + 1;
        let module = self.module.as_ref().ok_or_else(|| self.lost())?;
        let arch = self.arch.as_ref().ok_or_else(|| Error::Training {
            block,
            step: self.step,
            message: "an architecture step on a block that is not a single-path supernet".into(),
        })?;
        let alpha = module.arch_logits().ok_or_else(|| self.no_candidate(0))?;
        let probabilities = self.path_probabilities(module)?;
        let path = sample_path(arch.seed, self.index, self.step, Draw::Arch, &probabilities);
        let candidates = module.valid().candidates();
        if candidates.len() != probabilities.len() {
            return Err(self.no_candidate(candidates.len()));
        }
        let mut outputs = Vec::with_capacity(candidates.len());
        for candidate in &candidates {
            outputs.push(Activation::from_inner(
                candidate.forward(input.clone()).map_err(|e| relabel(e, block))?,
            ));
        }
        let device = alpha.device();
        let onehot: Vec<f32> = (0..candidates.len()).map(|i| if i == path { 1.0 } else { 0.0 }).collect();
        let onehot = Tensor::<B, 1>::from_data(TensorData::new(onehot, [candidates.len()]), &device);
        let p = burn::tensor::activation::softmax(alpha, 0);
        let gates = p.clone().sub(p.detach()).add(onehot);
        let mixed = Activation::gated_sum(outputs, gates).map_err(|e| relabel(e, block))?;
        let loss =
            module.loss(mixed, Activation::from_inner(target), &self.loss).map_err(|e| relabel(e, block))?;
        let value = self.loss_value(&loss)?;
        Ok((value, scaled_grads(loss, weight, module)))
    }

    /// One architecture step with every replica's gradients (summed in the
    /// given order) at the architecture learning rate. The step counter
    /// does not move: it counts training steps.
    pub fn apply_arch(&mut self, grads: Vec<GradientsParams>) -> Result<()> {
        let module = self.module.take().ok_or_else(|| self.lost())?;
        let Some(arch) = self.arch.as_mut() else {
            self.module = Some(module);
            return Ok(());
        };
        let lr = arch.settings.arch_lr;
        self.module = Some(step_optimizer(&mut arch.optimizer, lr, module, grads));
        Ok(())
    }

    /// `softmax(alpha)` of a supernet module, in f64.
    fn path_probabilities(&self, module: &S) -> Result<Vec<f64>> {
        let alpha = module.arch_logits().ok_or_else(|| self.no_candidate(0))?;
        let logits: Vec<f32> = alpha.into_data().iter::<f32>().collect();
        if logits.is_empty() || logits.iter().any(|a| !a.is_finite()) {
            return Err(Error::Training {
                block: self.index + 1,
                step: self.step,
                message: format!("architecture logits {logits:?} are empty or not finite"),
            });
        }
        Ok(softmax(&logits))
    }

    fn no_candidate(&self, path: usize) -> Error {
        Error::Training {
            block: self.index + 1,
            step: self.step,
            message: format!(
                "a single-path supernet needs one architecture logit per candidate (path {path} has no candidate)"
            ),
        }
    }

    /// The loss as a [`StepLoss`]: left on an asynchronous device, else read
    /// at once ([`Self::finite`]).
    fn loss_value(&self, loss: &Tensor<B, 1>) -> Result<StepLoss<B::InnerBackend>> {
        if <B::InnerBackend as FusedBackend>::ASYNC_DEVICE {
            return Ok(StepLoss::Pending(vec![(loss.clone().inner(), 1.0)]));
        }
        self.finite(loss).map(StepLoss::Read)
    }

    /// The loss's value, or an error naming the block and step when it is not finite.
    fn finite(&self, loss: &Tensor<B, 1>) -> Result<f32> {
        crate::device::count_host_read();
        let value: f32 = loss.clone().into_scalar().elem();
        if !value.is_finite() {
            return Err(Error::Training {
                block: self.index + 1,
                step: self.step,
                message: format!("loss is {value}"),
            });
        }
        Ok(value)
    }

    /// One optimizer step with the gradients of every replica of the stage
    /// (summed, in the given order), at this step's learning rate. `loss`
    /// is the step's loss (the replicas' weighted losses, summed).
    pub fn apply(&mut self, grads: Vec<GradientsParams>, loss: StepLoss<B::InnerBackend>) -> Result<()> {
        let module = self.module.take().ok_or_else(|| self.lost())?;
        let lr = self.lr.at(self.step);
        self.module = Some(step_optimizer(&mut self.optimizer, lr, module, grads));
        self.advance(loss);
        Ok(())
    }

    /// Counts a step taken elsewhere (a follower replica whose leader
    /// stepped) and records its loss.
    pub fn advance(&mut self, loss: StepLoss<B::InnerBackend>) {
        self.losses.push(self.step, loss);
        self.step += 1;
    }

    /// The loss of the last step, if it has been read back (see [`StepLoss`]).
    pub fn latest_loss(&self) -> Option<f32> {
        self.losses.latest()
    }

    /// The current module.
    pub fn module(&self) -> Option<&S> {
        self.module.as_ref()
    }

    /// Replaces the module (a follower replica receiving its leader's update).
    pub fn replace_module(&mut self, module: S) {
        self.module = Some(module);
    }

    /// Mean loss over the last [`FINAL_LOSS_WINDOW`] steps (NaN before any step).
    pub fn recent_loss(&self) -> f32 {
        let window = self.losses.window();
        window.iter().sum::<f32>() / window.len() as f32
    }

    /// The block's resumable state: weights, optimizer state, step counter
    /// (which is also the learning-rate position) and recent losses.
    pub fn save_state(&self) -> Result<TrainerState> {
        let block = self.index + 1;
        let module = self.module.as_ref().ok_or_else(|| self.lost())?;
        let record_error = |what: &str, e: RecorderError| Error::Training {
            block,
            step: self.step,
            message: format!("cannot serialise the {what} for a checkpoint: {e}"),
        };
        let weights = module_bytes(module).map_err(|e| record_error("weights", e))?;
        let optimizer = self.optimizer.to_bytes().map_err(|e| record_error("optimizer state", e))?;
        let arch_optimizer = match &self.arch {
            Some(arch) => {
                Some(arch.optimizer.to_bytes().map_err(|e| record_error("architecture optimizer state", e))?)
            }
            None => None,
        };
        let recent_losses = self.losses.window().into_iter().filter(|l| l.is_finite()).collect();
        Ok(TrainerState { weights, optimizer, arch_optimizer, step: self.step, recent_losses })
    }

    /// Restores a state written by [`Self::save_state`] (on `device`). On
    /// error the trainer is left as it was.
    pub fn load_state(&mut self, state: TrainerState, device: &B::Device) -> std::result::Result<(), String> {
        let module = self.module.clone().ok_or("the block has no module to load into")?;
        let module = load_module_bytes(module, state.weights, device)?;
        let optimizer = self
            .optimizer
            .clone()
            .with_bytes(state.optimizer, device)
            .map_err(|e| format!("optimizer state does not decode: {e}"))?;
        let arch = match (self.arch.clone(), state.arch_optimizer) {
            (Some(mut arch), Some(bytes)) => {
                arch.optimizer = arch
                    .optimizer
                    .with_bytes(bytes, device)
                    .map_err(|e| format!("architecture optimizer state does not decode: {e}"))?;
                Some(arch)
            }
            (Some(_), None) => {
                return Err("the checkpoint has no architecture optimizer state (arch.mpk)".into())
            }
            (None, _) => None,
        };
        self.module = Some(module);
        self.optimizer = optimizer;
        self.arch = arch;
        self.step = state.step;
        self.losses = LossLog::restored(state.recent_losses, state.step);
        Ok(())
    }

    /// The trained module.
    pub fn into_module(self) -> Option<S> {
        self.module
    }
}

/// A block's weights as bytes (burn's named MessagePack, full precision):
/// what a checkpoint keeps and what crosses to another process.
pub(crate) fn module_bytes<B: DistillBackend, S: StudentModule<B>>(
    module: &S,
) -> std::result::Result<Vec<u8>, RecorderError> {
    let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
    Recorder::<B>::record(&recorder, module.clone().into_record(), ())
}

/// `template` with the weights [`module_bytes`] wrote, loaded on `device`
/// (it keeps its autodiff setting); an error says why they do not load.
pub(crate) fn load_module_bytes<B: DistillBackend, S: StudentModule<B>>(
    template: S,
    bytes: Vec<u8>,
    device: &B::Device,
) -> std::result::Result<S, String> {
    let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
    let record =
        Recorder::<B>::load(&recorder, bytes, device).map_err(|e| format!("weights do not decode: {e}"))?;
    catch_unwind(AssertUnwindSafe(|| template.load_record(record)))
        .map_err(|_| "weights do not fit the block (other shapes?)".to_string())
}

/// What a checkpoint keeps of one block (see [`crate::checkpoint`]).
#[derive(Debug, Clone)]
pub struct TrainerState {
    /// The module record (burn named MessagePack, full precision).
    pub weights: Vec<u8>,
    /// The optimizer record (moments per parameter id).
    pub optimizer: Vec<u8>,
    /// The architecture optimizer's record (a single-path supernet block).
    pub arch_optimizer: Option<Vec<u8>>,
    /// Optimizer steps taken: the learning-rate position, and with the seed
    /// the data-order position (the order depends only on seed and epoch).
    pub step: usize,
    /// The last losses (for the report's final loss).
    pub recent_losses: Vec<f32>,
}

/// The gradients of `loss` times `weight` (a replica's share of the batch)
/// for `module`'s parameters.
fn scaled_grads<B: DistillBackend, S: StudentModule<B>>(
    loss: Tensor<B, 1>,
    weight: f32,
    module: &S,
) -> GradientsParams {
    let loss = if weight == 1.0 { loss } else { loss.mul_scalar(weight) };
    GradientsParams::from_grads(loss.backward(), module)
}

/// One update of `module` by `optimizer` with the gradients of every
/// replica (summed in the given order) at learning rate `lr`.
fn step_optimizer<B: DistillBackend, S: StudentModule<B>>(
    optimizer: &mut BlockOptimizer<B, S>,
    lr: f64,
    module: S,
    grads: Vec<GradientsParams>,
) -> S {
    if grads.len() == 1 {
        let grads = grads.into_iter().next().unwrap_or_default();
        optimizer.step(lr, module, grads)
    } else {
        let id = module.devices().into_iter().next().unwrap_or_default().id();
        let multi = MultiGradientsParams { grads: grads.into_iter().map(|g| (g, id)).collect() };
        optimizer.step_multi(lr, module, multi)
    }
}

/// A copy of a module with its own autodiff leaves (same parameter ids and
/// values): two replicas must never share leaf tensors, or their concurrent
/// backward passes would meet in one autodiff graph.
pub fn detached_copy<B: DistillBackend, S: StudentModule<B>>(module: &S) -> S {
    S::from_inner(module.valid())
}

/// One row of `metrics.csv`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MetricRow {
    /// Zero-based epoch.
    pub epoch: usize,
    /// Zero-based global step (batches seen so far).
    pub step: usize,
    /// One-based block number.
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

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex};
    use burn::module::{AutodiffModule, Module};
    use burn::tensor::{Distribution, Tensor};
    use pipebd_core::{flat_parameters, Activation, Block, BlockSpec};
    use pipebd_students::{Downsample, StudentBlock, StudentBlockConfig};

    use super::arch::{sample_path, softmax, Draw, SinglePath};
    use super::{BlockTrainer, TrainSettings};

    type B = Autodiff<Flex>;

    /// A supernet of two convolutions and a separable block for a [2, 6, 6] input.
    fn supernet() -> StudentBlock<B> {
        let device = Default::default();
        let conv = |width| StudentBlockConfig::Conv { width, out_channels: 4, downsample: Downsample::Pool };
        let separable = StudentBlockConfig::Separable {
            out_channels: 4,
            depth_multiplier: 2,
            inner_relu: true,
            downsample: Downsample::Pool,
        };
        let set = StudentBlockConfig::Candidates { candidates: vec![conv(3), conv(2), separable] };
        let module = set.init::<B>(1, &[2, 6, 6], &device).unwrap().module;
        // Draw the lazily initialised parameters once.
        module.clone().load_record(module.into_record())
    }

    fn trainer(module: StudentBlock<B>, seed: u64) -> BlockTrainer<B, StudentBlock<B>> {
        let spec = BlockSpec::infer("supernet", &module, &[2, 6, 6], &Default::default()).unwrap();
        let settings = TrainSettings {
            seed,
            single_path: Some(SinglePath { arch_every: 1, warmup: 0.0, arch_lr: 0.05 }),
            ..Default::default()
        };
        BlockTrainer::new(0, spec, module, &settings.optimizer, 100).configured(&settings)
    }

    fn batch() -> (Activation<Flex>, Activation<Flex>) {
        let device = Default::default();
        let x = Tensor::<Flex, 4>::random([5, 2, 6, 6], Distribution::Default, &device);
        let y = Tensor::<Flex, 4>::random([5, 4, 3, 3], Distribution::Default, &device);
        (Activation::Maps(x), Activation::Maps(y))
    }

    fn alpha(trainer: &BlockTrainer<B, StudentBlock<B>>) -> Vec<f32> {
        trainer.module().unwrap().arch_logits().unwrap().into_data().iter::<f32>().collect()
    }

    fn candidate_weights(trainer: &BlockTrainer<B, StudentBlock<B>>) -> Vec<Vec<f32>> {
        trainer.module().unwrap().candidates().iter().map(flat_parameters::<B, _>).collect()
    }

    #[test]
    fn a_training_step_trains_the_sampled_candidate_and_never_alpha() {
        // Seeded weights and batches (unseeded, a candidate could start with
        // every unit dead and not move): burn's generator held throughout.
        let _rng = crate::rng::burn_rng_lock();
        <Flex as burn::tensor::backend::Backend>::seed(&Default::default(), 3);
        let mut trainer = trainer(supernet(), 11);
        assert!(trainer.searches_paths());
        for step in 0..6 {
            let before = candidate_weights(&trainer);
            let alpha_before = alpha(&trainer);
            let path = sample_path(11, 0, step, Draw::Train, &softmax(&alpha_before));
            let (x, y) = batch();
            trainer.step(x, y).unwrap();
            let after = candidate_weights(&trainer);
            assert_eq!(alpha(&trainer), alpha_before, "step {step}: a training step moved alpha");
            for (c, (b, a)) in before.iter().zip(&after).enumerate() {
                if c == path {
                    assert_ne!(b, a, "step {step}: the sampled candidate {c} did not train");
                } else {
                    assert_eq!(b, a, "step {step}: candidate {c} trained but {path} was sampled");
                }
            }
        }
        assert_eq!(trainer.step, 6);
    }

    #[test]
    fn an_architecture_step_moves_alpha_only_by_the_proxylessnas_gradient() {
        let mut trainer = trainer(supernet(), 5);
        let (x, y) = batch();
        let weights = candidate_weights(&trainer);
        let logits = alpha(&trainer);
        let p = softmax(&logits);
        let (loss, grads) = trainer.compute_arch_grads(x.clone(), y.clone(), 1.0).unwrap();
        let loss = loss.value();

        // By hand: out = o_path, L = mean((out - y)^2), dL/dg_j = <dL/dout, o_j>,
        // dL/dalpha_i = sum_j dL/dg_j p_j (delta_ij - p_i).
        let path = sample_path(5, 0, 0, Draw::Arch, &p);
        let module = trainer.module().unwrap().valid();
        let flat = |a: Activation<Flex>| -> Vec<f64> {
            let Activation::Maps(t) = a else { panic!() };
            t.into_data().iter::<f32>().map(f64::from).collect()
        };
        let outputs: Vec<Vec<f64>> =
            module.candidates().iter().map(|c| flat(c.forward(x.clone()).unwrap())).collect();
        let target = flat(y);
        let n = target.len() as f64;
        let d_out: Vec<f64> = outputs[path].iter().zip(&target).map(|(o, t)| 2.0 * (o - t) / n).collect();
        let expected_loss: f64 =
            outputs[path].iter().zip(&target).map(|(o, t)| (o - t).powi(2)).sum::<f64>() / n;
        assert!((loss as f64 - expected_loss).abs() <= 1e-5 * expected_loss, "{loss} vs {expected_loss}");
        let d_gate: Vec<f64> =
            outputs.iter().map(|o| o.iter().zip(&d_out).map(|(a, b)| a * b).sum()).collect();
        let expected: Vec<f64> = (0..p.len())
            .map(|i| (0..p.len()).map(|j| d_gate[j] * p[j] * (if i == j { 1.0 } else { 0.0 } - p[i])).sum())
            .collect();
        let StudentBlock::Candidates(set) = trainer.module().unwrap() else { panic!() };
        let grad: Vec<f64> =
            grads.get::<Flex, 1>(set.alpha.id).unwrap().into_data().iter::<f32>().map(f64::from).collect();
        // The gradients sum to zero (softmax): compare against their scale.
        let scale = expected.iter().fold(0.0f64, |m, e| m.max(e.abs()));
        assert!(scale > 0.0, "a zero architecture gradient");
        for (g, e) in grad.iter().zip(&expected) {
            assert!((g - e).abs() <= 1e-3 * scale, "alpha gradient {grad:?}, by hand {expected:?}");
        }

        trainer.apply_arch(vec![grads]).unwrap();
        assert_eq!(candidate_weights(&trainer), weights, "an architecture step moved a candidate's weights");
        assert_ne!(alpha(&trainer), logits, "the architecture step did not move alpha");
        assert_eq!(trainer.step, 0, "architecture steps are not training steps");
        // Adam with beta1 = 0: the first step moves each logit by lr * sign(gradient).
        // (Up to epsilon 1e-8 against |gradient|: checked where that is negligible.)
        for ((after, before), g) in alpha(&trainer).iter().zip(&logits).zip(&grad) {
            let moved = (after - before) as f64;
            if g.abs() > 1e-5 {
                assert!((moved + 0.05 * g.signum()).abs() <= 1e-4, "moved {moved} for gradient {g}");
            }
        }
    }

    #[test]
    fn the_architecture_state_survives_a_checkpoint() {
        let mut trainer = trainer(supernet(), 5);
        for _ in 0..2 {
            let (x, y) = batch();
            let (_, grads) = trainer.compute_arch_grads(x, y, 1.0).unwrap();
            trainer.apply_arch(vec![grads]).unwrap();
        }
        let state = trainer.save_state().unwrap();
        assert!(state.arch_optimizer.is_some());
        let mut restored = super::tests::trainer(supernet(), 5);
        restored.load_state(state, &Default::default()).unwrap();
        assert_eq!(alpha(&restored), alpha(&trainer));
        // The next architecture step is the same from both.
        let (x, y) = batch();
        for t in [&mut trainer, &mut restored] {
            let (_, grads) = t.compute_arch_grads(x.clone(), y.clone(), 1.0).unwrap();
            t.apply_arch(vec![grads]).unwrap();
        }
        assert_eq!(alpha(&restored), alpha(&trainer));
        // Without the architecture optimizer's state the resume is refused.
        let mut state = trainer.save_state().unwrap();
        state.arch_optimizer = None;
        let error = super::tests::trainer(supernet(), 5).load_state(state, &Default::default()).unwrap_err();
        assert!(error.contains("arch.mpk"), "{error}");
    }
}

/// The loss bookkeeping on an asynchronous device (wgpu; Mesa's software
/// Vulkan driver where there is no GPU).
#[cfg(all(test, feature = "wgpu"))]
mod async_device_tests {
    use burn::backend::wgpu::WgpuDevice;
    use burn::backend::Autodiff;
    use burn::tensor::{Distribution, Tensor};
    use pipebd_core::{Activation, BlockSpec};
    use pipebd_students::{Downsample, StudentBlock, StudentBlockConfig};

    use super::{read_losses, BlockTrainer, OptimizerConfig};
    use crate::device::host_reads_on_this_thread;

    type Wgpu = pipebd_kernels::Wgpu;
    type W = Autodiff<Wgpu>;

    /// Six steps with no read back, then one read at the logged step: it
    /// finds the NaN that the third step's input brought and names that
    /// step, not the one it was read at.
    #[test]
    fn losses_stay_on_the_device_until_a_logged_step_which_names_the_step_that_diverged() {
        let device = WgpuDevice::DefaultDevice;
        let config = StudentBlockConfig::Conv { width: 3, out_channels: 4, downsample: Downsample::Pool };
        let module: StudentBlock<W> = config.init::<W>(1, &[2, 6, 6], &device).unwrap().module;
        let spec = BlockSpec::infer("conv", &module, &[2, 6, 6], &device).unwrap();
        let mut trainer = BlockTrainer::new(1, spec, module, &OptimizerConfig::default(), 100);
        let batch = |scale: f32| {
            let x = Tensor::<Wgpu, 4>::random([5, 2, 6, 6], Distribution::Default, &device).mul_scalar(scale);
            let y = Tensor::<Wgpu, 4>::random([5, 4, 3, 3], Distribution::Default, &device);
            (Activation::Maps(x), Activation::Maps(y))
        };
        let reads = host_reads_on_this_thread();
        for step in 0..6 {
            let (x, y) = batch(if step == 2 { f32::NAN } else { 1.0 });
            let (loss, grads) = trainer.compute_grads(x, y, 1.0).unwrap();
            trainer.apply(vec![grads], loss).unwrap();
            assert_eq!(trainer.latest_loss(), None, "step {step}'s loss was read back before a logged step");
        }
        assert_eq!(host_reads_on_this_thread(), reads, "values were read back during the steps");
        let error = read_losses(&mut [&mut trainer]).unwrap_err().to_string();
        assert!(host_reads_on_this_thread() > reads);
        assert!(
            error.contains("block 2")
                && error.contains("step 2")
                && error.contains("NaN")
                && error.contains("after step 5"),
            "{error}"
        );
    }

    /// A healthy run reads back once per logged step, and the reported
    /// final loss is the mean of the last steps' losses, all of them.
    #[test]
    fn a_logged_step_reads_its_loss_and_the_window_reads_the_rest() {
        let device = WgpuDevice::DefaultDevice;
        let config = StudentBlockConfig::Conv { width: 3, out_channels: 4, downsample: Downsample::Pool };
        let module: StudentBlock<W> = config.init::<W>(1, &[2, 6, 6], &device).unwrap().module;
        let spec = BlockSpec::infer("conv", &module, &[2, 6, 6], &device).unwrap();
        let mut trainer = BlockTrainer::new(0, spec, module, &OptimizerConfig::default(), 100);
        let x = Tensor::<Wgpu, 4>::random([5, 2, 6, 6], Distribution::Default, &device);
        let y = Tensor::<Wgpu, 4>::random([5, 4, 3, 3], Distribution::Default, &device);
        let mut values = Vec::new();
        for step in 0..30 {
            let (loss, grads) =
                trainer.compute_grads(Activation::Maps(x.clone()), Activation::Maps(y.clone()), 1.0).unwrap();
            values.push(loss.value());
            trainer.apply(vec![grads], loss).unwrap();
            if step % 10 == 0 {
                read_losses(&mut [&mut trainer]).unwrap();
                assert_eq!(trainer.latest_loss(), Some(values[step]));
            }
        }
        let last: Vec<f32> = values[values.len() - super::FINAL_LOSS_WINDOW..].to_vec();
        let mean = last.iter().sum::<f32>() / last.len() as f32;
        assert_eq!(trainer.recent_loss(), mean);
        assert!(values[29] < values[0], "the block did not learn: {values:?}");
    }
}
