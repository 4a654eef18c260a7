//! MNIST-format data for the built-in zoo: the engine's reader
//! ([`pipe_bd::data::mnist`], re-exported here as it was) and the dataset's
//! name in a config.

pub use pipe_bd::data::mnist::*;

/// `data.dataset` of MNIST-format images (MNIST, Fashion-MNIST).
pub(crate) const DATASET: &str = "mnist";
