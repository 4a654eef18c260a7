//! One block's training against loss curves PyTorch computed independently
//! (`tests/data/reference-curves.json`, written by
//! `bench/peers/reference_curves.py`): from the same initial weights on the
//! same real batches, pipe-bd's student step (forward, fused loss and
//! backward, Adam with its epsilon, the cosine learning rate) must give the
//! same loss at every step. A wrong gradient, optimizer update, learning rate
//! or loss shows here within a step or two.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Tensor, TensorData};
use pipe_bd::data::{ImageDataset, Split};
use pipe_bd::train::optim::{LrSchedule, OptimizerConfig, OptimizerKind};
use pipe_bd::train::BlockTrainer;
use pipe_bd::zoo::mnist_teacher;
use pipe_bd::{Activation, Block, BlockSpec, LossKind};
use pipebd_students::StudentBlockConfig;
use serde::Deserialize;

type Train = Autodiff<Flex>;

#[derive(Deserialize)]
struct Reference {
    steps: usize,
    lr: f64,
    epsilon: f64,
    batches: Vec<Vec<usize>>,
    blocks: Vec<BlockCurve>,
}

#[derive(Deserialize)]
struct BlockCurve {
    block: usize,
    student: StudentBlockConfig,
    params: Vec<Tensor1>,
    losses: Vec<f32>,
}

#[derive(Deserialize)]
struct Tensor1 {
    shape: Vec<usize>,
    values: Vec<f32>,
}

/// Replaces every float parameter, in visiting order, by the given values.
struct LoadInOrder<'a> {
    params: std::slice::Iter<'a, Tensor1>,
}

impl<B: burn::tensor::backend::Backend> ModuleMapper<B> for LoadInOrder<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let given = self.params.next().expect("the reference has fewer tensors than the module");
        assert_eq!(given.shape, tensor.dims().to_vec(), "tensor shapes differ");
        let grad = tensor.is_require_grad();
        let loaded =
            Tensor::from_data(TensorData::new(given.values.clone(), given.shape.clone()), &tensor.device());
        Param::from_mapped_value(id, loaded.set_require_grad(grad), mapper)
    }
}

#[test]
fn student_steps_follow_pytorchs_loss_curves_from_the_same_start() {
    let text = std::fs::read_to_string("tests/data/reference-curves.json").unwrap();
    let reference: Reference = serde_json::from_str(&text).unwrap();
    let device = Default::default();
    let teacher = mnist_teacher::<Flex>("data/teachers/mnist-cnn.pth".as_ref(), &device).unwrap();
    let train = ImageDataset::load_mnist("data/mnist".as_ref(), Split::Train, None).unwrap();
    let optimizer = OptimizerConfig {
        kind: OptimizerKind::Adam,
        lr: reference.lr,
        min_lr: 0.0,
        schedule: LrSchedule::Cosine,
        epsilon: reference.epsilon,
        ..Default::default()
    };
    assert_eq!(reference.blocks.len(), 3);
    for curve in &reference.blocks {
        let k = curve.block - 1;
        let input_shape = &teacher.specs[k].input_shape;
        let built = curve.student.init::<Train>(curve.block, input_shape, &device).unwrap();
        let mut loader = LoadInOrder { params: curve.params.iter() };
        let module = built.module.map(&mut loader);
        assert!(loader.params.next().is_none(), "block {}: the reference has more tensors", curve.block);
        let spec = BlockSpec { loss: teacher.specs[k].loss, ..teacher.specs[k].clone() };
        let expected_loss = if curve.block == 4 { LossKind::SoftTargetCrossEntropy } else { LossKind::Mse };
        assert_eq!(spec.loss, expected_loss);
        let mut trainer = BlockTrainer::new(k, spec, module, &optimizer, reference.steps);
        for (step, (indices, &theirs)) in reference.batches.iter().zip(&curve.losses).enumerate() {
            let mut x = Activation::Maps(train.images::<Flex>(indices, &device));
            for t in &teacher.blocks[..k] {
                x = t.forward(x).unwrap();
            }
            let y = teacher.blocks[k].forward(x.clone()).unwrap();
            let ours = trainer.step(x, y).unwrap();
            let tolerance = 1e-4 * theirs.abs() + 1e-6;
            assert!(
                (ours - theirs).abs() <= tolerance,
                "block {} step {step}: pipe-bd {ours} against PyTorch {theirs}",
                curve.block
            );
        }
    }
}
