//! A user's own zoo (the one of `examples/custom_zoo`) through the door the
//! built-in zoo uses: its config fields checked with file lines, and a run
//! trained, checkpointed, resumed and re-scored by the example's own binary.

use std::path::Path;

use burn::backend::{Autodiff, Flex};
use pipe_bd::train::inference_blocks;
use pipe_bd::Error;
use pipebd_cli::config::RunConfig;
use pipebd_cli::report::RunReport;
use pipebd_cli::zoo::Zoo;
use pipebd_zoo::Builtin;

use crate::common;

#[path = "../../examples/custom_zoo/zoo.rs"]
mod zoo;

use zoo::MyZoo;

const CONFIG: &str = "examples/custom-zoo.toml";

fn config_text() -> String {
    std::fs::read_to_string(CONFIG).unwrap()
}

/// The one-based line of `text` that starts with `start`.
fn line_of(text: &str, start: &str) -> usize {
    text.lines().position(|l| l.starts_with(start)).unwrap() + 1
}

/// Asserts a config error about `field` on `line`.
fn assert_error_at(result: Result<RunConfig, Error>, line: usize, field: &str) {
    match result {
        Err(Error::Config { line: got, field: Some(got_field), message, .. }) => {
            assert_eq!(got_field, field, "{message}");
            assert_eq!(got, Some(line), "{field}: {message}");
        }
        other => panic!("expected a config error about {field}, got {other:?}"),
    }
}

#[test]
fn a_user_zoo_checks_its_own_fields_and_the_errors_name_their_lines() {
    let text = config_text();
    let path = Path::new(CONFIG);
    MyZoo.parse_config(&text, path).unwrap();

    let bad_cut = text.replace("cut = [2, 2]", "cut = [2, 3]");
    assert_error_at(MyZoo.parse_config(&bad_cut, path), line_of(&text, "cut ="), "custom.cut");

    let bad_kind = text.replace("kind = \"mlp\"", "kind = \"mpl\"");
    assert_error_at(MyZoo.parse_config(&bad_kind, path), line_of(&text, "kind = \"mlp\""), "students[1]");

    let bad_field = text.replace("hidden = 96", "hiden = 96");
    assert_error_at(MyZoo.parse_config(&bad_field, path), line_of(&text, "hidden = 96"), "students[1]");

    // The engine alone accepts what only a zoo knows; the built-in zoo
    // refuses this one's teacher.
    RunConfig::parse(&text, path).unwrap();
    assert_error_at(
        Builtin.parse_config(&text, path),
        line_of(&text, "kind = \"mnist-cnn-cut\""),
        "teacher.kind",
    );
}

/// The `custom_zoo` example's binary, which `cargo test` builds beside the
/// test binaries (`target/<profile>/examples/`). Driving it as a user does,
/// rather than calling [`pipebd_cli::jobs::run::run`] with `MyZoo` here, keeps a
/// second copy of the whole engine (every backend, for the zoo's types) out
/// of this test binary's build.
fn custom_zoo() -> std::process::Command {
    let test_binary = std::env::current_exe().unwrap();
    let profile_dir = test_binary.parent().and_then(Path::parent).unwrap();
    let binary = profile_dir.join("examples").join(format!("custom_zoo{}", std::env::consts::EXE_SUFFIX));
    assert!(
        binary.is_file(),
        "{} is not built: `cargo test` builds the examples with the tests; with a filter, build it first \
         (`cargo build --release --example custom_zoo` with the same features)",
        binary.display()
    );
    let mut command = std::process::Command::new(binary);
    command.current_dir(common::repo());
    command
}

/// Runs `command`; returns its stdout, failing the test (with its stderr)
/// if it fails.
fn succeed(command: &mut std::process::Command) -> String {
    let output = command.output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{command:?} failed:\n{stdout}\n{stderr}");
    stdout.into_owned()
}

#[test]
fn a_user_zoo_trains_resumes_and_rescores_through_its_own_command_line() {
    let text = config_text()
        .replace("train_limit = 12000", "train_limit = 3200\ntest_limit = 2000")
        .replace("stitched_epochs = 1", "stitched_epochs = 0");
    let dir = tempfile::tempdir().unwrap();
    let config_path = dir.path().join("custom-zoo.toml");
    std::fs::write(&config_path, &text).unwrap();
    let config = MyZoo.parse_config(&text, &config_path).unwrap();
    assert_eq!((config.data.train_limit, config.train.stitched_epochs), (Some(3200), 0));

    // The students the run starts from, scored before training.
    let device = Default::default();
    let workload = MyZoo.workload::<Flex>(&config, &device, true).unwrap();
    let untrained = MyZoo.students::<Autodiff<Flex>>(&config, &workload.teacher.specs, &device).unwrap();
    let teacher = (&workload.teacher.blocks[..], &workload.teacher.specs[..]);
    let student = (&inference_blocks(&untrained)[..], &untrained.specs[..]);
    let scored = pipe_bd::eval::score(workload.evaluation.as_deref(), teacher, student, &device).unwrap();
    assert!(scored.test_samples > 0, "the zoo scores its students");
    let before = scored.student_accuracy;

    succeed(custom_zoo().arg("check").arg(&config_path));
    let out = dir.path().join("run");
    succeed(custom_zoo().arg("run").arg(&config_path).arg("--out").arg(&out));
    let read_report = || -> RunReport {
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap()
    };
    let report = read_report();
    assert_eq!(report.blocks.len(), 2, "the zoo's cut gives two blocks");
    assert!(report.steps_run > 0 && report.steps_run == report.steps);
    assert!(
        report.student_accuracy > before + 0.3,
        "trained {:.4} against untrained {before:.4}",
        report.student_accuracy
    );
    assert!(report.blocks.iter().all(|b| b.flops > 0 && b.flops_reduction.is_some()));
    assert_eq!(report.config.custom, config.custom, "report.json keeps the [custom] table");

    // The saved students reload into the zoo's modules and score the same:
    // on 2000 test images one image is 0.05 points, so the two decimals
    // `eval` prints tell any difference in the count of correct images.
    let eval = succeed(custom_zoo().arg("eval").arg(&out));
    let recorded = format!("{:.2}%", 100.0 * report.student_accuracy);
    assert!(
        eval.contains(&format!(
            "student accuracy {recorded} on 2000 test images (recorded at the end of training: {recorded})"
        )),
        "{eval}"
    );

    // Every block's checkpoint is complete: a resume trains nothing and
    // ends with the same students.
    succeed(custom_zoo().arg("run").arg(&config_path).arg("--resume").arg(&out));
    let resumed = read_report();
    assert_eq!(resumed.steps_run, 0);
    assert_eq!(resumed.student_accuracy, report.student_accuracy);
}
