//! Every schedule computes the same mathematics: with the same seed, data
//! order and batch, the trained student blocks agree whichever schedule
//! (and however many device slots) trained them.

use std::path::Path;

use burn::backend::{Autodiff, Flex};
use pipe_bd::flat_parameters;
use pipe_bd::plan::{flops_cost, Plan, StageSpec};
use pipe_bd::runtime::{Distillation, RuntimeSettings};
use pipebd_cli::config::RunConfig;
use pipebd_cli::zoo::Zoo;
use pipebd_zoo::mnist::Split;
use pipebd_zoo::{build_teacher, Builtin};

use crate::common;

type B = Autodiff<Flex>;

fn config() -> RunConfig {
    let text = common::small_config(512, 100, 1).replace(
        "kind = \"adam\"\nlr = 0.002",
        "kind = \"sgd\"\nlr = 0.5\nmomentum = 0.9\nweight_decay = 0.0001",
    );
    RunConfig::parse(&text, Path::new("schedules.toml")).unwrap()
}

/// Trains under `plan` on `slots` CPU slots; returns each block's parameters.
fn train(plan: &Plan, slots: usize) -> Vec<Vec<f32>> {
    let config = config();
    let device = Default::default();
    let data = pipebd_zoo::mnist::load(&config.data.dir, Split::Train, config.data.train_limit).unwrap();
    let teacher = build_teacher::<Flex>(&config, &device).unwrap();
    let students = Builtin.students::<B>(&config, &teacher.specs, &device).unwrap();
    let options = RuntimeSettings { threads_per_worker: 1, ..Default::default() };
    let devices = vec![device; slots];
    let output = Distillation::new(&teacher, students, &data)
        .settings(config.train_settings())
        .devices(devices)
        .runtime(options)
        .run(plan)
        .unwrap_or_else(|e| panic!("{}: {e}", plan.name));
    assert_eq!(output.log.steps, 8);
    output.students.blocks.iter().map(flat_parameters::<B, _>).collect()
}

fn plans(slots: usize) -> Vec<Plan> {
    let config = config();
    let teacher = Builtin.teacher_specs(&config).unwrap();
    let students = Builtin.student_specs(&config, &teacher).unwrap();
    let cost = flops_cost(&teacher, &students);
    ["dp", "ls", "tr", "tr-dpu"].iter().map(|name| Plan::named(name, 4, slots, &cost, &[]).unwrap()).collect()
}

fn check_all(slots: usize, hybrid: &[StageSpec]) {
    let reference = train(&Plan::ideal(4), 1);
    let moved = common::max_abs_diff(&reference, &train(&Plan::ideal(4), 1));
    assert_eq!(moved, 0.0, "ideal is not reproducible");
    let initial = {
        let config = config();
        let teacher = Builtin.teacher_specs(&config).unwrap();
        let students = Builtin.students::<B>(&config, &teacher, &Default::default()).unwrap();
        students.blocks.iter().map(flat_parameters::<B, _>).collect::<Vec<_>>()
    };
    let moved = common::max_abs_diff(&reference, &initial);
    assert!(moved > 1e-3, "training did not move the weights: {moved}");
    // Agreement means something only if the schedules land far closer to
    // ideal than training moved the weights: within 1% of that movement (and
    // never further than 1e-4, 1e-3 with replicas), so weights that barely
    // moved cannot pass.
    let tolerance = moved / 100.0;
    for plan in plans(slots) {
        let diff = common::max_abs_diff(&reference, &train(&plan, slots));
        assert!(
            diff <= tolerance.min(1e-4),
            "{} on {slots} slots ({}) differs from ideal by {diff}; training moved the weights by {moved}",
            plan.name,
            plan.describe()
        );
    }
    let plan = Plan::hybrid(hybrid, 4, slots).unwrap();
    let diff = common::max_abs_diff(&reference, &train(&plan, slots));
    assert!(
        diff <= tolerance.min(1e-3),
        "hybrid {} differs from ideal by {diff}; training moved the weights by {moved}",
        plan.describe()
    );
}

#[test]
fn every_schedule_trains_the_same_students_on_two_slots() {
    check_all(2, &[StageSpec { blocks: vec![1, 2, 3, 4], replicas: 2 }]);
}

#[test]
fn every_schedule_trains_the_same_students_on_three_slots() {
    check_all(
        3,
        &[StageSpec { blocks: vec![1], replicas: 2 }, StageSpec { blocks: vec![2, 3, 4], replicas: 1 }],
    );
}
