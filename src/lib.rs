//! # pipe-bd: pipelined parallel blockwise knowledge distillation
//!
//! A frozen teacher network is cut into K blocks; K small student blocks
//! are trained at once, each to reproduce its teacher block from the
//! teacher's own input to that block. The shape of the engine is
//! **data -> blocks -> schedule -> runtime -> report**:
//!
//! - [`data`]: datasets and seeded batching,
//! - [`block`]: the block API ([`block::Block`], [`block::Activation`],
//!   [`block::BlockSpec`], [`block::Teacher`], [`block::Students`]),
//! - [`zoo`]: the built-in teachers and students behind that API,
//! - [`train`]: per-block optimizer steps and the schedules,
//! - [`run`]: a whole job from a [`config::RunConfig`],
//! - [`report`]: `report.json` and `metrics.csv`.
//!
//! The `pipebd` binary is a thin layer over [`run`].
//!
//! # Feature flags
//! - `cuda`: burn's CUDA backend (`device = "cuda:N"`).
//! - `wgpu`: burn's wgpu backend (`device = "wgpu"` or `"wgpu:N"`).
//!
//! The CPU (`device = "cpu"`, burn's flex backend with autodiff) is always
//! available.
#![warn(missing_docs)]

pub mod bench;
pub mod block;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod device;
pub mod error;
pub mod fault;
pub mod optim;
pub mod plan;
pub mod planner;
pub mod plot;
pub mod profile;
pub mod recovery;
pub mod report;
pub mod run;
pub mod runtime;
pub mod simulate;
pub mod stitch;
pub mod sweep;
pub mod text;
pub mod trace;
pub mod train;
pub mod zoo;

pub use error::{Error, Result};
