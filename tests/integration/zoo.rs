//! A user's own zoo (the one of `examples/custom_zoo`) through the door the
//! built-in zoo uses: its config fields checked with file lines, and a run
//! trained, checkpointed, resumed and re-scored by the job layer.

use std::path::Path;

use burn::backend::{Autodiff, Flex};
use pipe_bd::config::{Overrides, RunConfig};
use pipe_bd::run::{run, RunFlags};
use pipe_bd::train::{accuracy, inference_blocks};
use pipe_bd::zoo::{Builtin, Evaluation, Zoo};
use pipe_bd::Error;

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

#[test]
fn a_user_zoo_trains_resumes_and_rescores_through_the_job_layer() {
    let mut config = MyZoo.load_config(Path::new(CONFIG), Overrides::default()).unwrap();
    config.data.train_limit = Some(3200);
    config.data.test_limit = Some(2000);
    config.train.stitched_epochs = 0;

    // The students the run starts from, scored before training.
    let device = Default::default();
    let workload = MyZoo.workload::<Flex>(&config, &device, true).unwrap();
    let untrained = MyZoo.students::<Autodiff<Flex>>(&config, &workload.teacher.specs, &device).unwrap();
    let Evaluation::Images(test) = &workload.evaluation else { panic!("the zoo scores images") };
    let before = accuracy::<Flex, _>(&inference_blocks(&untrained), test, &device, 1000).unwrap();

    let out = tempfile::tempdir().unwrap();
    let report = run(&MyZoo, &config, out.path(), &RunFlags::default(), &mut |_| {}).unwrap();
    assert_eq!(report.blocks.len(), 2, "the zoo's cut gives two blocks");
    assert!(report.steps_run > 0 && report.steps_run == report.steps);
    assert!(
        report.student_accuracy > before + 0.3,
        "trained {:.4} against untrained {before:.4}",
        report.student_accuracy
    );
    assert!(report.blocks.iter().all(|b| b.flops > 0 && b.flops_reduction.is_some()));
    assert_eq!(report.config.custom, config.custom, "report.json keeps the [custom] table");

    // The saved students reload into the zoo's modules and score the same.
    let eval = pipe_bd::eval::eval_run(&MyZoo, out.path()).unwrap();
    assert_eq!(eval.student_accuracy, report.student_accuracy);

    // Every block's checkpoint is complete: a resume trains nothing and
    // ends with the same students.
    let flags = RunFlags { resume: Some(out.path().to_path_buf()), ..Default::default() };
    let resumed = run(&MyZoo, &config, out.path(), &flags, &mut |_| {}).unwrap();
    assert_eq!(resumed.steps_run, 0);
    assert_eq!(resumed.student_accuracy, report.student_accuracy);
}
