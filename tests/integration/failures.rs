//! A failing block ends the whole pipelined run quickly with a clear error,
//! and leaves no thread behind. The faulty blocks are user blocks plugged in
//! through the public `Block` trait, wrapping a zoo block.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use pipe_bd::plan::Plan;
use pipe_bd::runtime::{Distillation, RuntimeSettings};
use pipe_bd::Error;
use pipe_bd::{Activation, Block, Students};
use pipebd_cli::config::RunConfig;
use pipebd_cli::zoo::Zoo;
use pipebd_kernels::FusedBackend;
use pipebd_students::StudentBlock;
use pipebd_zoo::mnist::Split;
use pipebd_zoo::{build_teacher, Builtin};

use crate::common;

type B = Autodiff<Flex>;

static PANIC_CALLS: AtomicUsize = AtomicUsize::new(0);
static NAN_CALLS: AtomicUsize = AtomicUsize::new(0);

const HEALTHY: usize = 0;
const PANICS_ON_THIRD_STEP: usize = 1;
const NAN_FROM_THIRD_STEP: usize = 2;

/// A zoo block that misbehaves on its third forward pass.
#[derive(Module, Debug)]
struct Faulty<B: FusedBackend> {
    inner: StudentBlock<B>,
    mode: usize,
}

impl<B: FusedBackend> Block<B> for Faulty<B> {
    fn forward(&self, input: Activation<B>) -> pipe_bd::BlockResult<Activation<B>> {
        let out = Block::forward(&self.inner, input)?;
        match self.mode {
            PANICS_ON_THIRD_STEP if PANIC_CALLS.fetch_add(1, Ordering::SeqCst) == 2 => {
                panic!("injected fault in the student block")
            }
            NAN_FROM_THIRD_STEP if NAN_CALLS.fetch_add(1, Ordering::SeqCst) >= 2 => Ok(match out {
                Activation::Maps(t) => Activation::Maps(t.mul_scalar(f32::NAN)),
                other => other,
            }),
            _ => Ok(out),
        }
    }
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0)
}

/// Trains on 2 slots with `tr-dpu`, block 2 faulty; returns the error, how
/// long the run took, and the threads alive just before it started (building the teacher may
/// start burn's global thread pool, which is not the run's).
fn run_with_fault(mode: usize) -> (Error, Duration, usize) {
    let config = RunConfig::parse(&common::small_config(640, 100, 1), Path::new("fault.toml")).unwrap();
    let device = Default::default();
    let data = pipebd_zoo::mnist::load(&config.data.dir, Split::Train, config.data.train_limit).unwrap();
    let teacher = build_teacher::<Flex>(&config, &device).unwrap();
    let students = Builtin.students::<B>(&config, &teacher.specs, &device).unwrap();
    let blocks = students
        .blocks
        .into_iter()
        .enumerate()
        .map(|(k, inner)| Faulty { inner, mode: if k == 1 { mode } else { HEALTHY } })
        .collect();
    let students = Students::new(blocks, students.specs, &teacher.specs).unwrap();
    let plan = Plan::tr(&[1.0, 1.0, 1.0, 1.0], 2, true);
    let options = RuntimeSettings { threads_per_worker: 1, ..Default::default() };
    let baseline = threads();
    let start = Instant::now();
    let result = Distillation::new(&teacher, students, &data)
        .settings(config.train_settings())
        .devices(vec![device; 2])
        .runtime(options)
        .run(&plan);
    let elapsed = start.elapsed();
    match result {
        Ok(_) => panic!("the faulty run finished without an error"),
        Err(e) => (e, elapsed, baseline),
    }
}

fn wait_for_threads(baseline: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(3);
    while threads() > baseline && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    threads()
}

#[test]
fn a_panicking_or_diverging_block_stops_every_worker_with_a_clear_error() {
    // Counts the process's threads: no other test may run beside it.
    if common::rerun_alone("failures::a_panicking_or_diverging_block_stops_every_worker_with_a_clear_error") {
        return;
    }
    let (error, elapsed, baseline) = run_with_fault(PANICS_ON_THIRD_STEP);
    let text = error.to_string();
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}: {text}");
    assert!(matches!(error, Error::Worker { stage: 1, .. }), "{text}");
    assert!(text.contains("block 2") && text.contains("step 2"), "{text}");
    assert!(text.contains("panicked: injected fault"), "{text}");
    assert_eq!(wait_for_threads(baseline), baseline, "threads left running after the panic");

    let (error, elapsed, baseline) = run_with_fault(NAN_FROM_THIRD_STEP);
    let text = error.to_string();
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}: {text}");
    assert!(text.contains("block 2") && text.contains("step 2") && text.contains("NaN"), "{text}");
    assert_eq!(wait_for_threads(baseline), baseline, "threads left running after the NaN");
}
