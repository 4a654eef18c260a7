//! Training: one student block's optimizer step, and the `ideal` schedule.
//!
//! Where a gradient stops: [`BlockTrainer::step`] lifts the teacher's input
//! and target activations into the autodiff backend as constants
//! ([`Activation::from_inner`]), so the backward pass of block k reaches only
//! block k's parameters.

use std::time::Instant;

use burn::tensor::ElementConversion;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use serde::Serialize;

use crate::block::{block_loss, relabel, Activation, Block, BlockSpec, StudentModule, Students, Teacher};
use crate::config::{OptimizerConfig, RunConfig};
use crate::data::{batches, epoch_order, ImageDataset};
use crate::error::{Error, Result};
use crate::optim::{BlockOptimizer, LrPlan};

/// Number of trailing steps averaged into a block's `final_loss`.
pub const FINAL_LOSS_WINDOW: usize = 20;

/// A student block with its optimizer and learning-rate plan.
pub struct BlockTrainer<B: AutodiffBackend, S: StudentModule<B>> {
    /// Zero-based block index.
    pub index: usize,
    /// The block's spec (decides the loss).
    pub spec: BlockSpec,
    module: Option<S>,
    optimizer: BlockOptimizer<B, S>,
    lr: LrPlan,
    /// Optimizer steps taken so far.
    pub step: usize,
    recent: Vec<f32>,
}

impl<B: AutodiffBackend, S: StudentModule<B>> BlockTrainer<B, S> {
    /// A trainer for block `index` that will take `total_steps` steps.
    pub fn new(index: usize, spec: BlockSpec, module: S, config: &OptimizerConfig, total_steps: usize) -> Self {
        Self {
            index,
            spec,
            module: Some(module),
            optimizer: BlockOptimizer::new(config),
            lr: LrPlan::new(config, total_steps),
            step: 0,
            recent: Vec::new(),
        }
    }

    /// Learning rate of the next step.
    pub fn current_lr(&self) -> f64 {
        self.lr.at(self.step)
    }

    /// One distillation step: student forward on the teacher's input, loss
    /// against the teacher's output, backward, optimizer step. Returns the
    /// loss. A non-finite loss is an error naming the block and step.
    pub fn step(
        &mut self,
        input: Activation<B::InnerBackend>,
        target: Activation<B::InnerBackend>,
    ) -> Result<f32> {
        let block = self.index + 1;
        let module = self.module.take().ok_or_else(|| Error::Training {
            block,
            step: self.step,
            message: "the block was lost by an earlier failed step".into(),
        })?;
        let output = module
            .forward(Activation::from_inner(input))
            .map_err(|e| relabel(e, block))?;
        let loss = block_loss(self.spec.loss, output, Activation::from_inner(target), block)?;
        let value: f32 = loss.clone().into_scalar().elem();
        if !value.is_finite() {
            return Err(Error::Training { block, step: self.step, message: format!("loss is {value}") });
        }
        let grads = GradientsParams::from_grads(loss.backward(), &module);
        let lr = self.lr.at(self.step);
        self.module = Some(self.optimizer.step(lr, module, grads));
        self.step += 1;
        if self.recent.len() == FINAL_LOSS_WINDOW {
            self.recent.remove(0);
        }
        self.recent.push(value);
        Ok(value)
    }

    /// Mean loss over the last [`FINAL_LOSS_WINDOW`] steps (NaN before any step).
    pub fn recent_loss(&self) -> f32 {
        self.recent.iter().sum::<f32>() / self.recent.len() as f32
    }

    /// The trained module.
    pub fn into_module(self) -> Option<S> {
        self.module
    }
}

/// One row of `metrics.csv`.
#[derive(Debug, Clone, Serialize)]
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
    /// Training samples processed (per block).
    pub samples: usize,
    /// Wall time of the training loop.
    pub seconds: f64,
}

/// Progress of a run, handed to an observer after every step.
#[derive(Debug, Clone)]
pub struct Progress {
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
}

/// Optimizer steps per epoch for a dataset of `len` samples.
pub fn steps_per_epoch(len: usize, batch_size: usize) -> usize {
    len / batch_size
}

/// Trains every student block on one device, running the teacher once per
/// batch (the `ideal` schedule of the paper: the single-device reference).
pub fn train_ideal<B, T, S>(
    teacher: &Teacher<B::InnerBackend, T>,
    students: Students<B, S>,
    data: &ImageDataset,
    config: &RunConfig,
    device: &B::Device,
    observer: &mut dyn FnMut(&Progress),
) -> Result<(Students<B, S>, TrainLog)>
where
    B: AutodiffBackend,
    T: Block<B::InnerBackend>,
    S: StudentModule<B>,
{
    let batch_size = config.train.batch_size;
    let per_epoch = steps_per_epoch(data.len(), batch_size);
    if per_epoch == 0 {
        return Err(Error::Config {
            path: "<config>".into(),
            line: None,
            field: Some("train.batch_size".into()),
            message: format!("batch size {batch_size} is larger than the {} training samples", data.len()),
        });
    }
    let total_steps = per_epoch * config.train.epochs;
    let Students { blocks, specs, .. } = students;
    let mut trainers: Vec<BlockTrainer<B, S>> = blocks
        .into_iter()
        .zip(specs.iter().cloned())
        .enumerate()
        .map(|(k, (module, spec))| BlockTrainer::new(k, spec, module, &config.optimizer, total_steps))
        .collect();

    let start = Instant::now();
    let mut log = TrainLog::default();
    let mut global_step = 0;
    for epoch in 0..config.train.epochs {
        let order = epoch_order(data.len(), config.seed, epoch);
        for (step_in_epoch, indices) in batches(&order, batch_size).enumerate() {
            let mut x = Activation::Maps(data.images::<B::InnerBackend>(indices, device));
            let mut losses = Vec::with_capacity(trainers.len());
            let log_this = global_step % config.train.log_every == 0 || global_step + 1 == total_steps;
            for (trainer, teacher_block) in trainers.iter_mut().zip(&teacher.blocks) {
                let y = teacher_block.forward(x.clone()).map_err(|e| relabel(e, trainer.index + 1))?;
                let lr = trainer.current_lr();
                let loss = trainer.step(x, y.clone())?;
                if log_this {
                    log.rows.push(MetricRow { epoch, step: global_step, block: trainer.index + 1, loss, lr });
                }
                losses.push(loss);
                x = y;
            }
            observer(&Progress {
                epoch,
                epochs: config.train.epochs,
                step_in_epoch,
                steps_per_epoch: per_epoch,
                losses,
            });
            global_step += 1;
        }
    }
    log.seconds = start.elapsed().as_secs_f64();
    log.steps = total_steps;
    log.samples = total_steps * batch_size;
    log.final_losses = trainers.iter().map(|t| t.recent_loss()).collect();
    let mut trained = Vec::with_capacity(trainers.len());
    for t in trainers {
        let index = t.index;
        trained.push(t.into_module().ok_or(Error::Training {
            block: index + 1,
            step: total_steps,
            message: "module missing after training".into(),
        })?);
    }
    Ok((Students::new(trained, specs.clone(), &specs)?, log))
}

/// Stitches blocks into one network and measures top-1 accuracy on `data`.
pub fn accuracy<B, M>(blocks: &[M], data: &ImageDataset, device: &B::Device, chunk: usize) -> Result<f64>
where
    B: burn::tensor::backend::Backend,
    M: Block<B>,
{
    let indices: Vec<usize> = (0..data.len()).collect();
    let mut correct = 0usize;
    for part in indices.chunks(chunk.max(1)) {
        let mut x = Activation::Maps(data.images::<B>(part, device));
        for (k, block) in blocks.iter().enumerate() {
            x = block.forward(x).map_err(|e| relabel(e, k + 1))?;
        }
        let Activation::Flat(logits) = x else {
            return Err(Error::Block {
                block: blocks.len(),
                message: format!("the last block must produce logits [batch, classes], got {:?}", x.dims()),
            });
        };
        let predicted = logits.argmax(1).into_data();
        let predicted: Vec<i64> = predicted.iter::<i64>().collect();
        let labels = data.labels_at(part);
        correct += predicted.iter().zip(&labels).filter(|(p, l)| **p == **l as i64).count();
    }
    Ok(correct as f64 / data.len().max(1) as f64)
}

/// The inference copies of trained student blocks (for evaluation).
pub fn inference_blocks<B: AutodiffBackend, S: StudentModule<B>>(students: &Students<B, S>) -> Vec<S::InnerModule> {
    students.blocks.iter().map(|b| b.valid()).collect()
}
