//! Shared fixtures for the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

/// Held by every test whose assertions depend on timing (watchdogs,
/// heartbeats, predicted step times) or that starts several processes: all
/// the integration tests share one process, and two such tests at once on a
/// two-core machine would starve each other. Other tests still run beside
/// them.
pub fn timing_sensitive() -> MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Held by every test that writes a whole model file (hundreds of MB): CI
/// machines can be short of disk, and four such files at once once filled
/// one. Each such test also writes under [`large_tempdir`], beside the build.
pub fn writes_large_files() -> MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A temporary folder under cargo's own scratch folder for integration
/// tests (`target/tmp`), on the disk the build already fits on, rather than
/// `/tmp`, which may be a small memory-backed filesystem; removed on drop.
pub fn large_tempdir() -> tempfile::TempDir {
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(&scratch).unwrap();
    tempfile::tempdir_in(scratch).unwrap()
}

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
    let sections =
        pipebd_zoo::smoke_sections(&mnist_dir(), &teacher_weights(), (train_limit, test_limit), epochs);
    format!("name = \"test\"\nseed = 7\ndevice = \"cpu\"\n\n{sections}")
}

/// Runs the `pipebd` binary with `args`; returns (exit code, stdout, stderr).
pub fn pipebd(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(pipebd_bin())
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

/// A MiniLM run config on the real Brown corpus (data from `scripts/setup-data.sh`).
pub fn minilm_config(
    train_limit: usize,
    test_limit: usize,
    epochs: usize,
    max_tokens: usize,
) -> pipebd_cli::config::RunConfig {
    let root = repo().join("data");
    let weights = root.join("minilm/model.safetensors");
    assert!(weights.is_file(), "{} not found: run `bash scripts/setup-data.sh` first", weights.display());
    let text = format!(
        r#"name = "minilm-test"
seed = 3

[data]
dataset = "brown"
dir = "{brown}"
train_limit = {train_limit}
test_limit = {test_limit}
max_tokens = {max_tokens}

[teacher]
kind = "minilm-l6"
weights = "{weights}"

[train]
epochs = {epochs}
batch_size = 16
log_every = 1

[optimizer]
kind = "adam"
lr = 0.0002

[[students]]
kind = "encoder"
ffn = 768
"#,
        brown = root.join("brown").display(),
        weights = weights.display(),
    );
    let mut text = text;
    for _ in 1..6 {
        text.push_str("\n[[students]]\nkind = \"encoder\"\nffn = 768\n");
    }
    pipebd_cli::config::RunConfig::parse(&text, std::path::Path::new("minilm-test.toml")).unwrap()
}

/// The largest absolute difference between two lists of flattened
/// parameters (same lengths asserted).
pub fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

/// The newest complete checkpoint step of `block` (one-based) in `checkpoints`.
pub fn newest_step(checkpoints: &std::path::Path, block: usize) -> Option<usize> {
    pipe_bd::train::checkpoint::list(checkpoints, block).first().map(|(s, _)| *s)
}

/// Kills `child` with SIGKILL as soon as some of its 4 blocks has a
/// checkpoint at `step` or later in `checkpoints` (fails after 120 s, or if
/// the run ends first).
pub fn kill_after_checkpoint(child: &mut std::process::Child, checkpoints: &std::path::Path, step: usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while (1..=4).all(|b| newest_step(checkpoints, b).unwrap_or(0) < step) {
        assert!(std::time::Instant::now() < deadline, "no checkpoint after 120 s");
        assert!(child.try_wait().unwrap().is_none(), "the run ended before it could be killed");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
}

/// Every float parameter of every student block saved in a run folder,
/// flattened (for comparing two runs' students).
pub fn student_weights(run_dir: &std::path::Path) -> Vec<Vec<f32>> {
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::tensor::{backend::Backend, Tensor};
    use pipebd_cli::zoo::Zoo;
    struct Flatten(Vec<f32>);
    impl<B: Backend> ModuleVisitor<B> for Flatten {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.extend(param.val().into_data().iter::<f32>());
        }
    }
    let report = pipebd_cli::report::RunReport::read(run_dir).unwrap();
    let teacher = pipebd_zoo::Builtin.teacher_specs(&report.config).unwrap();
    let (blocks, _) =
        pipebd_cli::jobs::eval::load_students(&pipebd_zoo::Builtin, run_dir, &report.config, &teacher)
            .unwrap();
    blocks
        .iter()
        .map(|b| {
            let mut v = Flatten(Vec::new());
            b.visit(&mut v);
            v.0
        })
        .collect()
}

/// Set in the environment of a test re-run by [`rerun_alone`].
const ALONE: &str = "PIPEBD_TEST_ALONE";

/// For a test that inspects its own process (counts its threads): the
/// integration tests share one process, so such a test re-runs itself in a
/// fresh one. Returns true in the parent, after the child passed (the test
/// has nothing left to do); false in the child, which then runs the body.
/// `test` is the test's path in this binary, e.g. `failures::name`.
pub fn rerun_alone(test: &str) -> bool {
    if std::env::var_os(ALONE).is_some() {
        return false;
    }
    let out = std::process::Command::new(std::env::current_exe().expect("the test binary's path"))
        .args(["--exact", test, "--test-threads", "1", "--nocapture"])
        .env(ALONE, "1")
        .output()
        .expect("the test binary runs again");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{test} failed in its own process:\n{stdout}\n{stderr}");
    assert!(stdout.contains("1 passed"), "{test} did not run in its own process:\n{stdout}\n{stderr}");
    true
}

/// The `pipebd` binary (crate `pipebd-zoo`) beside this test binary in the
/// target folder: `cargo test --workspace` builds it (pipebd-zoo's own
/// tests need it); a test run of the engine's package alone needs
/// `cargo build --release --bin pipebd` first.
pub fn pipebd_bin() -> &'static str {
    static BIN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        let test_binary = std::env::current_exe().expect("the test binary's path");
        // target/<profile>/deps/integration-<hash> -> target/<profile>/pipebd
        let profile_dir = test_binary.parent().and_then(|deps| deps.parent()).expect("a target folder");
        let bin = profile_dir.join(format!("pipebd{}", std::env::consts::EXE_SUFFIX));
        assert!(
            bin.is_file(),
            "no pipebd binary at {}: build it with `cargo build --release --features wgpu,mpi --bin pipebd` \
             (or run `cargo test --workspace`, which builds it)",
            bin.display()
        );
        bin.to_string_lossy().into_owned()
    })
}
