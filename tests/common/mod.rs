//! Shared fixtures for the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

/// Repository root (where `data/` lives).
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The MNIST folder installed by `scripts/setup-data.sh`; fails the test with
/// instructions when it is missing.
pub fn mnist_dir() -> PathBuf {
    let dir = repo().join("data/mnist");
    assert!(
        dir.join("t10k-images-idx3-ubyte").is_file(),
        "MNIST not found in {}: run `bash scripts/setup-data.sh` first",
        dir.display()
    );
    dir
}

/// The teacher weights installed by `scripts/setup-data.sh`.
pub fn teacher_weights() -> PathBuf {
    let path = repo().join("data/teachers/mnist-cnn.pth");
    assert!(path.is_file(), "{} not found: run `bash scripts/setup-data.sh` first", path.display());
    path
}

/// A small but complete run config on real MNIST, as TOML text.
pub fn small_config(train_limit: usize, test_limit: usize, epochs: usize) -> String {
    format!(
        r#"name = "test"
seed = 7
device = "cpu"

[data]
dataset = "mnist"
dir = "{data}"
train_limit = {train_limit}
test_limit = {test_limit}

[teacher]
kind = "mnist-cnn"
weights = "{weights}"

[train]
epochs = {epochs}
batch_size = 64
log_every = 1

[optimizer]
kind = "adam"
lr = 0.002

[[students]]
kind = "conv"
width = 16
out_channels = 32

[[students]]
kind = "bottleneck"
rank = 16
out_channels = 64

[[students]]
kind = "bottleneck"
rank = 24
out_channels = 128

[[students]]
kind = "head"
hidden = 64
classes = 10
"#,
        data = mnist_dir().display(),
        weights = teacher_weights().display(),
    )
}

/// Runs the `pipebd` binary with `args`; returns (exit code, stdout, stderr).
pub fn pipebd(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pipebd"))
        .args(args)
        .current_dir(repo())
        .output()
        .expect("the pipebd binary runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
