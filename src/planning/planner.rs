//! The AHD planner: cut K blocks into contiguous stages and give each stage
//! a replica count, using every one of W device slots, so that the slowest
//! stage is as fast as possible and every stage fits in device memory.
//!
//! Exact, by dynamic programming over prefixes: `best[j][w]` is the best
//! bottleneck for the first `j` blocks on `w` slots, and
//! `best[j][w] = min over i < j, 1 <= g <= w of max(best[i][w - g], cost(i..j, g))`.
//! That is O(K^2 W^2) stage evaluations (W = 64, K = 48 in well under a
//! second), and it keeps the `keep` best plans per state so the runner-ups
//! can be shown.

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// Measured costs the planner works from. Index `[k][g - 1]` is block `k`
/// (zero-based) run by a stage of `g` replicas, each on `batch / g` samples.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostTable {
    /// Teacher forward seconds per step; `None` where infeasible (out of memory).
    pub teacher_forward: Vec<Vec<Option<f64>>>,
    /// Student forward + backward + optimizer step seconds per step.
    pub student_step: Vec<Vec<Option<f64>>>,
    /// Seconds per step to average the block's student gradients over `g` replicas.
    pub gradient_average: Vec<Vec<f64>>,
    /// Seconds to receive block `k`'s input at `batch / g`: the data load for
    /// block 0, the transfer of block `k - 1`'s output otherwise.
    pub input_transfer: Vec<Vec<f64>>,
    /// Peak bytes a replica needs for block `k` (teacher and student).
    pub memory: Vec<Vec<Option<u64>>>,
    /// The optimizer-update part of `student_step` (what a barrier delays).
    #[serde(default)]
    pub update: Vec<Vec<f64>>,
}

impl CostTable {
    /// Number of blocks.
    pub fn blocks(&self) -> usize {
        self.teacher_forward.len()
    }

    /// Seconds per step of every block on one replica (teacher forward and
    /// student step), for comparing devices; infeasible entries count 0.
    pub fn single_replica_seconds(&self) -> f64 {
        let first = |rows: &Vec<Vec<Option<f64>>>| {
            rows.iter().map(|r| r.first().copied().flatten().unwrap_or(0.0)).sum::<f64>()
        };
        first(&self.teacher_forward) + first(&self.student_step)
    }

    /// The table of the slowest of `tables` entry by entry (infeasible if
    /// any is), for planning over devices that differ; an error when their
    /// shapes differ (other blocks or replica counts).
    pub fn slowest(tables: &[CostTable]) -> std::result::Result<CostTable, String> {
        let first = tables.first().ok_or("no cost tables")?.clone();
        let shape = |t: &CostTable| (t.blocks(), t.max_replicas());
        let mut out = first;
        for (i, t) in tables.iter().enumerate().skip(1) {
            if shape(t) != shape(&out) {
                return Err(format!(
                    "cost table {i} covers {:?} (blocks, replicas), the first {:?}",
                    shape(t),
                    shape(&out)
                ));
            }
            let worst_opt = |a: &mut Vec<Vec<Option<f64>>>, b: &Vec<Vec<Option<f64>>>| {
                for (ra, rb) in a.iter_mut().zip(b) {
                    for (x, y) in ra.iter_mut().zip(rb) {
                        *x = match (*x, *y) {
                            (Some(p), Some(q)) => Some(p.max(q)),
                            _ => None,
                        };
                    }
                }
            };
            let worst = |a: &mut Vec<Vec<f64>>, b: &Vec<Vec<f64>>| {
                for (ra, rb) in a.iter_mut().zip(b) {
                    for (x, y) in ra.iter_mut().zip(rb) {
                        *x = x.max(*y);
                    }
                }
            };
            worst_opt(&mut out.teacher_forward, &t.teacher_forward);
            worst_opt(&mut out.student_step, &t.student_step);
            worst(&mut out.gradient_average, &t.gradient_average);
            worst(&mut out.input_transfer, &t.input_transfer);
            worst(&mut out.update, &t.update);
            for (ra, rb) in out.memory.iter_mut().zip(&t.memory) {
                for (x, y) in ra.iter_mut().zip(rb) {
                    *x = match (*x, *y) {
                        (Some(p), Some(q)) => Some(p.max(q)),
                        _ => None,
                    };
                }
            }
        }
        Ok(out)
    }

    /// Largest replica count the table covers.
    pub fn max_replicas(&self) -> usize {
        self.teacher_forward.first().map_or(0, |row| row.len())
    }

    /// Seconds per step of a stage running `blocks` on `g` replicas, or
    /// `None` if some entry is infeasible or over `memory_limit`.
    pub fn stage_cost(&self, blocks: Range<usize>, g: usize, memory_limit: Option<u64>) -> Option<f64> {
        let gi = g.checked_sub(1)?;
        let mut seconds = *self.input_transfer.get(blocks.start)?.get(gi)?;
        let mut bytes = 0u64;
        for k in blocks {
            seconds += self.teacher_forward[k].get(gi).copied()??;
            seconds += self.student_step[k].get(gi).copied()??;
            seconds += self.gradient_average[k].get(gi).copied()?;
            bytes += self.memory[k].get(gi).copied()??;
        }
        match memory_limit {
            Some(limit) if bytes > limit => None,
            _ => Some(seconds),
        }
    }
}

/// One stage of a planned schedule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedStage {
    /// Blocks (zero-based, contiguous).
    pub blocks: Range<usize>,
    /// Replicas.
    pub replicas: usize,
}

/// A candidate plan with its predicted step time (its slowest stage).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// Predicted seconds per step.
    pub step_seconds: f64,
    /// The stages, in block order.
    pub stages: Vec<PlannedStage>,
}

impl Candidate {
    /// `{1 x2 | 2-3 | 4-6}` (one-based blocks).
    pub fn describe(&self) -> String {
        let stages: Vec<String> =
            self.stages.iter().map(|s| crate::plan::describe_stage(&s.blocks, s.replicas)).collect();
        format!("{{{}}}", stages.join(" | "))
    }
}

/// A partial plan in the DP table: bottleneck so far and how it was reached.
#[derive(Clone)]
struct Entry {
    bottleneck: f64,
    /// (previous prefix end, replicas of the last stage, rank in the previous state's list)
    back: Option<(usize, usize, usize)>,
}

/// The `keep` best plans of `costs` on exactly `slots` device slots, best
/// first, each stage within `memory_limit` bytes per replica. Empty when no
/// plan is feasible.
pub fn plan(costs: &CostTable, slots: usize, memory_limit: Option<u64>, keep: usize) -> Vec<Candidate> {
    let k = costs.blocks();
    let keep = keep.max(1);
    if k == 0 || slots == 0 {
        return Vec::new();
    }
    // best[j][w]: up to `keep` entries, ascending bottleneck.
    let mut best: Vec<Vec<Vec<Entry>>> = vec![vec![Vec::new(); slots + 1]; k + 1];
    best[0][0].push(Entry { bottleneck: 0.0, back: None });
    let max_g = costs.max_replicas().min(slots);
    for j in 1..=k {
        for i in 0..j {
            for g in 1..=max_g {
                let Some(cost) = costs.stage_cost(i..j, g, memory_limit) else {
                    continue;
                };
                for w in g..=slots {
                    if best[i][w - g].is_empty() {
                        continue;
                    }
                    let mut additions = Vec::new();
                    for (rank, prev) in best[i][w - g].iter().enumerate() {
                        additions
                            .push(Entry { bottleneck: prev.bottleneck.max(cost), back: Some((i, g, rank)) });
                    }
                    let list = &mut best[j][w];
                    list.extend(additions);
                    list.sort_by(|a, b| a.bottleneck.total_cmp(&b.bottleneck));
                    list.truncate(keep);
                }
            }
        }
    }
    (0..best[k][slots].len()).map(|rank| rebuild(&best, k, slots, rank)).collect()
}

fn rebuild(best: &[Vec<Vec<Entry>>], blocks: usize, slots: usize, rank: usize) -> Candidate {
    let step_seconds = best[blocks][slots][rank].bottleneck;
    let mut stages = Vec::new();
    let (mut j, mut w, mut r) = (blocks, slots, rank);
    while let Some((i, g, prev_rank)) = best[j][w][r].back {
        stages.push(PlannedStage { blocks: i..j, replicas: g });
        j = i;
        w -= g;
        r = prev_rank;
    }
    stages.reverse();
    Candidate { step_seconds, stages }
}

/// Every plan by enumeration (the tests' oracle): each way to cut the
/// blocks into contiguous stages, each assignment of replicas summing to `slots`.
#[cfg(test)]
fn brute_force(costs: &CostTable, slots: usize, memory_limit: Option<u64>) -> Vec<Candidate> {
    let k = costs.blocks();
    let mut out = Vec::new();
    // Cut points: a bitmask over the K-1 gaps between blocks.
    for mask in 0u64..(1u64 << k.saturating_sub(1)) {
        let mut ranges = Vec::new();
        let mut start = 0;
        for gap in 0..k.saturating_sub(1) {
            if mask & (1 << gap) != 0 {
                ranges.push(start..gap + 1);
                start = gap + 1;
            }
        }
        ranges.push(start..k);
        let mut replicas = vec![1; ranges.len()];
        assign(costs, slots, memory_limit, &ranges, 0, &mut replicas, &mut out);
    }
    out.sort_by(|a, b| a.step_seconds.total_cmp(&b.step_seconds));
    out
}

/// Every assignment of replicas to the stages of a cut (the oracle's inner loop).
#[cfg(test)]
fn assign(
    costs: &CostTable,
    slots: usize,
    memory_limit: Option<u64>,
    ranges: &[Range<usize>],
    s: usize,
    replicas: &mut Vec<usize>,
    out: &mut Vec<Candidate>,
) {
    if s == ranges.len() {
        if replicas.iter().sum::<usize>() != slots {
            return;
        }
        let mut worst = 0.0f64;
        for (range, &g) in ranges.iter().zip(replicas.iter()) {
            match costs.stage_cost(range.clone(), g, memory_limit) {
                Some(c) => worst = worst.max(c),
                None => return,
            }
        }
        let stages = ranges
            .iter()
            .zip(replicas.iter())
            .map(|(r, &g)| PlannedStage { blocks: r.clone(), replicas: g })
            .collect();
        out.push(Candidate { step_seconds: worst, stages });
        return;
    }
    let used: usize = replicas[..s].iter().sum();
    for g in 1..=slots.saturating_sub(used) {
        replicas[s] = g;
        assign(costs, slots, memory_limit, ranges, s + 1, replicas, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Random costs shaped like real ones: work shrinks with replicas,
    /// averaging and transfers grow, a few entries infeasible.
    fn random_table(rng: &mut StdRng, blocks: usize, max_g: usize) -> CostTable {
        let mut table = CostTable {
            teacher_forward: vec![],
            student_step: vec![],
            gradient_average: vec![],
            input_transfer: vec![],
            memory: vec![],
            update: vec![],
        };
        for _ in 0..blocks {
            let t: f64 = rng.random_range(0.1..10.0);
            let s: f64 = rng.random_range(0.1..10.0);
            let m: u64 = rng.random_range(1..100);
            let feasible = |rng: &mut StdRng| rng.random_range(0..20) != 0;
            table.teacher_forward.push(
                (1..=max_g)
                    .map(|g| feasible(rng).then_some(t / g as f64 * rng.random_range(1.0..1.3)))
                    .collect(),
            );
            table
                .student_step
                .push((1..=max_g).map(|g| Some(s / g as f64 * rng.random_range(1.0..1.3))).collect());
            table
                .gradient_average
                .push((1..=max_g).map(|g| if g == 1 { 0.0 } else { rng.random_range(0.0..1.0) }).collect());
            table.input_transfer.push((1..=max_g).map(|_| rng.random_range(0.0..0.5)).collect());
            table.memory.push((1..=max_g).map(|g| Some(m.div_ceil(g as u64) + 10)).collect());
        }
        table
    }

    #[test]
    fn the_slowest_table_takes_each_entrys_worst_and_refuses_other_shapes() {
        let mut rng = StdRng::seed_from_u64(3);
        let (a, b) = (random_table(&mut rng, 4, 3), random_table(&mut rng, 4, 3));
        let worst = CostTable::slowest(&[a.clone(), b.clone()]).unwrap();
        for k in 0..4 {
            for g in 0..3 {
                let expected = match (a.teacher_forward[k][g], b.teacher_forward[k][g]) {
                    (Some(x), Some(y)) => Some(x.max(y)),
                    _ => None,
                };
                assert_eq!(worst.teacher_forward[k][g], expected, "block {k}, g {g}");
                let step = a.student_step[k][g].unwrap().max(b.student_step[k][g].unwrap());
                assert_eq!(worst.student_step[k][g], Some(step));
                assert_eq!(worst.input_transfer[k][g], a.input_transfer[k][g].max(b.input_transfer[k][g]));
            }
        }
        assert!(worst.single_replica_seconds() >= a.single_replica_seconds().max(b.single_replica_seconds()));
        let other = random_table(&mut rng, 5, 3);
        assert!(CostTable::slowest(&[a, other]).unwrap_err().contains("(5, 3)"));
    }

    #[test]
    fn dynamic_programming_matches_brute_force_on_random_profiles() {
        let mut rng = StdRng::seed_from_u64(7);
        for blocks in 1..=7 {
            for slots in 1..=6 {
                for trial in 0..4 {
                    let table = random_table(&mut rng, blocks, slots);
                    let limit = (trial % 2 == 1).then_some(150);
                    let exact = brute_force(&table, slots, limit);
                    let planned = plan(&table, slots, limit, 3);
                    assert_eq!(exact.is_empty(), planned.is_empty(), "K={blocks} W={slots}");
                    for (p, e) in planned.iter().zip(&exact) {
                        assert!(
                            (p.step_seconds - e.step_seconds).abs() < 1e-12,
                            "K={blocks} W={slots}: {} vs brute force {}",
                            p.step_seconds,
                            e.step_seconds
                        );
                    }
                    if let Some(best) = planned.first() {
                        let used: usize = best.stages.iter().map(|s| s.replicas).sum();
                        assert_eq!(used, slots);
                        let covered: Vec<usize> = best.stages.iter().flat_map(|s| s.blocks.clone()).collect();
                        assert_eq!(covered, (0..blocks).collect::<Vec<_>>());
                        let worst = best
                            .stages
                            .iter()
                            .map(|s| table.stage_cost(s.blocks.clone(), s.replicas, limit).unwrap())
                            .fold(0.0, f64::max);
                        assert!((worst - best.step_seconds).abs() < 1e-12);
                    }
                }
            }
        }
    }

    #[test]
    fn memory_limit_forces_replication_or_splitting() {
        // Two blocks of 60 bytes each on one replica: together they do not fit in 100.
        let table = CostTable {
            teacher_forward: vec![vec![Some(1.0), Some(0.5)]; 2],
            student_step: vec![vec![Some(1.0), Some(0.5)]; 2],
            gradient_average: vec![vec![0.0, 0.1]; 2],
            input_transfer: vec![vec![0.0, 0.0]; 2],
            memory: vec![vec![Some(60), Some(30)]; 2],
            update: vec![vec![0.0, 0.0]; 2],
        };
        let unlimited = plan(&table, 2, None, 1);
        let limited = plan(&table, 1, Some(100), 1);
        assert!(limited.is_empty(), "one slot cannot hold both blocks");
        assert!(!unlimited.is_empty());
        let fits = plan(&table, 2, Some(100), 5);
        assert!(fits.iter().all(|c| c.stages.iter().all(|s| s
            .blocks
            .clone()
            .map(|k| table.memory[k][s.replicas - 1].unwrap())
            .sum::<u64>()
            <= 100)));
    }
}
