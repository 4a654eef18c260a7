//! Your own teacher, data set and students, end to end through the library.
//!
//! 1. A teacher of our own: a 3-layer MLP (784 -> 256 -> 128 -> 10), first
//!    trained on MNIST here with an ordinary burn loop, then frozen and cut
//!    into three blocks (one per layer); its specs are inferred.
//! 2. A data set of our own: MNIST images as flat vectors (`Dataset`).
//! 3. Students of our own: each layer factorised through a rank-32 bottleneck.
//! 4. Blockwise distillation under teacher relaying with decoupled updates
//!    on three CPU slots with per-block checkpoints, then one stitched pass;
//!    the students saved, reloaded into fresh modules and scored next to the
//!    teacher.
//!
//! ```sh
//! bash scripts/setup-data.sh     # once: MNIST into data/
//! cargo run --release --example custom_teacher -- --train-limit 6000
//! ```

use std::path::Path;

use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use burn::tensor::{Device, Int, Tensor, TensorData};
use pipe_bd::data::mnist::Split;
use pipe_bd::data::{epoch_order, ImageDataset};
use pipe_bd::eval::{load_student_records, save_students};
use pipe_bd::runtime::{Distillation, RuntimeSettings};
use pipe_bd::train::checkpoint::CheckpointPolicy;
use pipe_bd::train::stitch::{StitchedGradients, StitchedPass, StitchedRun};
use pipe_bd::train::{inference_blocks, TrainSettings};
use pipe_bd::{
    forward_chain, Activation, Block, BlockResult, Dataset, FusedBackend, Plan, Samples, Students, Teacher,
};

type Train = Autodiff<Flex>;

/// MNIST images as flat `[784]` vectors, normalised like the CNN teacher's.
struct FlatMnist(ImageDataset);

impl Samples for FlatMnist {
    fn len(&self) -> usize {
        self.0.len()
    }
}

impl<B: Backend> Dataset<B> for FlatMnist {
    fn batch(&self, indices: &[usize], device: &B::Device) -> BlockResult<Activation<B>> {
        if let Some(i) = indices.iter().find(|&&i| i >= self.0.len()) {
            return Err(pipe_bd::BlockError::Data { message: format!("no image {i}") });
        }
        Ok(Activation::Flat(self.0.images::<B>(indices, device).flatten(1, 3)))
    }
}

/// A linear layer, with a ReLU after it except on the logits.
#[derive(Module, Debug)]
struct Dense<B: Backend> {
    linear: Linear<B>,
    relu: bool,
}

impl<B: Backend> Dense<B> {
    fn new(inputs: usize, outputs: usize, relu: bool, device: &B::Device) -> Self {
        Self { linear: LinearConfig::new(inputs, outputs).init(device), relu }
    }

    fn apply(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let y = self.linear.forward(x);
        if self.relu {
            relu(y)
        } else {
            y
        }
    }
}

impl<B: FusedBackend> Block<B> for Dense<B> {
    fn forward(&self, input: Activation<B>) -> BlockResult<Activation<B>> {
        match input {
            Activation::Flat(x) => Ok(Activation::Flat(self.apply(x))),
            other => {
                Err(pipe_bd::BlockError::block(format!("expected flat vectors, got {:?}", other.dims())))
            }
        }
    }
}

/// A student layer: `inputs -> rank -> outputs` (two thin matrices instead of one wide).
#[derive(Module, Debug)]
struct LowRank<B: Backend> {
    down: Linear<B>,
    up: Dense<B>,
}

impl<B: FusedBackend> Block<B> for LowRank<B> {
    fn forward(&self, input: Activation<B>) -> BlockResult<Activation<B>> {
        match input {
            Activation::Flat(x) => Ok(Activation::Flat(self.up.apply(self.down.forward(x)))),
            other => {
                Err(pipe_bd::BlockError::block(format!("expected flat vectors, got {:?}", other.dims())))
            }
        }
    }
}

const WIDTHS: [usize; 4] = [784, 256, 128, 10];

/// The student for teacher layer `k`: `WIDTHS[k] -> 32 -> WIDTHS[k + 1]`.
fn low_rank<B: Backend>(k: usize, device: &B::Device) -> LowRank<B> {
    LowRank {
        down: LinearConfig::new(WIDTHS[k], 32).init(device),
        up: Dense::new(32, WIDTHS[k + 1], k < 2, device),
    }
}

/// The teacher while it is being trained: its layers in one module.
#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    layers: Vec<Dense<B>>,
}

/// Trains the MLP teacher on `data` for two passes (an ordinary burn loop)
/// and returns its layers, frozen (on the inner backend).
fn train_teacher(data: &FlatMnist, device: &Device<Flex>) -> Vec<Dense<Flex>> {
    let mut mlp = Mlp::<Train> {
        layers: (0..3).map(|k| Dense::new(WIDTHS[k], WIDTHS[k + 1], k < 2, device)).collect(),
    };
    let mut optimizer = AdamConfig::new().init::<Train, Mlp<Train>>();
    let loss = CrossEntropyLossConfig::new().init(device);
    let order: Vec<usize> = (0..2).flat_map(|epoch| epoch_order(data.len(), 1, epoch)).collect();
    for batch in order.chunks_exact(64) {
        let mut x = data.0.images::<Train>(batch, device).flatten(1, 3);
        for layer in &mlp.layers {
            x = layer.apply(x);
        }
        let labels: Vec<i64> = data.0.labels_at(batch).into_iter().map(i64::from).collect();
        let targets = Tensor::<Train, 1, Int>::from_data(TensorData::new(labels, [batch.len()]), device);
        let grads = GradientsParams::from_grads(loss.forward(x, targets).backward(), &mlp);
        mlp = optimizer.step(1e-3, mlp, grads);
    }
    mlp.valid().layers
}

/// Top-1 accuracy of `blocks` chained, on `data`.
fn accuracy<M: Block<Flex>>(blocks: &[M], data: &FlatMnist) -> Result<f64, Box<dyn std::error::Error>> {
    let device = Default::default();
    let indices: Vec<usize> = (0..data.len()).collect();
    let Activation::Flat(logits) = forward_chain(blocks, Dataset::<Flex>::batch(data, &indices, &device)?)?
    else {
        return Err("the last block must produce logits".into());
    };
    let predicted = logits.argmax(1).into_data().iter::<i64>().collect::<Vec<_>>();
    let labels = data.0.labels_at(&indices);
    let right = predicted.iter().zip(&labels).filter(|(p, l)| **p == i64::from(**l)).count();
    Ok(right as f64 / labels.len() as f64)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let train_limit = std::env::args()
        .skip_while(|a| a != "--train-limit")
        .nth(1)
        .map(|n| n.parse::<usize>())
        .transpose()?
        .unwrap_or(6000);
    let device = Default::default();
    <Flex as Backend>::seed(&device, 3);
    let train =
        FlatMnist(pipe_bd::data::mnist::load(Path::new("data/mnist"), Split::Train, Some(train_limit))?);
    let test = FlatMnist(pipe_bd::data::mnist::load(Path::new("data/mnist"), Split::Test, Some(2000))?);

    // 1. The teacher: trained here, then frozen; specs inferred by a forward pass.
    let teacher = Teacher::from_blocks(train_teacher(&train, &device), &[WIDTHS[0]], &device)?;
    println!("teacher blocks: {:?}", teacher.specs.iter().map(|s| (&s.name, s.params)).collect::<Vec<_>>());

    // 3. The students: rank-32 factorisations of each layer.
    let blocks: Vec<LowRank<Train>> = (0..3).map(|k| low_rank(k, &device)).collect();
    let students = Students::from_blocks(blocks, &teacher.specs, &device)?;

    // 4. Blockwise distillation on three slots (one block each), then a stitched pass.
    let settings = TrainSettings { epochs: 2, batch_size: 64, ..Default::default() };
    // Per-block checkpoints as for the built-in zoo (`RuntimeSettings::resume_from` resumes).
    let out = Path::new("runs/custom-teacher");
    let runtime = RuntimeSettings {
        checkpoints: Some(CheckpointPolicy::in_dir(out.join("checkpoints"))),
        ..Default::default()
    };
    let output = Distillation::new(&teacher, students, &train)
        .settings(settings.clone())
        .devices(vec![device; 3])
        .runtime(runtime)
        .run(&Plan::tr(&[1.0; 3], 3, true))?;
    println!("blockwise: {} steps, final losses {:?}", output.log.steps, output.log.final_losses);
    let blockwise_accuracy = accuracy(&inference_blocks(&output.students), &test)?;
    let pass = StitchedPass {
        first_step: output.log.steps,
        gradients: StitchedGradients::EndToEnd,
        ..Default::default()
    };
    let (students, log) =
        StitchedRun::new(&teacher, &train, &settings, &device).train(output.students, &pass, &mut |_| {})?;
    println!("stitched pass: {} steps, final losses {:?}", log.steps, log.final_losses);

    // Save the students, reload them into fresh modules, score the reloaded ones.
    save_students(out, &students)?;
    let fresh: Vec<LowRank<Flex>> = (0..3).map(|k| low_rank(k, &device)).collect();
    let reloaded = load_student_records(out, fresh, &device)?;
    println!(
        "test accuracy on {} images: teacher {:.2}%, student {:.2}% after blockwise training, {:.2}% after the stitched pass (saved to and reloaded from {})",
        test.len(),
        100.0 * accuracy(&teacher.blocks, &test)?,
        100.0 * blockwise_accuracy,
        100.0 * accuracy(&reloaded, &test)?,
        out.display()
    );
    Ok(())
}
