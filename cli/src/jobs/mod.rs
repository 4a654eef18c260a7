//! The job layer: what each `pipebd` command does, from a
//! [`crate::config::RunConfig`] and a [`crate::zoo::Zoo`]. The command line
//! (`crate::cli`) parses arguments and prints; everything it runs is here,
//! one module per command, so a library user can call the same jobs.

pub mod bench;
pub mod check;
pub mod eval;
pub mod export;
pub mod kernels;
pub mod link;
pub mod plot;
pub mod profile;
pub mod run;
pub mod search;
pub mod sweep;
