//! Distillation losses and (later) fused CubeCL kernels for pipe-bd.
//!
//! This crate sits at the bottom of the dependency graph
//! (`kernels <- students/teachers <- engine`). Today it holds the reference
//! implementations of the two blockwise distillation losses, written with
//! ordinary burn tensor ops so that they run on every backend (flex, wgpu,
//! cuda). Fused CubeCL versions will plug in behind the same functions.
//!
//! # Feature flags
//! None yet.
#![warn(missing_docs)]

pub mod loss;
