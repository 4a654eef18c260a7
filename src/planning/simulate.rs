//! Predicts how long a [`Plan`] takes from measured block costs, without
//! running it: the pipeline fill, bounded channels, replica gradient
//! averaging and global barriers are modelled step by step.
//!
//! Each stage is represented by one of its replicas (they are symmetric).
//! For step `i` of stage `s`:
//! - it starts when it finished step `i - 1` and its input is there (the data
//!   for stages that read it, else the previous stage's send of step `i`);
//! - it loads data (if it does), runs its teacher blocks, then hands the
//!   activation on: the send completes once the channel has room, that is,
//!   once the next stage has taken step `i - capacity`;
//! - it trains its student blocks (forward, backward, gradient averaging,
//!   update); with a barrier, every stage finishes step `i` together, when
//!   the last one gets there.
//!
//! Phases (only `dp` has several) run one after another.

use serde::{Deserialize, Serialize};

use crate::plan::{Phase, Plan};
use crate::planning::planner::CostTable;

/// What the simulator predicts for a plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Seconds for all steps of all phases.
    pub total_seconds: f64,
    /// `total_seconds / steps`.
    pub step_seconds: f64,
    /// Idle fraction of each worker, in the order the runtime numbers them
    /// (phase by phase, stage by stage, replica by replica).
    pub idle_fractions: Vec<f64>,
}

/// Predicts `plan` running `steps` steps with channels of `capacity`, from
/// `costs` (which must cover every replica count the plan uses) and the
/// data-loading time `data_load[g - 1]` per step at batch share `B / g`,
/// each worker having a processor of its own. Returns `None` if the plan
/// uses an infeasible entry of `costs`.
pub fn simulate(
    plan: &Plan,
    costs: &CostTable,
    data_load: &[f64],
    steps: usize,
    capacity: usize,
) -> Option<Prediction> {
    let steps = steps.max(1);
    let capacity = capacity.max(1);
    let mut total = 0.0;
    let mut busy_per_worker: Vec<(f64, f64)> = Vec::new(); // (busy seconds, phase seconds)
    for phase in &plan.phases {
        let stages = &phase.stages;
        let n = stages.len();
        let parts = stage_parts(phase, costs, data_load)?;
        let before: Vec<f64> = parts.iter().map(|p| p.before).collect();
        let after: Vec<f64> = parts.iter().map(|p| p.after).collect();
        let updates: Vec<f64> = parts.iter().map(|p| p.update).collect();
        let relays: Vec<bool> = (0..n).map(|s| s + 1 < n && !stages[s + 1].loads_data).collect();
        let mut start = vec![vec![0.0f64; steps]; n];
        let mut sent = vec![vec![0.0f64; steps]; n];
        let mut finish = vec![vec![0.0f64; steps]; n];
        for i in 0..steps {
            for s in 0..n {
                let free = if i > 0 { finish[s][i - 1] } else { 0.0 };
                let input = if s > 0 && relays[s - 1] { sent[s - 1][i] } else { 0.0 };
                start[s][i] = free.max(input);
                let ready = start[s][i] + before[s];
                // The channel to the next stage holds `capacity` steps.
                let room = if relays[s] && i >= capacity { start[s + 1][i - capacity] } else { 0.0 };
                sent[s][i] = ready.max(room);
                finish[s][i] = sent[s][i] + after[s];
            }
            if phase.barrier {
                // Everyone reaches the barrier before its optimizer updates;
                // the updates run after the last one arrives.
                let last = (0..n).map(|s| finish[s][i] - updates[s]).fold(0.0, f64::max);
                for (s, row) in finish.iter_mut().enumerate() {
                    row[i] = last + updates[s];
                }
            }
        }
        let phase_seconds = (0..n).map(|s| finish[s][steps - 1]).fold(0.0, f64::max);
        total += phase_seconds;
        for (s, stage) in stages.iter().enumerate() {
            let busy = steps as f64 * (before[s] + after[s]);
            for _ in 0..stage.replicas() {
                busy_per_worker.push((busy, phase_seconds));
            }
        }
    }
    let idle_fractions =
        busy_per_worker.iter().map(|(busy, wall)| (1.0 - busy / wall.max(1e-12)).clamp(0.0, 1.0)).collect();
    Some(Prediction { total_seconds: total, step_seconds: total / steps as f64, idle_fractions })
}

/// As [`simulate`], when the workers share `processors` processors (more
/// workers than cores). An event-driven processor-sharing simulation: at
/// every instant each computing worker (a stage counts once per replica)
/// progresses at `min(1, processors / computing workers)`, so workers that
/// wait on a channel or a barrier leave their share to the others. (A
/// mean-field slowdown, the same for the whole run, over-charges pipelines
/// whose workers are busy at different times.)
pub fn simulate_shared(
    plan: &Plan,
    costs: &CostTable,
    data_load: &[f64],
    steps: usize,
    capacity: usize,
    processors: f64,
) -> Option<Prediction> {
    let steps = steps.max(1);
    let capacity = capacity.max(1);
    let processors = processors.max(1e-9);
    let mut total = 0.0;
    let mut busy_per_worker: Vec<(f64, f64)> = Vec::new();
    for phase in &plan.phases {
        let parts = stage_parts(phase, costs, data_load)?;
        let (seconds, busy) = share_phase(phase, &parts, steps, capacity, processors);
        total += seconds;
        for (s, stage) in phase.stages.iter().enumerate() {
            for _ in 0..stage.replicas() {
                busy_per_worker.push((busy[s], seconds));
            }
        }
    }
    let idle_fractions =
        busy_per_worker.iter().map(|(busy, wall)| (1.0 - busy / wall.max(1e-12)).clamp(0.0, 1.0)).collect();
    Some(Prediction { total_seconds: total, step_seconds: total / steps as f64, idle_fractions })
}

/// One stage's work per step, in seconds on a processor of its own: before
/// its send (data, input hand-off, teacher blocks), after it (student steps
/// and gradient averaging), and the optimizer-update part of the latter.
struct StageParts {
    before: f64,
    after: f64,
    update: f64,
}

fn stage_parts(phase: &Phase, costs: &CostTable, data_load: &[f64]) -> Option<Vec<StageParts>> {
    let mut parts = Vec::with_capacity(phase.stages.len());
    for stage in &phase.stages {
        let gi = stage.replicas().checked_sub(1)?;
        let mut before = if stage.loads_data { *data_load.get(gi).unwrap_or(&0.0) } else { 0.0 };
        if !stage.loads_data {
            before += *costs.input_transfer.get(stage.blocks.start)?.get(gi)?;
        }
        for k in stage.teacher_start()..stage.blocks.end {
            before += costs.teacher_forward.get(k)?.get(gi).copied()??;
        }
        let mut after = 0.0;
        let mut update = 0.0;
        for k in stage.blocks.clone() {
            after += costs.student_step.get(k)?.get(gi).copied()??;
            after += costs.gradient_average.get(k)?.get(gi).copied()?;
            update += costs.update.get(k).and_then(|row| row.get(gi)).copied().unwrap_or(0.0);
        }
        parts.push(StageParts { before, after, update: update.min(after) });
    }
    Some(parts)
}

/// Where a stage is within its current step.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Task {
    /// Waiting for its previous step to end and its input to arrive.
    Start,
    /// Data, hand-off and teacher blocks (work left).
    Before(f64),
    /// Waiting for room in the channel to the next stage.
    Send,
    /// Student steps up to the barrier, or to the step's end without one (work left).
    Train(f64),
    /// Waiting for every stage to reach the barrier.
    Barrier,
    /// The optimizer update after the barrier (work left).
    Update(f64),
    /// All steps done.
    Done,
}

impl Task {
    fn work_left(self) -> Option<f64> {
        match self {
            Task::Before(left) | Task::Train(left) | Task::Update(left) => Some(left),
            _ => None,
        }
    }

    fn progressed(self, work: f64) -> Task {
        match self {
            Task::Before(left) => Task::Before(left - work),
            Task::Train(left) => Task::Train(left - work),
            Task::Update(left) => Task::Update(left - work),
            other => other,
        }
    }
}

/// Ends the current step: the next one, or [`Task::Done`] after the last.
fn finish_step(step: &mut usize, steps: usize) -> Task {
    *step += 1;
    if *step >= steps {
        Task::Done
    } else {
        Task::Start
    }
}

/// One phase under processor sharing: its seconds and each stage's busy
/// seconds (per replica).
fn share_phase(
    phase: &Phase,
    parts: &[StageParts],
    steps: usize,
    capacity: usize,
    processors: f64,
) -> (f64, Vec<f64>) {
    let stages = &phase.stages;
    let n = stages.len();
    let relays: Vec<bool> = (0..n).map(|s| s + 1 < n && !stages[s + 1].loads_data).collect();
    let mut step = vec![0usize; n];
    let mut task = vec![Task::Start; n];
    let mut started: Vec<Vec<f64>> = vec![Vec::with_capacity(steps); n];
    let mut sent: Vec<Vec<f64>> = vec![Vec::with_capacity(steps); n];
    let mut busy = vec![0.0f64; n];
    let mut now = 0.0f64;
    loop {
        // Zero-time transitions until nothing changes.
        let mut changed = true;
        while changed {
            changed = false;
            for s in 0..n {
                let i = step[s];
                let next = match task[s] {
                    Task::Start if s > 0 && relays[s - 1] && sent[s - 1].len() <= i => None,
                    Task::Start => {
                        started[s].push(now);
                        Some(Task::Before(parts[s].before))
                    }
                    Task::Before(left) if left <= 1e-15 => Some(Task::Send),
                    Task::Send if relays[s] && i >= capacity && started[s + 1].len() <= i - capacity => None,
                    Task::Send => {
                        sent[s].push(now);
                        let train =
                            if phase.barrier { parts[s].after - parts[s].update } else { parts[s].after };
                        Some(Task::Train(train))
                    }
                    Task::Train(left) if left <= 1e-15 => {
                        Some(if phase.barrier { Task::Barrier } else { finish_step(&mut step[s], steps) })
                    }
                    Task::Barrier => {
                        let all_there = (0..n).all(|o| {
                            step[o] > i
                                || (step[o] == i && matches!(task[o], Task::Barrier | Task::Update(_)))
                        });
                        all_there.then_some(Task::Update(parts[s].update))
                    }
                    Task::Update(left) if left <= 1e-15 => Some(finish_step(&mut step[s], steps)),
                    _ => None,
                };
                if let Some(next) = next {
                    task[s] = next;
                    changed = true;
                }
            }
        }
        let computing: Vec<usize> = (0..n).filter(|&s| task[s].work_left().is_some()).collect();
        if computing.is_empty() {
            // Every stage is done (or, for an invalid plan, stuck: stop rather than spin).
            break;
        }
        // Progress the computing stages until the first of them finishes.
        let weight: f64 = computing.iter().map(|&s| stages[s].replicas() as f64).sum();
        let rate = (processors / weight).min(1.0);
        let dt = computing
            .iter()
            .filter_map(|&s| task[s].work_left())
            .map(|left| left.max(0.0) / rate)
            .fold(f64::INFINITY, f64::min);
        now += dt;
        for &s in &computing {
            busy[s] += dt;
            task[s] = task[s].progressed(dt * rate);
        }
    }
    (now, busy)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uniform(blocks: usize, teacher: f64, student: f64) -> CostTable {
        let g = 4;
        CostTable {
            teacher_forward: vec![(1..=g).map(|r| Some(teacher / r as f64)).collect(); blocks],
            student_step: vec![(1..=g).map(|r| Some(student / r as f64)).collect(); blocks],
            gradient_average: vec![vec![0.0; g]; blocks],
            input_transfer: vec![vec![0.0; g]; blocks],
            memory: vec![vec![Some(1); g]; blocks],
            update: vec![vec![0.0; g]; blocks],
        }
    }

    #[test]
    fn a_balanced_pipeline_approaches_its_slowest_stage() {
        let costs = uniform(4, 1.0, 1.0);
        let steps = 1000;
        let ideal = simulate(&Plan::ideal(4), &costs, &[0.0; 4], steps, 2).unwrap();
        assert!((ideal.step_seconds - 8.0).abs() < 1e-9);
        let tr = simulate(&Plan::tr(&[1.0; 4], 2, true), &costs, &[0.0; 4], steps, 2).unwrap();
        // Two stages of 4 s each, plus a fill of one stage's teacher part.
        assert!((tr.step_seconds - 4.0).abs() < 0.01, "{}", tr.step_seconds);
        // DP: phase k recomputes k teacher blocks, halved over 2 replicas.
        let dp = simulate(&Plan::dp(4, 2), &costs, &[0.0; 4], steps, 2).unwrap();
        let expected = (1..=4).map(|k| (k as f64 + 1.0) / 2.0).sum::<f64>();
        assert!((dp.step_seconds - expected).abs() < 1e-9, "{} vs {expected}", dp.step_seconds);
    }

    #[test]
    fn a_barrier_makes_the_fast_stage_wait_for_the_slow_one() {
        let costs = uniform(2, 1.0, 3.0);
        let steps = 200;
        let decoupled = simulate(&Plan::tr(&[1.0, 1.0], 2, true), &costs, &[0.0; 4], steps, 2).unwrap();
        let barrier = simulate(&Plan::tr(&[1.0, 1.0], 2, false), &costs, &[0.0; 4], steps, 2).unwrap();
        // Without the barrier each stage needs 4 s per step; with it, stage 2
        // cannot start step i before stage 1 sent it (1 s in), so 5 s.
        assert!((decoupled.step_seconds - 4.0).abs() < 0.05, "{}", decoupled.step_seconds);
        assert!((barrier.step_seconds - 5.0).abs() < 0.05, "{}", barrier.step_seconds);
        assert!(barrier.idle_fractions[0] > decoupled.idle_fractions[0]);
    }

    #[test]
    fn workers_sharing_fewer_processors_slow_down() {
        let costs = uniform(4, 1.0, 1.0);
        // DP over 3 replicas keeps all 3 busy: on 2 processors, 1.5x slower.
        let own = simulate(&Plan::dp(4, 3), &costs, &[0.0; 4], 100, 2).unwrap();
        let shared = simulate_shared(&Plan::dp(4, 3), &costs, &[0.0; 4], 100, 2, 2.0).unwrap();
        assert!(
            (shared.step_seconds / own.step_seconds - 1.5).abs() < 0.01,
            "{} {}",
            shared.step_seconds,
            own.step_seconds
        );
        // Enough processors: no change.
        let plenty = simulate_shared(&Plan::dp(4, 3), &costs, &[0.0; 4], 100, 2, 8.0).unwrap();
        assert!((plenty.step_seconds - own.step_seconds).abs() < 1e-12);
    }

    #[test]
    fn processor_sharing_with_plenty_of_processors_is_the_plain_simulation() {
        let mut costs = uniform(4, 1.0, 2.0);
        costs.student_step[2] = vec![Some(5.0), Some(2.6), Some(1.7), Some(1.3)];
        costs.update = vec![vec![0.3; 4]; 4];
        let plans = [
            Plan::ideal(4),
            Plan::dp(4, 3),
            Plan::ls(&[1.0, 1.0, 3.0, 1.0], 3),
            Plan::tr(&[1.0, 1.0, 3.0, 1.0], 3, false),
            Plan::tr(&[1.0, 1.0, 3.0, 1.0], 2, true),
        ];
        for plan in plans {
            for capacity in [1, 2, 4] {
                let plain = simulate(&plan, &costs, &[0.1; 4], 50, capacity).unwrap();
                let shared = simulate_shared(&plan, &costs, &[0.1; 4], 50, capacity, 64.0).unwrap();
                assert!(
                    (plain.total_seconds - shared.total_seconds).abs() < 1e-6 * plain.total_seconds,
                    "{}: {} vs {}",
                    plan.name,
                    plain.total_seconds,
                    shared.total_seconds
                );
                for (a, b) in plain.idle_fractions.iter().zip(&shared.idle_fractions) {
                    assert!((a - b).abs() < 1e-6, "{}: idle {a} vs {b}", plan.name);
                }
            }
        }
    }

    #[test]
    fn one_processor_runs_exactly_the_total_work() {
        // On one processor, with some stage always computing, a step takes
        // the sum of every stage's work: teacher and student of stage 1, and
        // stage 2's own teacher block and student, 4 s.
        let costs = uniform(2, 1.0, 1.0);
        for decoupled in [false, true] {
            let plan = Plan::tr(&[1.0, 1.0], 2, decoupled);
            let one = simulate_shared(&plan, &costs, &[0.0; 4], 200, 2, 1.0).unwrap();
            assert!((one.step_seconds - 4.0).abs() < 0.05, "{}", one.step_seconds);
            let own = simulate(&plan, &costs, &[0.0; 4], 200, 2).unwrap();
            assert!(own.step_seconds < 3.5, "{}", own.step_seconds);
        }
    }

    #[test]
    fn a_small_channel_throttles_a_fast_producer() {
        // Stage 1 produces every 1 s, stage 2 consumes every 3 s: with any
        // capacity the steady state is stage 2's pace, and stage 1 idles.
        let mut costs = uniform(2, 0.5, 0.5);
        costs.student_step[1] = vec![Some(2.5); 4];
        let p = simulate(&Plan::tr(&[1.0, 1.0], 2, true), &costs, &[0.0; 4], 300, 1).unwrap();
        assert!((p.step_seconds - 3.0).abs() < 0.05, "{}", p.step_seconds);
        assert!(p.idle_fractions[0] > 0.6, "{:?}", p.idle_fractions);
    }
}
