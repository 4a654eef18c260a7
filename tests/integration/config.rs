//! Bad configs fail before any work, naming the file, line and field;
//! the CLI exits with code 2 and does not panic.

use std::path::Path;

use pipe_bd::Error;
use pipebd_cli::config::RunConfig;
use pipebd_cli::zoo::Zoo;
use pipebd_zoo::Builtin;

use crate::common;

const GOOD: &str = r#"name = "t"
device = "cpu"

[data]
dataset = "mnist"
dir = "data/mnist"

[teacher]
kind = "mnist-cnn"
weights = "data/teachers/mnist-cnn.pth"

[train]
epochs = 1
batch_size = 32

[optimizer]
kind = "sgd"
lr = 0.1

[[students]]
kind = "conv"
width = 8
out_channels = 32

[[students]]
kind = "separable"
out_channels = 64

[[students]]
kind = "separable"
out_channels = 128

[[students]]
kind = "head"
hidden = 32
classes = 10
"#;

/// Parses with the built-in zoo's checks, as `pipebd` does.
fn parse(text: &str) -> Result<RunConfig, Error> {
    Builtin.parse_config(text, Path::new("bad.toml"))
}

/// Asserts a config error at `line` about `field` whose message contains `needle`.
fn assert_config_error(text: &str, line: usize, field: &str, needle: &str) {
    match parse(text) {
        Err(e @ Error::Config { .. }) => {
            let Error::Config { line: got_line, field: got_field, .. } = &e else { unreachable!() };
            assert_eq!(*got_line, Some(line), "wrong line in: {e}");
            assert_eq!(got_field.as_deref(), Some(field), "wrong field in: {e}");
            let shown = e.to_string();
            assert!(shown.starts_with(&format!("bad.toml:{line}")), "{shown}");
            assert!(shown.contains(needle), "`{needle}` not in: {shown}");
        }
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn the_good_config_parses() {
    let config = parse(GOOD).unwrap();
    assert_eq!(config.students.len(), 4);
    assert_eq!(config.train.batch_size, 32);
}

#[test]
fn a_train_limit_flag_overrides_the_config_and_zero_is_refused_naming_the_flag() {
    use pipebd_cli::config::Overrides;
    let mut config = parse(GOOD).unwrap();
    config.apply(Overrides { train_limit: Some(112), ..Default::default() }).unwrap();
    assert_eq!(config.data.train_limit, Some(112));
    let error = config.apply(Overrides { train_limit: Some(0), ..Default::default() }).unwrap_err();
    let shown = error.to_string();
    assert!(shown.contains("--train-limit") && shown.contains("at least 1"), "{shown}");
    assert_eq!(config.data.train_limit, Some(112), "a refused flag changes nothing");
}

#[test]
fn unknown_field_names_line_and_field() {
    let text = GOOD.replace("batch_size = 32", "batch_size = 32\nbach_size = 3");
    assert_config_error(&text, 15, "train.bach_size", "unknown field");
}

#[test]
fn wrong_type_names_line_and_field() {
    let text = GOOD.replace("batch_size = 32", "batch_size = \"big\"");
    assert_config_error(&text, 14, "train.batch_size", "invalid type");
}

#[test]
fn zero_batch_size_names_line_and_field() {
    let text = GOOD.replace("batch_size = 32", "batch_size = 0");
    assert_config_error(&text, 14, "train.batch_size", "at least 1");
}

#[test]
fn negative_learning_rate_is_refused() {
    let text = GOOD.replace("lr = 0.1", "lr = -0.1");
    assert_config_error(&text, 18, "optimizer.lr", "positive");
}

#[test]
fn unknown_device_is_refused() {
    let text = GOOD.replace("device = \"cpu\"", "device = \"tpu:0\"");
    assert_config_error(&text, 2, "device", "unknown device");
}

#[test]
fn unknown_student_kind_names_its_line() {
    let text =
        GOOD.replace("kind = \"separable\"\nout_channels = 64", "kind = \"transformer\"\nout_channels = 64");
    match parse(&text) {
        Err(e @ Error::Config { .. }) => {
            let shown = e.to_string();
            assert!(shown.contains("transformer"), "{shown}");
            assert!(shown.contains("students[1]"), "expected the bad entry to be named: {shown}");
        }
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn missing_section_is_named() {
    let text = GOOD.replace("[train]\nepochs = 1\nbatch_size = 32\n", "");
    let err = parse(&text).unwrap_err();
    assert!(err.to_string().contains("missing field `train`"), "{err}");
}

#[test]
fn not_toml_at_all_is_refused() {
    let err = parse("this is = = not toml").unwrap_err();
    assert!(matches!(err, Error::Config { line: Some(1), .. }), "{err}");
}

#[test]
fn student_with_wrong_output_shape_is_rejected_before_training() {
    let config = parse(&GOOD.replace("out_channels = 128", "out_channels = 96")).unwrap();
    let err = pipebd_cli::jobs::check::preflight(&Builtin, &config).unwrap_err();
    match &err {
        Error::Core(pipe_bd::BlockError::ShapeMismatch { block, student, teacher, .. }) => {
            assert_eq!(*block, 3);
            assert_eq!(student, &vec![96, 3, 3]);
            assert_eq!(teacher, &vec![128, 3, 3]);
        }
        other => panic!("expected a shape mismatch, got {other:?}"),
    }
    let shown = err.to_string();
    assert!(
        shown.contains("block 3") && shown.contains("[96, 3, 3]") && shown.contains("[128, 3, 3]"),
        "{shown}"
    );
}

#[test]
fn wrong_number_of_student_blocks_is_rejected() {
    let text = GOOD.split("[[students]]\nkind = \"head\"").next().unwrap().to_string();
    let err = parse(&text).unwrap_err();
    assert!(err.to_string().contains("4 blocks but 3 student blocks"), "{err}");
    assert!(err.to_string().contains("students"), "names the field: {err}");
}

#[test]
fn head_on_a_too_small_input_is_rejected() {
    let text = GOOD.replace(
        "[[students]]\nkind = \"head\"\nhidden = 32\nclasses = 10",
        "[[students]]\nkind = \"head\"\nhidden = 32\nclasses = 7",
    );
    let config = parse(&text).unwrap();
    let err = pipebd_cli::jobs::check::preflight(&Builtin, &config).unwrap_err();
    assert!(matches!(err, Error::Core(pipe_bd::BlockError::ShapeMismatch { block: 4, .. })), "{err}");
}

/// Cargo passes the package's features to its integration tests, so
/// `cfg!(feature = "cuda")` here is the build's own.
#[test]
fn cuda_is_refused_with_the_reason_unless_built_in_and_present() {
    let config = parse(&GOOD.replace("device = \"cpu\"", "device = \"cuda:0\"")).unwrap();
    match pipebd_cli::jobs::check::preflight(&Builtin, &config) {
        // Built without CUDA: always refused, saying how to build it in.
        Err(Error::Device { device, message }) if !cfg!(feature = "cuda") => {
            assert_eq!(device, "cuda:0");
            assert!(message.contains("--features cuda"), "{message}");
        }
        // Built with CUDA on a machine without a driver: refused, naming the driver.
        Err(Error::Device { device, message }) => {
            assert_eq!(device, "cuda:0");
            assert!(message.contains("driver"), "{message}");
        }
        // Built with CUDA and a driver present: the slot is CUDA device 0.
        Ok((devices, _)) if cfg!(feature = "cuda") => {
            assert_eq!(devices, vec![pipe_bd::device::DeviceSpec::Cuda(0)]);
        }
        other => {
            let build = if cfg!(feature = "cuda") { "with" } else { "without" };
            panic!("cuda:0 in a build {build} CUDA: {other:?}")
        }
    }
}

#[test]
fn cli_exits_with_code_2_on_bad_configs() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("unknown-field.toml", GOOD.replace("epochs = 1", "epochs = 1\nepoch = 2"), "train.epoch"),
        ("bad-shape.toml", GOOD.replace("out_channels = 64", "out_channels = 65"), "block 2"),
        ("zero.toml", GOOD.replace("epochs = 1", "epochs = 0"), "train.epochs"),
    ];
    for (name, text, needle) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        let out_dir = dir.path().join("out");
        let (code, _, stderr) =
            common::pipebd(&["run", path.to_str().unwrap(), "--out", out_dir.to_str().unwrap(), "--quiet"]);
        assert_eq!(code, 2, "{name}: {stderr}");
        assert!(stderr.contains(name), "{name}: file not named: {stderr}");
        assert!(stderr.contains(needle), "{name}: `{needle}` not in: {stderr}");
        assert!(!stderr.contains("panicked"), "{name}: {stderr}");
    }
    let (code, _, stderr) = common::pipebd(&["run", "no/such/config.toml", "--quiet"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("no/such/config.toml"), "{stderr}");
}

#[test]
fn unknown_field_in_a_student_entry_names_the_entry() {
    let text = GOOD.replace(
        "kind = \"separable\"\nout_channels = 64",
        "kind = \"separable\"\nout_channels = 64\nwidht = 3",
    );
    let err = parse(&text).unwrap_err();
    let shown = err.to_string();
    assert!(shown.contains("students[1]"), "{shown}");
    assert!(shown.contains("widht"), "{shown}");
}

#[test]
fn unknown_generator_names_line_and_field() {
    let text = GOOD.replace("device = \"cpu\"", "device = \"cpu\"\ngenerator = \"numpy\"");
    assert_config_error(&text, 3, "generator", "unknown variant");
}

#[test]
fn an_output_loss_needs_end_to_end_gradients_and_a_positive_weight() {
    let local = GOOD.replace(
        "batch_size = 32",
        "batch_size = 32\nstitched_gradients = \"local\"\nstitched_output_loss = \"mse\"",
    );
    assert_config_error(&local, 16, "train.stitched_output_loss", "end-to-end");
    let zero = GOOD.replace("batch_size = 32", "batch_size = 32\nstitched_output_weight = 0.0");
    assert_config_error(&zero, 15, "train.stitched_output_weight", "positive");
    let unknown = GOOD.replace("batch_size = 32", "batch_size = 32\nstitched_output_loss = \"cosine\"");
    assert_config_error(&unknown, 15, "train.stitched_output_loss", "pooled-cosine");
}

#[test]
fn a_stitched_block_weight_is_a_number_at_least_zero_and_zero_needs_an_output_loss() {
    let negative = GOOD.replace("batch_size = 32", "batch_size = 32\nstitched_block_weight = -1.0");
    assert_config_error(&negative, 15, "train.stitched_block_weight", ">= 0");
    let alone = GOOD.replace("batch_size = 32", "batch_size = 32\nstitched_block_weight = 0.0");
    assert_config_error(&alone, 15, "train.stitched_block_weight", "stitched_output_loss");
    let output_only = GOOD.replace(
        "batch_size = 32",
        "batch_size = 32\nstitched_block_weight = 0.0\nstitched_output_loss = \"mse\"",
    );
    let config = parse(&output_only).unwrap();
    assert_eq!(config.train.stitched_block_weight, 0.0);
    assert_eq!(parse(GOOD).unwrap().train.stitched_block_weight, 1.0);
}

#[test]
fn a_pooled_cosine_output_loss_on_an_image_teacher_is_refused_before_training() {
    let text = GOOD.replace("batch_size = 32", "batch_size = 32\nstitched_output_loss = \"pooled-cosine\"");
    let config = parse(&text).unwrap();
    let err = pipebd_cli::jobs::check::preflight(&Builtin, &config).unwrap_err();
    match &err {
        Error::Config { field, .. } => {
            assert_eq!(field.as_deref(), Some("train.stitched_output_loss"), "{err}")
        }
        other => panic!("expected a config error, got {other:?}"),
    }
    assert!(err.to_string().contains("token states"), "{err}");
    let logits = GOOD
        .replace("batch_size = 32", "batch_size = 32\nstitched_output_loss = \"soft-target-cross-entropy\"");
    let config = parse(&logits).unwrap();
    assert!(pipebd_cli::jobs::check::preflight(&Builtin, &config).is_ok(), "logits take a cross-entropy");
    // The MNIST CNN has no head after its last block to score through.
    let head = GOOD.replace("batch_size = 32", "batch_size = 32\nstitched_output_loss = \"head-kl\"");
    let err = pipebd_cli::jobs::check::preflight(&Builtin, &parse(&head).unwrap()).unwrap_err();
    assert!(
        matches!(&err, Error::Config { field, .. } if field.as_deref() == Some("train.stitched_output_loss")),
        "{err}"
    );
    assert!(err.to_string().contains("has none"), "{err}");
}
