//! What happens when a device slot is lost: the new plan over the
//! survivors, and what the report says about it.
//!
//! - One replica of a replicated stage lost: the stage keeps its other
//!   replicas, and the batch shares are recomputed over them (the lost
//!   replica's samples move to the others). No state is lost: the stage
//!   leader holds the optimizer state.
//! - A whole stage lost (its only worker, or a stage leader with the
//!   optimizer state): the planner places the blocks over the surviving
//!   slots from the run's cost table (the profile for `auto`, FLOPs
//!   otherwise), and the lost blocks restart from their last checkpoint.

use serde::{Deserialize, Serialize};

use crate::plan::{Plan, StageSpec};
use crate::planner::{plan as best_plans, CostTable};

/// One block that restarted from a checkpoint after a failure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RestoredBlock {
    /// One-based block.
    pub block: usize,
    /// Steps the block had completed when its worker was lost.
    pub lost_at: usize,
    /// The step it restarted from (its newest checkpoint; 0 without one).
    pub resumed_at: usize,
}

/// One worker failure and what the run did about it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailureRecord {
    /// One-based stage of the failed worker.
    pub stage: usize,
    /// Its replica within the stage.
    pub replica: usize,
    /// Its device slot (excluded from then on).
    pub slot: usize,
    /// The error.
    pub error: String,
    /// What was done: re-routing to the other replicas, or re-planning.
    pub action: String,
    /// The plan in force before.
    pub old_plan: String,
    /// The plan after.
    pub new_plan: String,
    /// Blocks that restarted from a checkpoint.
    pub restored: Vec<RestoredBlock>,
    /// Block steps of training discarded (sum over restored blocks).
    pub steps_lost: usize,
    /// Seconds the worker had been silent when it was declared lost (a
    /// hang; 0 for an error or a panic, which are noticed at once).
    pub detection_seconds: f64,
    /// Seconds from the failure being detected to every stage being back
    /// at the step it had reached (lost steps retrained).
    pub recovery_seconds: f64,
}

/// A resumed run and its failures, as the report writes them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResilienceLog {
    /// Per block, where a `--resume` took it from (empty without a resume).
    pub resumed: Vec<crate::checkpoint::ResumedBlock>,
    /// Every failure survived, in order.
    pub failures: Vec<FailureRecord>,
    /// Block checkpoints written.
    pub checkpoints_written: usize,
    /// The plan in force at the end.
    pub final_plan: String,
}

/// How a plan changes when `failed` is lost from phase `from_phase` on.
#[derive(Debug, Clone, PartialEq)]
pub enum Replan {
    /// Every stage that used the slot has other replicas: drop it there.
    Reroute(Plan),
    /// Some stage lost its last replica: the planner's plan over `survivors`.
    Replanned(Plan),
}

/// A cost table from FLOPs alone (teacher forward, student forward and
/// backward = 3x forward), for re-planning a run that has no profile.
pub fn flops_costs(teacher_flops: &[f64], student_flops: &[f64], max_replicas: usize) -> CostTable {
    let scaled = |flops: f64| (1..=max_replicas).map(|g| Some(flops / g as f64)).collect::<Vec<_>>();
    let zeros = vec![0.0; max_replicas];
    CostTable {
        teacher_forward: teacher_flops.iter().map(|&f| scaled(f)).collect(),
        student_step: student_flops.iter().map(|&f| scaled(3.0 * f)).collect(),
        gradient_average: vec![zeros.clone(); teacher_flops.len()],
        input_transfer: vec![zeros.clone(); teacher_flops.len()],
        memory: vec![vec![Some(0); max_replicas]; teacher_flops.len()],
        update: vec![zeros; teacher_flops.len()],
    }
}

/// The plan after losing slot `failed` during phase `from_phase`, over the
/// `survivors` (the plan's slots still alive). `Err` when nothing can run.
pub fn replan(
    plan: &Plan,
    from_phase: usize,
    failed: usize,
    survivors: &[usize],
    costs: &CostTable,
    memory_limit: Option<u64>,
) -> Result<Replan, String> {
    let mut rerouted = plan.clone();
    let mut stage_lost = false;
    for phase in rerouted.phases.iter_mut().skip(from_phase) {
        for stage in &mut phase.stages {
            stage.slots.retain(|&s| s != failed);
            stage_lost |= stage.slots.is_empty();
        }
    }
    if !stage_lost {
        return Ok(Replan::Reroute(rerouted));
    }
    if survivors.is_empty() {
        return Err(format!("device slot {failed} was the last one left"));
    }
    let blocks = costs.blocks();
    let candidate =
        best_plans(costs, survivors.len(), memory_limit, 1).into_iter().next().ok_or_else(|| {
            format!("the {blocks} blocks do not fit on the {} surviving slots", survivors.len())
        })?;
    let specs: Vec<StageSpec> = candidate
        .stages
        .iter()
        .map(|s| StageSpec { blocks: (s.blocks.start + 1..=s.blocks.end).collect(), replicas: s.replicas })
        .collect();
    let mut phase = Plan::hybrid(&specs, blocks, survivors.len()).map_err(|e| e.0)?.phases.remove(0);
    for stage in &mut phase.stages {
        for slot in &mut stage.slots {
            *slot = survivors[*slot];
        }
    }
    let mut replanned = plan.clone();
    replanned.phases.truncate(from_phase);
    replanned.phases.push(phase);
    replanned.name = format!("{} (re-planned)", plan.name.trim_end_matches(" (re-planned)"));
    Ok(Replan::Replanned(replanned))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_replica_is_dropped_and_a_lost_stage_is_replanned_over_the_survivors() {
        let specs =
            [StageSpec { blocks: vec![1, 2], replicas: 2 }, StageSpec { blocks: vec![3, 4], replicas: 1 }];
        let plan = Plan::hybrid(&specs, 4, 3).unwrap();
        let costs = flops_costs(&[1.0; 4], &[1.0; 4], 3);

        let Ok(Replan::Reroute(after)) = replan(&plan, 0, 1, &[0, 2], &costs, None) else {
            panic!("losing one of two replicas must re-route")
        };
        assert_eq!(after.phases[0].stages[0].slots, vec![0]);
        assert_eq!(after.phases[0].stages[1].slots, vec![2]);

        let Ok(Replan::Replanned(after)) = replan(&after, 0, 2, &[0], &costs, None) else {
            panic!("losing a stage's only replica must re-plan")
        };
        let stages = &after.phases[0].stages;
        assert_eq!(stages.len(), 1);
        assert_eq!((stages[0].blocks.clone(), stages[0].slots.clone()), (0..4, vec![0]));

        // Two survivors with non-contiguous ids: the planner's slots map onto them.
        let Ok(Replan::Replanned(after)) = replan(&Plan::tr(&[1.0; 4], 3, true), 0, 1, &[0, 2], &costs, None)
        else {
            panic!("tr has no replicas: losing a slot must re-plan")
        };
        let mut used: Vec<usize> = after.phases[0].stages.iter().flat_map(|s| s.slots.clone()).collect();
        used.sort();
        assert_eq!(used, vec![0, 2]);
        assert!(replan(&Plan::ideal(4), 0, 0, &[], &costs, None).is_err());
    }
}
