//! `--trace` writes valid Chrome trace-event JSON with spans of every kind
//! for every worker; the spans follow the plan (each block's student steps on
//! the worker of its stage, once per step), never overlap within a worker, lie
//! inside the training time, and add up to the report's busy and idle times.

use std::collections::{HashMap, HashSet};
use std::ops::RangeInclusive;
use std::path::Path;

use pipe_bd::trace::SpanKind;
use pipebd_cli::config::RunConfig;
use pipebd_cli::jobs::run::RunFlags;
use pipebd_cli::report::RunReport;
use pipebd_zoo::run_builtin;

use crate::common;

/// 640 training samples at batch 64.
const STEPS: usize = 10;

/// One complete (`"ph": "X"`) event of `trace.json`.
#[derive(Debug)]
struct Event {
    worker: u64,
    kind: String,
    block: Option<u64>,
    start_us: u64,
    duration_us: u64,
}

/// What `trace.json` holds.
struct Trace {
    events: Vec<Event>,
    /// Thread names (`worker N: <role> (slot S)`), by worker.
    names: HashMap<u64, String>,
}

impl Trace {
    fn kinds(&self, worker: u64) -> HashSet<&str> {
        self.events.iter().filter(|e| e.worker == worker).map(|e| e.kind.as_str()).collect()
    }

    fn workers(&self) -> HashSet<u64> {
        self.events.iter().map(|e| e.worker).collect()
    }

    fn count(&self, worker: u64, kind: &str, block: Option<u64>) -> usize {
        self.events.iter().filter(|e| e.worker == worker && e.kind == kind && e.block == block).count()
    }
}

fn traced_run(schedule: &str, devices: &[&str], extra: &str) -> (RunReport, Trace) {
    let devices: Vec<String> = devices.iter().map(|d| format!("\"{d}\"")).collect();
    let text = common::small_config(64 * STEPS, 200, 1).replace(
        "device = \"cpu\"",
        &format!("device = \"cpu\"\ndevices = [{}]\nschedule = \"{schedule}\"\n{extra}", devices.join(", ")),
    );
    let config = RunConfig::parse(&text, Path::new("trace.toml")).unwrap();
    let out = tempfile::tempdir().unwrap();
    let report =
        run_builtin(&config, out.path(), &RunFlags { trace: true, ..Default::default() }, &mut |_| {})
            .unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("trace.json")).unwrap()).unwrap();
    let mut trace = Trace { events: Vec::new(), names: HashMap::new() };
    for event in json["traceEvents"].as_array().unwrap() {
        let worker = event["tid"].as_u64().unwrap();
        match event["ph"].as_str().unwrap() {
            "X" => {
                let (Some(start_us), Some(duration_us)) = (event["ts"].as_u64(), event["dur"].as_u64())
                else {
                    panic!("a span without start or duration: {event}");
                };
                assert!(duration_us >= 1, "{event}");
                trace.events.push(Event {
                    worker,
                    kind: event["cat"].as_str().unwrap().to_string(),
                    block: event["args"]["block"].as_u64(),
                    start_us,
                    duration_us,
                });
            }
            "M" => {
                assert_eq!(event["name"], "thread_name");
                trace.names.insert(worker, event["args"]["name"].as_str().unwrap().to_string());
            }
            other => panic!("unexpected phase {other}"),
        }
    }
    (report, trace)
}

fn assert_has(kinds: &HashSet<&str>, expected: &[&str], worker: u64) {
    for kind in expected {
        assert!(kinds.contains(*kind), "worker {worker} has no `{kind}` span: {kinds:?}");
    }
}

/// A stage of a one-phase plan as `Plan::describe` writes it
/// (`{1 x2 | 2-4}`): one-based blocks, replicas, and whether it reads the
/// data itself (the first stage, or one marked `(recompute)`).
#[derive(Debug)]
struct Stage {
    blocks: RangeInclusive<u64>,
    replicas: usize,
    loads_data: bool,
}

fn stages(plan: &str) -> Vec<Stage> {
    assert!(!plan.contains(" then "), "one phase expected: {plan}");
    let inner = plan
        .strip_prefix('{')
        .and_then(|rest| rest.split_once('}'))
        .map(|(inner, _)| inner)
        .unwrap_or_else(|| panic!("not a plan: {plan}"));
    inner
        .split(" | ")
        .enumerate()
        .map(|(i, stage)| {
            let (stage, recompute) = match stage.strip_suffix(" (recompute)") {
                Some(stage) => (stage, true),
                None => (stage, false),
            };
            let (range, replicas) = match stage.split_once(" x") {
                Some((range, replicas)) => (range, replicas.parse().unwrap()),
                None => (stage, 1),
            };
            let (first, last) = match range.split_once('-') {
                Some((first, last)) => (first.parse().unwrap(), last.parse().unwrap()),
                None => (range.parse().unwrap(), range.parse().unwrap()),
            };
            Stage { blocks: first..=last, replicas, loads_data: i == 0 || recompute }
        })
        .collect()
}

/// `stage S replica R` (one-based stage, zero-based replica).
fn stage_and_replica(role: &str) -> (usize, usize) {
    match role.split_whitespace().collect::<Vec<_>>().as_slice() {
        ["stage", stage, "replica", replica] => (stage.parse().unwrap(), replica.parse().unwrap()),
        _ => panic!("unexpected worker role `{role}`"),
    }
}

/// Checks the spans of every worker against the plan, the step count and
/// the report's per-worker summary.
fn check_spans(report: &RunReport, trace: &Trace) {
    assert_eq!(report.steps, STEPS);
    let stages = stages(&report.plan);
    let blocks = *stages.last().unwrap().blocks.end();
    assert_eq!(trace.names.len(), report.workers.len(), "one named thread per worker");
    let idle: Vec<&str> = SpanKind::ALL.iter().filter(|k| k.is_idle()).map(|k| k.name()).collect();
    let train_us = report.train_seconds * 1e6;
    let mut student_steps = vec![0; blocks as usize + 1];
    for w in &report.workers {
        let id = w.worker as u64;
        let (stage, replica) = stage_and_replica(&w.role);
        let stage = &stages[stage - 1];
        assert!(replica < stage.replicas, "{} in plan {}", w.role, report.plan);
        assert_eq!(trace.names[&id], format!("worker {id}: {} (slot {})", w.role, w.slot));

        // One span after another, all inside the training time.
        let mut spans: Vec<&Event> = trace.events.iter().filter(|e| e.worker == id).collect();
        spans.sort_by_key(|e| e.start_us);
        for e in &spans {
            // (+1: the trace shows a span shorter than a microsecond as 1.)
            assert!((e.start_us + e.duration_us) as f64 <= train_us + 1.0, "{e:?} ends after {train_us} us");
        }
        for pair in spans.windows(2) {
            assert!(
                pair[1].start_us + 1 >= pair[0].start_us + pair[0].duration_us,
                "worker {id}: {:?} overlaps {:?}",
                pair[0],
                pair[1]
            );
        }

        // The report's busy and idle times are these spans' sums (rounded down
        // to whole microseconds per span there, at least 1 here), and disjoint
        // spans of a worker's lifetime add up to at most that lifetime.
        for (waiting, reported) in [(false, w.busy_seconds), (true, w.idle_seconds)] {
            let (sum, count) = spans
                .iter()
                .filter(|e| idle.contains(&e.kind.as_str()) == waiting)
                .fold((0.0, 0.0), |(sum, count), e| (sum + e.duration_us as f64, count + 1.0));
            let reported = reported * 1e6;
            assert!(
                reported <= sum + 0.5 && reported >= sum - count - 0.5,
                "worker {id}: report says {reported} us {}, its {count} spans {sum} us",
                if waiting { "idle" } else { "busy" }
            );
        }
        assert!(w.busy_seconds > 0.0, "{w:?}");
        assert!(w.busy_seconds + w.idle_seconds <= w.wall_seconds + 1e-6, "{w:?}");
        assert!(w.wall_seconds <= report.train_seconds + 1e-6, "{w:?} outlived the training");

        // Each block's student step once per step, on the workers of its stage;
        // its optimizer step on the stage's first replica; the teacher blocks up
        // to the stage's last (from the first one if the stage reads the data).
        for b in 1..=blocks {
            let here = stage.blocks.contains(&b);
            let student = trace.count(id, "student_forward_backward", Some(b));
            assert_eq!(student, if here { STEPS } else { 0 }, "worker {id} ({}): block {b}", w.role);
            student_steps[b as usize] += student;
            let optimizer = trace.count(id, "optimizer_step", Some(b));
            assert_eq!(optimizer, if here && replica == 0 { STEPS } else { 0 }, "worker {id}: block {b}");
            let runs_teacher = b <= *stage.blocks.end() && (stage.loads_data || b >= *stage.blocks.start());
            let teacher = trace.count(id, "teacher_forward", Some(b));
            assert_eq!(teacher, if runs_teacher { STEPS } else { 0 }, "worker {id}: teacher block {b}");
        }
        let loads = trace.count(id, "data_load", None);
        assert_eq!(loads, if stage.loads_data { STEPS } else { 0 }, "worker {id}: data loads");
    }
    for b in 1..=blocks {
        let stage = stages.iter().find(|s| s.blocks.contains(&b)).unwrap();
        assert_eq!(student_steps[b as usize], STEPS * stage.replicas, "block {b}: student steps in all");
    }
}

const WORK: [&str; 3] = ["teacher_forward", "student_forward_backward", "optimizer_step"];

#[test]
fn two_worker_relay_traces_every_kind_of_span() {
    let (report, trace) = traced_run("tr", &["cpu", "cpu"], "");
    assert_eq!(trace.workers().len(), 2, "two workers");
    assert_eq!(stages(&report.plan).len(), 2, "{}", report.plan);
    assert_has(&trace.kinds(0), &WORK, 0);
    assert_has(&trace.kinds(0), &["data_load", "send_wait", "barrier_wait"], 0);
    assert_has(&trace.kinds(1), &WORK, 1);
    assert_has(&trace.kinds(1), &["recv_wait", "barrier_wait"], 1);
    assert!(!trace.kinds(1).contains("data_load"), "only the first stage reads data");
    assert_eq!(report.workers.len(), 2);
    check_spans(&report, &trace);
}

#[test]
fn replicated_stage_traces_gradient_averaging() {
    let hybrid = "[[stages]]\nblocks = [1]\nreplicas = 2\n\n[[stages]]\nblocks = [2, 3, 4]\n";
    let (report, trace) = traced_run("hybrid", &["cpu", "cpu", "cpu"], hybrid);
    assert_eq!(report.plan, "{1 x2 | 2-4}");
    assert_eq!(trace.workers().len(), 3);
    for w in 0..2 {
        assert_has(&trace.kinds(w), &WORK[..2], w);
        assert_has(&trace.kinds(w), &["data_load", "send_wait", "gradient_average"], w);
    }
    // Replica 0 steps for the group; replica 1 receives the updated blocks.
    assert!(trace.kinds(0).contains("optimizer_step"));
    assert!(!trace.kinds(1).contains("optimizer_step"));
    assert_has(&trace.kinds(2), &WORK, 2);
    assert_has(&trace.kinds(2), &["recv_wait"], 2);
    check_spans(&report, &trace);
}
