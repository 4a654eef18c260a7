//! Short real-data runs: every block's loss goes down, and the saved
//! student reloads and scores exactly as it did at the end of training.

use std::path::Path;

use pipe_bd::config::RunConfig;

mod common;

#[test]
fn per_block_loss_decreases_and_saved_student_reloads_with_the_same_score() {
    let config = RunConfig::parse(&common::small_config(6400, 1000, 1), Path::new("small.toml")).unwrap();
    let out = tempfile::tempdir().unwrap();
    let mut steps_seen = 0;
    let report =
        pipe_bd::run::run(&config, out.path(), &Default::default(), &mut |_| steps_seen += 1).unwrap();
    assert_eq!(steps_seen, 100, "6400 samples at batch 64 is 100 steps");
    assert_eq!(report.steps, 100);

    // metrics.csv: one row per step per block (log_every = 1).
    let csv = std::fs::read_to_string(out.path().join("metrics.csv")).unwrap();
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some("epoch,step,block,loss,lr"));
    let rows: Vec<(usize, usize, f32)> = lines
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (f[1].parse().unwrap(), f[2].parse().unwrap(), f[3].parse().unwrap())
        })
        .collect();
    assert_eq!(rows.len(), 100 * 4);
    for block in 1..=4 {
        let losses: Vec<f32> = rows.iter().filter(|r| r.1 == block).map(|r| r.2).collect();
        let first = losses[..5].iter().sum::<f32>() / 5.0;
        let last = losses[losses.len() - 5..].iter().sum::<f32>() / 5.0;
        assert!(last < 0.8 * first, "block {block}: loss {first} -> {last} did not drop by 20%");
    }

    // report.json carries the documented fields.
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("report.json")).unwrap()).unwrap();
    for field in
        ["teacher_accuracy", "student_accuracy", "wall_seconds", "samples_per_second", "schedule", "config"]
    {
        assert!(json.get(field).is_some(), "report.json lacks `{field}`");
    }
    for block in json["blocks"].as_array().unwrap() {
        for field in ["params", "flops", "final_loss"] {
            assert!(block.get(field).is_some(), "report.json blocks[] lack `{field}`");
        }
    }
    assert!(report.teacher_accuracy > 0.97);
    assert!(report.student_accuracy > 0.10, "a trained student beats chance: {}", report.student_accuracy);

    // Reload from disk and re-score.
    let eval = pipe_bd::run::eval_run(out.path()).unwrap();
    assert_eq!(eval.test_samples, 1000);
    assert_eq!(eval.student_accuracy, report.student_accuracy);

    // Through the CLI too.
    let (code, stdout, stderr) = common::pipebd(&["eval", out.path().to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains(&format!("{:.2}%", 100.0 * report.student_accuracy)), "{stdout}");
}

#[test]
fn eval_of_a_folder_without_a_run_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, stderr) = common::pipebd(&["eval", dir.path().to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(stderr.contains("report.json"), "{stderr}");
}
