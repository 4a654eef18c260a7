//! The readers of the built-in zoo as `pipebd` calls them, behind plain
//! (non-generic) functions of a path: what `pipebd-fuzz` feeds mutated
//! files. Not part of the library's API (hidden from its docs).

use std::path::Path;

use pipe_bd::Result;

use crate::{Builtin, Lift};

/// `pipebd check <path>`: the config read, parsed, checked by the zoo and
/// preflighted (devices, shapes, schedule, the files it names).
pub fn check_config(path: &Path) -> Result<()> {
    pipebd_cli::jobs::check::check_file(&Builtin, path).map(drop)
}

/// What `pipebd sweep <path>` reads and checks before running any point.
pub fn check_sweep(path: &Path) -> Result<()> {
    pipebd_cli::jobs::sweep::load(&Builtin, path).map(drop)
}

/// A SmolLM2 (`llama` or `deci`) GGUF file as a run loads it: the model
/// with every tensor dequantized, and its tokenizer.
pub fn load_gguf_model(path: &Path) -> Result<()> {
    type Cpu = burn::backend::Flex;
    let model = crate::teachers::smollm2::SmolLm2::<Cpu>::load(path, &Default::default()).lift()?;
    model.tokenizer.encode("The fuzzer's 12 words, tokenized.", 16).lift().map(drop)
}

/// An MNIST IDX image file (`*-images-idx3-ubyte`).
pub fn read_idx_images(path: &Path) -> Result<()> {
    crate::mnist::read_idx_images(path).map(drop)
}

/// An MNIST IDX label file (10 classes).
pub fn read_idx_labels(path: &Path) -> Result<()> {
    crate::mnist::read_idx_labels(path, 10).map(drop)
}
