//! [`BlockTrainer`]: one student block with its optimizer, learning-rate
//! plan, loss log and (for a single-path supernet block) architecture
//! optimizer; its step, and its state as a checkpoint keeps it.

use std::panic::{catch_unwind, AssertUnwindSafe};

use burn::optim::{GradientsParams, MultiGradientsParams};
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder, RecorderError};
use burn::tensor::backend::DeviceOps;
use burn::tensor::{ElementConversion, Tensor, TensorData};
use pipebd_core::{Activation, Block, BlockSpec, Loss, StudentModule};
use pipebd_kernels::{DistillBackend, FusedBackend};

use crate::error::{relabel, Error, Result};
use crate::train::arch::{sample_path, softmax, Draw, SinglePath};
use crate::train::optim::{BlockOptimizer, LrPlan, OptimizerConfig};

use super::losses::{read_losses, LossLog, StepLoss};
use super::TrainSettings;

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
    pub(super) losses: LossLog<B::InnerBackend>,
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
