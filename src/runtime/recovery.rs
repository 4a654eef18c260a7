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
//!
//! `recover` is the runtime's failure policy: which failures a run
//! survives, and the plan, record and restored blocks it goes on with.

use std::collections::BTreeMap;
use std::time::Instant;

use pipebd_core::{BlockSpec, StudentModule};
use pipebd_kernels::DistillBackend;
use serde::{Deserialize, Serialize};

use super::phase::PhaseFailure;
use super::resume::restore_newest;
use super::RuntimeSettings;
use crate::error::{Error, Result};
use crate::plan::{Plan, StageSpec};
use crate::planning::planner::{plan as best_plans, CostTable};
use crate::train::BlockTrainer;

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
    pub resumed: Vec<crate::train::checkpoint::ResumedBlock>,
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

/// What the failure policy needs from the run besides the failure itself.
pub(super) struct RecoveryContext<'a, B: DistillBackend, S: StudentModule<B>> {
    /// The failure budget, the re-planning costs and memory, the checkpoints.
    pub(super) runtime: &'a RuntimeSettings,
    /// The teacher's block specs, for re-planning from FLOPs.
    pub(super) teacher_specs: &'a [BlockSpec],
    /// The students' block specs, for re-planning from FLOPs.
    pub(super) student_specs: &'a [BlockSpec],
    /// Optimizer steps per block in the whole run.
    pub(super) total_steps: usize,
    /// Per block, what its checkpoints must match.
    pub(super) identities: &'a [BTreeMap<String, serde_json::Value>],
    /// The run's devices; restored blocks are loaded on the first.
    pub(super) devices: &'a [B::Device],
    /// Block `k`'s trainer as it was before training, for blocks lost
    /// before their first checkpoint.
    pub(super) fresh: &'a dyn Fn(usize) -> BlockTrainer<B, S>,
}

/// A failure survived: what the run goes on with.
pub(super) struct Recovered<B: DistillBackend, S: StudentModule<B>> {
    /// The plan without the lost slot.
    pub(super) plan: Plan,
    /// The report's record of the failure (`recovery_seconds` is filled in
    /// once the lost steps are retrained).
    pub(super) record: FailureRecord,
    /// The lost blocks' trainers, reloaded from their newest checkpoint
    /// (from scratch without one).
    pub(super) trainers: Vec<BlockTrainer<B, S>>,
    /// When the failure was detected.
    pub(super) detected_at: Instant,
    /// The step every stage must complete again for the run to have
    /// regained what it lost.
    pub(super) target: usize,
}

/// The failure policy. A worker's device failure (`Error::is_device_failure`)
/// within `runtime.max_failures` loses its slot: the plan is re-routed or
/// re-planned over the surviving slots from phase `phase_index` on, and the
/// blocks whose state was on the worker are reloaded. Any other failure, one
/// failure too many, or a plan that cannot go on ends the run with an error.
/// `failures` are the failures survived so far (their slots are lost too).
pub(super) fn recover<B: DistillBackend, S: StudentModule<B>>(
    failure: PhaseFailure,
    plan: &Plan,
    phase_index: usize,
    failures: &[FailureRecord],
    context: &RecoveryContext<'_, B, S>,
) -> Result<Recovered<B, S>> {
    let runtime = context.runtime;
    let Error::Worker { stage, replica, slot, .. } = &failure.error else {
        return Err(failure.error);
    };
    let (stage, replica, slot) = (*stage, *replica, *slot);
    if !failure.error.is_device_failure() || failures.len() >= runtime.max_failures {
        return Err(failure.error);
    }
    let lost_slots: Vec<usize> = failures.iter().map(|f| f.slot).chain([slot]).collect();
    let survivors: Vec<usize> = (0..plan.slots()).filter(|s| !lost_slots.contains(s)).collect();
    let costs = runtime.costs.clone().unwrap_or_else(|| {
        let flops = |s: &BlockSpec| s.flops as f64;
        let teacher_flops: Vec<f64> = context.teacher_specs.iter().map(flops).collect();
        let student_flops: Vec<f64> = context.student_specs.iter().map(flops).collect();
        flops_costs(&teacher_flops, &student_flops, survivors.len().max(1))
    });
    let (new_plan, action) =
        match replan(plan, phase_index, slot, &survivors, &costs, runtime.memory_per_device) {
            Ok(Replan::Reroute(p)) => {
                (p, "re-routed its share of each batch to the other replicas".to_string())
            }
            Ok(Replan::Replanned(p)) => {
                (p, format!("re-planned the blocks over the surviving slots {survivors:?}"))
            }
            Err(why) => {
                return Err(Error::Plan {
                    plan: plan.name.clone(),
                    message: format!(
                        "cannot continue after losing device slot {slot}: {why}; {}",
                        failure.error
                    ),
                })
            }
        };
    let mut restored = Vec::new();
    let mut trainers = Vec::new();
    for k in failure.lost_blocks {
        let lost_at = failure.block_steps.get(&k).copied().unwrap_or(0);
        let mut trainer = (context.fresh)(k);
        let (identity, device) = (&context.identities[k], &context.devices[0]);
        let resumed_at = match &runtime.checkpoints {
            Some(policy) => restore_newest(&mut trainer, &policy.dir, identity, device, false)?.step,
            None => 0,
        };
        trainers.push(trainer);
        restored.push(RestoredBlock { block: k + 1, lost_at, resumed_at });
    }
    restored.sort_by_key(|r| r.block);
    let target = restored.iter().map(|r| r.lost_at).max().unwrap_or(0).max(failure.completed + 1);
    let detection_seconds = match &failure.error {
        Error::Worker { source, .. } => match source.as_ref() {
            Error::Stalled { seconds, .. } => *seconds,
            _ => 0.0,
        },
        _ => 0.0,
    };
    let record = FailureRecord {
        stage,
        replica,
        slot,
        error: failure.error.to_string(),
        action,
        old_plan: plan.describe(),
        new_plan: new_plan.describe(),
        steps_lost: restored.iter().map(|r| r.lost_at.saturating_sub(r.resumed_at)).sum(),
        restored,
        detection_seconds,
        recovery_seconds: 0.0,
    };
    Ok(Recovered { plan: new_plan, record, trainers, detected_at: failure.detected_at, target })
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
