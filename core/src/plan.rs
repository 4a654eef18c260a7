//! Schedules as data.
//!
//! A [`Plan`] says which device slots train which student blocks, where each
//! worker gets its input (the data loader, or the previous stage's teacher
//! activation), and whether a global barrier precedes each optimizer step.
//! Every named schedule of the paper (`ideal`, `dp`, `ls`, `tr`, `tr-dpu`), a
//! hand-written hybrid and (later) the planner's output are values of this
//! one type, interpreted by one runtime (the engine's `runtime`); nothing else in
//! the code knows the schedule names.

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::BlockSpec;

/// One pipeline stage: a contiguous range of blocks, trained by `slots.len()`
/// data-parallel replicas.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stage {
    /// Student blocks trained here (zero-based, contiguous).
    pub blocks: Range<usize>,
    /// Device slots of the replicas (indices into the run's device list).
    /// Replica r of g handles samples `r*B/g .. (r+1)*B/g` of each batch.
    pub slots: Vec<usize>,
    /// True when this stage reads the data itself and recomputes the teacher
    /// prefix `0..blocks.start`; false when it receives the teacher's
    /// activation at `blocks.start` from the previous stage.
    pub loads_data: bool,
}

impl Stage {
    /// Number of replicas.
    pub fn replicas(&self) -> usize {
        self.slots.len()
    }

    /// First teacher block this stage runs.
    pub fn teacher_start(&self) -> usize {
        if self.loads_data {
            0
        } else {
            self.blocks.start
        }
    }
}

/// Stages that run together, pipelined; phases run one after another.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Phase {
    /// The stages, in pipeline order.
    pub stages: Vec<Stage>,
    /// A global barrier across all workers of the phase before every
    /// optimizer step (teacher relaying without decoupled updates).
    pub barrier: bool,
}

/// A whole schedule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Name shown in reports (`tr-dpu`, `hybrid`, ...).
    pub name: String,
    /// Phases, run one after another (only `dp` has more than one).
    pub phases: Vec<Phase>,
}

/// A stage as written by a user: one-based blocks and a replica count.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageSpec {
    /// The blocks of the stage, one-based, contiguous and ascending (`[2, 3]`).
    pub blocks: Vec<usize>,
    /// Data-parallel replicas of the stage (default 1).
    #[serde(default = "one")]
    pub replicas: usize,
}

fn one() -> usize {
    1
}

/// The schedules a plan can be built by, by name. The one place that knows
/// schedule names: configs, the CLI and reports parse and print them here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// One device slot trains every block ([`Plan::ideal`]).
    Ideal,
    /// Blocks one after another, each data parallel ([`Plan::dp`]).
    Dp,
    /// Layer split, every device recomputes its teacher prefix ([`Plan::ls`]).
    Ls,
    /// Teacher relaying with a barrier before each step ([`Plan::tr`]).
    Tr,
    /// Teacher relaying with decoupled updates ([`Plan::tr`]).
    TrDpu,
    /// User stages with replicas ([`Plan::hybrid`]).
    Hybrid,
    /// Automatic hybrid distribution: planned from a measured profile by
    /// the engine's planner.
    Auto,
}

impl Schedule {
    /// Every schedule, in the order the documentation lists them.
    pub const ALL: [Schedule; 7] = [
        Schedule::Ideal,
        Schedule::Dp,
        Schedule::Ls,
        Schedule::Tr,
        Schedule::TrDpu,
        Schedule::Hybrid,
        Schedule::Auto,
    ];

    /// What `pipebd bench` compares unless told otherwise: the paper's two
    /// baselines and its two schedules.
    pub const BENCHED: [Schedule; 4] = [Schedule::Dp, Schedule::Ls, Schedule::Tr, Schedule::TrDpu];

    /// The name as written in configs and reports (`tr-dpu`).
    pub fn name(self) -> &'static str {
        match self {
            Schedule::Ideal => "ideal",
            Schedule::Dp => "dp",
            Schedule::Ls => "ls",
            Schedule::Tr => "tr",
            Schedule::TrDpu => "tr-dpu",
            Schedule::Hybrid => "hybrid",
            Schedule::Auto => "auto",
        }
    }

    /// The schedule called `name`, or an error listing the names.
    pub fn parse(name: &str) -> Result<Self, PlanError> {
        Self::ALL.into_iter().find(|s| s.name() == name).ok_or_else(|| {
            PlanError(format!("unknown schedule `{name}`: expected one of {}", Self::names().join(", ")))
        })
    }

    /// Every name, in order.
    pub fn names() -> Vec<&'static str> {
        Self::ALL.iter().map(|s| s.name()).collect()
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a plan cannot be built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanError(pub String);

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Plan {
    /// The single-device reference: one worker runs the teacher once and
    /// trains every block.
    pub fn ideal(blocks: usize) -> Self {
        Self {
            name: Schedule::Ideal.name().into(),
            phases: vec![Phase {
                stages: vec![Stage { blocks: 0..blocks, slots: vec![0], loads_data: true }],
                barrier: false,
            }],
        }
    }

    /// The DNA-style baseline: blocks trained one after another, each data
    /// parallel over all `devices`, recomputing the teacher prefix.
    pub fn dp(blocks: usize, devices: usize) -> Self {
        let phases = (0..blocks)
            .map(|k| Phase {
                stages: vec![Stage { blocks: k..k + 1, slots: (0..devices).collect(), loads_data: true }],
                barrier: false,
            })
            .collect();
        Self { name: Schedule::Dp.name().into(), phases }
    }

    /// Layer split: a fixed block-to-device map (contiguous ranges balanced
    /// by `cost`), every device loading data and recomputing the teacher
    /// prefix up to its own blocks.
    pub fn ls(cost: &[f64], devices: usize) -> Self {
        let stages = balanced_ranges(cost, devices)
            .into_iter()
            .enumerate()
            .map(|(d, blocks)| Stage { blocks, slots: vec![d], loads_data: true })
            .collect();
        Self { name: Schedule::Ls.name().into(), phases: vec![Phase { stages, barrier: false }] }
    }

    /// Teacher relaying: contiguous ranges balanced by `cost`, only the first
    /// device reads data, each passes its last teacher activation on; a global
    /// barrier before each step (`decoupled = false`) or none (`tr-dpu`).
    pub fn tr(cost: &[f64], devices: usize, decoupled: bool) -> Self {
        let stages = balanced_ranges(cost, devices)
            .into_iter()
            .enumerate()
            .map(|(d, blocks)| Stage { blocks, slots: vec![d], loads_data: d == 0 })
            .collect();
        let name = if decoupled { Schedule::TrDpu } else { Schedule::Tr }.name();
        Self { name: name.into(), phases: vec![Phase { stages, barrier: !decoupled }] }
    }

    /// A hybrid (AHD-style) plan from user stages: teacher relaying with
    /// decoupled updates, where a stage may be replicated.
    pub fn hybrid(specs: &[StageSpec], blocks: usize, devices: usize) -> Result<Self, PlanError> {
        let mut stages = Vec::new();
        let mut next_block = 0;
        let mut next_slot = 0;
        for (i, spec) in specs.iter().enumerate() {
            let first = *spec
                .blocks
                .first()
                .ok_or_else(|| PlanError(format!("stage {}: `blocks` is empty", i + 1)))?;
            let expected: Vec<usize> = (first..first + spec.blocks.len()).collect();
            if spec.blocks != expected {
                return Err(PlanError(format!(
                    "stage {}: blocks {:?} are not contiguous and ascending",
                    i + 1,
                    spec.blocks
                )));
            }
            if first != next_block + 1 {
                return Err(PlanError(format!(
                    "stage {}: starts at block {first}, expected block {} (stages must cover the blocks in order)",
                    i + 1,
                    next_block + 1
                )));
            }
            if spec.replicas == 0 {
                return Err(PlanError(format!("stage {}: `replicas` must be at least 1", i + 1)));
            }
            let range = next_block..next_block + spec.blocks.len();
            next_block = range.end;
            let slots: Vec<usize> = (next_slot..next_slot + spec.replicas).collect();
            next_slot += spec.replicas;
            stages.push(Stage { blocks: range, slots, loads_data: i == 0 });
        }
        if next_block != blocks {
            return Err(PlanError(format!(
                "the stages cover blocks 1..={next_block}, but there are {blocks} blocks"
            )));
        }
        if next_slot != devices {
            return Err(PlanError(format!(
                "the stages use {next_slot} device slots (sum of replicas), but {devices} devices are given"
            )));
        }
        Ok(Self { name: Schedule::Hybrid.name().into(), phases: vec![Phase { stages, barrier: false }] })
    }

    /// A plan by schedule name, for `blocks` blocks over `devices` device
    /// slots. `cost` (one entry per block) balances the stage cuts of `ls` /
    /// `tr`; `hybrid` takes its stages from `hybrid`. `auto` is planned from
    /// a profile by the engine's planner, not here.
    pub fn named(
        name: &str,
        blocks: usize,
        devices: usize,
        cost: &[f64],
        hybrid: &[StageSpec],
    ) -> Result<Self, PlanError> {
        let schedule = Schedule::parse(name)?;
        if devices == 0 {
            return Err(PlanError("at least one device is needed".into()));
        }
        let needs_split = matches!(schedule, Schedule::Ls | Schedule::Tr | Schedule::TrDpu);
        if needs_split && devices > blocks {
            return Err(PlanError(format!(
                "`{name}` gives each device at least one block: {devices} devices but only {blocks} blocks"
            )));
        }
        match schedule {
            Schedule::Ideal => Ok(Self::ideal(blocks)),
            Schedule::Dp => Ok(Self::dp(blocks, devices)),
            Schedule::Ls => Ok(Self::ls(cost, devices)),
            Schedule::Tr => Ok(Self::tr(cost, devices, false)),
            Schedule::TrDpu => Ok(Self::tr(cost, devices, true)),
            Schedule::Hybrid => {
                if hybrid.is_empty() {
                    return Err(PlanError("schedule `hybrid` needs [[stages]] entries in the config".into()));
                }
                Self::hybrid(hybrid, blocks, devices)
            }
            Schedule::Auto => Err(PlanError("`auto` is planned from a profile, not by name".into())),
        }
    }

    /// Device slots the plan uses.
    pub fn slots(&self) -> usize {
        self.phases.iter().flat_map(|p| &p.stages).flat_map(|s| &s.slots).max().map_or(0, |m| m + 1)
    }

    /// A one-line description: `{1 x2 | 2-3 | 4}` per phase.
    pub fn describe(&self) -> String {
        self.phases
            .iter()
            .map(|phase| {
                let stages: Vec<String> = phase
                    .stages
                    .iter()
                    .map(|s| {
                        let data = if s.loads_data && s.blocks.start > 0 { " (recompute)" } else { "" };
                        format!("{}{data}", describe_stage(&s.blocks, s.replicas()))
                    })
                    .collect();
                format!("{{{}}}{}", stages.join(" | "), if phase.barrier { " barrier" } else { "" })
            })
            .collect::<Vec<_>>()
            .join(" then ")
    }
}

/// One stage as users write it: one-based blocks and replicas, `2-3 x2`.
pub fn describe_stage(blocks: &Range<usize>, replicas: usize) -> String {
    let range = if blocks.len() == 1 {
        format!("{}", blocks.start + 1)
    } else {
        format!("{}-{}", blocks.start + 1, blocks.end)
    };
    if replicas > 1 {
        format!("{range} x{replicas}")
    } else {
        range
    }
}

/// A per-block cost proxy from specs: teacher forward FLOPs plus three times
/// the student's (forward, backward, update).
pub fn flops_cost(teacher: &[BlockSpec], student: &[BlockSpec]) -> Vec<f64> {
    teacher.iter().zip(student).map(|(t, s)| t.flops as f64 + 3.0 * s.flops as f64).collect()
}

/// Cuts `cost.len()` blocks into `parts` non-empty contiguous ranges
/// minimising the largest range sum (exact, by dynamic programming).
pub fn balanced_ranges(cost: &[f64], parts: usize) -> Vec<Range<usize>> {
    let n = cost.len();
    let parts = parts.clamp(1, n.max(1));
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(cost.iter().scan(0.0, |acc, c| {
            *acc += c;
            Some(*acc)
        }))
        .collect();
    // best[p][i]: minimal max-sum cutting the first i blocks into p ranges.
    let mut best = vec![vec![f64::INFINITY; n + 1]; parts + 1];
    let mut cut = vec![vec![0usize; n + 1]; parts + 1];
    best[0][0] = 0.0;
    for p in 1..=parts {
        for i in p..=n {
            for j in (p - 1)..i {
                let value = best[p - 1][j].max(prefix[i] - prefix[j]);
                if value < best[p][i] {
                    best[p][i] = value;
                    cut[p][i] = j;
                }
            }
        }
    }
    let mut ranges = Vec::with_capacity(parts);
    let mut end = n;
    for p in (1..=parts).rev() {
        let start = cut[p][end];
        ranges.push(start..end);
        end = start;
    }
    ranges.reverse();
    ranges
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_ranges_are_contiguous_and_minimise_the_largest_part() {
        let cost = [1.0, 10.0, 10.0, 1.0];
        let ranges = balanced_ranges(&cost, 2);
        assert_eq!(ranges, vec![0..2, 2..4]);
        let ranges = balanced_ranges(&cost, 3);
        assert_eq!(ranges.len(), 3);
        let largest = ranges.iter().map(|r| cost[r.clone()].iter().sum::<f64>()).fold(0.0, f64::max);
        assert_eq!(largest, 11.0);
    }

    #[test]
    fn hybrid_rejects_gaps_overlaps_and_wrong_device_counts() {
        let s = |blocks: Vec<usize>, replicas| StageSpec { blocks, replicas };
        assert!(Plan::hybrid(&[s(vec![1], 2), s(vec![2, 3], 1), s(vec![4], 1)], 4, 4).is_ok());
        assert!(Plan::hybrid(&[s(vec![1], 2), s(vec![3, 4], 1)], 4, 3)
            .unwrap_err()
            .0
            .contains("expected block 2"));
        assert!(Plan::hybrid(&[s(vec![1, 3], 1), s(vec![4], 1)], 4, 2).unwrap_err().0.contains("contiguous"));
        assert!(Plan::hybrid(&[s(vec![1, 2], 1), s(vec![3, 4], 1)], 4, 3)
            .unwrap_err()
            .0
            .contains("3 devices"));
        assert!(Plan::hybrid(&[s(vec![1, 2], 1)], 4, 1).unwrap_err().0.contains("4 blocks"));
    }

    #[test]
    fn dp_has_one_phase_per_block_over_all_devices() {
        let plan = Plan::dp(3, 2);
        assert_eq!(plan.phases.len(), 3);
        assert!(plan.phases.iter().all(|p| p.stages.len() == 1 && p.stages[0].slots == vec![0, 1]));
        assert_eq!(plan.describe(), "{1 x2} then {2 x2 (recompute)} then {3 x2 (recompute)}");
    }

    #[test]
    fn tr_relays_and_ls_recomputes() {
        let cost = [1.0, 1.0, 1.0, 1.0];
        let tr = Plan::tr(&cost, 2, false);
        assert!(tr.phases[0].barrier);
        assert_eq!(tr.phases[0].stages.iter().map(|s| s.teacher_start()).collect::<Vec<_>>(), vec![0, 2]);
        let ls = Plan::ls(&cost, 2);
        assert_eq!(ls.phases[0].stages.iter().map(|s| s.teacher_start()).collect::<Vec<_>>(), vec![0, 0]);
        assert!(Plan::named("tr", 2, 3, &[1.0, 1.0], &[]).is_err());
    }

    #[test]
    fn every_schedule_name_parses_back_and_unknown_names_list_them() {
        for schedule in Schedule::ALL {
            assert_eq!(Schedule::parse(schedule.name()), Ok(schedule));
        }
        let err = Schedule::parse("pipedream").unwrap_err().0;
        assert!(err.contains("pipedream") && err.contains("tr-dpu") && err.contains("auto"), "{err}");
    }
}
