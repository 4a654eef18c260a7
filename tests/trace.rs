//! `--trace` writes valid Chrome trace-event JSON with spans of every kind
//! for every worker, and the report gains per-worker busy fractions.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use pipe_bd::config::RunConfig;
use pipe_bd::run::{run, RunOptions};

mod common;

fn traced_run(
    schedule: &str,
    devices: &[&str],
    extra: &str,
) -> (pipe_bd::report::RunReport, HashMap<u64, HashSet<String>>) {
    let devices: Vec<String> = devices.iter().map(|d| format!("\"{d}\"")).collect();
    let text = common::small_config(640, 200, 1).replace(
        "device = \"cpu\"",
        &format!("device = \"cpu\"\ndevices = [{}]\nschedule = \"{schedule}\"\n{extra}", devices.join(", ")),
    );
    let config = RunConfig::parse(&text, Path::new("trace.toml")).unwrap();
    let out = tempfile::tempdir().unwrap();
    let report =
        run(&config, out.path(), &RunOptions { trace: true, ..Default::default() }, &mut |_| {}).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("trace.json")).unwrap()).unwrap();
    let mut kinds: HashMap<u64, HashSet<String>> = HashMap::new();
    for event in json["traceEvents"].as_array().unwrap() {
        let tid = event["tid"].as_u64().unwrap();
        match event["ph"].as_str().unwrap() {
            "X" => {
                assert!(event["ts"].is_u64() && event["dur"].as_u64().unwrap() >= 1, "{event}");
                kinds.entry(tid).or_default().insert(event["cat"].as_str().unwrap().to_string());
            }
            "M" => assert_eq!(event["name"], "thread_name"),
            other => panic!("unexpected phase {other}"),
        }
    }
    (report, kinds)
}

fn assert_has(kinds: &HashSet<String>, expected: &[&str], worker: u64) {
    for kind in expected {
        assert!(kinds.contains(*kind), "worker {worker} has no `{kind}` span: {kinds:?}");
    }
}

const WORK: [&str; 3] = ["teacher_forward", "student_forward_backward", "optimizer_step"];

#[test]
fn two_worker_relay_traces_every_kind_of_span() {
    let (report, kinds) = traced_run("tr", &["cpu", "cpu"], "");
    assert_eq!(kinds.len(), 2, "two workers");
    assert_has(&kinds[&0], &WORK, 0);
    assert_has(&kinds[&0], &["data_load", "send_wait", "barrier_wait"], 0);
    assert_has(&kinds[&1], &WORK, 1);
    assert_has(&kinds[&1], &["recv_wait", "barrier_wait"], 1);
    assert!(!kinds[&1].contains("data_load"), "only the first stage reads data");
    assert_eq!(report.workers.len(), 2);
    for w in &report.workers {
        assert!(w.busy_fraction > 0.0 && w.busy_fraction <= 1.0, "{w:?}");
        assert!((w.busy_fraction + w.idle_fraction - 1.0).abs() < 1e-9, "{w:?}");
    }
}

#[test]
fn replicated_stage_traces_gradient_averaging() {
    let stages = "[[stages]]\nblocks = [1]\nreplicas = 2\n\n[[stages]]\nblocks = [2, 3, 4]\n";
    let (report, kinds) = traced_run("hybrid", &["cpu", "cpu", "cpu"], stages);
    assert_eq!(report.plan, "{1 x2 | 2-4}");
    assert_eq!(kinds.len(), 3);
    for w in 0..2 {
        assert_has(&kinds[&w], &WORK[..2], w);
        assert_has(&kinds[&w], &["data_load", "send_wait", "gradient_average"], w);
    }
    // Replica 0 steps for the group; replica 1 receives the updated blocks.
    assert!(kinds[&0].contains("optimizer_step"));
    assert!(!kinds[&1].contains("optimizer_step"));
    assert_has(&kinds[&2], &WORK, 2);
    assert_has(&kinds[&2], &["recv_wait"], 2);
}
