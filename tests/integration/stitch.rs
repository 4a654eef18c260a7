//! The stitched pass trains each block on the stitched student's own
//! input (local or end to end): afterwards the stitched student's
//! intermediate output is closer to the teacher's than after the same
//! number of further blockwise steps.

use std::path::Path;

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use pipe_bd::data::ImageDataset;
use pipe_bd::plan::Plan;
use pipe_bd::runtime::Distillation;
use pipe_bd::train::stitch::{OutputLoss, OutputLossKind, StitchedGradients, StitchedPass, StitchedRun};
use pipe_bd::train::TrainSettings;
use pipe_bd::{forward_chain, Activation, Teacher};
use pipebd_cli::config::RunConfig;
use pipebd_cli::zoo::Zoo;
use pipebd_teachers::TeacherBlock;
use pipebd_zoo::mnist::Split;
use pipebd_zoo::{build_teacher, Builtin};

use crate::common;

type B = Autodiff<Flex>;

#[test]
fn the_stitched_pass_brings_the_stitched_student_closer_to_the_teacher() {
    let config = RunConfig::parse(&common::small_config(1280, 200, 2), Path::new("stitch.toml")).unwrap();
    let device = Default::default();
    let data = pipebd_zoo::mnist::load(&config.data.dir, Split::Train, config.data.train_limit).unwrap();
    let test = pipebd_zoo::mnist::load(&config.data.dir, Split::Test, config.data.test_limit).unwrap();
    let teacher = build_teacher::<Flex>(&config, &device).unwrap();
    let settings = config.train_settings();
    let blockwise = |settings: &TrainSettings, students| {
        Distillation::new(&teacher, students, &data)
            .settings(settings.clone())
            .run(&Plan::ideal(4))
            .unwrap()
            .students
    };
    let trained = blockwise(&settings, Builtin.students::<B>(&config, &teacher.specs, &device).unwrap());

    // Mean squared distance of the stitched output of blocks 1-3 from the teacher's.
    let indices: Vec<usize> = (0..test.len()).collect();
    let images = test.images::<Flex>(&indices, &device);
    let target = forward_chain(&teacher.blocks[..3], Activation::Maps(images.clone())).unwrap();
    let target = target.into_maps(3).unwrap();
    let gap = |students: &pipe_bd::Students<B, _>| -> f32 {
        let blocks: Vec<_> =
            students.blocks[..3].iter().map(|b: &pipebd_students::StudentBlock<B>| b.valid()).collect();
        let out = forward_chain(&blocks, Activation::Maps(images.clone())).unwrap().into_maps(3).unwrap();
        out.sub(target.clone()).powf_scalar(2.0).mean().into_scalar()
    };
    let before = gap(&trained);

    let mut optimizer = config.optimizer.clone();
    optimizer.lr /= 3.0;
    let mut steps = 0;
    let local = StitchedPass {
        epochs: 2,
        optimizer,
        first_step: 40,
        gradients: StitchedGradients::Local,
        output_loss: None,
        block_weight: 1.0,
    };
    let (stitched, log) = StitchedRun::new(&teacher, &data, &settings, &device)
        .train(trained, &local, &mut |_| steps += 1)
        .unwrap();
    assert_eq!((log.steps, steps), (40, 40));
    assert_eq!(log.rows.first().map(|r| r.step), Some(40), "rows are numbered after the blockwise steps");
    let after = gap(&stitched);
    assert!(after < 0.95 * before, "stitched gap {before} -> {after}: expected a 5% drop");

    // The control: the same 40 steps at the same rate, blockwise (teacher
    // inputs), from the same starting point, close the gap less.
    let again = blockwise(&settings, Builtin.students::<B>(&config, &teacher.specs, &device).unwrap());
    let mut more = settings.clone();
    more.optimizer = local.optimizer.clone();
    let control = gap(&blockwise(&more, again));
    // End to end (gradients through the stitched chain), from the same start.
    let again = blockwise(&settings, Builtin.students::<B>(&config, &teacher.specs, &device).unwrap());
    let end_to_end = StitchedPass { gradients: StitchedGradients::EndToEnd, ..local };
    let (chained, _) =
        StitchedRun::new(&teacher, &data, &settings, &device).train(again, &end_to_end, &mut |_| {}).unwrap();
    let end_to_end = gap(&chained);
    eprintln!(
        "stitched gap: blockwise {before}, +local {after}, +end-to-end {end_to_end}, +blockwise {control}"
    );
    assert!(after < control, "local {after} vs blockwise {control}: the stitched input should matter");
    assert!(end_to_end < control, "end-to-end {end_to_end} vs blockwise {control}");
}

/// What the output-loss tests share: a small MNIST run's config, its
/// training and test images, the teacher and the settings.
struct OutputLossSetup {
    config: RunConfig,
    data: ImageDataset,
    test: ImageDataset,
    teacher: Teacher<Flex, TeacherBlock<Flex>>,
    settings: TrainSettings,
}

impl OutputLossSetup {
    fn new() -> Self {
        let config = RunConfig::parse(&common::small_config(640, 200, 1), Path::new("stitch.toml")).unwrap();
        let data = pipebd_zoo::mnist::load(&config.data.dir, Split::Train, config.data.train_limit).unwrap();
        let test = pipebd_zoo::mnist::load(&config.data.dir, Split::Test, config.data.test_limit).unwrap();
        let teacher = build_teacher::<Flex>(&config, &Default::default()).unwrap();
        let settings = config.train_settings();
        Self { config, data, test, teacher, settings }
    }

    /// Fresh students after the config's blockwise epochs.
    fn blockwise(
        config: &RunConfig,
        teacher: &Teacher<Flex, TeacherBlock<Flex>>,
        data: &ImageDataset,
        settings: &TrainSettings,
    ) -> pipe_bd::Students<B, pipebd_students::StudentBlock<B>> {
        let students = Builtin.students::<B>(config, &teacher.specs, &Default::default()).unwrap();
        Distillation::new(teacher, students, data)
            .settings(settings.clone())
            .run(&Plan::ideal(4))
            .unwrap()
            .students
    }
}

#[test]
fn an_output_loss_pulls_the_final_output_towards_the_teacher() {
    let OutputLossSetup { config, data, test, teacher, settings } = OutputLossSetup::new();
    let device = Default::default();
    let trained = || OutputLossSetup::blockwise(&config, &teacher, &data, &settings);
    // Mean squared distance of the stitched student's logits from the teacher's.
    let indices: Vec<usize> = (0..test.len()).collect();
    let images = test.images::<Flex>(&indices, &device);
    let logits = |a: Activation<Flex>| match a {
        Activation::Flat(t) => t,
        other => panic!("expected logits, got {:?}", other.dims()),
    };
    let target = logits(forward_chain(&teacher.blocks, Activation::Maps(images.clone())).unwrap());
    let gap = |students: &pipe_bd::Students<B, _>| -> f32 {
        let blocks: Vec<_> =
            students.blocks.iter().map(|b: &pipebd_students::StudentBlock<B>| b.valid()).collect();
        let out = logits(forward_chain(&blocks, Activation::Maps(images.clone())).unwrap());
        out.sub(target.clone()).powf_scalar(2.0).mean().into_scalar()
    };
    let plain =
        StitchedPass { epochs: 2, optimizer: config.optimizer.clone(), first_step: 10, ..Default::default() };
    let (without, log) =
        StitchedRun::new(&teacher, &data, &settings, &device).train(trained(), &plain, &mut |_| {}).unwrap();
    assert_eq!(log.final_output_loss, None);
    let pulled =
        StitchedPass { output_loss: Some(OutputLoss { kind: OutputLossKind::Mse, weight: 10.0 }), ..plain };
    let (with, log) =
        StitchedRun::new(&teacher, &data, &settings, &device).train(trained(), &pulled, &mut |_| {}).unwrap();
    let value = log.final_output_loss.expect("the output loss is reported");
    assert!(value.is_finite() && value > 0.0, "{value}");
    let (without, with) = (gap(&without), gap(&with));
    eprintln!("logit gap: block losses only {without}, plus the output MSE {with}");
    assert!(with < 0.9 * without, "the output loss should pull the logits closer: {without} -> {with}");
    // The output loss alone (block weight 0) trains too: the blocks' losses
    // are still logged, and the logits come closer than where blockwise
    // training left them.
    let before = gap(&trained());
    let alone = StitchedPass { block_weight: 0.0, ..pulled };
    let (only, log) =
        StitchedRun::new(&teacher, &data, &settings, &device).train(trained(), &alone, &mut |_| {}).unwrap();
    assert!(log.final_losses.iter().all(|l| l.is_finite() && *l > 0.0), "{:?}", log.final_losses);
    let only = gap(&only);
    eprintln!("logit gap: blockwise {before}, then the output MSE alone {only}");
    assert!(only < 0.9 * before, "the output loss alone should pull the logits closer: {before} -> {only}");
}

/// A fixed linear map of the logits, standing in for a zoo's frozen output
/// head: 10 classes to 7 scores, every real row weighted 1 but the first.
struct FixedHead {
    weight: burn::tensor::Tensor<B, 2>,
}

impl pipe_bd::OutputHead<B> for FixedHead {
    fn scores(&self, output: Activation<B>) -> pipe_bd::BlockResult<pipe_bd::HeadScores<B>> {
        let Activation::Flat(logits) = output else { panic!("expected logits") };
        let rows = logits.dims()[0];
        // The first row does not count (a padding token's, say).
        let weights: Vec<f32> = (0..rows).map(|row| if row == 0 { 0.0 } else { 1.0 }).collect();
        let weights = burn::tensor::Tensor::<B, 1>::from_data(
            burn::tensor::TensorData::new(weights, [rows]),
            &logits.device(),
        );
        Ok(pipe_bd::HeadScores { scores: logits.matmul(self.weight.clone()), weights })
    }
}

#[test]
fn a_head_kl_output_loss_pulls_the_predictions_through_the_head_towards_the_teacher() {
    let OutputLossSetup { config, data, test, teacher, settings } = OutputLossSetup::new();
    let device = Default::default();
    let trained = || OutputLossSetup::blockwise(&config, &teacher, &data, &settings);
    let weight =
        burn::tensor::Tensor::<B, 2>::random([10, 7], burn::tensor::Distribution::Normal(0.0, 1.0), &device);
    let head = FixedHead { weight };
    // The KL through the head of the stitched student's test predictions.
    let indices: Vec<usize> = (0..test.len()).collect();
    let images =
        Activation::<B>::Maps(burn::tensor::Tensor::from_inner(test.images::<Flex>(&indices, &device)));
    let target =
        forward_chain(&teacher.blocks, Activation::Maps(test.images::<Flex>(&indices, &device))).unwrap();
    let kl = |students: &pipe_bd::Students<B, pipebd_students::StudentBlock<B>>| -> f32 {
        let out = forward_chain(&students.blocks, images.clone()).unwrap();
        let kl = pipe_bd::head_kl(&head, out, Activation::from_inner(target.clone()), 1.0).unwrap();
        kl.into_scalar()
    };
    let plain =
        StitchedPass { epochs: 2, optimizer: config.optimizer.clone(), first_step: 10, ..Default::default() };
    let through_head = StitchedPass {
        output_loss: Some(OutputLoss { kind: OutputLossKind::HeadKl, weight: 30.0 }),
        ..plain.clone()
    };
    // Without the head the loss cannot be computed, and says so.
    let err = StitchedRun::new(&teacher, &data, &settings, &device)
        .train(trained(), &through_head, &mut |_| {})
        .map(|_| ())
        .unwrap_err();
    assert!(err.to_string().contains("head-kl"), "{err}");
    let (without, _) =
        StitchedRun::new(&teacher, &data, &settings, &device).train(trained(), &plain, &mut |_| {}).unwrap();
    let (with, log) = StitchedRun::new(&teacher, &data, &settings, &device)
        .with_head(&head)
        .train(trained(), &through_head, &mut |_| {})
        .unwrap();
    let value = log.final_output_loss.expect("the output loss is reported");
    assert!(value.is_finite() && value > 0.0, "{value}");
    let (without, with) = (kl(&without), kl(&with));
    eprintln!("KL through the head: block losses only {without}, plus the head's KL {with}");
    assert!(with < 0.9 * without, "the head's KL should pull the predictions closer: {without} -> {with}");
}

/// `train.epochs = 0` with stitched epochs: no blockwise step, only the
/// stitched pass, starting from the saved students (`weights`).
#[test]
fn a_run_without_blockwise_epochs_only_finetunes_the_saved_students_stitched() {
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("first");
    let text = common::small_config(640, 200, 1);
    let config_path = dir.path().join("first.toml");
    std::fs::write(&config_path, &text).unwrap();
    let (code, _, stderr) =
        common::pipebd(&["run", config_path.to_str().unwrap(), "--out", first.to_str().unwrap(), "--quiet"]);
    assert_eq!(code, 0, "{stderr}");

    // The same students, starting from the first run's weights, stitched
    // only, at a rate too small to move them far (blockwise training at the
    // config's 0.002 moves them by far more).
    let mut finetune = text.replace("epochs = 1", "epochs = 0\nstitched_epochs = 1\nstitched_lr = 1e-5");
    for k in 1..=4 {
        let weights = first.join("student").join(format!("block-{k}.mpk"));
        let table = ["conv\"", "bottleneck\"\nrank = 16", "bottleneck\"\nrank = 24", "head\""][k - 1];
        let with_weights = format!("{table}\nweights = \"{}\"", weights.display());
        assert!(finetune.contains(table), "block {k}: {table} in {finetune}");
        finetune = finetune.replacen(table, &with_weights, 1);
    }
    let finetune_path = dir.path().join("finetune.toml");
    std::fs::write(&finetune_path, &finetune).unwrap();
    let second = dir.path().join("second");
    let (code, stdout, stderr) = common::pipebd(&[
        "run",
        finetune_path.to_str().unwrap(),
        "--out",
        second.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("no blockwise epochs") && !stdout.contains("trained 0 steps"), "{stdout}");
    let report = pipebd_cli::report::RunReport::read(&second).unwrap();
    assert_eq!(report.steps, 0, "no blockwise steps");
    let startup = report.startup.expect("the start-up's times");
    assert!(startup.teacher_and_data_seconds > 0.0 && startup.students_seconds > 0.0, "{startup:?}");
    let stitched = report.stitched.expect("a stitched pass");
    assert_eq!(stitched.steps, 640 / 64, "one stitched epoch");
    // Each step timed, and the pass's rate is its samples over its time.
    assert_eq!(stitched.step_seconds.len(), stitched.steps);
    assert!(stitched.step_seconds.iter().sum::<f64>() <= stitched.seconds);
    let rate = (stitched.steps * 64) as f64 / stitched.seconds;
    assert!(
        (stitched.samples_per_second - rate).abs() <= 1e-9 * rate,
        "{} vs {rate}",
        stitched.samples_per_second
    );
    let (before, after) = (common::student_weights(&first), common::student_weights(&second));
    let moved = common::max_abs_diff(&before, &after);
    assert!(moved > 0.0 && moved < 1e-3, "the stitched pass moved the saved weights by {moved}");
}
