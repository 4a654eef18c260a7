//! A run spread over processes computes what the same run computes in one
//! process. The ranks here are threads of the test, joined by the
//! `Loopback` transport: the exact message flow of a multi-process run
//! (every hand-off encoded, sent and decoded; barrier, heartbeats, stop and
//! the end-of-phase state exchange), without an MPI library. `tests/integration/mpi.rs`
//! runs the same through `mpirun`.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use pipe_bd::fault::{Fault, FaultKind};
use pipe_bd::flat_parameters;
use pipe_bd::plan::{flops_cost, Plan, StageSpec};
use pipe_bd::runtime::transport::{Loopback, Tag, Transport};
use pipe_bd::runtime::{Distillation, RuntimeSettings};
use pipebd_cli::config::RunConfig;
use pipebd_cli::zoo::Zoo;
use pipebd_zoo::mnist::Split;
use pipebd_zoo::{build_teacher, Builtin};

use crate::common;

type B = Autodiff<Flex>;

fn config() -> RunConfig {
    RunConfig::parse(&common::small_config(512, 100, 1), Path::new("cluster.toml")).unwrap()
}

/// Trains under `plan` with `options`; every block's parameters, or the error.
fn train(plan: &Plan, slots: usize, options: RuntimeSettings) -> Result<Vec<Vec<f32>>, String> {
    let config = config();
    let device = Default::default();
    let data = pipebd_zoo::mnist::load(&config.data.dir, Split::Train, config.data.train_limit).unwrap();
    let teacher = build_teacher::<Flex>(&config, &device).unwrap();
    let students = Builtin.students::<B>(&config, &teacher.specs, &device).unwrap();
    let output = Distillation::new(&teacher, students, &data)
        .settings(config.train_settings())
        .devices(vec![device; slots])
        .runtime(options)
        .run(plan)
        .map_err(|e| e.to_string())?;
    assert_eq!(output.log.steps, 8);
    Ok(output.students.blocks.iter().map(flat_parameters::<B, _>).collect())
}

fn one_process(plan: &Plan, slots: usize) -> Vec<Vec<f32>> {
    train(plan, slots, RuntimeSettings { threads_per_worker: 1, ..Default::default() }).unwrap()
}

/// The same run as `ranks` ranks (threads here), each with its own copies of
/// teacher, students and data, as separate processes would have.
fn ranks(plan: &Plan, ranks: usize, faults: Vec<Fault>) -> Vec<Result<Vec<Vec<f32>>, String>> {
    ranks_over(plan, Loopback::group(ranks), faults, Duration::from_secs(20))
}

fn ranks_over(
    plan: &Plan,
    transports: Vec<Arc<dyn Transport>>,
    faults: Vec<Fault>,
    timeout: Duration,
) -> Vec<Result<Vec<Vec<f32>>, String>> {
    let ranks = transports.len();
    let slots = plan.slots().max(ranks);
    let handles: Vec<_> = transports
        .into_iter()
        .map(|transport: Arc<dyn Transport>| {
            let plan = plan.clone();
            let faults = faults.clone();
            std::thread::spawn(move || {
                let options = RuntimeSettings {
                    threads_per_worker: 1,
                    timeout,
                    transport: Some(transport),
                    faults,
                    ..Default::default()
                };
                train(&plan, slots, options)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn plans(slots: usize, hybrid: &[StageSpec]) -> Vec<Plan> {
    let config = config();
    let teacher = Builtin.teacher_specs(&config).unwrap();
    let students = Builtin.student_specs(&config, &teacher).unwrap();
    let cost = flops_cost(&teacher, &students);
    let mut plans: Vec<Plan> = ["dp", "ls", "tr", "tr-dpu"]
        .iter()
        .map(|name| Plan::named(name, 4, slots, &cost, &[]).unwrap())
        .collect();
    plans.push(Plan::hybrid(hybrid, 4, slots).unwrap());
    plans
}

fn check_all(slots: usize, hybrid: &[StageSpec]) {
    for plan in plans(slots, hybrid) {
        let reference = one_process(&plan, slots);
        for (rank, result) in ranks(&plan, slots, Vec::new()).into_iter().enumerate() {
            let weights =
                result.unwrap_or_else(|e| panic!("{} on {slots} ranks, rank {rank}: {e}", plan.name));
            // Every rank ends holding every block, as trained.
            let diff = common::max_abs_diff(&reference, &weights);
            assert!(
                diff <= 1e-6,
                "{} ({}) on {slots} ranks: rank {rank}'s blocks differ from one process by {diff}",
                plan.name,
                plan.describe()
            );
        }
    }
}

#[test]
fn every_schedule_on_two_ranks_trains_what_one_process_trains() {
    let _one = common::timing_sensitive();
    check_all(2, &[StageSpec { blocks: vec![1, 2, 3, 4], replicas: 2 }]);
}

#[test]
fn every_schedule_on_three_ranks_trains_what_one_process_trains() {
    let _one = common::timing_sensitive();
    check_all(
        3,
        &[StageSpec { blocks: vec![1], replicas: 2 }, StageSpec { blocks: vec![2, 3, 4], replicas: 1 }],
    );
}

#[test]
fn a_failing_rank_stops_every_rank_with_its_error() {
    let _one = common::timing_sensitive();
    let plan = Plan::tr(&[1.0; 4], 3, false);
    let fault = Fault { kind: FaultKind::Error, slot: Some(1), block: None, step: 3 };
    let started = Instant::now();
    let results = ranks(&plan, 3, vec![fault]);
    // Well within the 20 s timeout: the stop message, not a timeout, ended them.
    assert!(started.elapsed() < Duration::from_secs(15), "ranks took {:?} to stop", started.elapsed());
    let errors: Vec<String> =
        results.into_iter().map(|r| r.expect_err("a rank finished a failed run")).collect();
    assert!(errors[1].contains("injected fault"), "rank 1: {}", errors[1]);
    for rank in [0, 2] {
        assert!(
            errors[rank].contains("rank 1") && errors[rank].contains("injected fault"),
            "rank {rank} does not name rank 1's failure: {}",
            errors[rank]
        );
    }
}

#[test]
fn a_plan_needing_more_slots_than_ranks_is_refused_before_training() {
    let plan = Plan::tr(&[1.0; 4], 3, true);
    for result in ranks(&plan, 2, Vec::new()) {
        let error = result.expect_err("a 3-slot plan ran on 2 ranks");
        assert!(error.contains("3 device slots") && error.contains("2 ranks"), "{error}");
    }
}

/// A rank whose messages stop leaving after `after` (its process frozen, or
/// its link cut), while it still hears the others.
#[derive(Debug)]
struct CutOff {
    inner: Arc<dyn Transport>,
    after: Instant,
}

impl Transport for CutOff {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn ranks(&self) -> usize {
        self.inner.ranks()
    }
    fn post(&self, to: usize, tag: Tag, bytes: Vec<u8>) -> pipe_bd::Result<()> {
        if Instant::now() < self.after {
            self.inner.post(to, tag, bytes)?;
        }
        Ok(())
    }
    fn receive(&self, from: usize, tag: Tag, wait: Duration) -> pipe_bd::Result<Option<Vec<u8>>> {
        self.inner.receive(from, tag, wait)
    }
    fn receive_any(&self, tag: Tag, wait: Duration) -> pipe_bd::Result<Option<(usize, Vec<u8>)>> {
        self.inner.receive_any(tag, wait)
    }
}

#[test]
fn a_silent_rank_is_noticed_within_the_timeout_and_the_others_stop() {
    let _one = common::timing_sensitive();
    let plan = Plan::tr(&[1.0; 4], 3, true);
    let mut transports = Loopback::group(3);
    let silent = CutOff { inner: transports[2].clone(), after: Instant::now() };
    transports[2] = Arc::new(silent);
    let timeout = Duration::from_secs(3);
    let started = Instant::now();
    let results = ranks_over(&plan, transports, Vec::new(), timeout);
    assert!(started.elapsed() < Duration::from_secs(20), "ranks took {:?} to stop", started.elapsed());
    // Rank 2 itself hears everything and may finish; the others cannot.
    for (rank, result) in results.into_iter().enumerate().take(2) {
        let error = result.expect_err("a rank finished although rank 2 went silent");
        assert!(error.contains("rank 2") && error.contains("no heartbeat"), "rank {rank}: {error}");
    }
}
