//! `schedule = "auto"`: profile (cached), plan, train, and report the
//! predicted next to the measured step time.

use std::path::Path;

use pipe_bd::config::RunConfig;
use pipe_bd::run::{profile_key, run, RunOptions, PROFILE_CACHE};

mod common;

#[test]
fn auto_plans_from_a_cached_profile_and_reports_its_prediction() {
    let text = common::small_config(640, 100, 1)
        .replace("name = \"test\"", "name = \"auto-test\"")
        .replace("device = \"cpu\"", "devices = [\"cpu\", \"cpu\"]\nschedule = \"auto\"");
    let config = RunConfig::parse(&text, Path::new("auto.toml")).unwrap();
    let cache = common::repo().join(PROFILE_CACHE).join(format!("{}.json", profile_key(&config)));
    let _ = std::fs::remove_file(&cache);

    let out = tempfile::tempdir().unwrap();
    let report = run(&config, out.path(), &RunOptions::default(), &mut |_| {}).unwrap();
    assert_eq!(report.schedule, "auto");
    assert!(report.plan.starts_with('{') && report.plan.ends_with('}'), "{}", report.plan);
    let predicted = report.predicted_step_seconds.expect("auto predicts its step time");
    assert!(predicted > 0.0);
    let ratio = report.measured_over_predicted.unwrap();
    assert!((ratio - report.measured_step_seconds / predicted).abs() < 1e-9);
    assert!(cache.is_file(), "the profile was not cached at {}", cache.display());

    // A second run reuses the cached profile: same plan.
    let modified = std::fs::metadata(&cache).unwrap().modified().unwrap();
    let again = run(&config, out.path(), &RunOptions::default(), &mut |_| {}).unwrap();
    assert_eq!(again.plan, report.plan);
    assert_eq!(
        std::fs::metadata(&cache).unwrap().modified().unwrap(),
        modified,
        "the profile was measured again"
    );
}
