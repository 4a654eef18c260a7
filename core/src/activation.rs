//! [`Activation`]: what flows between blocks.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use pipebd_kernels::DistillBackend;

use crate::error::{Error, Result};

/// A batch of activations flowing between blocks. The first dimension is
/// always the batch.
#[derive(Debug, Clone)]
pub enum Activation<B: Backend> {
    /// `[batch, features]`, for example logits.
    Flat(Tensor<B, 2>),
    /// Token states `[batch, tokens, features]` with their `[batch, tokens]`
    /// mask (1 for real tokens, 0 for padding), which travels with them.
    Tokens {
        /// The states.
        hidden: Tensor<B, 3>,
        /// 1 for real tokens, 0 for padding.
        mask: Tensor<B, 2>,
    },
    /// `[batch, channels, height, width]`.
    Maps(Tensor<B, 4>),
}

impl<B: Backend> Activation<B> {
    /// Full shape, batch first.
    pub fn dims(&self) -> Vec<usize> {
        match self {
            Self::Flat(t) => t.dims().to_vec(),
            Self::Tokens { hidden, .. } => hidden.dims().to_vec(),
            Self::Maps(t) => t.dims().to_vec(),
        }
    }

    /// Number of samples in the batch.
    pub fn batch_size(&self) -> usize {
        self.dims()[0]
    }

    /// The device the activation is on.
    pub fn device(&self) -> B::Device {
        match self {
            Self::Flat(t) => t.device(),
            Self::Tokens { hidden, .. } => hidden.device(),
            Self::Maps(t) => t.device(),
        }
    }

    /// The feature maps, or an error naming `block` if this is another rank.
    pub fn into_maps(self, block: usize) -> Result<Tensor<B, 4>> {
        match self {
            Self::Maps(t) => Ok(t),
            other => Err(Error::Block {
                block,
                message: format!("expected feature maps [batch, c, h, w], got shape {:?}", other.dims()),
            }),
        }
    }

    /// The token states and their mask, or an error naming `block` if this
    /// is another kind.
    pub fn into_tokens(self, block: usize) -> Result<(Tensor<B, 3>, Tensor<B, 2>)> {
        match self {
            Self::Tokens { hidden, mask } => Ok((hidden, mask)),
            other => Err(Error::Block {
                block,
                message: format!(
                    "expected token states [batch, tokens, hidden], got shape {:?}",
                    other.dims()
                ),
            }),
        }
    }

    /// Moves the activation to `device`.
    pub fn to_device(self, device: &B::Device) -> Self {
        match self {
            Self::Flat(t) => Self::Flat(t.to_device(device)),
            Self::Tokens { hidden, mask } => {
                Self::Tokens { hidden: hidden.to_device(device), mask: mask.to_device(device) }
            }
            Self::Maps(t) => Self::Maps(t.to_device(device)),
        }
    }

    /// Samples `start..start + len` of the batch.
    pub fn narrow_batch(self, start: usize, len: usize) -> Self {
        match self {
            Self::Flat(t) => Self::Flat(t.narrow(0, start, len)),
            Self::Tokens { hidden, mask } => {
                Self::Tokens { hidden: hidden.narrow(0, start, len), mask: mask.narrow(0, start, len) }
            }
            Self::Maps(t) => Self::Maps(t.narrow(0, start, len)),
        }
    }

    /// Concatenates batches of the same kind along the batch dimension.
    /// Returns `None` for an empty list or mixed kinds.
    pub fn cat_batch(parts: Vec<Self>) -> Option<Self> {
        let first = parts.first()?;
        Some(match first {
            Self::Flat(_) => Self::Flat(Tensor::cat(
                parts
                    .into_iter()
                    .map(|p| match p {
                        Self::Flat(t) => Some(t),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()?,
                0,
            )),
            Self::Tokens { .. } => {
                let (hidden, mask): (Vec<_>, Vec<_>) = parts
                    .into_iter()
                    .map(|p| match p {
                        Self::Tokens { hidden, mask } => Some((hidden, mask)),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()?
                    .into_iter()
                    .unzip();
                Self::Tokens { hidden: Tensor::cat(hidden, 0), mask: Tensor::cat(mask, 0) }
            }
            Self::Maps(_) => Self::Maps(Tensor::cat(
                parts
                    .into_iter()
                    .map(|p| match p {
                        Self::Maps(t) => Some(t),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()?,
                0,
            )),
        })
    }
}

impl<B: Backend> Activation<B> {
    /// The gated sum `sum_i gates[i] * parts[i]` of activations of one
    /// shape (a single-path supernet's mixed output); token masks are taken
    /// from the first part. Differentiable in `gates` and in the parts.
    pub fn gated_sum(parts: Vec<Self>, gates: Tensor<B, 1>) -> Result<Self> {
        let count = parts.len();
        if count == 0 || gates.dims()[0] != count {
            return Err(Error::block(format!("cannot gate {count} outputs with {} gates", gates.dims()[0])));
        }
        let mut total: Option<Self> = None;
        for (i, part) in parts.into_iter().enumerate() {
            let gate = gates.clone().slice(i..i + 1);
            let scaled = match part {
                Self::Flat(t) => Self::Flat(t.mul(gate.reshape([1, 1]))),
                Self::Tokens { hidden, mask } => {
                    Self::Tokens { hidden: hidden.mul(gate.reshape([1, 1, 1])), mask }
                }
                Self::Maps(t) => Self::Maps(t.mul(gate.reshape([1, 1, 1, 1]))),
            };
            total = Some(match (total, scaled) {
                (None, scaled) => scaled,
                (Some(Self::Flat(a)), Self::Flat(b)) => Self::Flat(a.add(b)),
                (Some(Self::Tokens { hidden: a, mask }), Self::Tokens { hidden: b, .. }) => {
                    Self::Tokens { hidden: a.add(b), mask }
                }
                (Some(Self::Maps(a)), Self::Maps(b)) => Self::Maps(a.add(b)),
                (Some(first), other) => {
                    return Err(Error::block(format!(
                        "cannot gate outputs of different kinds: {:?} and {:?}",
                        first.dims(),
                        other.dims()
                    )))
                }
            });
        }
        total.ok_or_else(|| Error::block("no outputs to gate"))
    }
}

impl<B: DistillBackend> Activation<B> {
    /// Lifts an activation computed on the inner backend (for example by the
    /// frozen teacher) into the autodiff backend as a constant: no gradient
    /// flows back through it.
    pub fn from_inner(inner: Activation<B::InnerBackend>) -> Self {
        match inner {
            Activation::Flat(t) => Self::Flat(Tensor::from_inner(t)),
            Activation::Tokens { hidden, mask } => {
                Self::Tokens { hidden: Tensor::from_inner(hidden), mask: Tensor::from_inner(mask) }
            }
            Activation::Maps(t) => Self::Maps(Tensor::from_inner(t)),
        }
    }
}

impl<B: Backend> Activation<B> {
    /// A batch of `batch` zero samples of per-sample shape `shape`: feature
    /// maps for `[c, h, w]`, token states (every token real) for
    /// `[tokens, features]`, a flat batch for `[features]`. Used to infer a
    /// block's output shape from its module ([`crate::BlockSpec::infer`]).
    pub fn zeros(batch: usize, shape: &[usize], device: &B::Device) -> Result<Self> {
        Ok(match *shape {
            [features] => Self::Flat(Tensor::zeros([batch, features], device)),
            [tokens, features] => Self::Tokens {
                hidden: Tensor::zeros([batch, tokens, features], device),
                mask: Tensor::ones([batch, tokens], device),
            },
            [c, h, w] => Self::Maps(Tensor::zeros([batch, c, h, w], device)),
            _ => {
                return Err(Error::block(format!(
                    "per-sample shape {shape:?}: expected [features], [tokens, features] or [channels, height, width]"
                )))
            }
        })
    }
}

impl<B: pipebd_kernels::FusedBackend> Activation<B> {
    /// Token states run through `layers` in turn, the mask riding along
    /// (a stack of transformer layers as one block); an error naming
    /// `block` if this is another kind.
    pub fn through_token_layers<L: pipebd_kernels::TokenLayer<B>>(
        self,
        layers: &[L],
        block: usize,
    ) -> Result<Self> {
        let (mut hidden, mask) = self.into_tokens(block)?;
        for layer in layers {
            hidden = layer.forward_tokens(hidden, mask.clone());
        }
        Ok(Activation::Tokens { hidden, mask })
    }
}
