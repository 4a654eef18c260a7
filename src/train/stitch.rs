//! An optional pass after blockwise training: each student block learns
//! from the *stitched student's* output of the blocks before it, the input
//! it will see at inference, against the teacher's output of its own block.
//!
//! Blockwise distillation trains block k on the teacher's input to block k,
//! so at inference the small errors of blocks 1..k-1 reach block k as an
//! input it never saw, and they compound. This pass (`train.stitched_epochs`)
//! closes that gap, in one of two ways:
//!
//! - `local`: the stitched input is detached, so every block keeps its own
//!   loss, gradient and optimizer; only its input changes.
//! - `end-to-end` (default): the sum of the blocks' losses is
//!   backpropagated through the stitched chain, so earlier blocks also learn
//!   to make the later ones' job easier; each block still steps its own
//!   optimizer.
//!
//! Every block's loss is still against the teacher's output of that block.
//! An end-to-end pass can add a loss on the final output
//! (`train.stitched_output_loss`): one of the block losses, or `head-kl`,
//! the KL of the next-token (or class) distributions through a frozen head
//! the zoo provides ([`OutputHead`]: a language model's LM head), as
//! Puzzle's global distillation does. It is not part of Pipe-BD proper and
//! runs on one device.

use burn::optim::GradientsParams;
use burn::tensor::{ElementConversion, Tensor};
use pipebd_core::{
    head_kl, Activation, Block, Dataset, Loss, LossKind, OutputHead, StudentModule, Students, Teacher,
};
use pipebd_kernels::DistillBackend;
use serde::{Deserialize, Serialize};

use crate::data::epoch_order;
use crate::error::{relabel, Error, Result};
use crate::train::optim::OptimizerConfig;
use crate::train::{steps_per_epoch, BlockTrainer, MetricRow, Progress, StepLoss, TrainSettings};

/// What the stitched pass did.
#[derive(Debug, Clone, Default)]
pub struct StitchedLog {
    /// Optimizer steps per block.
    pub steps: usize,
    /// Wall time.
    pub seconds: f64,
    /// Metric rows (steps numbered after the blockwise steps).
    pub rows: Vec<MetricRow>,
    /// Per block, the mean loss over its last steps.
    pub final_losses: Vec<f32>,
    /// The output loss (unweighted) averaged over the last epoch, if any.
    pub final_output_loss: Option<f32>,
    /// Wall time of each step (loading its batch included), in order.
    pub step_seconds: Vec<f64>,
}

/// How gradients flow in the stitched passes (`train.stitched_gradients`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StitchedGradients {
    /// Through the whole stitched chain.
    #[default]
    EndToEnd,
    /// Stopped at every block's input.
    Local,
}

impl StitchedGradients {
    /// The name used in configs.
    pub fn name(self) -> &'static str {
        match self {
            Self::EndToEnd => "end-to-end",
            Self::Local => "local",
        }
    }
}

/// The stitched passes after blockwise training: how many, with which
/// optimizer, and how gradients flow.
#[derive(Debug, Clone, PartialEq)]
pub struct StitchedPass {
    /// Passes over the data.
    pub epochs: usize,
    /// A fresh optimizer per block with these settings (cosine schedule over
    /// the passes).
    pub optimizer: OptimizerConfig,
    /// Metric rows are numbered from this step (the blockwise steps before).
    pub first_step: usize,
    /// Through the stitched chain, or stopped at each block's input.
    pub gradients: StitchedGradients,
    /// An extra loss on the final output, added with its weight to the sum
    /// of the block losses (end-to-end passes only).
    pub output_loss: Option<OutputLoss>,
    /// Weight of the block losses in an end-to-end pass's sum (1 by
    /// default). 0 leaves the output loss alone to train the students, as
    /// Puzzle's global distillation does: the blocks' own losses are still
    /// computed and logged, but no gradient comes from them.
    pub block_weight: f64,
}

/// A loss on the stitched student's final output against the teacher's
/// (`train.stitched_output_loss` and `stitched_output_weight`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutputLoss {
    /// Which loss.
    pub kind: OutputLossKind,
    /// Its weight in the summed loss.
    pub weight: f64,
}

/// The losses `train.stitched_output_loss` names: a block loss applied to
/// the final activations, or the KL through the zoo's frozen output head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OutputLossKind {
    /// Mean squared error of the final activations.
    Mse,
    /// Soft-target cross-entropy (the final activations are logits).
    SoftTargetCrossEntropy,
    /// One minus the cosine of the mean-pooled sentence embeddings.
    PooledCosine,
    /// `KL(teacher || student)` of the distributions over the scores of the
    /// zoo's frozen output head (a language model's next-token
    /// distributions), averaged over real tokens.
    HeadKl,
}

impl OutputLossKind {
    /// The block loss this is, or `None` for the head's KL.
    pub fn block_loss(self) -> Option<LossKind> {
        match self {
            Self::Mse => Some(LossKind::Mse),
            Self::SoftTargetCrossEntropy => Some(LossKind::SoftTargetCrossEntropy),
            Self::PooledCosine => Some(LossKind::PooledCosine),
            Self::HeadKl => None,
        }
    }

    /// The name used in configs.
    pub fn name(self) -> &'static str {
        match self.block_loss() {
            Some(kind) => kind.name(),
            None => "head-kl",
        }
    }
}

impl Default for StitchedPass {
    /// One end-to-end pass with the default optimizer at a third of its
    /// learning rate, numbered from step 0. After a blockwise run with
    /// other settings, [`StitchedPass::after`] is what a config gives.
    fn default() -> Self {
        Self::with_optimizer(&OptimizerConfig::default(), 0)
    }
}

impl StitchedPass {
    /// One end-to-end pass after a blockwise run under `settings` that took
    /// `blockwise_steps` steps: the run's optimizer at a third of its
    /// learning rate (as a config without `stitched_lr` gives), its steps
    /// numbered on from the run's.
    pub fn after(settings: &crate::train::TrainSettings, blockwise_steps: usize) -> Self {
        Self::with_optimizer(&settings.optimizer, blockwise_steps)
    }

    fn with_optimizer(optimizer: &OptimizerConfig, first_step: usize) -> Self {
        let mut optimizer = optimizer.clone();
        optimizer.lr /= 3.0;
        optimizer.min_lr = optimizer.min_lr.min(optimizer.lr);
        Self {
            epochs: 1,
            optimizer,
            first_step,
            gradients: StitchedGradients::EndToEnd,
            output_loss: None,
            block_weight: 1.0,
        }
    }
}

/// What a stitched pass reads and does not train: the frozen teacher, the
/// data, the run's settings (batches, seed, logging, temperature), the
/// device, and the frozen output head a `head-kl` output loss scores
/// through. Build it, then [`train`](Self::train) the students:
///
/// ```ignore
/// let (students, log) = StitchedRun::new(&teacher, &data, &settings, &device)
///     .with_head(&head) // only for `head-kl`
///     .train(students, &pass, &mut |_| {})?;
/// ```
pub struct StitchedRun<'a, B: DistillBackend, T: Block<B::InnerBackend>> {
    teacher: &'a Teacher<B::InnerBackend, T>,
    data: &'a dyn Dataset<B::InnerBackend>,
    settings: &'a TrainSettings,
    device: &'a B::Device,
    head: Option<&'a dyn OutputHead<B>>,
}

impl<'a, B, T> StitchedRun<'a, B, T>
where
    B: DistillBackend,
    T: Block<B::InnerBackend>,
{
    /// A pass of `teacher`'s students over `data` on `device` under
    /// `settings`, without an output head.
    pub fn new(
        teacher: &'a Teacher<B::InnerBackend, T>,
        data: &'a dyn Dataset<B::InnerBackend>,
        settings: &'a TrainSettings,
        device: &'a B::Device,
    ) -> Self {
        Self { teacher, data, settings, device, head: None }
    }

    /// The same with `head`, the frozen output head that a `head-kl`
    /// output loss scores through (required by it, unused otherwise).
    pub fn with_head(mut self, head: &'a dyn OutputHead<B>) -> Self {
        self.head = Some(head);
        self
    }

    /// The same with an optional head ([`with_head`](Self::with_head) or
    /// none).
    pub fn with_optional_head(mut self, head: Option<&'a dyn OutputHead<B>>) -> Self {
        self.head = head;
        self
    }

    /// Runs `pass` on `students`: every block learns from the stitched
    /// student's output of the blocks before it; `observer` sees every
    /// step's progress. Returns the trained students and what the pass did.
    pub fn train<S: StudentModule<B>>(
        &self,
        students: Students<B, S>,
        pass: &StitchedPass,
        observer: &mut dyn FnMut(&Progress),
    ) -> Result<(Students<B, S>, StitchedLog)> {
        let StitchedRun { teacher, data, settings, device, head } = *self;
        let start = std::time::Instant::now();
        let per_epoch = steps_per_epoch(data.len(), settings.batch_size);
        let (epochs, first_step) = (pass.epochs, pass.first_step);
        let through_blocks = pass.gradients == StitchedGradients::EndToEnd;
        let output_loss = final_loss(pass, head, settings.temperature, students.specs.len())?;
        let mut output_losses: Vec<f32> = Vec::new();
        let total = per_epoch * epochs;
        let Students { blocks, specs, .. } = students;
        let mut trainers: Vec<BlockTrainer<B, S>> = blocks
            .into_iter()
            .zip(specs.iter().cloned())
            .enumerate()
            .map(|(k, (m, spec))| {
                BlockTrainer::new(k, spec, m.fork(device), &pass.optimizer, total)
                    .with_temperature(settings.temperature)
            })
            .collect();
        let mut log = StitchedLog { steps: total, ..Default::default() };
        let mut order = Vec::new();
        for step in 0..total {
            let step_start = std::time::Instant::now();
            let epoch = step / per_epoch;
            if step % per_epoch == 0 {
                // A different order from the blockwise epochs', still fixed by the seed.
                order = epoch_order(data.len(), settings.seed ^ 0x5717_c4ed, epoch);
            }
            let base = (step % per_epoch) * settings.batch_size;
            let input = data.batch(&order[base..base + settings.batch_size], device)?;
            let lrs: Vec<f64> = trainers.iter().map(|t| t.current_lr()).collect();
            let (losses, output) = if through_blocks {
                let (losses, output) =
                    end_to_end_step(teacher, &mut trainers, input, output_loss.as_ref(), pass.block_weight)?;
                if epoch + 1 == epochs {
                    output_losses.extend(output);
                }
                (losses, output)
            } else {
                (local_step(teacher, &mut trainers, input)?, None)
            };
            log.step_seconds.push(step_start.elapsed().as_secs_f64());
            if step % settings.log_every == 0 || step + 1 == total {
                for (k, (&loss, &lr)) in losses.iter().zip(&lrs).enumerate() {
                    log.rows.push(MetricRow { epoch, step: first_step + step, block: k + 1, loss, lr });
                }
                // The stitched student's output loss, the one an output-only
                // pass minimises, as block 0 (at the last block's rate).
                if let (Some(loss), Some(&lr)) = (output, lrs.last()) {
                    log.rows.push(MetricRow { epoch, step: first_step + step, block: 0, loss, lr });
                }
            }
            observer(&Progress {
                phase: 0,
                phases: 1,
                epoch,
                epochs,
                step_in_epoch: step % per_epoch,
                steps_per_epoch: per_epoch,
                losses,
                output_loss: output,
            });
        }
        log.final_losses = trainers.iter().map(|t| t.recent_loss()).collect();
        log.final_output_loss = (!output_losses.is_empty())
            .then(|| output_losses.iter().sum::<f32>() / output_losses.len() as f32);
        log.seconds = start.elapsed().as_secs_f64();
        let modules: Vec<S> = trainers.into_iter().filter_map(|t| t.into_module()).collect();
        Ok((Students::new(modules, specs.clone(), &specs)?, log))
    }
}

/// Runs `pass` over `data` on `device` (see [`StitchedRun`], which this
/// calls).
#[deprecated(
    since = "0.3.0",
    note = "use `StitchedRun::new(teacher, data, settings, device)\
    .with_optional_head(head).train(students, pass, observer)`"
)]
#[allow(clippy::too_many_arguments)]
pub fn stitched_pass<B, T, S>(
    teacher: &Teacher<B::InnerBackend, T>,
    students: Students<B, S>,
    data: &dyn Dataset<B::InnerBackend>,
    settings: &TrainSettings,
    pass: &StitchedPass,
    head: Option<&dyn OutputHead<B>>,
    device: &B::Device,
    observer: &mut dyn FnMut(&Progress),
) -> Result<(Students<B, S>, StitchedLog)>
where
    B: DistillBackend,
    T: Block<B::InnerBackend>,
    S: StudentModule<B>,
{
    StitchedRun::new(teacher, data, settings, device).with_optional_head(head).train(students, pass, observer)
}

/// One step with each block's gradient stopped at its input: block k
/// learns from the (detached) stitched output of blocks 1..k-1. Returns the
/// per-block losses.
fn local_step<B, T, S>(
    teacher: &Teacher<B::InnerBackend, T>,
    trainers: &mut [BlockTrainer<B, S>],
    input: Activation<B::InnerBackend>,
) -> Result<Vec<f32>>
where
    B: DistillBackend,
    T: Block<B::InnerBackend>,
    S: StudentModule<B>,
{
    let mut teacher_x = input.clone();
    let mut student_x = input;
    let mut losses = Vec::with_capacity(trainers.len());
    for (k, trainer) in trainers.iter_mut().enumerate() {
        let block = k + 1;
        let target = teacher.blocks[k].forward(teacher_x).map_err(|e| relabel(e, block))?;
        // The block's output before its step is the next block's input.
        let next = match trainer.module() {
            Some(module) => module.valid().forward(student_x.clone()).map_err(|e| relabel(e, block))?,
            None => student_x.clone(),
        };
        losses.push(trainer.step(student_x, target.clone())?);
        teacher_x = target;
        student_x = next;
    }
    Ok(losses)
}

/// `pass`'s output loss, ready to compute on the output of the last of
/// `blocks` blocks; an error when it cannot be (a local pass, or `head-kl`
/// without a head).
fn final_loss<'a, B: DistillBackend>(
    pass: &StitchedPass,
    head: Option<&'a dyn OutputHead<B>>,
    temperature: f64,
    blocks: usize,
) -> Result<Option<(FinalLoss<'a, B>, f64)>> {
    let Some(OutputLoss { kind, weight }) = pass.output_loss else { return Ok(None) };
    let refuse = |message: &str| Error::Training { block: blocks, step: 0, message: message.into() };
    if pass.gradients != StitchedGradients::EndToEnd {
        return Err(refuse("an output loss needs end-to-end stitched gradients"));
    }
    let loss = match (kind.block_loss(), head) {
        (Some(block_loss), _) => FinalLoss::Block(Loss::new(block_loss).with_temperature(temperature)),
        (None, Some(head)) => FinalLoss::Head { head, temperature },
        (None, None) => {
            return Err(refuse(
                "the `head-kl` output loss needs the teacher's output head, and none was given",
            ))
        }
    };
    Ok(Some((loss, weight)))
}

/// The output loss of an end-to-end pass, ready to compute.
enum FinalLoss<'a, B: DistillBackend> {
    /// A block loss on the final activations.
    Block(Loss),
    /// The KL through the frozen output head.
    Head { head: &'a dyn OutputHead<B>, temperature: f64 },
}

impl<B: DistillBackend> FinalLoss<'_, B> {
    fn compute(&self, student: Activation<B>, teacher: Activation<B>) -> pipebd_core::Result<Tensor<B, 1>> {
        match self {
            Self::Block(loss) => loss.compute(student, teacher),
            Self::Head { head, temperature } => head_kl(*head, student, teacher, *temperature),
        }
    }
}

/// `loss` added to the running sum `total` (the sum so far, if any).
fn add_loss<B: burn::tensor::backend::Backend>(
    total: Option<Tensor<B, 1>>,
    loss: Tensor<B, 1>,
) -> Tensor<B, 1> {
    match total {
        Some(sum) => sum.add(loss),
        None => loss,
    }
}

/// One step with gradients through the stitched chain: the sum of every
/// block's loss against the teacher, times `block_weight` (plus
/// `output_loss`, weighted, on the last block's output), backpropagated
/// through all blocks; each block steps its own optimizer. Returns the
/// per-block losses and the output loss's unweighted value.
fn end_to_end_step<B, T, S>(
    teacher: &Teacher<B::InnerBackend, T>,
    trainers: &mut [BlockTrainer<B, S>],
    input: Activation<B::InnerBackend>,
    output_loss: Option<&(FinalLoss<'_, B>, f64)>,
    block_weight: f64,
) -> Result<(Vec<f32>, Option<f32>)>
where
    B: DistillBackend,
    T: Block<B::InnerBackend>,
    S: StudentModule<B>,
{
    let mut teacher_x = input.clone();
    let mut student_x = Activation::<B>::from_inner(input);
    let mut total: Option<Tensor<B, 1>> = None;
    let mut values = Vec::with_capacity(trainers.len());
    for (k, trainer) in trainers.iter().enumerate() {
        let block = k + 1;
        let target = teacher.blocks[k].forward(teacher_x).map_err(|e| relabel(e, block))?;
        let module = trainer.module().ok_or_else(|| Error::Training {
            block,
            step: trainer.step,
            message: "the block was lost by an earlier failed step".into(),
        })?;
        let output = module.forward(student_x).map_err(|e| relabel(e, block))?;
        let loss = module
            .loss(output.clone(), Activation::from_inner(target.clone()), &trainer.loss)
            .map_err(|e| relabel(e, block))?;
        let value: f32 = loss.clone().into_scalar().elem();
        if !value.is_finite() {
            return Err(Error::Training { block, step: trainer.step, message: format!("loss is {value}") });
        }
        values.push(value);
        if block_weight > 0.0 {
            let loss = if block_weight == 1.0 { loss } else { loss.mul_scalar(block_weight) };
            total = Some(add_loss(total, loss));
        }
        student_x = output;
        teacher_x = target;
    }
    let mut output_value = None;
    if let (Some((loss, weight)), Some(last)) = (output_loss, trainers.last()) {
        let weight = *weight;
        let block = trainers.len();
        let extra =
            loss.compute(student_x, Activation::from_inner(teacher_x)).map_err(|e| relabel(e, block))?;
        let value: f32 = extra.clone().into_scalar().elem();
        if !value.is_finite() {
            return Err(Error::Training {
                block,
                step: last.step,
                message: format!("output loss is {value}"),
            });
        }
        output_value = Some(value);
        total = Some(add_loss(total, extra.mul_scalar(weight)));
    }
    let Some(total) = total else {
        return Ok((values, output_value));
    };
    let mut grads = total.backward();
    for (trainer, &value) in trainers.iter_mut().zip(&values) {
        let module = trainer.module().cloned();
        let block_grads = match &module {
            Some(m) => GradientsParams::from_module(&mut grads, m),
            None => GradientsParams::new(),
        };
        trainer.apply(vec![block_grads], StepLoss::Read(value))?;
    }
    Ok((values, output_value))
}
