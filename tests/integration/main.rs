//! The integration tests of the `pipe-bd` package, one module per subject,
//! built as one test binary: every test binary links its own copy of the
//! engine's generic code, so one binary instead of twenty cuts the release
//! build of the suite by most of its time. Filter by module as usual, e.g.
//! `cargo test --release --test integration schedules::`.
//!
//! Tests whose assertions depend on timing, or that start several processes,
//! hold [`common::timing_sensitive`] so that no two of them run at once.

mod common;

mod auto;
// burn's wgpu backend: named to sort near the front, because libtest starts
// tests in name order and its distillation run on Mesa's software Vulkan is
// the longest test (about 150 s); started last, it ran alone on one core
// after everything else had finished.
mod backend_wgpu;
mod bad_input;
mod cluster;
mod config;
mod custom_loss;
mod decoder_steps;
mod docs;
mod experiments;
mod export;
mod failures;
mod idx;
mod layers;
mod library;
mod minilm;
mod mpi;
mod pictures;
mod reference;
mod resilience;
mod schedules;
mod search;
mod signals;
mod smollm2;
mod stitch;
mod sweep;
mod teacher;
mod trace;
mod train;
mod zoo;
