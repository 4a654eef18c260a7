//! `schedule = "auto"`: profile (cached), plan, train, and report the
//! predicted next to the measured step time.
//!
//! Nothing here depends on how fast the machine is or what else runs on it:
//! how close the prediction comes to the measurement is printed by
//! `pipebd bench` (its `measured/predicted` column), not asserted in a test
//! that shares two cores with the rest of the suite.

use std::path::Path;
use std::time::Instant;

use pipe_bd::planning::planner::{plan as best_plans, Candidate};
use pipebd_cli::config::RunConfig;
use pipebd_cli::jobs::profile::{plan_from_candidate, profile_key, Profile, PROFILE_CACHE};
use pipebd_cli::jobs::run::RunFlags;
use pipebd_cli::report::RunReport;
use pipebd_zoo::run_builtin;

use crate::common;

/// 1280 training samples at batch 64.
const STEPS: usize = 20;

/// The planner's choice from the cached profile on two slots, its
/// description, and all of its workers' work per step, in seconds.
fn planned_from(cache: &Path) -> (Candidate, String, f64) {
    let costs = Profile::read(cache).unwrap().cost_table(2);
    let best = best_plans(&costs, 2, None, 1).into_iter().next().expect("a feasible plan on 2 slots");
    let described = plan_from_candidate(&best, costs.blocks(), 2).unwrap().describe();
    let all_work = best
        .stages
        .iter()
        .map(|s| s.replicas as f64 * costs.stage_cost(s.blocks.clone(), s.replicas, None).unwrap())
        .sum();
    (best, described, all_work)
}

/// The report ran the planner's choice for the cached profile, and its
/// predicted step time is one that plan can have on those costs: no faster
/// than its slowest stage, and no slower than all of its workers' work done
/// one after another (the simulator never leaves every worker idle). A
/// prediction in the wrong unit (ms for s: 1000x), a total taken for a
/// per-step time (20x here), or a simulation of another plan or step count
/// falls outside this; how close it comes to the clock is `pipebd bench`'s.
fn assert_prediction_fits_the_plan(report: &RunReport, cache: &Path, caller_seconds: f64) {
    assert_eq!((report.steps, report.steps_run), (STEPS, STEPS));
    assert!(
        report.train_seconds > 0.0
            && report.train_seconds <= report.wall_seconds
            && report.wall_seconds <= caller_seconds,
        "training {} s, whole run {} s, measured by the caller {caller_seconds} s",
        report.train_seconds,
        report.wall_seconds
    );
    let (best, described, all_work) = planned_from(cache);
    assert_eq!(report.plan, described, "auto ran another plan than the planner's best");
    let predicted = report.predicted_step_seconds.expect("auto predicts its step time");
    eprintln!(
        "plan {}: predicted {predicted:.4} s/step, measured {:.4} s/step (printed, not asserted)",
        report.plan, report.measured_step_seconds
    );
    assert!(
        predicted >= best.step_seconds * (1.0 - 1e-9) && predicted <= all_work * (1.0 + 1e-9),
        "plan {}: predicted {predicted} s/step, outside [{} s (slowest stage), {all_work} s (all work in turn)]",
        report.plan,
        best.step_seconds
    );
    assert!(report.measured_over_predicted.is_some(), "auto reports measured over predicted");
}

#[test]
fn auto_plans_from_a_cached_profile_and_predicts_its_step_time() {
    let text = common::small_config(64 * STEPS, 100, 1)
        .replace("name = \"test\"", "name = \"auto-test\"")
        .replace("device = \"cpu\"", "devices = [\"cpu\", \"cpu\"]\nschedule = \"auto\"");
    let config = RunConfig::parse(&text, Path::new("auto.toml")).unwrap();
    let cache = common::repo().join(PROFILE_CACHE).join(format!("{}.json", profile_key(&config)));
    let _ = std::fs::remove_file(&cache);

    let out = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let report = run_builtin(&config, out.path(), &RunFlags::default(), &mut |_| {}).unwrap();
    let caller_seconds = started.elapsed().as_secs_f64();
    assert_eq!(report.schedule, "auto");
    assert!(cache.is_file(), "the profile was not cached at {}", cache.display());
    assert_prediction_fits_the_plan(&report, &cache, caller_seconds);

    // A second run reuses the cached profile: same plan, same prediction
    // (up to the JSON round trip of the costs).
    let modified = std::fs::metadata(&cache).unwrap().modified().unwrap();
    let started = Instant::now();
    let again = run_builtin(&config, out.path(), &RunFlags::default(), &mut |_| {}).unwrap();
    let caller_seconds = started.elapsed().as_secs_f64();
    assert_eq!(again.plan, report.plan);
    assert_eq!(
        std::fs::metadata(&cache).unwrap().modified().unwrap(),
        modified,
        "the profile was measured again"
    );
    let (first, second) = (report.predicted_step_seconds.unwrap(), again.predicted_step_seconds.unwrap());
    assert!(
        (first - second).abs() <= 1e-9 * first,
        "the cached profile predicts {second} s/step, the measured one {first}"
    );
    assert_prediction_fits_the_plan(&again, &cache, caller_seconds);
}
