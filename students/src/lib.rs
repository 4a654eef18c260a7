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
//!   one such block may replace several teacher layers;
//! - `decoder`: a pre-norm Llama decoder layer for `[tokens, hidden]` inputs
//!   (Puzzle's per-layer library: fewer query/key-value heads, a narrower
//!   SwiGLU, attention replaced by a linear map or removed, the feed-forward
//!   removed);
//! - `skip`: the identity, no parameters and no FLOPs (Puzzle's no-op: a
//!   candidate that drops the teacher block);
//! - `candidates`: several blocks of the kinds above for one teacher block,
//!   all trained at once on the same teacher input and target (blockwise
//!   architecture search; [`CandidateSet`]).
//!
//! # Feature flags
//! None.
#![warn(missing_docs)]

mod config;
mod conv;
mod head;
mod init;
mod kinds;
mod skip;
#[cfg(test)]
mod tests;

pub use config::{DecoderMixer, Downsample, EncoderInit, StudentBlockConfig, MAX_PRODUCT, MAX_SIZE};
pub use conv::{BottleneckBlock, ConvBlock, InvertedResidualBlock, SeparableBlock};
pub use head::HeadBlock;
pub use init::{BuiltStudent, StudentError};
pub use kinds::{Candidate, CandidateSet, StudentBlock};
pub use skip::SkipBlock;
