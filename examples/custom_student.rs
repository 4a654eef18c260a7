//! Your own student blocks on the built-in MNIST teacher.
//!
//! The students are plain burn modules: depthwise-separable conv stages and
//! a one-layer head, about 10x cheaper than the teacher's blocks. They
//! implement `pipe_bd::Block`, and pipe-bd trains all four at once under
//! teacher relaying with decoupled updates on two CPU worker slots.
//!
//! ```sh
//! bash scripts/setup-data.sh     # once: MNIST and the teacher's weights into data/
//! cargo run --release --example custom_student                        # one epoch, about 3 minutes on 2 cores
//! cargo run --release --example custom_student -- --train-limit 1280  # a 20-step smoke run
//! ```

use std::path::Path;

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use pipe_bd::eval::{score, TopOneAccuracy};
use pipe_bd::runtime::Distillation;
use pipe_bd::train::{inference_blocks, TrainSettings};
use pipe_bd::{Activation, Block, BlockResult, FusedBackend, Plan, Students};
use pipebd_zoo::mnist::Split;

/// Training backend: burn's CPU backend with autodiff (the teacher runs on
/// its inner backend, `Flex`).
type Train = Autodiff<Flex>;

/// Depthwise 3x3 -> pointwise 1x1 -> ReLU -> 2x2 max-pool.
#[derive(Module, Debug)]
struct SeparableStage<B: Backend> {
    depthwise: Conv2d<B>,
    pointwise: Conv2d<B>,
    pool: MaxPool2d,
}

/// One student block: a conv stage, or the classifier head.
// Built once per run and moved rarely: boxing a variant would buy nothing
// and burn's `Module` derive wants the variants by value.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
enum TinyStudent<B: Backend> {
    Stage(SeparableStage<B>),
    Head(Linear<B>),
}

impl<B: FusedBackend> Block<B> for TinyStudent<B> {
    fn forward(&self, input: Activation<B>) -> BlockResult<Activation<B>> {
        let x = input.into_maps(0)?;
        Ok(match self {
            TinyStudent::Stage(s) => {
                Activation::Maps(s.pool.forward(relu(s.pointwise.forward(s.depthwise.forward(x)))))
            }
            TinyStudent::Head(head) => Activation::Flat(head.forward(x.flatten(1, 3))),
        })
    }
}

/// A student for a teacher block with per-sample input `input` and output `output`.
fn student_for<B: Backend>(input: &[usize], output: &[usize], device: &B::Device) -> TinyStudent<B> {
    match (input, output) {
        ([c_in, ..], [c_out, _, _]) => {
            // At least 8 depthwise filters: one filter of a 1-channel image
            // would leave the pointwise layer nothing to mix.
            let depth = c_in * 8usize.div_ceil(*c_in);
            TinyStudent::Stage(SeparableStage {
                depthwise: Conv2dConfig::new([*c_in, depth], [3, 3])
                    .with_groups(*c_in)
                    .with_padding(PaddingConfig2d::Same)
                    .init(device),
                pointwise: Conv2dConfig::new([depth, *c_out], [1, 1]).init(device),
                pool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
            })
        }
        (_, [classes]) => TinyStudent::Head(LinearConfig::new(input.iter().product(), *classes).init(device)),
        _ => panic!("no student for {input:?} -> {output:?}"),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let train_limit = std::env::args()
        .skip_while(|a| a != "--train-limit")
        .nth(1)
        .map(|n| n.parse::<usize>())
        .transpose()?
        .unwrap_or(60_000);
    let device = Default::default();
    <Flex as Backend>::seed(&device, 7);

    // The built-in teacher, cut into its 4 blocks, and MNIST.
    let teacher = pipebd_zoo::mnist_teacher::<Flex>(Path::new("data/teachers/mnist-cnn.pth"), &device)?;
    let train = pipebd_zoo::mnist::load(Path::new("data/mnist"), Split::Train, Some(train_limit))?;
    let test = pipebd_zoo::mnist::load(Path::new("data/mnist"), Split::Test, Some(2000))?;

    // Our students: shapes, parameters and losses are inferred from the
    // modules and checked against the teacher's blocks.
    let blocks =
        teacher.specs.iter().map(|t| student_for(&t.input_shape, &t.output_shape, &device)).collect();
    let students = Students::<Train, _>::from_blocks(blocks, &teacher.specs, &device)?;
    for (t, s) in teacher.specs.iter().zip(&students.specs) {
        println!("{:<6} teacher {:>7} params, student {:>6}", t.name, t.params, s.params);
    }

    // Teacher relaying with decoupled updates on two worker slots; the cut
    // balances the teacher's FLOPs.
    let cost: Vec<f64> = teacher.specs.iter().map(|s| s.flops as f64).collect();
    let plan = Plan::tr(&cost, 2, true);
    let settings = TrainSettings { epochs: 1, batch_size: 64, ..Default::default() };
    let output = Distillation::new(&teacher, students, &train)
        .settings(settings)
        .devices(vec![device; 2])
        .run(&plan)?;
    println!(
        "trained {} steps under {} {} in {:.1} s; final block losses {:?}",
        output.log.steps,
        plan.name,
        plan.describe(),
        output.log.seconds,
        output.log.final_losses
    );

    // Top-1 accuracy of the teacher and of the stitched student.
    let stitched = inference_blocks(&output.students);
    let evaluation = TopOneAccuracy(test);
    let scored = score(
        Some(&evaluation),
        (&teacher.blocks, &teacher.specs),
        (&stitched, &output.students.specs),
        &device,
    )?;
    println!(
        "test accuracy on {} images: teacher {:.2}%, stitched student {:.2}%",
        scored.test_samples,
        100.0 * scored.teacher_accuracy,
        100.0 * scored.student_accuracy
    );
    Ok(())
}
