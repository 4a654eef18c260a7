//! A student block's own loss (`Block::loss`) is the one its trainer
//! minimises, and the trainer's temperature reaches the soft-target loss.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::{Tensor, TensorData};
use pipe_bd::train::optim::OptimizerConfig;
use pipe_bd::train::BlockTrainer;
use pipe_bd::{Activation, Block, BlockResult, BlockSpec, FusedBackend, Loss, LossKind};

type Train = Autodiff<Flex>;

#[derive(Module, Debug)]
struct Plain<B: burn::tensor::backend::Backend> {
    linear: Linear<B>,
}

/// The same layer, trained on twice the default loss.
#[derive(Module, Debug)]
struct Doubled<B: burn::tensor::backend::Backend> {
    linear: Linear<B>,
}

fn flat<B: FusedBackend>(input: Activation<B>, linear: &Linear<B>) -> BlockResult<Activation<B>> {
    match input {
        Activation::Flat(x) => Ok(Activation::Flat(linear.forward(x))),
        other => Err(pipe_bd::BlockError::block(format!("expected flat input, got {:?}", other.dims()))),
    }
}

impl<B: FusedBackend> Block<B> for Plain<B> {
    fn forward(&self, input: Activation<B>) -> BlockResult<Activation<B>> {
        flat(input, &self.linear)
    }
}

impl<B: FusedBackend> Block<B> for Doubled<B> {
    fn forward(&self, input: Activation<B>) -> BlockResult<Activation<B>> {
        flat(input, &self.linear)
    }

    fn loss(&self, student: Activation<B>, teacher: Activation<B>, loss: &Loss) -> BlockResult<Tensor<B, 1>> {
        Ok(loss.compute(student, teacher)?.mul_scalar(2.0))
    }
}

/// A 4 -> 3 layer with fixed weights (every call the same values: burn's
/// own init is lazy, so clones would draw different ones).
fn fixed_linear<B: burn::tensor::backend::Backend>() -> Linear<B> {
    let device = Default::default();
    let weight: Vec<f32> = (0..12).map(|i| ((i * 7 % 11) as f32 - 5.0) / 10.0).collect();
    Linear {
        weight: Param::from_tensor(Tensor::from_data(TensorData::new(weight, [4, 3]), &device)),
        bias: Some(Param::from_tensor(Tensor::from_data(
            TensorData::new(vec![0.1, -0.1, 0.2], [3]),
            &device,
        ))),
    }
}

fn batch(values: Vec<f32>, rows: usize) -> Activation<Flex> {
    let cols = values.len() / rows;
    Activation::Flat(Tensor::from_data(TensorData::new(values, [rows, cols]), &Default::default()))
}

fn first_step_loss<S: pipe_bd::StudentModule<Train>>(module: S, kind: LossKind, temperature: f64) -> f32 {
    let spec = BlockSpec::infer("b", &module, &[4], &Default::default()).unwrap().with_loss(kind);
    let mut trainer =
        BlockTrainer::new(0, spec, module, &OptimizerConfig::default(), 10).with_temperature(temperature);
    let input = batch((0..8).map(|i| i as f32 / 8.0).collect(), 2);
    let target = batch(vec![0.3, -0.2, 1.0, 0.5, 0.0, 2.0], 2);
    trainer.step(input, target).unwrap()
}

#[test]
fn the_trainer_minimises_the_blocks_own_loss() {
    let plain = first_step_loss(Plain { linear: fixed_linear() }, LossKind::Mse, 1.0);
    let doubled = first_step_loss(Doubled { linear: fixed_linear() }, LossKind::Mse, 1.0);
    assert!(plain > 0.0);
    assert!((doubled - 2.0 * plain).abs() < 1e-5 * plain, "doubled {doubled} vs plain {plain}");
}

#[test]
fn the_trainers_temperature_reaches_the_soft_target_loss() {
    let at_one =
        first_step_loss(Plain::<Train> { linear: fixed_linear() }, LossKind::SoftTargetCrossEntropy, 1.0);
    let at_four =
        first_step_loss(Plain::<Train> { linear: fixed_linear() }, LossKind::SoftTargetCrossEntropy, 4.0);
    // The same value as the loss computed directly at that temperature.
    let student = Plain::<Flex> { linear: fixed_linear() };
    let input = batch((0..8).map(|i| i as f32 / 8.0).collect(), 2);
    let output = Block::forward(&student, input).unwrap();
    let target = batch(vec![0.3, -0.2, 1.0, 0.5, 0.0, 2.0], 2);
    let direct: f32 = Loss::new(LossKind::SoftTargetCrossEntropy)
        .with_temperature(4.0)
        .compute(output, target)
        .unwrap()
        .into_scalar();
    assert!((at_four - direct).abs() < 1e-5 * direct.abs().max(1.0), "{at_four} vs {direct}");
    assert!((at_four - at_one).abs() > 1e-3, "temperature 4 gave the same loss as 1: {at_four}");
}
