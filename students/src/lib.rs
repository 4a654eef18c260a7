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
//! - `inverted`: MobileNetV2's inverted residual (1x1 expand, depthwise 3x3
//!   or 5x5, linear 1x1 project),
//! - `head`: a small classifier head (flatten, hidden layer, logits),
//! - `encoder`: a post-LN transformer encoder layer of configurable width
//!   (heads, head width, feed-forward width) for `[tokens, hidden]` inputs;
//!   one such block may replace several teacher layers.
//!
//! # Feature flags
//! None.
#![warn(missing_docs)]

mod conv;
mod head;

pub use conv::{BottleneckBlock, ConvBlock, InvertedResidualBlock, SeparableBlock};

pub use head::HeadBlock;

use burn::module::Module;
use pipebd_core::{Activation, Block, Error as CoreError, FusedBackend};
use pipebd_kernels::encoder::{EncoderLayer, EncoderLayerConfig};
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
    /// `conv 3x3 (c_in -> width) -> ReLU -> conv 1x1 (width -> out) -> ReLU [-> max-pool 2]`.
    Conv {
        /// Channels of the hidden 3x3 convolution.
        width: usize,
        /// Output channels (must equal the teacher block's).
        out_channels: usize,
        /// How height and width are halved: `pool` (2x2 max-pool at the end,
        /// default), `stride` (the 3x3 convolution has stride 2: about 4x
        /// cheaper) or `none` (keep the resolution).
        #[serde(default)]
        downsample: Downsample,
    },
    /// `depthwise 3x3 -> [ReLU] -> pointwise 1x1 (c_in -> out) -> ReLU [-> max-pool 2]`.
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
        /// How height and width are halved: `pool` (2x2 max-pool at the end,
        /// default), `stride` (the 3x3 convolution has stride 2: about 4x
        /// cheaper) or `none` (keep the resolution).
        #[serde(default)]
        downsample: Downsample,
    },
    /// A Tucker-style bottleneck: `1x1 (c_in -> rank) -> 3x3 (rank -> rank) ->
    /// 1x1 (rank -> out) -> ReLU [-> max-pool 2]`, with optional ReLUs inside.
    Bottleneck {
        /// Channels of the inner 3x3 convolution.
        rank: usize,
        /// Output channels (must equal the teacher block's).
        out_channels: usize,
        /// ReLU after each inner convolution (default false: the three
        /// convolutions then factorise one 3x3 convolution).
        #[serde(default)]
        inner_relu: bool,
        /// How height and width are halved: `pool` (2x2 max-pool at the end,
        /// default), `stride` (the 3x3 convolution has stride 2: about 4x
        /// cheaper) or `none` (keep the resolution).
        #[serde(default)]
        downsample: Downsample,
    },
    /// MobileNetV2's inverted residual: `1x1 (c_in -> c_in * expansion) ->
    /// ReLU6 -> depthwise k x k -> ReLU6 -> 1x1 (-> out)` with no activation
    /// after the projection [-> max-pool 2], plus the input when no
    /// downsampling and `c_in == out`.
    Inverted {
        /// Width of the hidden layer as a multiple of the input channels
        /// (MobileNetV2: 6; 3 is cheaper).
        expansion: usize,
        /// Side of the depthwise kernel: 3 (default) or 5.
        #[serde(default = "default_kernel")]
        kernel: usize,
        /// Output channels (must equal the teacher block's).
        out_channels: usize,
        /// How height and width are halved: `pool` (2x2 max-pool at the end,
        /// default), `stride` (the depthwise convolution has stride 2) or
        /// `none` (keep the resolution).
        #[serde(default)]
        downsample: Downsample,
    },
    /// `flatten -> linear (in -> hidden) -> ReLU -> linear (hidden -> classes)`.
    Head {
        /// Width of the hidden layer.
        hidden: usize,
        /// Number of output logits (must equal the teacher's).
        classes: usize,
    },
    /// A post-LN transformer encoder layer: multi-head attention over the
    /// real tokens, then `GELU` feed-forward, each with a residual and a
    /// layer norm. Input and output are `[tokens, hidden]`.
    Encoder {
        /// Attention heads (default 12, as MiniLM).
        #[serde(default = "default_heads")]
        heads: usize,
        /// Width of each head (default 32, as MiniLM: fewer heads then mean
        /// a narrower, cheaper attention).
        #[serde(default = "default_head_dim")]
        head_dim: usize,
        /// Width of the feed-forward layer (MiniLM's is 1536).
        ffn: usize,
        /// Initial weights: `random`, or `teacher` (default): the first
        /// teacher layer this block replaces, pruned to the student's size by
        /// keeping its most important heads and feed-forward neurons.
        #[serde(default)]
        init: EncoderInit,
    },
}

/// How an `encoder` student block gets its initial weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EncoderInit {
    /// Pruned from the teacher layer it replaces (the first, if several).
    #[default]
    Teacher,
    /// burn's default random initialisation.
    Random,
}

fn default_heads() -> usize {
    12
}
fn default_head_dim() -> usize {
    32
}

/// How a conv student halves its input's height and width.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Downsample {
    /// A 2x2 max-pool after the block, like the teacher's stages.
    #[default]
    Pool,
    /// Stride 2 in the block's 3x3 convolution (output `floor(h/2) x floor(w/2)`).
    Stride,
    /// Keep the resolution.
    None,
}

impl Downsample {
    /// Output height and width for an `h x w` input.
    pub fn output(self, h: usize, w: usize) -> (usize, usize) {
        match self {
            Downsample::Pool | Downsample::Stride => (h / 2, w / 2),
            Downsample::None => (h, w),
        }
    }
}

fn default_one() -> usize {
    1
}

fn default_kernel() -> usize {
    3
}

/// A built student block: its module and what it declares about itself.
#[derive(Debug)]
pub struct BuiltStudent<B: FusedBackend> {
    /// The module, randomly initialised.
    pub module: StudentBlock<B>,
    /// Per-sample output shape for the given input shape.
    pub output_shape: Vec<usize>,
    /// Forward FLOPs per sample (two per multiply-accumulate).
    pub flops: u64,
}

/// One student block of any zoo kind.
// Built once per run and moved rarely: boxing a variant would buy nothing
// and burn's `Module` derive wants the variants by value.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum StudentBlock<B: FusedBackend> {
    /// See [`StudentBlockConfig::Conv`].
    Conv(ConvBlock<B>),
    /// See [`StudentBlockConfig::Separable`].
    Separable(SeparableBlock<B>),
    /// See [`StudentBlockConfig::Bottleneck`].
    Bottleneck(BottleneckBlock<B>),
    /// See [`StudentBlockConfig::Inverted`].
    Inverted(InvertedResidualBlock<B>),
    /// See [`StudentBlockConfig::Head`].
    Head(HeadBlock<B>),
    /// See [`StudentBlockConfig::Encoder`].
    Encoder(EncoderLayer<B>),
}

impl<B: FusedBackend> Block<B> for StudentBlock<B> {
    /// Conv, separable, bottleneck and inverted blocks map feature maps to feature
    /// maps, the head maps them to logits, the encoder maps token states to
    /// token states (the mask travels on). Any other input is an error.
    fn forward(&self, input: Activation<B>) -> Result<Activation<B>, CoreError> {
        Ok(match (self, input) {
            (Self::Conv(block), Activation::Maps(x)) => Activation::Maps(block.forward(x)),
            (Self::Separable(block), Activation::Maps(x)) => Activation::Maps(block.forward(x)),
            (Self::Bottleneck(block), Activation::Maps(x)) => Activation::Maps(block.forward(x)),
            (Self::Inverted(block), Activation::Maps(x)) => Activation::Maps(block.forward(x)),
            (Self::Head(block), Activation::Maps(x)) => Activation::Flat(block.forward(x)),
            (Self::Encoder(layer), Activation::Tokens { hidden, mask }) => {
                Activation::Tokens { hidden: layer.forward(hidden, mask.clone()), mask }
            }
            (block, input) => {
                return Err(CoreError::block(format!(
                    "a `{}` student block cannot take input of shape {:?}",
                    block.kind(),
                    input.dims()
                )))
            }
        })
    }
}

impl<B: FusedBackend> StudentBlock<B> {
    /// The kind name as written in TOML.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Conv(_) => "conv",
            Self::Separable(_) => "separable",
            Self::Bottleneck(_) => "bottleneck",
            Self::Inverted(_) => "inverted",
            Self::Head(_) => "head",
            Self::Encoder(_) => "encoder",
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
            Self::Inverted { .. } => "inverted",
            Self::Head { .. } => "head",
            Self::Encoder { .. } => "encoder",
        }
    }

    /// Builds block number `block` (one-based, used in errors) for inputs of
    /// per-sample shape `input_shape`.
    pub fn init<B: FusedBackend>(
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
        let image = || {
            image_shape(input_shape).ok_or_else(|| {
                invalid(format!("expects image-shaped input [channels, height, width], got {input_shape:?}"))
            })
        };
        match *self {
            Self::Conv { width, out_channels, downsample } => {
                positive("width", width)?;
                positive("out_channels", out_channels)?;
                let [c, h, w] = image()?;
                let (module, flops) = ConvBlock::new(c, width, out_channels, h, w, downsample, device);
                let (oh, ow) = downsample.output(h, w);
                Ok(BuiltStudent {
                    module: StudentBlock::Conv(module),
                    output_shape: vec![out_channels, oh, ow],
                    flops,
                })
            }
            Self::Separable { out_channels, depth_multiplier, inner_relu, downsample } => {
                positive("out_channels", out_channels)?;
                positive("depth_multiplier", depth_multiplier)?;
                let [c, h, w] = image()?;
                let (module, flops) = SeparableBlock::new(
                    c,
                    depth_multiplier,
                    out_channels,
                    h,
                    w,
                    inner_relu,
                    downsample,
                    device,
                );
                let (oh, ow) = downsample.output(h, w);
                Ok(BuiltStudent {
                    module: StudentBlock::Separable(module),
                    output_shape: vec![out_channels, oh, ow],
                    flops,
                })
            }
            Self::Bottleneck { rank, out_channels, inner_relu, downsample } => {
                positive("rank", rank)?;
                positive("out_channels", out_channels)?;
                let [c, h, w] = image()?;
                let (module, flops) =
                    BottleneckBlock::new(c, rank, out_channels, h, w, inner_relu, downsample, device);
                let (oh, ow) = downsample.output(h, w);
                Ok(BuiltStudent {
                    module: StudentBlock::Bottleneck(module),
                    output_shape: vec![out_channels, oh, ow],
                    flops,
                })
            }
            Self::Inverted { expansion, kernel, out_channels, downsample } => {
                positive("expansion", expansion)?;
                positive("out_channels", out_channels)?;
                if kernel != 3 && kernel != 5 {
                    return Err(invalid(format!("`kernel` must be 3 or 5, got {kernel}")));
                }
                let [c, h, w] = image()?;
                let (module, flops) =
                    InvertedResidualBlock::new(c, expansion, kernel, out_channels, h, w, downsample, device);
                let (oh, ow) = downsample.output(h, w);
                Ok(BuiltStudent {
                    module: StudentBlock::Inverted(module),
                    output_shape: vec![out_channels, oh, ow],
                    flops,
                })
            }
            Self::Head { hidden, classes } => {
                positive("hidden", hidden)?;
                positive("classes", classes)?;
                let [c, h, w] = image()?;
                let features = c * h * w;
                let (module, flops) = HeadBlock::new(features, hidden, classes, device);
                Ok(BuiltStudent { module: StudentBlock::Head(module), output_shape: vec![classes], flops })
            }
            Self::Encoder { heads, head_dim, ffn, .. } => {
                positive("heads", heads)?;
                positive("head_dim", head_dim)?;
                positive("ffn", ffn)?;
                let [tokens, hidden] = match input_shape {
                    [t, h] => [*t, *h],
                    _ => {
                        return Err(invalid(format!(
                            "expects token states [tokens, hidden], got {input_shape:?}"
                        )))
                    }
                };
                let config = EncoderLayerConfig::new(hidden, heads, head_dim, ffn);
                Ok(BuiltStudent {
                    module: StudentBlock::Encoder(config.init(device)),
                    output_shape: vec![tokens, hidden],
                    flops: config.flops(tokens),
                })
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

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::Tensor;

    fn forward_shape(config: &StudentBlockConfig, input: [usize; 3]) -> (Vec<usize>, Vec<usize>) {
        let device = Default::default();
        let built = config.init::<Flex>(1, &input, &device).unwrap();
        let x = Tensor::<Flex, 4>::zeros([2, input[0], input[1], input[2]], &device);
        let actual = Block::forward(&built.module, Activation::Maps(x)).unwrap().dims()[1..].to_vec();
        (built.output_shape, actual)
    }

    #[test]
    fn declared_output_shapes_match_the_forward_pass_for_every_downsample_mode() {
        for downsample in [Downsample::Pool, Downsample::Stride, Downsample::None] {
            for (c, hw) in [(1, 28), (32, 14), (64, 7)] {
                let configs = [
                    StudentBlockConfig::Conv { width: 4, out_channels: 8, downsample },
                    StudentBlockConfig::Separable {
                        out_channels: 8,
                        depth_multiplier: 1,
                        inner_relu: true,
                        downsample,
                    },
                    StudentBlockConfig::Bottleneck {
                        rank: 4,
                        out_channels: 8,
                        inner_relu: false,
                        downsample,
                    },
                    StudentBlockConfig::Inverted { expansion: 3, kernel: 3, out_channels: 8, downsample },
                    StudentBlockConfig::Inverted { expansion: 6, kernel: 5, out_channels: 8, downsample },
                    StudentBlockConfig::Inverted { expansion: 2, kernel: 5, out_channels: c, downsample },
                ];
                for config in &configs {
                    let (declared, actual) = forward_shape(config, [c, hw, hw]);
                    assert_eq!(declared, actual, "{config:?} on {c}x{hw}x{hw}");
                }
            }
        }
        let (declared, actual) =
            forward_shape(&StudentBlockConfig::Head { hidden: 16, classes: 10 }, [128, 3, 3]);
        assert_eq!((declared, actual), (vec![10], vec![10]));
    }

    #[test]
    fn encoder_blocks_keep_the_token_shape_and_refuse_images() {
        let device = Default::default();
        let config =
            StudentBlockConfig::Encoder { heads: 2, head_dim: 4, ffn: 16, init: EncoderInit::Random };
        let built = config.init::<Flex>(1, &[5, 12], &device).unwrap();
        assert_eq!(built.output_shape, vec![5, 12]);
        let input = Activation::Tokens {
            hidden: Tensor::zeros([3, 5, 12], &device),
            mask: Tensor::ones([3, 5], &device),
        };
        match Block::forward(&built.module, input) {
            Ok(Activation::Tokens { hidden, .. }) => assert_eq!(hidden.dims(), [3, 5, 12]),
            other => panic!("unexpected output {other:?}"),
        }
        let refused = Block::forward(&built.module, Activation::Maps(Tensor::zeros([1, 1, 5, 12], &device)));
        assert!(refused.unwrap_err().to_string().contains("`encoder` student block"));
        let err = config.init::<Flex>(2, &[1, 28, 28], &device).unwrap_err();
        assert!(err.to_string().contains("token states"), "{err}");
    }

    #[test]
    fn an_inverted_block_adds_its_input_only_when_the_shapes_allow() {
        let device = Default::default();
        let same = StudentBlockConfig::Inverted { expansion: 2, kernel: 3, out_channels: 4, downsample: Downsample::None };
        let built = same.init::<Flex>(1, &[4, 6, 6], &device).unwrap();
        // With every weight zero the block is the identity when residual, zero otherwise.
        let zeroed = built.module.map(&mut Zero);
        let x = Tensor::<Flex, 4>::ones([1, 4, 6, 6], &device);
        let out = Block::forward(&zeroed, Activation::Maps(x.clone())).unwrap();
        assert_eq!(out.dims(), [1, 4, 6, 6]);
        let Activation::Maps(out) = out else { panic!("feature maps expected") };
        assert_eq!(out.sum().into_scalar(), 144.0, "the input comes through");
        let pooled = StudentBlockConfig::Inverted { expansion: 2, kernel: 3, out_channels: 4, downsample: Downsample::Pool };
        let zeroed = pooled.init::<Flex>(1, &[4, 6, 6], &device).unwrap().module.map(&mut Zero);
        let Activation::Maps(out) = Block::forward(&zeroed, Activation::Maps(x)).unwrap() else { panic!() };
        assert_eq!(out.sum().into_scalar(), 0.0, "no residual across a downsampling");
        let bad = StudentBlockConfig::Inverted { expansion: 2, kernel: 4, out_channels: 4, downsample: Downsample::Pool };
        let err = bad.init::<Flex>(2, &[4, 6, 6], &device).unwrap_err();
        assert_eq!(err.to_string(), "student block 2 (inverted): `kernel` must be 3 or 5, got 4");
    }

    /// Sets every parameter to zero.
    struct Zero;

    impl<B: burn::tensor::backend::Backend> burn::module::ModuleMapper<B> for Zero {
        fn map_float<const D: usize>(
            &mut self,
            param: burn::module::Param<Tensor<B, D>>,
        ) -> burn::module::Param<Tensor<B, D>> {
            param.map(|t| t.zeros_like())
        }
    }

    #[test]
    fn zero_sizes_are_refused_naming_the_block_and_field() {
        let config = StudentBlockConfig::Bottleneck {
            rank: 0,
            out_channels: 8,
            inner_relu: false,
            downsample: Downsample::Pool,
        };
        let err = config.init::<Flex>(3, &[32, 14, 14], &Default::default()).unwrap_err();
        assert_eq!(err.to_string(), "student block 3 (bottleneck): `rank` must be at least 1");
    }
}
