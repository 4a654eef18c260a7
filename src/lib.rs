//! # pipe-bd: pipelined parallel blockwise knowledge distillation
//!
//! A frozen teacher network is cut into K blocks; K small student blocks
//! are trained at once, each to reproduce its teacher block from the
//! teacher's own input to that block. The shape of the engine is
//! **data -> blocks -> schedule -> runtime -> report**:
//!
//! The block API comes from `pipebd-core` and is re-exported here
//! ([`Activation`], [`Block`], [`BlockSpec`], [`Teacher`], [`Students`],
//! [`Dataset`], [`Plan`], and the backend traits [`FusedBackend`] and
//! [`DistillBackend`]), so a user's crate needs only `pipe-bd` and `burn`
//! ([`serde`] is re-exported for a zoo of its own; the built-in teachers,
//! students and data are the `pipebd-zoo` crate's, which a zoo may reuse).
//! Train your own blocks with [`runtime::Distillation`]; see
//! `examples/` and `ARCHITECTURE.md`.
//!
//! - [`data`]: datasets and seeded batching,
//! - [`train`]: one block's optimizer step, its settings, the stitched pass,
//! - [`runtime`]: the one interpreter of plans,
//! - [`eval`]: scoring trained students ([`eval::Evaluate`],
//!   [`eval::TopOneAccuracy`]) and their saved records,
//! - [`search`]: choosing one candidate student per block under a budget.
//!
//! The application (the `pipebd` command line, config files, jobs, reports
//! and pictures, the `Zoo` trait) is the `pipebd-cli` crate above this one;
//! this crate links none of clap, toml, indicatif or plotters. The `pipebd`
//! binary (crate `pipebd-zoo`) is `pipebd_cli::run_with(Builtin)`; a crate
//! with its own zoo gets the same command line for its blocks.
//!
//! This crate depends on no teacher, student or data set: the built-in ones
//! live in `pipebd-zoo`, above it (a rule cargo enforces).
//!
//! # Feature flags
//! - `cuda`: burn's CUDA backend (`device = "cuda:N"`).
//! - `wgpu`: burn's wgpu backend (`device = "wgpu"` or `"wgpu:N"`).
//!
//! The CPU (`device = "cpu"`, burn's flex backend with autodiff) is always
//! available.
#![warn(missing_docs)]

pub mod data;
pub mod device;
pub mod error;
pub mod eval;
pub mod fault;
pub mod fsio;
pub use pipebd_core::plan;
pub mod planning;
pub mod rng;
pub mod runtime;
pub mod search;
pub mod trace;
pub mod train;

pub use error::{Error, Result};
pub use pipebd_core::{
    flat_parameters, forward_chain, head_kl, parameter_tensors, Activation, Block, BlockSpec, Dataset,
    DistillBackend, FusedBackend, HeadScores, Loss, LossKind, OutputHead, Phase, Plan, Samples, Schedule,
    Stage, StageSpec, StudentModule, Students, Teacher,
};
pub use pipebd_core::{Error as BlockError, Result as BlockResult};
/// serde, which a [`zoo::Zoo`] parses its config sections with: derive with
/// `#[derive(pipe_bd::serde::Deserialize)]` and `#[serde(crate =
/// "pipe_bd::serde")]`, and a crate needs no serde of its own.
pub use serde;
