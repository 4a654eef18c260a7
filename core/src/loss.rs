//! The distillation loss of one block: [`LossKind`] and its settings.

use burn::tensor::Tensor;
use pipebd_kernels::FusedBackend;
use serde::{Deserialize, Serialize};

use crate::activation::Activation;
use crate::error::{Error, Result};

/// Whether `temperature` can soften a softmax: a finite positive number
/// (the one rule, which configs and losses both apply).
pub fn is_valid_temperature(temperature: f64) -> bool {
    temperature.is_finite() && temperature > 0.0
}

/// [`is_valid_temperature`] as an error naming the value.
pub(crate) fn check_temperature(temperature: f64) -> Result<()> {
    if is_valid_temperature(temperature) {
        Ok(())
    } else {
        Err(Error::block(format!("temperature {temperature} must be a positive number")))
    }
}

/// How a block's student output is compared with the teacher's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LossKind {
    /// Mean squared error over all elements (over real tokens only for
    /// token states: padding is masked out).
    Mse,
    /// Soft-target cross-entropy against the teacher's softmax (logits blocks).
    SoftTargetCrossEntropy,
    /// One minus the cosine of the mean-pooled sentence embeddings (token
    /// states only): the embedding a sentence encoder is scored on. Used as
    /// the stitched pass's output loss (`train.stitched_output_loss`).
    PooledCosine,
    /// Normalized MSE, `|s - t|^2 / (|t|^2 + eps)` per sequence (its real
    /// tokens) or per sample, averaged: the same scale for every block
    /// whatever the norm of its states (Puzzle's BLD loss).
    Nmse,
    /// Normalized MSE per token vector, averaged over the real tokens (token
    /// states; per sample for other outputs).
    NmseToken,
}

impl LossKind {
    /// The usual loss of a teacher block with per-sample output `output`:
    /// the soft-target cross-entropy for the last block when it produces a
    /// flat vector (logits), the MSE for every other.
    pub fn for_block(output: &[usize], last: bool) -> Self {
        if last && output.len() == 1 {
            LossKind::SoftTargetCrossEntropy
        } else {
            LossKind::Mse
        }
    }

    /// Whether this loss can compare outputs of per-sample shape `output`:
    /// the MSE any, the cross-entropy flat logits, the pooled cosine token
    /// states (`[tokens, hidden]`).
    pub fn accepts(self, output: &[usize]) -> bool {
        match self {
            LossKind::Mse | LossKind::Nmse | LossKind::NmseToken => true,
            LossKind::SoftTargetCrossEntropy => output.len() == 1,
            LossKind::PooledCosine => output.len() == 2,
        }
    }

    /// The name used in configs.
    pub fn name(self) -> &'static str {
        match self {
            LossKind::Mse => "mse",
            LossKind::SoftTargetCrossEntropy => "soft-target-cross-entropy",
            LossKind::PooledCosine => "pooled-cosine",
            LossKind::Nmse => "nmse",
            LossKind::NmseToken => "nmse-token",
        }
    }
}

/// A block's loss: its kind and the settings that go with it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Loss {
    /// Which loss.
    pub kind: LossKind,
    /// Softmax temperature of the soft-target cross-entropy (1 = plain
    /// softmax). Both logits are divided by it and the loss is multiplied by
    /// its square, so that gradient scales stay comparable (Hinton et al.).
    /// Ignored by the MSE.
    pub temperature: f64,
}

impl Loss {
    /// `kind` at temperature 1.
    pub fn new(kind: LossKind) -> Self {
        Self { kind, temperature: 1.0 }
    }

    /// The same loss at `temperature`.
    pub fn with_temperature(self, temperature: f64) -> Self {
        Self { temperature, ..self }
    }

    /// The loss of `student` against `teacher` (same shapes), reduced to one
    /// element. Errors name block 0; the engine puts the number in.
    pub fn compute<B: FusedBackend>(
        &self,
        student: Activation<B>,
        teacher: Activation<B>,
    ) -> Result<Tensor<B, 1>> {
        use pipebd_kernels::loss;
        if student.dims() != teacher.dims() {
            return Err(Error::block(format!(
                "student output {:?} and teacher output {:?} differ",
                student.dims(),
                teacher.dims()
            )));
        }
        match (self.kind, student, teacher) {
            (LossKind::Mse, Activation::Flat(s), Activation::Flat(t)) => Ok(loss::mse(s, t)),
            (LossKind::Mse, Activation::Tokens { hidden: s, mask }, Activation::Tokens { hidden: t, .. }) => {
                Ok(loss::masked_mse(s, t, mask))
            }
            (LossKind::Mse, Activation::Maps(s), Activation::Maps(t)) => Ok(loss::mse(s, t)),
            (
                LossKind::Nmse,
                Activation::Tokens { hidden: s, mask },
                Activation::Tokens { hidden: t, .. },
            ) => Ok(loss::masked_nmse(s, t, mask)),
            (
                LossKind::NmseToken,
                Activation::Tokens { hidden: s, mask },
                Activation::Tokens { hidden: t, .. },
            ) => Ok(loss::masked_nmse_token(s, t, mask)),
            (LossKind::Nmse | LossKind::NmseToken, Activation::Flat(s), Activation::Flat(t)) => {
                Ok(loss::nmse(s, t))
            }
            (LossKind::Nmse | LossKind::NmseToken, Activation::Maps(s), Activation::Maps(t)) => {
                Ok(loss::nmse(s, t))
            }
            (LossKind::SoftTargetCrossEntropy, Activation::Flat(s), Activation::Flat(t)) => {
                let temperature = self.temperature;
                if temperature == 1.0 {
                    return Ok(loss::soft_target_cross_entropy(s, t));
                }
                check_temperature(temperature)?;
                let scale = 1.0 / temperature;
                let ce = loss::soft_target_cross_entropy(s.mul_scalar(scale), t.mul_scalar(scale));
                Ok(ce.mul_scalar(temperature * temperature))
            }
            (
                LossKind::PooledCosine,
                Activation::Tokens { hidden: s, mask },
                Activation::Tokens { hidden: t, .. },
            ) => Ok(loss::pooled_cosine_distance(s, t, mask)),
            (kind, s, t) => {
                Err(Error::block(format!("loss {kind:?} cannot compare {:?} with {:?}", s.dims(), t.dims())))
            }
        }
    }
}
