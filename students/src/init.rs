//! Building student blocks: [`StudentBlockConfig::init`] turns one
//! `[[students]]` entry into a [`BuiltStudent`] (the module with its output
//! shape and forward FLOPs for a given input shape), building each candidate
//! of a candidate set in turn; [`StudentError`] says what went wrong.

use pipebd_core::FusedBackend;
use pipebd_kernels::encoder::EncoderLayerConfig;

use crate::config::{Downsample, StudentBlockConfig};
use crate::conv::{BottleneckBlock, ConvBlock, InvertedResidualBlock, SeparableBlock};
use crate::head::HeadBlock;
use crate::kinds::{Candidate, CandidateSet, StudentBlock};
use crate::skip::SkipBlock;

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

/// A built student block: its module and what it declares about itself.
#[derive(Debug)]
pub struct BuiltStudent<B: FusedBackend> {
    /// The module, randomly initialised.
    pub module: StudentBlock<B>,
    /// Per-sample output shape for the given input shape.
    pub output_shape: Vec<usize>,
    /// Forward FLOPs per sample (two per multiply-accumulate); for a
    /// candidate set, the sum of its candidates' (what training it costs).
    pub flops: u64,
}

impl StudentBlockConfig {
    /// Builds block number `block` (one-based, used in errors) for inputs of
    /// per-sample shape `input_shape`.
    pub fn init<B: FusedBackend>(
        &self,
        block: usize,
        input_shape: &[usize],
        device: &B::Device,
    ) -> Result<BuiltStudent<B>, StudentError> {
        let invalid = |message: String| StudentError::Invalid { block, kind: self.kind(), message };
        self.check_sizes().map_err(invalid)?;
        match *self {
            Self::Encoder { heads, head_dim, ffn, .. } => {
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
            Self::Decoder { .. } => {
                let [tokens, hidden] = match input_shape {
                    [t, h] => [*t, *h],
                    _ => {
                        return Err(invalid(format!(
                            "expects token states [tokens, hidden], got {input_shape:?}"
                        )))
                    }
                };
                let config = self.decoder_config(hidden).unwrap_or_else(|| unreachable!("a decoder block"));
                Ok(BuiltStudent {
                    module: StudentBlock::Decoder(config.init(device)),
                    output_shape: vec![tokens, hidden],
                    flops: config.flops(tokens),
                })
            }
            Self::Skip => Ok(BuiltStudent {
                module: StudentBlock::Skip(SkipBlock::new()),
                output_shape: input_shape.to_vec(),
                flops: 0,
            }),
            Self::Candidates { ref candidates } => {
                init_candidates(candidates, block, input_shape, device).map_err(invalid)
            }
            _ => {
                let image = image_shape(input_shape).ok_or_else(|| {
                    invalid(format!(
                        "expects image-shaped input [channels, height, width], got {input_shape:?}"
                    ))
                })?;
                Ok(self.init_image(image, device))
            }
        }
    }

    /// Builds a block of a kind that takes image-shaped input `[c, h, w]`
    /// (the sizes already checked).
    fn init_image<B: FusedBackend>(&self, [c, h, w]: [usize; 3], device: &B::Device) -> BuiltStudent<B> {
        let maps = |module, flops, out_channels, downsample: Downsample| {
            let (oh, ow) = downsample.output(h, w);
            BuiltStudent { module, output_shape: vec![out_channels, oh, ow], flops }
        };
        match *self {
            Self::Conv { width, out_channels, downsample } => {
                let (module, flops) = ConvBlock::new(c, width, out_channels, h, w, downsample, device);
                maps(StudentBlock::Conv(module), flops, out_channels, downsample)
            }
            Self::Separable { out_channels, depth_multiplier, inner_relu, downsample } => {
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
                maps(StudentBlock::Separable(module), flops, out_channels, downsample)
            }
            Self::Bottleneck { rank, out_channels, inner_relu, downsample } => {
                let (module, flops) =
                    BottleneckBlock::new(c, rank, out_channels, h, w, inner_relu, downsample, device);
                maps(StudentBlock::Bottleneck(module), flops, out_channels, downsample)
            }
            Self::Inverted { expansion, kernel, out_channels, downsample } => {
                let (module, flops) =
                    InvertedResidualBlock::new(c, expansion, kernel, out_channels, h, w, downsample, device);
                maps(StudentBlock::Inverted(module), flops, out_channels, downsample)
            }
            Self::Head { hidden, classes } => {
                let (module, flops) = HeadBlock::new(c * h * w, hidden, classes, device);
                BuiltStudent { module: StudentBlock::Head(module), output_shape: vec![classes], flops }
            }
            Self::Encoder { .. } | Self::Decoder { .. } | Self::Skip | Self::Candidates { .. } => {
                unreachable!("`init` builds {} blocks itself", self.kind())
            }
        }
    }
}

/// Builds a candidate set for block number `block`: every candidate must
/// build, none may be a set itself, and all must give the same output shape.
fn init_candidates<B: FusedBackend>(
    candidates: &[StudentBlockConfig],
    block: usize,
    input_shape: &[usize],
    device: &B::Device,
) -> Result<BuiltStudent<B>, String> {
    if candidates.is_empty() {
        return Err("`candidates` must list at least one student block".into());
    }
    let mut modules = Vec::with_capacity(candidates.len());
    let mut flops = 0;
    let mut output_shape: Option<Vec<usize>> = None;
    for (c, candidate) in candidates.iter().enumerate() {
        if let StudentBlockConfig::Candidates { .. } = candidate {
            return Err(format!("candidate {}: candidate sets cannot nest", c + 1));
        }
        let built = candidate.init::<B>(block, input_shape, device).map_err(|e| {
            let StudentError::Invalid { message, kind, .. } = e;
            format!("candidate {} ({kind}): {message}", c + 1)
        })?;
        match &output_shape {
            Some(first) if *first != built.output_shape => {
                return Err(format!(
                    "candidate {} ({}) outputs {:?} but candidate 1 outputs {first:?}: \
                     every candidate must produce the teacher block's shape",
                    c + 1,
                    candidate.kind(),
                    built.output_shape
                ))
            }
            Some(_) => {}
            None => output_shape = Some(built.output_shape.clone()),
        }
        flops += built.flops;
        modules.extend(Candidate::from_block(built.module));
    }
    Ok(BuiltStudent {
        module: StudentBlock::Candidates(CandidateSet::new(modules, device)),
        output_shape: output_shape.unwrap_or_default(),
        flops,
    })
}

fn image_shape(shape: &[usize]) -> Option<[usize; 3]> {
    match shape {
        [c, h, w] => Some([*c, *h, *w]),
        _ => None,
    }
}
