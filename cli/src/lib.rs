//! # pipebd-cli: the application on top of the pipe-bd engine
//!
//! Everything a user drives from a terminal or a batch script, for any
//! [`Zoo`] (where teachers, students and data come from):
//!
//! - [`cli`]: the `pipebd` command line ([`run_with`]: the `pipebd` binary is
//!   `run_with(pipebd_zoo::Builtin)`; a crate with its own zoo gets the same
//!   commands for its blocks, see `examples/custom_zoo/`),
//! - [`config`]: TOML run configs (schema, validation, `--set` overrides) and
//!   the engine settings they become,
//! - [`jobs`]: what each command does, from a [`config::RunConfig`] and a zoo
//!   ([`jobs::run`]: a whole run; plots, sweeps, search, profile, bench),
//! - [`report`]: `report.json`; [`metrics`]: `metrics.csv`, written and read,
//! - [`reporter`]: every line written while a command works (`--quiet`,
//!   `--log-format json`),
//! - [`zoo`]: the [`Zoo`] trait and the helpers a zoo's config sections use.
//!
//! The engine (`pipe-bd`: blocks, schedules, planner, runtime, evaluation)
//! links none of this crate's command-line, config and picture libraries.

#![warn(missing_docs)]

pub mod cli;
pub mod config;
pub mod jobs;
pub mod metrics;
pub mod report;
pub mod reporter;
pub mod zoo;

pub use cli::run_with;
pub use pipe_bd::{Error, Result};
pub use zoo::Zoo;
