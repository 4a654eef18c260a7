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
use pipe_bd::train::optim::{LrSchedule, OptimizerConfig, OptimizerKind};
use pipe_bd::train::BlockTrainer;
use pipe_bd::{Activation, Block, BlockSpec, LossKind};
use pipebd_students::StudentBlockConfig;
use pipebd_zoo::mnist::Split;
use pipebd_zoo::mnist_teacher;
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
    let train = pipebd_zoo::mnist::load("data/mnist".as_ref(), Split::Train, None).unwrap();
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
    use pipe_bd::data::DataOrder;
    use pipe_bd::rng::Generator;
    use pipebd_cli::config::Overrides;
    use pipebd_cli::zoo::Zoo;
    use pipebd_zoo::Builtin;

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

#[derive(Deserialize)]
struct TextReference {
    steps: usize,
    lr: f64,
    epsilon: f64,
    block: usize,
    heads: usize,
    head_dim: usize,
    ffn: usize,
    max_tokens: usize,
    batches: Vec<Vec<Vec<u32>>>,
    losses: Vec<f32>,
}

/// Element `index` (row-major, PyTorch's layout) of tensor number `tensor`
/// of the patterned student, in [-0.5, 0.5): the integer pattern of
/// `bench/peers/reference_curves_minilm.py`, the same bits on both sides.
fn pattern(tensor: usize, index: usize) -> f64 {
    ((index * 7919 + tensor * 104_729) % 20_011) as f64 / 20_011.0 - 0.5
}

/// A linear layer's weight and bias from the pattern (tensors `tensor` and
/// `tensor + 1`), the weight in burn's `[in, out]` layout.
fn patterned_linear<B: burn::tensor::backend::Backend>(
    layer: &mut burn::nn::Linear<B>,
    tensor: usize,
    device: &B::Device,
) {
    let [d_in, d_out] = layer.weight.dims();
    let scale = 2.0 / (d_in as f64).sqrt();
    let weight: Vec<f32> =
        (0..d_in * d_out).map(|n| (scale * pattern(tensor, (n % d_out) * d_in + n / d_out)) as f32).collect();
    let bias: Vec<f32> = (0..d_out).map(|n| (0.1 * pattern(tensor + 1, n)) as f32).collect();
    layer.weight = Param::from_tensor(Tensor::from_data(TensorData::new(weight, [d_in, d_out]), device));
    layer.bias = Some(Param::from_tensor(Tensor::from_data(TensorData::new(bias, [d_out]), device)));
}

fn patterned_norm<B: burn::tensor::backend::Backend>(
    norm: &mut burn::nn::LayerNorm<B>,
    tensor: usize,
    device: &B::Device,
) {
    let n = norm.gamma.dims()[0];
    let values = |t, f: fn(f64) -> f64| -> Vec<f32> { (0..n).map(|i| f(pattern(t, i)) as f32).collect() };
    let (gamma, beta) = (values(tensor, |p| 1.0 + 0.2 * p), values(tensor + 1, |p| 0.1 * p));
    norm.gamma = Param::from_tensor(Tensor::from_data(TensorData::new(gamma, [n]), device));
    norm.beta = Some(Param::from_tensor(Tensor::from_data(TensorData::new(beta, [n]), device)));
}

/// An encoder student's training against the loss curve PyTorch computed
/// (`tests/data/minilm-reference-curves.json`, written by
/// `bench/peers/reference_curves_minilm.py`): MiniLM's second layer, a
/// narrow student from the same patterned weights, the same real Brown
/// batches with their padding. The masked attention, the residual layer
/// norms, GELU, the masked MSE and Adam (eps 1e-8, cosine) must give
/// PyTorch's loss at every step to 5 digits.
#[test]
fn an_encoder_students_steps_follow_pytorchs_loss_curve_from_the_same_start() {
    use pipebd_kernels::encoder::EncoderLayerConfig;
    let text = std::fs::read_to_string("tests/data/minilm-reference-curves.json").unwrap();
    let reference: TextReference = serde_json::from_str(&text).unwrap();
    let device = Default::default();
    let config = crate::common::minilm_config(64, 16, 1, reference.max_tokens);
    let (embeddings, teacher) = pipebd_zoo::build_minilm::<Flex>(&config, &device).unwrap();
    let sizes = EncoderLayerConfig::new(384, reference.heads, reference.head_dim, reference.ffn);
    let rng = pipe_bd::rng::burn_rng_lock();
    let mut layer = sizes.init::<Train>(&device);
    drop(rng);
    for (i, linear) in
        [&mut layer.query, &mut layer.key, &mut layer.value, &mut layer.attn_out].into_iter().enumerate()
    {
        patterned_linear(linear, 2 * i, &device);
    }
    patterned_norm(&mut layer.attn_norm, 8, &device);
    patterned_linear(&mut layer.ffn_in, 10, &device);
    patterned_linear(&mut layer.ffn_out, 12, &device);
    patterned_norm(&mut layer.ffn_norm, 14, &device);
    let optimizer = OptimizerConfig {
        kind: OptimizerKind::Adam,
        lr: reference.lr,
        min_lr: 0.0,
        schedule: LrSchedule::Cosine,
        epsilon: reference.epsilon,
        ..Default::default()
    };
    let k = reference.block - 1;
    let module = pipebd_students::StudentBlock::Encoder(layer);
    let mut trainer = BlockTrainer::new(k, teacher.specs[k].clone(), module, &optimizer, reference.steps);
    assert_eq!(reference.batches.len(), reference.steps);
    for (step, (batch, &theirs)) in reference.batches.iter().zip(&reference.losses).enumerate() {
        let ids: Vec<&[u32]> = batch.iter().map(Vec::as_slice).collect();
        assert!(ids.iter().any(|s| s.len() < reference.max_tokens), "step {step}: a batch without padding");
        let mut x = pipebd_zoo::text::embed_batch(&embeddings, &ids, reference.max_tokens, &device);
        for t in &teacher.blocks[..k] {
            x = t.forward(x).unwrap();
        }
        let y = teacher.blocks[k].forward(x.clone()).unwrap();
        let ours = trainer.step(x, y).unwrap();
        let tolerance = 1e-5 * theirs.abs();
        assert!((ours - theirs).abs() <= tolerance, "step {step}: pipe-bd {ours} against PyTorch {theirs}");
    }
}
