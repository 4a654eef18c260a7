//! Broken configs and input files fed to the real binary: `pipebd check`
//! (and `pipebd run`, before any training) refuses each with exit code 2 and
//! an error that names the file or the field; nothing panics.

use std::path::{Path, PathBuf};

use pipe_bd::Error;
use pipebd_zoo::mnist::read_idx_images;

use crate::common;

/// Writes `bytes` to `dir/name`; returns the path.
fn write(dir: &Path, name: &str, bytes: impl AsRef<[u8]>) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn text(path: &Path) -> &str {
    path.to_str().expect("temporary paths are UTF-8")
}

/// The small MNIST config of the other tests: valid, and cheap to check.
fn good_config() -> String {
    common::small_config(64, 64, 1)
}

/// The config with its data folder replaced by `dir`.
fn with_data_dir(dir: &Path) -> String {
    good_config().replace(&common::mnist_dir().display().to_string(), text(dir))
}

/// The config with its teacher weights replaced by `path`.
fn with_weights(path: &Path) -> String {
    good_config().replace(&common::teacher_weights().display().to_string(), text(path))
}

/// Asserts that the binary exited with code 2 without panicking and that
/// stderr holds every needle.
fn assert_refused(what: &str, (code, stdout, stderr): (i32, String, String), needles: &[&str]) {
    assert_eq!(code, 2, "{what}: expected exit code 2\nstdout: {stdout}\nstderr: {stderr}");
    assert!(!stderr.contains("panicked"), "{what}: {stderr}");
    for needle in needles {
        assert!(stderr.contains(needle), "{what}: `{needle}` not in: {stderr}");
    }
}

/// Writes `config` to `dir/name` and asserts that `pipebd check` refuses it.
fn check_refuses(dir: &Path, name: &str, config: &str, needles: &[&str]) {
    let path = write(dir, name, config);
    assert_refused(name, common::pipebd(&["check", text(&path)]), needles);
}

/// An uncompressed IDX file: big-endian header words, then the payload.
fn idx(words: &[u32], payload: &[u8]) -> Vec<u8> {
    let mut bytes: Vec<u8> = words.iter().flat_map(|w| w.to_be_bytes()).collect();
    bytes.extend(payload);
    bytes
}

#[test]
fn check_accepts_the_small_config() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "good.toml", good_config());
    let (code, stdout, stderr) = common::pipebd(&["check", text(&path)]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("ok"), "{stdout}");
}

#[test]
fn check_refuses_a_batch_larger_than_the_training_set() {
    // 64 training samples (`train_limit`): a batch of 65 would never step.
    let dir = tempfile::tempdir().unwrap();
    let config = good_config().replace("batch_size = 64", "batch_size = 65");
    check_refuses(
        dir.path(),
        "big-batch.toml",
        &config,
        &["big-batch.toml", "train.batch_size", "64 training samples"],
    );
}

#[test]
fn check_refuses_a_missing_data_folder() {
    let dir = tempfile::tempdir().unwrap();
    let nowhere = dir.path().join("no-mnist-here");
    let config = with_data_dir(&nowhere);
    check_refuses(dir.path(), "no-data.toml", &config, &[text(&nowhere), "not found", "data.dir"]);
}

#[test]
fn check_refuses_a_data_folder_without_the_mnist_files() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let config = with_data_dir(&empty);
    check_refuses(dir.path(), "empty-data.toml", &config, &["train-images-idx3-ubyte", "not found"]);
}

#[test]
fn check_refuses_a_missing_test_label_file_and_mismatched_counts() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("mnist");
    std::fs::create_dir(&data).unwrap();
    write(&data, "train-images-idx3-ubyte", idx(&[0x803, 2, 28, 28], &[0; 2 * 784]));
    write(&data, "train-labels-idx1-ubyte", idx(&[0x801, 2], &[3, 7]));
    write(&data, "t10k-images-idx3-ubyte", idx(&[0x803, 1, 28, 28], &[0; 784]));
    let config = with_data_dir(&data);
    check_refuses(dir.path(), "no-labels.toml", &config, &["t10k-labels-idx1-ubyte", "not found"]);

    write(&data, "t10k-labels-idx1-ubyte", idx(&[0x801, 3], &[1, 2, 3]));
    let needles = ["t10k-labels-idx1-ubyte", "3 labels for 1 images"];
    check_refuses(dir.path(), "three-labels.toml", &config, &needles);
}

#[test]
fn check_reports_an_idx_header_with_huge_dimensions_as_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("mnist");
    std::fs::create_dir(&data).unwrap();
    // count * rows * cols is about 2^96: it overflows any size arithmetic.
    let header = [0x803, u32::MAX, u32::MAX, u32::MAX];
    let images = write(&data, "train-images-idx3-ubyte", idx(&header, &[0; 8]));
    let needles = ["train-images-idx3-ubyte", "corrupt header"];
    check_refuses(dir.path(), "huge.toml", &with_data_dir(&data), &needles);

    // The reader that training uses says the same.
    match read_idx_images(&images) {
        Err(e @ Error::Data { .. }) => assert!(e.to_string().contains("corrupt header"), "{e}"),
        other => panic!("expected a data error, got {other:?}"),
    }
    // Dimensions whose product fits are measured against the file, not allocated.
    let large = write(&data, "large-images", idx(&[0x803, u32::MAX, 1 << 16, 1], &[0; 8]));
    match read_idx_images(&large) {
        Err(e @ Error::Data { .. }) => assert!(e.to_string().contains("truncated"), "{e}"),
        other => panic!("expected a data error, got {other:?}"),
    }
}

#[test]
fn check_refuses_missing_teacher_weights() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pth");
    let config = with_weights(&missing);
    let needles = ["missing.pth", "not found", "teacher.weights"];
    check_refuses(dir.path(), "no-weights.toml", &config, &needles);
}

#[test]
fn check_refuses_weights_that_are_not_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let notes = write(dir.path(), "notes.pth", "# my notes: not a checkpoint\n");
    let needles = ["notes.pth", "not a PyTorch checkpoint"];
    check_refuses(dir.path(), "text-weights.toml", &with_weights(&notes), &needles);

    let folder = dir.path().join("weights.pth");
    std::fs::create_dir(&folder).unwrap();
    let needles = ["weights.pth", "is a folder"];
    check_refuses(dir.path(), "folder-weights.toml", &with_weights(&folder), &needles);
}

#[test]
fn run_refuses_unloadable_weights_before_creating_its_output_folder() {
    let dir = tempfile::tempdir().unwrap();
    let notes = write(dir.path(), "notes.pth", "# my notes: not a checkpoint\n");
    let config = write(dir.path(), "text-weights.toml", with_weights(&notes));
    let out = dir.path().join("out");
    let result = common::pipebd(&["run", text(&config), "--out", text(&out), "--quiet"]);
    assert_refused("run with text weights", result, &["notes.pth"]);
    assert!(!out.exists(), "the output folder was created before the weights were checked");
}

#[test]
fn check_refuses_non_finite_or_negative_optimizer_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("weight_decay = nan", "optimizer.weight_decay"),
        ("weight_decay = inf", "optimizer.weight_decay"),
        ("weight_decay = -0.01", "optimizer.weight_decay"),
        ("min_lr = nan", "optimizer.min_lr"),
        ("min_lr = -1e-4", "optimizer.min_lr"),
        ("epsilon = nan", "optimizer.epsilon"),
        ("epsilon = inf", "optimizer.epsilon"),
        ("epsilon = -1e-8", "optimizer.epsilon"),
        ("momentum = nan", "optimizer.momentum"),
        ("momentum = -0.5", "optimizer.momentum"),
    ];
    for (i, (line, field)) in cases.into_iter().enumerate() {
        let config = good_config().replace("lr = 0.002", &format!("lr = 0.002\n{line}"));
        let name = format!("optimizer-{i}.toml");
        check_refuses(dir.path(), &name, &config, &[name.as_str(), field]);
    }
    for (i, lr) in ["nan", "inf", "-0.002"].into_iter().enumerate() {
        let config = good_config().replace("lr = 0.002", &format!("lr = {lr}"));
        let name = format!("lr-{i}.toml");
        check_refuses(dir.path(), &name, &config, &[name.as_str(), "optimizer.lr"]);
    }
}

#[test]
fn check_refuses_zero_sample_limits() {
    let dir = tempfile::tempdir().unwrap();
    for (from, to, field) in [
        ("test_limit = 64", "test_limit = 0", "data.test_limit"),
        ("train_limit = 64", "train_limit = 0", "data.train_limit"),
    ] {
        let config = good_config().replace(from, to);
        let name = format!("{}.toml", field.replace('.', "-"));
        check_refuses(dir.path(), &name, &config, &[name.as_str(), field, "at least 1"]);
    }
}

#[test]
fn check_refuses_a_student_count_that_does_not_match_the_teacher() {
    let dir = tempfile::tempdir().unwrap();
    let head = "[[students]]\nkind = \"head\"";
    let three = good_config().split(head).next().unwrap().to_string();
    let needles = ["three.toml", "field `students`", "4 blocks but 3"];
    check_refuses(dir.path(), "three.toml", &three, &needles);
    let five = format!("{}\n{head}\nhidden = 32\nclasses = 10\n", good_config());
    let needles = ["five.toml", "field `students`", "4 blocks but 5"];
    check_refuses(dir.path(), "five.toml", &five, &needles);
}

#[test]
fn run_refuses_an_out_path_that_is_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = write(dir.path(), "good.toml", good_config());
    let taken = write(dir.path(), "taken", "keep me");
    let result = common::pipebd(&["run", text(&config), "--out", text(&taken), "--quiet"]);
    assert_refused("--out a file", result, &["--out", text(&taken), "is a file, expected a directory"]);
    assert_eq!(std::fs::read_to_string(&taken).unwrap(), "keep me");

    let below = taken.join("run");
    let result = common::pipebd(&["run", text(&config), "--out", text(&below), "--quiet"]);
    let needles = ["--out", text(&taken), "is a file, expected a directory"];
    assert_refused("--out below a file", result, &needles);
}

/// A MiniLM config on the real Brown corpus with its weights at `weights`.
fn minilm_config(weights: &Path) -> String {
    let brown = common::repo().join("data/brown");
    assert!(brown.is_dir(), "{} not found: run `bash scripts/setup-data.sh` first", brown.display());
    let mut config = format!(
        r#"name = "minilm-bad"

[data]
dataset = "brown"
dir = "{brown}"
train_limit = 64
test_limit = 16

[teacher]
kind = "minilm-l6"
weights = "{weights}"

[train]
epochs = 1
batch_size = 16

[optimizer]
kind = "adam"
lr = 0.0002
"#,
        brown = brown.display(),
        weights = text(weights),
    );
    for _ in 0..6 {
        config.push_str("\n[[students]]\nkind = \"encoder\"\nffn = 768\n");
    }
    config
}

#[test]
fn check_refuses_minilm_weights_that_are_missing_or_not_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.safetensors");
    let needles = ["missing.safetensors", "not found"];
    check_refuses(dir.path(), "minilm-missing.toml", &minilm_config(&missing), &needles);

    let notes = write(dir.path(), "notes.safetensors", "these are my notes, not weights\n");
    let needles = ["notes.safetensors", "not a safetensors file"];
    check_refuses(dir.path(), "minilm-text.toml", &minilm_config(&notes), &needles);

    // A well-formed header whose tensor data is cut off.
    let header = br#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header);
    bytes.extend([0u8; 4]);
    let cut = write(dir.path(), "cut.safetensors", bytes);
    let needles = ["cut.safetensors", "truncated"];
    check_refuses(dir.path(), "minilm-cut.toml", &minilm_config(&cut), &needles);
}

/// The configs the fuzzer found (`tests/data/fuzz/config`: student sizes
/// that were allocated, aborting, or overflowed a capacity, panicking,
/// before being refused): each is refused with exit code 2, naming the file
/// and the size.
#[test]
fn check_refuses_every_config_the_fuzzer_found() {
    let dir = common::repo().join("tests/data/fuzz/config");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "{files:?}");
    // Each names its file and the size at fault (a decoder's by the check of
    // what its teacher layer can give, which runs first).
    let value = |name: &str| match name {
        "rank-2-63.toml" => "`rank` = 9223372036854775807 is larger than 65536",
        "out-channels-1e9.toml" => "`out_channels` = 1000000000 is larger than 65536",
        "decoder-ffn-2-32.toml" => "ffn 4294967296",
        _ => "",
    };
    for file in &files {
        let name = file.file_name().unwrap().to_str().unwrap();
        assert_refused(name, common::pipebd(&["check", text(file)]), &[name, value(name)]);
    }
}
