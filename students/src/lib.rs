//! The student block zoo of pipe-bd.
//!
//! A student block is a small burn module trained to reproduce one teacher
//! block. Blocks are described by a serde-friendly [`StudentBlockConfig`]
//! (one entry of the `[[students]]` list of a run config) and built for a
//! given per-sample input shape with [`StudentBlockConfig::init`], which also
//! computes the block's output shape and forward FLOPs so that the engine can
//! check them against the teacher before training.
//!
//! Available kinds (`kind = "..."` in TOML):
//! - `conv`: a plain conv block of configurable width,
//! - `separable`: a depthwise-separable conv block (MobileNet style),
//! - `bottleneck`: a Tucker-style 1x1 -> 3x3 -> 1x1 conv block,
//! - `head`: a small classifier head (flatten, hidden layer, logits).
//!
//! # Feature flags
//! None.
#![warn(missing_docs)]

mod conv;
mod head;

pub use conv::{BottleneckBlock, ConvBlock, SeparableBlock};
pub use head::HeadBlock;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

/// Everything that can go wrong while building a student block.
#[derive(Debug, thiserror::Error)]
pub enum StudentError {
    /// The block's configuration cannot be applied to its input.
    #[error("student block {block} ({kind}): {message}")]
    Invalid {
        /// One-based block number.
        block: usize,
        /// The block kind from the config.
        kind: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// Configuration of one student block, as written in `[[students]]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum StudentBlockConfig {
    /// `conv 3x3 (c_in -> width) -> ReLU -> conv 1x1 (width -> out) -> ReLU -> [max-pool 2]`.
    Conv {
        /// Channels of the hidden 3x3 convolution.
        width: usize,
        /// Output channels (must equal the teacher block's).
        out_channels: usize,
        /// Halve height and width with a 2x2 max-pool (default true).
        #[serde(default = "default_true")]
        pool: bool,
    },
    /// `depthwise 3x3 -> [ReLU] -> pointwise 1x1 (c_in -> out) -> ReLU -> [max-pool 2]`.
    Separable {
        /// Output channels (must equal the teacher block's).
        out_channels: usize,
        /// Channel multiplier of the depthwise convolution (default 1).
        #[serde(default = "default_one")]
        depth_multiplier: usize,
        /// ReLU between the depthwise and the pointwise convolution (default false:
        /// the pair is then a factorisation of one 3x3 convolution).
        #[serde(default)]
        inner_relu: bool,
        /// Halve height and width with a 2x2 max-pool (default true).
        #[serde(default = "default_true")]
        pool: bool,
    },
    /// A Tucker-style bottleneck: `1x1 (c_in -> rank) -> 3x3 (rank -> rank) ->
    /// 1x1 (rank -> out) -> ReLU -> [max-pool 2]`, with optional ReLUs inside.
    Bottleneck {
        /// Channels of the inner 3x3 convolution.
        rank: usize,
        /// Output channels (must equal the teacher block's).
        out_channels: usize,
        /// ReLU after each inner convolution (default false: the three
        /// convolutions then factorise one 3x3 convolution).
        #[serde(default)]
        inner_relu: bool,
        /// Halve height and width with a 2x2 max-pool (default true).
        #[serde(default = "default_true")]
        pool: bool,
    },
    /// `flatten -> linear (in -> hidden) -> ReLU -> linear (hidden -> classes)`.
    Head {
        /// Width of the hidden layer.
        hidden: usize,
        /// Number of output logits (must equal the teacher's).
        classes: usize,
    },
}

fn default_true() -> bool {
    true
}
fn default_one() -> usize {
    1
}

/// A built student block: its module and what it declares about itself.
#[derive(Debug)]
pub struct BuiltStudent<B: Backend> {
    /// The module, randomly initialised.
    pub module: StudentBlock<B>,
    /// Per-sample output shape for the given input shape.
    pub output_shape: Vec<usize>,
    /// Forward FLOPs per sample (two per multiply-accumulate).
    pub flops: u64,
}

/// One student block of any zoo kind.
#[derive(Module, Debug)]
pub enum StudentBlock<B: Backend> {
    /// See [`StudentBlockConfig::Conv`].
    Conv(ConvBlock<B>),
    /// See [`StudentBlockConfig::Separable`].
    Separable(SeparableBlock<B>),
    /// See [`StudentBlockConfig::Bottleneck`].
    Bottleneck(BottleneckBlock<B>),
    /// See [`StudentBlockConfig::Head`].
    Head(HeadBlock<B>),
}

/// The output of a student block: feature maps or logits.
#[derive(Debug, Clone)]
pub enum StudentOutput<B: Backend> {
    /// `[batch, channels, height, width]`.
    Maps(Tensor<B, 4>),
    /// `[batch, classes]`.
    Logits(Tensor<B, 2>),
}

impl<B: Backend> StudentBlock<B> {
    /// Runs the block on a batch of feature maps.
    pub fn forward(&self, x: Tensor<B, 4>) -> StudentOutput<B> {
        match self {
            Self::Conv(block) => StudentOutput::Maps(block.forward(x)),
            Self::Separable(block) => StudentOutput::Maps(block.forward(x)),
            Self::Bottleneck(block) => StudentOutput::Maps(block.forward(x)),
            Self::Head(block) => StudentOutput::Logits(block.forward(x)),
        }
    }
}

impl StudentBlockConfig {
    /// The kind name as written in TOML.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Conv { .. } => "conv",
            Self::Separable { .. } => "separable",
            Self::Bottleneck { .. } => "bottleneck",
            Self::Head { .. } => "head",
        }
    }

    /// Builds block number `block` (one-based, used in errors) for inputs of
    /// per-sample shape `input_shape`.
    pub fn init<B: Backend>(
        &self,
        block: usize,
        input_shape: &[usize],
        device: &B::Device,
    ) -> Result<BuiltStudent<B>, StudentError> {
        let invalid = |message: String| StudentError::Invalid { block, kind: self.kind(), message };
        let positive = |name: &str, value: usize| {
            if value == 0 {
                Err(invalid(format!("`{name}` must be at least 1")))
            } else {
                Ok(())
            }
        };
        match *self {
            Self::Conv { width, out_channels, pool } => {
                positive("width", width)?;
                positive("out_channels", out_channels)?;
                let [c, h, w] = image_shape(input_shape).ok_or_else(|| {
                    invalid(format!("expects image-shaped input [channels, height, width], got {input_shape:?}"))
                })?;
                let (module, flops) = ConvBlock::new(c, width, out_channels, h, w, pool, device);
                let (oh, ow) = pooled(h, w, pool);
                Ok(BuiltStudent { module: StudentBlock::Conv(module), output_shape: vec![out_channels, oh, ow], flops })
            }
            Self::Separable { out_channels, depth_multiplier, inner_relu, pool } => {
                positive("out_channels", out_channels)?;
                positive("depth_multiplier", depth_multiplier)?;
                let [c, h, w] = image_shape(input_shape).ok_or_else(|| {
                    invalid(format!("expects image-shaped input [channels, height, width], got {input_shape:?}"))
                })?;
                let (module, flops) =
                    SeparableBlock::new(c, depth_multiplier, out_channels, h, w, inner_relu, pool, device);
                let (oh, ow) = pooled(h, w, pool);
                Ok(BuiltStudent {
                    module: StudentBlock::Separable(module),
                    output_shape: vec![out_channels, oh, ow],
                    flops,
                })
            }
            Self::Bottleneck { rank, out_channels, inner_relu, pool } => {
                positive("rank", rank)?;
                positive("out_channels", out_channels)?;
                let [c, h, w] = image_shape(input_shape).ok_or_else(|| {
                    invalid(format!("expects image-shaped input [channels, height, width], got {input_shape:?}"))
                })?;
                let (module, flops) = BottleneckBlock::new(c, rank, out_channels, h, w, inner_relu, pool, device);
                let (oh, ow) = pooled(h, w, pool);
                Ok(BuiltStudent {
                    module: StudentBlock::Bottleneck(module),
                    output_shape: vec![out_channels, oh, ow],
                    flops,
                })
            }
            Self::Head { hidden, classes } => {
                positive("hidden", hidden)?;
                positive("classes", classes)?;
                let [c, h, w] = image_shape(input_shape).ok_or_else(|| {
                    invalid(format!("expects image-shaped input [channels, height, width], got {input_shape:?}"))
                })?;
                let features = c * h * w;
                let (module, flops) = HeadBlock::new(features, hidden, classes, device);
                Ok(BuiltStudent { module: StudentBlock::Head(module), output_shape: vec![classes], flops })
            }
        }
    }
}

fn image_shape(shape: &[usize]) -> Option<[usize; 3]> {
    match shape {
        [c, h, w] => Some([*c, *h, *w]),
        _ => None,
    }
}

fn pooled(h: usize, w: usize, pool: bool) -> (usize, usize) {
    if pool {
        (h / 2, w / 2)
    } else {
        (h, w)
    }
}
