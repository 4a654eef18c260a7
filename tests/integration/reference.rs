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
        // Building draws (then discards) burn's initial weights: not from
        // under another test's seeded build.
        let rng = pipe_bd::rng::burn_rng_lock();
        let built = curve.student.init::<Train>(curve.block, input_shape, &device).unwrap();
        let mut loader = LoadInOrder { params: curve.params.iter() };
        let module = built.module.map(&mut loader);
        drop(rng);
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

#[derive(Deserialize)]
struct TorchInit {
    seed: u64,
    samples: usize,
    blocks: Vec<Vec<TensorDigest>>,
    epochs: Vec<OrderDigest>,
}

#[derive(Deserialize)]
struct TensorDigest {
    shape: Vec<usize>,
    first: Vec<f32>,
    last: f32,
    sum: f64,
}

#[derive(Deserialize)]
struct OrderDigest {
    first: Vec<usize>,
    last: Vec<usize>,
}

/// `generator = "torch"` (the quickstart's students, seed 42) draws exactly
/// the weights `torch.nn` draws after `torch.manual_seed(42)`, and the epoch
/// orders are the `torch.randperm` calls that follow
/// (`tests/data/torch-init.json`, written by `bench/peers/reference_init.py`).
#[test]
fn torch_generator_draws_what_pytorch_draws() {
    use pipe_bd::config::Overrides;
    use pipe_bd::data::DataOrder;
    use pipe_bd::rng::Generator;
    use pipe_bd::zoo::{Builtin, Zoo};

    let text = std::fs::read_to_string("tests/data/torch-init.json").unwrap();
    let reference: TorchInit = serde_json::from_str(&text).unwrap();
    let path = std::path::Path::new("experiments/mnist-cnn.toml");
    let mut config = Builtin.load_config(path, Overrides::default()).unwrap();
    config.seed = reference.seed;
    config.generator = Generator::Torch;
    let teacher = Builtin.teacher_specs(&config).unwrap();
    let students = Builtin.students::<Train>(&config, &teacher, &Default::default()).unwrap();
    assert_eq!(students.blocks.len(), reference.blocks.len());
    for (k, (block, expected)) in students.blocks.iter().zip(&reference.blocks).enumerate() {
        let tensors = pipe_bd::parameter_tensors::<Train, _>(block);
        assert_eq!(tensors.len(), expected.len(), "block {}: number of tensors", k + 1);
        for (t, ((shape, values), want)) in tensors.iter().zip(expected).enumerate() {
            let at = format!("block {} tensor {t}", k + 1);
            assert_eq!(shape, &want.shape, "{at}: shape");
            assert_eq!(&values[..want.first.len()], &want.first[..], "{at}: first values");
            assert_eq!(values.last(), Some(&want.last), "{at}: last value");
            let sum: f64 = values.iter().map(|&v| v as f64).sum();
            assert!((sum - want.sum).abs() < 1e-9 * values.len() as f64, "{at}: sum {sum} vs {}", want.sum);
        }
    }
    let params = students.specs.iter().map(|s| s.params).sum();
    let order = DataOrder::new(Generator::Torch, reference.seed, params);
    for (epoch, want) in reference.epochs.iter().enumerate() {
        let got = order.epoch(reference.samples, epoch);
        assert_eq!(&got[..want.first.len()], &want.first[..], "epoch {epoch}: first samples");
        assert_eq!(&got[got.len() - want.last.len()..], &want.last[..], "epoch {epoch}: last samples");
    }
}
