//! `pipebd profile`: what each block costs on one device slot, at the batch
//! share of every replica count g = 1..W; the input of the AHD planner.
//!
//! Per block and g (batch `B / g`): teacher forward, student forward +
//! backward + step, the extra time of summing g replicas' gradients, the
//! time to hand the block's input activation to another worker thread, and
//! the memory the block holds on its slot: the teacher block's and the
//! student's weights, the student's gradients and optimizer moments
//! (counted), plus the peak resident growth of the student step (measured).
//! Each time is the median of
//! several repeats after a warm-up, with its spread. A measurement that
//! fails (out of memory, a kernel error, a panic) marks the entry
//! infeasible instead of aborting the profile.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use burn::module::Module;
use pipebd_core::{Activation, Block};
use pipebd_kernels::DistillBackend;
use serde::{Deserialize, Serialize};

use crate::config::RunConfig;
use crate::jobs::check::preflight;
use crate::zoo::{Workload, Zoo};
use pipe_bd::data::epoch_order;
use pipe_bd::device::{dispatch, wait_for, BackendJob};
use pipe_bd::error::{Error, Result};
use pipe_bd::fsio::write_atomic;
use pipe_bd::plan::{Plan, Schedule, StageSpec};
use pipe_bd::planning::planner::{Candidate, CostTable};
use pipe_bd::runtime::{concurrent_workers, threads_per_worker};
use pipe_bd::train::optim::{OptimizerConfig, OptimizerKind};
use pipe_bd::train::{detached_copy, BlockTrainer, StepLoss};

/// Median and spread of repeated timings, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// Median seconds.
    pub median: f64,
    /// `(max - min) / median` over the repeats.
    pub spread: f64,
    /// Repeats measured (after the warm-up).
    pub repeats: usize,
}

impl Timing {
    fn of(mut seconds: Vec<f64>) -> Option<Self> {
        if seconds.is_empty() {
            return None;
        }
        seconds.sort_by(f64::total_cmp);
        let median = seconds[seconds.len() / 2];
        let spread = (seconds[seconds.len() - 1] - seconds[0]) / median.max(1e-12);
        Some(Self { median, spread, repeats: seconds.len() })
    }
}

/// One block at one replica count.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Replicas g (each runs `batch / g` samples).
    pub replicas: usize,
    /// Samples per replica.
    pub batch: usize,
    /// Teacher forward.
    pub teacher_forward: Option<Timing>,
    /// Student forward + backward + optimizer step.
    pub student_step: Option<Timing>,
    /// Extra time of a step that sums g replicas' gradients (0 for g = 1).
    pub gradient_average: Option<Timing>,
    /// The optimizer update alone (part of `student_step`).
    #[serde(default)]
    pub optimizer_update: Option<Timing>,
    /// Handing the block's input to another worker thread (the data load for block 1).
    pub input_transfer: Option<Timing>,
    /// Peak resident memory growth during the student step, bytes: the
    /// transient part (activations, temporaries), shrinking with the batch
    /// share; a noisy figure (the allocator reuses what an earlier block
    /// freed).
    pub peak_memory_bytes: Option<u64>,
    /// What the block keeps resident whatever the batch, bytes: the teacher
    /// block's weights, the student's weights, gradients and optimizer
    /// moments, 4 bytes each (absent in profiles written before it).
    #[serde(default)]
    pub state_bytes: Option<u64>,
    /// Why the entry is infeasible, if it is.
    pub error: Option<String>,
}

/// A whole profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Config name.
    pub name: String,
    /// The device the costs were measured on.
    pub device: String,
    /// Global batch size.
    pub batch_size: usize,
    /// Largest replica count measured.
    pub max_replicas: usize,
    /// `entries[k][g - 1]`.
    pub entries: Vec<Vec<Entry>>,
}

/// Repeats measured per entry, after one warm-up run.
const REPEATS: usize = 9;

/// Measures the config's blocks for g = 1..=`max_replicas` and writes the
/// profile as JSON to `out`.
pub fn profile<Z: Zoo>(
    zoo: &Z,
    config: &RunConfig,
    max_replicas: usize,
    out: &Path,
    say: &mut dyn FnMut(&str),
) -> Result<Profile> {
    let profile = measure(zoo, config, max_replicas, say)?;
    let json = serde_json::to_string_pretty(&profile)
        .map_err(|e| Error::Data { path: out.to_path_buf(), message: e.to_string() })?;
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("creating directory", dir, e))?;
    }
    write_atomic(out, json.as_bytes())?;
    Ok(profile)
}

/// Measures the config's blocks for g = 1..=`max_replicas` on the first
/// device slot, with each worker's share of the cores.
pub fn measure<Z: Zoo>(
    zoo: &Z,
    config: &RunConfig,
    max_replicas: usize,
    say: &mut dyn FnMut(&str),
) -> Result<Profile> {
    let (devices, _) = preflight(zoo, config)?;
    if max_replicas == 0 || max_replicas > config.train.batch_size {
        return Err(Error::Config {
            path: "--devices".into(),
            line: None,
            field: Some("devices".into()),
            message: format!(
                "profile needs 1 to batch size ({}) replicas, got {max_replicas}",
                config.train.batch_size
            ),
        });
    }
    // Measure under the runtime's conditions: each of W workers gets its
    // share of the cores (`runtime.threads_per_worker`, 0 = cores / W).
    let threads = threads_per_worker(config.runtime.threads_per_worker, max_replicas);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| Error::Device { device: config.device_slots().join(","), message: e.to_string() })?;
    dispatch(&devices[..1], ProfileJob { zoo, config, max_replicas, say, pool, threads })
}

impl Profile {
    /// Reads a profile written by [`profile`].
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("reading", path, e))?;
        serde_json::from_str(&text).map_err(|e| Error::Data {
            path: path.to_path_buf(),
            message: format!("not a pipebd profile: {e}"),
        })
    }

    /// The planner's cost table for up to `slots` replicas. Replica counts
    /// beyond the measured ones are extrapolated from the largest measured
    /// g: work and transfers shrink linearly with the batch share, gradient
    /// averaging grows linearly with g - 1.
    pub fn cost_table(&self, slots: usize) -> CostTable {
        let mut table = CostTable {
            teacher_forward: Vec::new(),
            student_step: Vec::new(),
            gradient_average: Vec::new(),
            input_transfer: Vec::new(),
            memory: Vec::new(),
            update: Vec::new(),
        };
        for row in &self.entries {
            let (mut t, mut s, mut a, mut x, mut m, mut u) = (vec![], vec![], vec![], vec![], vec![], vec![]);
            for g in 1..=slots {
                let (entry, scale) = match row.get(g - 1) {
                    Some(e) => (e, 1.0),
                    None => {
                        let last = &row[row.len() - 1];
                        (last, last.replicas as f64 / g as f64)
                    }
                };
                let median = |timing: &Option<Timing>| timing.map(|t| t.median * scale);
                t.push(median(&entry.teacher_forward));
                s.push(median(&entry.student_step));
                let average = entry.gradient_average.map_or(0.0, |t| t.median);
                let measured_g = entry.replicas.max(1);
                a.push(if g == 1 || measured_g == 1 {
                    0.0
                } else {
                    average * (g - 1) as f64 / (measured_g - 1) as f64
                });
                x.push(median(&entry.input_transfer).unwrap_or(0.0));
                // Each replica holds the whole state; the transient part shrinks with the share.
                let transient = entry.peak_memory_bytes.map(|b| (b as f64 * scale) as u64);
                m.push(transient.map(|b| b + entry.state_bytes.unwrap_or(0)));
                u.push(entry.optimizer_update.map_or(0.0, |t| t.median));
            }
            table.teacher_forward.push(t);
            table.student_step.push(s);
            table.gradient_average.push(a);
            table.input_transfer.push(x);
            table.memory.push(m);
            table.update.push(u);
        }
        table
    }
}

/// A memory figure of this process from /proc/self/status (`VmRSS:` now,
/// `VmHWM:` peak since the last [`reset_peak_resident`]), in bytes; Linux only.
pub(crate) fn resident_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// Restarts the peak (`VmHWM`) count of this process (Linux only).
pub(crate) fn reset_peak_resident() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Runs `f` once to warm up, then [`REPEATS`] times; a panic or error makes
/// the timing infeasible, with the reason.
fn time_repeated(mut f: impl FnMut() -> Result<()>) -> std::result::Result<Timing, String> {
    let mut seconds = Vec::with_capacity(REPEATS);
    for i in 0..=REPEATS {
        let start = Instant::now();
        match catch_unwind(AssertUnwindSafe(&mut f)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e.to_string()),
            Err(panic) => return Err(format!("panicked: {}", pipe_bd::error::panic_message(panic.as_ref()))),
        }
        if i > 0 {
            seconds.push(start.elapsed().as_secs_f64());
        }
    }
    Timing::of(seconds).ok_or_else(|| "no repeats".into())
}

struct ProfileJob<'a, Z> {
    zoo: &'a Z,
    config: &'a RunConfig,
    max_replicas: usize,
    say: &'a mut dyn FnMut(&str),
    pool: rayon::ThreadPool,
    threads: usize,
}

type Measured = (
    std::result::Result<Timing, String>,
    std::result::Result<Timing, String>,
    std::result::Result<Timing, String>,
    std::result::Result<Timing, String>,
    Option<u64>,
);

impl<Z> ProfileJob<'_, Z> {
    /// Teacher forward, student step, optimizer update, gradient averaging
    /// and peak memory of one block at replica count `g`.
    fn measure_block<
        B: DistillBackend,
        T: Block<B::InnerBackend> + Sync,
        S: pipebd_core::StudentModule<B>,
    >(
        &self,
        g: usize,
        teacher: &T,
        trainer: &mut BlockTrainer<B, S>,
        input: &Activation<B::InnerBackend>,
        y: &Activation<B::InnerBackend>,
    ) -> Measured {
        self.pool.install(|| {
            let teacher_forward = time_repeated(|| {
                wait_for(teacher.forward(input.clone())?);
                Ok(())
            });
            let before = resident_bytes("VmRSS:");
            reset_peak_resident();
            let student_step = time_repeated(|| trainer.step(input.clone(), y.clone()).map(|_| ()));
            let peak = resident_bytes("VmHWM:").zip(before).map(|(p, b)| p.saturating_sub(b));
            let single = time_update(trainer, input, y, 1);
            let gradient_average = if g == 1 {
                Ok(Timing { median: 0.0, spread: 0.0, repeats: 0 })
            } else {
                // The extra cost of an update that sums g replicas' gradients.
                match (time_update(trainer, input, y, g), &single) {
                    (Ok(multi), Ok(single)) => {
                        Ok(Timing { median: (multi.median - single.median).max(0.0), ..multi })
                    }
                    (Err(e), _) => Err(e),
                    (_, Err(e)) => Err(e.clone()),
                }
            };
            (teacher_forward, student_step, single, gradient_average, peak)
        })
    }
}

/// How a failed plan's message names the memory limit set by `setting`:
/// nothing without one, else the bytes and GiB and what would help.
pub(crate) fn memory_limit_words(setting: &str, limit: Option<u64>) -> String {
    match limit {
        None => String::new(),
        Some(bytes) => format!(
            " within {setting} = {bytes} bytes ({:.2} GiB) per slot: raise it, or add slots \
             (`pipebd profile` prints each block's state and peak memory)",
            bytes as f64 / (1u64 << 30) as f64
        ),
    }
}

/// The bytes a block keeps resident on its slot: the teacher block's
/// `teacher_params` weights, and the student's `student_params` weights,
/// gradients and optimizer moments (Adam: two; SGD with momentum: one), 4
/// bytes each.
fn state_bytes(teacher_params: usize, student_params: usize, optimizer: &OptimizerConfig) -> u64 {
    let moments = match optimizer.kind {
        OptimizerKind::Adam => 2,
        OptimizerKind::Sgd if optimizer.momentum != 0.0 => 1,
        OptimizerKind::Sgd => 0,
    };
    4 * (teacher_params as u64 + (2 + moments) * student_params as u64)
}

/// Runs `measure` while each trainer of `others` keeps doing the work of
/// the measured block (teacher `block`'s forward and a student step on the
/// same batch) on a thread of its own with a pool of `threads`.
fn contended<B, T, S, R>(
    others: Vec<BlockTrainer<B, S>>,
    threads: usize,
    block: &T,
    (input, y): (&Activation<B::InnerBackend>, &Activation<B::InnerBackend>),
    measure: impl FnOnce() -> R,
) -> R
where
    B: DistillBackend,
    T: Block<B::InnerBackend> + Sync,
    S: pipebd_core::StudentModule<B>,
{
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        for mut other in others {
            let stop = &stop;
            scope.spawn(move || {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
                let mut work = || {
                    while !stop.load(Ordering::Relaxed) {
                        let busy = block.forward(input.clone()).map(wait_for);
                        if busy.is_err() || other.step(input.clone(), y.clone()).is_err() {
                            break;
                        }
                    }
                };
                match pool {
                    Ok(pool) => pool.install(work),
                    Err(_) => work(),
                }
            });
        }
        let measured = measure();
        stop.store(true, Ordering::Relaxed);
        measured
    })
}

impl<Z: Zoo> BackendJob for ProfileJob<'_, Z> {
    type Output = Profile;

    fn run<B: DistillBackend>(self, devices: &[B::Device]) -> Result<Profile> {
        let config = self.config;
        let device = &devices[0];
        let Workload { teacher, train: data, .. } =
            self.zoo.workload::<B::InnerBackend>(config, device, false)?;
        let students = self.zoo.students::<B>(config, &teacher.specs, device)?;
        let batch = config.train.batch_size;
        let settings = config.train_settings();
        let order = epoch_order(data.len(), config.seed, 0);
        let blocks = teacher.blocks.len();
        let mut entries: Vec<Vec<Entry>> = vec![Vec::new(); blocks];
        for g in 1..=self.max_replicas {
            let share = batch / g;
            (self.say)(&format!("replicas {g}: batch share {share}"));
            let threads = self.threads;
            // Contend as the runtime will, but with at most one busy thread per
            // core: oversubscription is the simulator's business (`simulate_shared`).
            let others = self.max_replicas.min(concurrent_workers(threads)) - 1;
            let row = (|| -> Result<Vec<Entry>> {
                let mut row = Vec::with_capacity(blocks);
                let indices = &order[..share.min(order.len())];
                let mut x = data.batch(indices, device)?;
                let load = time_repeated(|| {
                    wait_for(data.batch(indices, device)?);
                    Ok(())
                });
                for k in 0..blocks {
                    let input = x.clone();
                    let y = teacher.blocks[k].forward(input.clone())?;
                    // A single-path supernet steps one sampled candidate per step.
                    let mut trainer = BlockTrainer::new(
                        k,
                        students.specs[k].clone(),
                        detached_copy(&students.blocks[k]),
                        &config.optimizer,
                        usize::MAX / 2,
                    )
                    .configured(&settings);
                    // The other W - 1 workers are busy too when the runtime runs:
                    // keep as many threads doing the same block's work meanwhile,
                    // so that shared caches and memory bandwidth are contended.
                    let copies = (0..others).map(|_| {
                        let module = detached_copy(&students.blocks[k]);
                        BlockTrainer::new(
                            k,
                            students.specs[k].clone(),
                            module,
                            &config.optimizer,
                            usize::MAX / 2,
                        )
                        .configured(&settings)
                    });
                    let block = &teacher.blocks[k];
                    let measured = contended(copies.collect(), threads, block, (&input, &y), || {
                        self.measure_block(g, block, &mut trainer, &input, &y)
                    });
                    let (teacher_forward, student_step, optimizer_update, gradient_average, peak) = measured;
                    let input_transfer = if k == 0 { load.clone() } else { handoff_time(&input) };
                    let state_bytes = state_bytes(
                        teacher.specs[k].params,
                        students.blocks[k].num_params(),
                        &config.optimizer,
                    );
                    let error = [&teacher_forward, &student_step, &optimizer_update, &gradient_average]
                        .iter()
                        .find_map(|r| r.as_ref().err().cloned());
                    row.push(Entry {
                        replicas: g,
                        batch: share,
                        teacher_forward: teacher_forward.ok(),
                        student_step: student_step.ok(),
                        gradient_average: gradient_average.ok(),
                        optimizer_update: optimizer_update.ok(),
                        input_transfer: input_transfer.ok(),
                        peak_memory_bytes: peak,
                        state_bytes: Some(state_bytes),
                        error,
                    });
                    x = y;
                }
                Ok(row)
            })()?;
            for (k, entry) in row.into_iter().enumerate() {
                entries[k].push(entry);
            }
        }
        Ok(Profile {
            name: config.name.clone(),
            device: config.device_slots()[0].clone(),
            batch_size: batch,
            max_replicas: self.max_replicas,
            entries,
        })
    }
}

/// Times only the optimizer update of a step that sums `g` gradient sets
/// (the backward passes that produce them are not timed).
fn time_update<B: DistillBackend, S: pipebd_core::StudentModule<B>>(
    trainer: &mut BlockTrainer<B, S>,
    input: &Activation<B::InnerBackend>,
    target: &Activation<B::InnerBackend>,
    g: usize,
) -> std::result::Result<Timing, String> {
    let mut seconds = Vec::with_capacity(REPEATS);
    let device = input.device();
    let sync = || {
        let _ = B::sync(&device);
    };
    for i in 0..=REPEATS {
        let mut grads = Vec::with_capacity(g);
        for _ in 0..g {
            let (_, grad) = trainer
                .compute_grads(input.clone(), target.clone(), 1.0 / g as f32)
                .map_err(|e| e.to_string())?;
            grads.push(grad);
        }
        sync();
        let start = Instant::now();
        trainer.apply(grads, StepLoss::Read(0.0)).map_err(|e| e.to_string())?;
        sync();
        if i > 0 {
            seconds.push(start.elapsed().as_secs_f64());
        }
    }
    Timing::of(seconds).ok_or_else(|| "no repeats".into())
}

/// Time to hand an activation to another thread through a bounded channel
/// and have it acknowledged there (what a stage boundary costs).
fn handoff_time<B: burn::tensor::backend::Backend>(
    activation: &Activation<B>,
) -> std::result::Result<Timing, String> {
    let (to_peer, from_here) = crossbeam_channel::bounded::<Activation<B>>(1);
    let (ack, acked) = crossbeam_channel::bounded::<()>(1);
    std::thread::scope(|scope| {
        scope.spawn(move || {
            while let Ok(received) = from_here.recv() {
                drop(received);
                let _ = ack.send(());
            }
        });
        let timing = time_repeated(|| {
            to_peer
                .send(activation.clone())
                .map_err(|_| Error::Timeout { message: "profile peer hung up".into() })?;
            acked.recv().map_err(|_| Error::Timeout { message: "profile peer hung up".into() })
        });
        drop(to_peer);
        timing
    })
}

/// Where `schedule = "auto"` keeps profiles, keyed by what they depend on.
pub const PROFILE_CACHE: &str = "runs/.profile-cache";

/// A stable key for the profile of a config: teacher, students, batch size,
/// device slots, optimizer and threads (FNV-1a over their JSON).
pub fn profile_key(config: &RunConfig) -> String {
    let parts = serde_json::json!({
        "teacher": config.teacher,
        "students": config.students,
        "custom": config.custom,
        "batch": config.train.batch_size,
        "data": config.data.options,
        "devices": config.device_slots(),
        "optimizer": config.optimizer,
        "threads": config.runtime.threads_per_worker,
    });
    // A single-path search steps one candidate per block: another cost.
    let parts = match config.search.mode {
        crate::config::SearchMode::All => parts,
        crate::config::SearchMode::SinglePath => serde_json::json!([parts, "single-path"]),
    };
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in parts.to_string().bytes() {
        hash ^= byte as u64;
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{}-{hash:016x}", config.name)
}

/// The profile for `config`: read from [`PROFILE_CACHE`] if one with the
/// same key exists (and counts each block's resident state), else measured
/// and cached.
pub fn cached_profile<Z: Zoo>(
    zoo: &Z,
    config: &RunConfig,
    say: &mut dyn FnMut(&str),
) -> Result<crate::jobs::profile::Profile> {
    cached_profile_named(zoo, config, &profile_key(config), say)
}

fn cached_profile_named<Z: Zoo>(
    zoo: &Z,
    config: &RunConfig,
    key: &str,
    say: &mut dyn FnMut(&str),
) -> Result<crate::jobs::profile::Profile> {
    let path = Path::new(PROFILE_CACHE).join(format!("{key}.json"));
    if path.is_file() {
        if let Ok(profile) = crate::jobs::profile::Profile::read(&path) {
            // One written before the resident state was counted would let a
            // memory cap through plans that do not fit.
            if profile.entries.iter().flatten().all(|e| e.state_bytes.is_some()) {
                say(&format!("using the cached profile {}", path.display()));
                return Ok(profile);
            }
            say(&format!(
                "the cached profile {} counts no resident memory (older pipebd): measuring again",
                path.display()
            ));
        }
    }
    say(&format!("profiling the blocks (cached in {})", path.display()));
    crate::jobs::profile::profile(zoo, config, config.device_slots().len(), &path, say)
}

/// Plans `schedule = "auto"`: the best hybrid plan for the config's device
/// slots from its (cached) profile, within `runtime.memory_per_device`.
pub fn auto_plan<Z: Zoo>(
    zoo: &Z,
    config: &RunConfig,
    say: &mut dyn FnMut(&str),
) -> Result<(Plan, CostTable)> {
    let slots = config.device_slots().len();
    let profile = cached_profile(zoo, config, say)?;
    plan_on(profile.cost_table(slots), config, say)
}

/// The best hybrid plan for the config's device slots on `costs`.
fn plan_on(costs: CostTable, config: &RunConfig, say: &mut dyn FnMut(&str)) -> Result<(Plan, CostTable)> {
    let slots = config.device_slots().len();
    let blocks = costs.blocks();
    let candidates = pipe_bd::planning::planner::plan(&costs, slots, config.runtime.memory_per_device, 3);
    let best = candidates.first().ok_or_else(|| Error::Plan {
        plan: Schedule::Auto.name().into(),
        message: format!(
            "no way to place the {blocks} blocks on {slots} slots fits{}",
            memory_limit_words("runtime.memory_per_device", config.runtime.memory_per_device)
        ),
    })?;
    for (i, c) in candidates.iter().enumerate() {
        say(&format!(
            "{} {} (planner bottleneck {:.1} ms)",
            if i == 0 { "chosen" } else { "runner-up" },
            c.describe(),
            1e3 * c.step_seconds
        ));
    }
    Ok((plan_from_candidate(best, blocks, slots)?, costs))
}

/// The runtime's plan for a planner candidate (named `auto`).
pub fn plan_from_candidate(candidate: &Candidate, blocks: usize, slots: usize) -> Result<Plan> {
    let specs: Vec<StageSpec> = candidate
        .stages
        .iter()
        .map(|s| StageSpec { blocks: (s.blocks.start + 1..=s.blocks.end).collect(), replicas: s.replicas })
        .collect();
    let mut plan = Plan::hybrid(&specs, blocks, slots)
        .map_err(|e| Error::Plan { plan: Schedule::Auto.name().into(), message: e.0 })?;
    plan.name = Schedule::Auto.name().into();
    Ok(plan)
}

/// How long rank 0 waits for the other ranks' profiles.
const PROFILE_WAIT: std::time::Duration = std::time::Duration::from_secs(3600);

/// One rank's cost table for `auto` across processes: the config's blocks
/// measured on this rank's own device slot (its device first in the list),
/// cached under a key of its own (ranks on one machine profile at once).
fn rank_costs<Z: Zoo>(
    zoo: &Z,
    config: &RunConfig,
    rank: usize,
    say: &mut dyn FnMut(&str),
) -> Result<CostTable> {
    let mut own = config.clone();
    let mut slots = config.device_slots();
    let slot_count = slots.len();
    slots.rotate_left(rank.min(slot_count.saturating_sub(1)));
    own.devices = Some(slots);
    let key = format!("{}-rank{rank}", profile_key(&own));
    Ok(cached_profile_named(zoo, &own, &key, say)?.cost_table(slot_count))
}

/// `auto` on a rank other than 0 of a run across processes: measures this
/// rank's device and hands the cost table (or why it could not) to rank 0.
pub fn send_rank_costs<Z: Zoo>(
    zoo: &Z,
    config: &RunConfig,
    transport: &dyn pipe_bd::runtime::transport::Transport,
) -> Result<()> {
    let rank = transport.rank();
    let mut quiet = |_: &str| {};
    let message = match rank_costs(zoo, config, rank, &mut quiet) {
        Ok(costs) => serde_json::json!({ "costs": costs }),
        Err(e) => serde_json::json!({ "error": e.to_string() }),
    };
    transport.post(0, pipe_bd::runtime::transport::Tag::Profile, message.to_string().into_bytes())
}

/// `auto` on rank 0 of a run across processes: measures rank 0's device,
/// takes every other rank's cost table, and plans on the slowest rank's
/// cost of each entry (a pipeline moves at its slowest stage, and any stage
/// may land on any rank), saying how far the ranks differ.
pub fn auto_plan_across_ranks<Z: Zoo>(
    zoo: &Z,
    config: &RunConfig,
    transport: &dyn pipe_bd::runtime::transport::Transport,
    say: &mut dyn FnMut(&str),
) -> Result<(Plan, CostTable)> {
    let mine = rank_costs(zoo, config, 0, say)?;
    let mut tables = vec![mine];
    for rank in 1..transport.ranks() {
        let bytes = transport
            .receive(rank, pipe_bd::runtime::transport::Tag::Profile, PROFILE_WAIT)?
            .ok_or_else(|| Error::Timeout {
                message: format!("rank 0 waited {} s for rank {rank}'s profile", PROFILE_WAIT.as_secs()),
            })?;
        tables.push(costs_from_bytes(rank, &bytes)?);
    }
    let total = |t: &CostTable| t.single_replica_seconds();
    for (rank, table) in tables.iter().enumerate() {
        say(&format!(
            "rank {rank}: the blocks take {:.1} ms a step on one replica ({:.2}x rank 0)",
            1e3 * total(table),
            total(table) / total(&tables[0]).max(1e-12)
        ));
    }
    let slowest = CostTable::slowest(&tables).map_err(|message| Error::Peer { rank: 0, message })?;
    plan_on(slowest, config, say)
}

/// A rank's cost table (or its failure to measure one) from its message.
fn costs_from_bytes(rank: usize, bytes: &[u8]) -> Result<CostTable> {
    let damaged = |e: String| Error::Peer { rank, message: format!("sent a damaged profile message: {e}") };
    let mut message: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| damaged(e.to_string()))?;
    if let Some(error) = message.get("error").and_then(|e| e.as_str()) {
        return Err(Error::Peer { rank, message: format!("could not profile its device: {error}") });
    }
    let costs = message.get_mut("costs").ok_or_else(|| damaged("no `costs` in the message".into()))?;
    serde_json::from_value(costs.take()).map_err(|e| damaged(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(replicas: usize, peak: u64, state: Option<u64>) -> Entry {
        let timing = Some(Timing { median: 0.01, spread: 0.0, repeats: 1 });
        Entry {
            replicas,
            batch: 16 / replicas,
            teacher_forward: timing,
            student_step: timing,
            gradient_average: timing,
            optimizer_update: timing,
            input_transfer: timing,
            peak_memory_bytes: Some(peak),
            state_bytes: state,
            error: None,
        }
    }

    fn profile(entries: Vec<Vec<Entry>>) -> Profile {
        Profile { name: "t".into(), device: "cpu".into(), batch_size: 16, max_replicas: 1, entries }
    }

    #[test]
    fn every_replica_holds_the_whole_state_and_a_share_of_the_transient() {
        let table = profile(vec![vec![entry(1, 1000, Some(5000))]]).cost_table(4);
        // Measured at g = 1; at g = 2 and 4 the transient shrinks with the share.
        assert_eq!(table.memory[0], vec![Some(6000), Some(5500), Some(5000 + 1000 / 3), Some(5250)]);
        // A profile written before the state was counted plans on the transient alone.
        let old = profile(vec![vec![entry(1, 1000, None)]]).cost_table(2);
        assert_eq!(old.memory[0], vec![Some(1000), Some(500)]);
    }

    #[test]
    fn the_state_counts_weights_gradients_and_optimizer_moments() {
        let mut optimizer = OptimizerConfig { kind: OptimizerKind::Adam, ..Default::default() };
        // Teacher weights, then the student's weights, gradients, two moments.
        assert_eq!(state_bytes(10, 5, &optimizer), 4 * (10 + 4 * 5));
        optimizer.kind = OptimizerKind::Sgd;
        optimizer.momentum = 0.9;
        assert_eq!(state_bytes(10, 5, &optimizer), 4 * (10 + 3 * 5));
        optimizer.momentum = 0.0;
        assert_eq!(state_bytes(10, 5, &optimizer), 4 * (10 + 2 * 5));
    }

    #[test]
    fn a_cap_below_the_state_rejects_a_stage_the_transient_alone_would_fit() {
        use pipe_bd::planning::planner::plan;
        let block = || vec![entry(1, 10, Some(1000))];
        let table = profile(vec![block(), block()]).cost_table(2);
        // Two blocks of 1010 bytes: together on one slot they need 2020.
        assert!(plan(&table, 1, Some(2019), 1).is_empty());
        assert!(!plan(&table, 1, Some(2020), 1).is_empty());
        // On two slots, one block each fits 1010.
        assert!(!plan(&table, 2, Some(1010), 1).is_empty());
    }
}
