//! A block's losses as training records them: read back at once on the
//! CPU, or kept on an asynchronous device and read once per logged step
//! ([`read_losses`]), with the window the report's final loss averages.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use pipebd_core::StudentModule;
use pipebd_kernels::DistillBackend;

use crate::error::{Error, Result};
use crate::train::BlockTrainer;

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
pub(super) struct LossLog<B: Backend> {
    entries: std::collections::VecDeque<(usize, StepLoss<B>)>,
    /// Steps before this one were checked finite (or read at once).
    checked_to: usize,
}

impl<B: Backend> LossLog<B> {
    pub(super) fn new() -> Self {
        Self { entries: Default::default(), checked_to: 0 }
    }

    /// Records `step`'s loss (checked already when it was read at once).
    pub(super) fn push(&mut self, step: usize, loss: StepLoss<B>) {
        let read = matches!(loss, StepLoss::Read(_));
        self.entries.push_back((step, loss));
        if read {
            self.checked(step);
        }
    }

    /// Marks the losses up to `step` checked and drops those the window no
    /// longer needs.
    pub(super) fn checked(&mut self, step: usize) {
        self.checked_to = step + 1;
        while self.entries.len() > FINAL_LOSS_WINDOW
            && self.entries.front().is_some_and(|(s, _)| *s < self.checked_to)
        {
            self.entries.pop_front();
        }
    }

    /// The last loss's parts, when it is still on the device.
    pub(super) fn unread_latest(&self) -> Option<&Vec<(Tensor<B, 1>, f32)>> {
        match self.entries.back() {
            Some((_, StepLoss::Pending(parts))) => Some(parts),
            _ => None,
        }
    }

    /// Settles the last loss at `value` (read back). Not finite: the first
    /// step since the last check whose loss is not finite (read back now),
    /// and that loss.
    pub(super) fn settle_latest(&mut self, value: f32) -> std::result::Result<(), (usize, f32)> {
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
    pub(super) fn latest(&self) -> Option<f32> {
        match self.entries.back() {
            Some((_, StepLoss::Read(value))) => Some(*value),
            _ => None,
        }
    }

    /// Every kept step's loss, those still on the device read back (one read).
    pub(super) fn values(&self) -> Vec<(usize, f32)> {
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
    pub(super) fn window(&self) -> Vec<f32> {
        let mut values: Vec<f32> = self.values().into_iter().map(|(_, v)| v).collect();
        values.split_off(values.len().saturating_sub(FINAL_LOSS_WINDOW))
    }

    /// A log holding `values` as the losses of the steps before `step`.
    pub(super) fn restored(values: Vec<f32>, step: usize) -> Self {
        let first = step.saturating_sub(values.len());
        let entries = values.into_iter().enumerate().map(|(i, v)| (first + i, StepLoss::Read(v))).collect();
        Self { entries, checked_to: step }
    }
}
