//! Correctness checks of the fused ops against the unfused burn ops.
//!
//! [`run`] draws fresh random inputs of awkward sizes (not multiples of the
//! tile, batch 1, long rows), runs each fused op on the backend under test and
//! its unfused reference ([`crate::reference::unfused`], burn's ops on the CPU)
//! under autodiff, and reports the relative error of the forward output and of
//! every gradient.
//! The kernel tests assert on these rows; `pipebd kernels --check` prints them.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::reference::unfused;
use burn::tensor::ops::ConvOptions;

use crate::{
    conv2d, conv2d_pool, linear, loss, max_pool2x2, pointwise_conv, set_conv_variant, set_matmul_variant,
    ConvVariant, DistillBackend, Epilogue, MatmulVariant,
};

/// Relative error allowed for the losses (forward and gradient).
pub const LOSS_TOLERANCE: f64 = 1e-4;
/// Relative error allowed for the matmul ops (forward and gradients).
pub const MATMUL_TOLERANCE: f64 = 1e-3;
/// Relative error allowed for the optimizer update after 20 steps against
/// burn's own `Adam` and `Sgd` (the same operations in the same order).
pub const OPTIMIZER_TOLERANCE: f64 = 1e-6;

/// One compared quantity.
#[derive(Debug, Clone)]
pub struct CheckRow {
    /// The op (`mse`, `soft-ce`, `linear`, `pointwise-conv`).
    pub op: String,
    /// Input shapes and options.
    pub case: String,
    /// What was compared: `forward`, `d student`, `d x`, `d weight`, `d bias`.
    pub quantity: String,
    /// `max |fused - reference| / max(max |reference|, 1e-6)`; infinite when
    /// the fused result has a NaN or infinity (for example an unwritten
    /// element of a poisoned output).
    pub relative_error: f64,
    /// The bound the error must stay under.
    pub tolerance: f64,
}

impl CheckRow {
    /// Whether the error is within the tolerance.
    pub fn passed(&self) -> bool {
        self.relative_error <= self.tolerance
    }
}

/// Relative error of `fused` against `reference` (see [`CheckRow::relative_error`]).
pub fn relative_error(fused: &[f32], reference: &[f32]) -> f64 {
    if fused.len() != reference.len() || fused.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let scale = reference.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-6);
    let diff = fused.iter().zip(reference).fold(0f64, |m, (a, b)| m.max((*a as f64 - *b as f64).abs()));
    diff / scale
}

pub(crate) fn values<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    tensor.into_data().convert::<f32>().to_vec().unwrap_or_default()
}

/// The reference side: burn's ops on the CPU. (burn's own reductions on other
/// backends are not trusted as a reference: burn 0.21's wgpu `mean` of a
/// `[1, 100003]` tensor is off by 35% on Mesa's software Vulkan.)
pub(crate) type Reference = burn::backend::Autodiff<burn::backend::Flex>;

pub(crate) fn random(rng: &mut StdRng, shape: &[usize], scale: f32) -> TensorData {
    let n = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale).collect();
    TensorData::new(data, shape.to_vec())
}

pub(crate) fn tensor<B: Backend, const D: usize>(data: &TensorData, device: &B::Device) -> Tensor<B, D> {
    Tensor::from_data(data.clone(), device)
}

pub(crate) struct Rows {
    pub(crate) rows: Vec<CheckRow>,
    pub(crate) op: &'static str,
    pub(crate) case: String,
    pub(crate) tolerance: f64,
}

impl Rows {
    pub(crate) fn add(&mut self, quantity: &str, fused: &[f32], reference: &[f32]) {
        self.rows.push(CheckRow {
            op: self.op.to_string(),
            case: self.case.clone(),
            quantity: quantity.to_string(),
            relative_error: relative_error(fused, reference),
            tolerance: self.tolerance,
        });
    }
}

type LossFn<B, const D: usize> = fn(Tensor<B, D>, Tensor<B, D>) -> Tensor<B, 1>;

/// A loss and its student gradient (scaled by `upstream`) on backend `B`.
fn loss_on<B: DistillBackend, const D: usize>(
    f: LossFn<B, D>,
    student: &TensorData,
    teacher: &TensorData,
    upstream: f32,
    device: &B::Device,
) -> (Vec<f32>, Vec<f32>) {
    let s = tensor::<B, D>(student, device).require_grad();
    let value = f(s.clone(), tensor(teacher, device));
    let grads = value.clone().mul_scalar(upstream).backward();
    (values(value), values(s.grad(&grads).expect("student gradient")))
}

#[allow(clippy::too_many_arguments)]
fn check_loss<B: DistillBackend, const D: usize>(
    out: &mut Vec<CheckRow>,
    rng: &mut StdRng,
    op: &'static str,
    shape: [usize; D],
    scale: f32,
    fused: LossFn<B, D>,
    reference: LossFn<Reference, D>,
    device: &B::Device,
) {
    let student = random(rng, &shape, scale);
    let teacher = random(rng, &shape, scale);
    let upstream = 1.0 + rng.random::<f32>();
    let f = loss_on::<B, D>(fused, &student, &teacher, upstream, device);
    let r = loss_on::<Reference, D>(reference, &student, &teacher, upstream, &Default::default());
    let mut rows = Rows { rows: vec![], op, case: format!("{shape:?}"), tolerance: LOSS_TOLERANCE };
    rows.add("forward", &f.0, &r.0);
    rows.add("d student", &f.1, &r.1);
    out.extend(rows.rows);
}

/// Inputs of a layer check: x, weight, optional bias, and the random upstream
/// gradient the output is probed with.
struct LayerInputs {
    x: TensorData,
    weight: TensorData,
    bias: Option<TensorData>,
    probe: TensorData,
}

/// Forward output and the gradients of x, weight and bias on backend `B`.
type LayerResults = (Vec<f32>, Vec<f32>, Vec<f32>, Option<Vec<f32>>);

fn layer_on<B: DistillBackend, const DX: usize, const DW: usize>(
    inputs: &LayerInputs,
    f: impl Fn(Tensor<B, DX>, Tensor<B, DW>, Option<Tensor<B, 1>>) -> Tensor<B, DX>,
    device: &B::Device,
) -> LayerResults {
    let x = tensor::<B, DX>(&inputs.x, device).require_grad();
    let w = tensor::<B, DW>(&inputs.weight, device).require_grad();
    let b = inputs.bias.as_ref().map(|b| tensor::<B, 1>(b, device).require_grad());
    let y = f(x.clone(), w.clone(), b.clone());
    let grads = (y.clone() * tensor::<B, DX>(&inputs.probe, device)).sum().backward();
    let db = b.map(|b| values(b.grad(&grads).expect("bias gradient")));
    (
        values(y),
        values(x.grad(&grads).expect("x gradient")),
        values(w.grad(&grads).expect("weight gradient")),
        db,
    )
}

fn floats(data: &TensorData) -> Vec<f32> {
    data.to_vec::<f32>().unwrap_or_default()
}

/// Zeroes the probe (the upstream gradient) wherever the pre-activation lies
/// within a hair of an activation kink (0 for relu and relu6, 6 for relu6):
/// there, two correct implementations may round to opposite sides and
/// legitimately disagree on the derivative.
fn avoid_kinks(probe: &mut TensorData, pre: &[f64], epilogue: Epilogue) {
    if !matches!(epilogue, Epilogue::Relu | Epilogue::Relu6) {
        return;
    }
    let mut values = floats(probe);
    for (v, p) in values.iter_mut().zip(pre) {
        if p.abs() < 1e-3 || (epilogue == Epilogue::Relu6 && (p - 6.0).abs() < 1e-3) {
            *v = 0.0;
        }
    }
    *probe = TensorData::new(values, probe.shape.clone());
}

/// `x [rows, in] @ w [in, out] + b` in f64 on the host.
fn linear_pre(inputs: &LayerInputs, rows: usize, d_in: usize, d_out: usize) -> Vec<f64> {
    let (x, w) = (floats(&inputs.x), floats(&inputs.weight));
    let b = inputs.bias.as_ref().map(floats);
    let mut pre = vec![0f64; rows * d_out];
    for r in 0..rows {
        for o in 0..d_out {
            let dot: f64 = (0..d_in).map(|i| x[r * d_in + i] as f64 * w[i * d_out + o] as f64).sum();
            pre[r * d_out + o] = dot + b.as_ref().map_or(0.0, |b| b[o] as f64);
        }
    }
    pre
}

/// The pointwise conv's pre-activation `[batch, out, h*w]` in f64 on the host.
fn conv_pre(inputs: &LayerInputs, batch: usize, c_in: usize, c_out: usize, pixels: usize) -> Vec<f64> {
    let (x, w) = (floats(&inputs.x), floats(&inputs.weight));
    let b = inputs.bias.as_ref().map(floats);
    let mut pre = vec![0f64; batch * c_out * pixels];
    for n in 0..batch {
        for o in 0..c_out {
            for p in 0..pixels {
                let dot: f64 =
                    (0..c_in).map(|c| w[o * c_in + c] as f64 * x[(n * c_in + c) * pixels + p] as f64).sum();
                pre[(n * c_out + o) * pixels + p] = dot + b.as_ref().map_or(0.0, |b| b[o] as f64);
            }
        }
    }
    pre
}

fn add_layer_rows(rows: &mut Rows, f: LayerResults, r: LayerResults) {
    rows.add("forward", &f.0, &r.0);
    rows.add("d x", &f.1, &r.1);
    rows.add("d weight", &f.2, &r.2);
    if let (Some(fb), Some(rb)) = (f.3, r.3) {
        rows.add("d bias", &fb, &rb);
    }
}

/// Checks every op on `device` against burn's unfused ops on the CPU, on fresh
/// random inputs drawn from `seed`.
pub fn run<B: DistillBackend>(device: &B::Device, seed: u64) -> Vec<CheckRow> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    check_loss::<B, 2>(&mut out, &mut rng, "mse", [1, 7], 2.0, loss::mse, unfused::mse, device);
    check_loss::<B, 4>(&mut out, &mut rng, "mse", [3, 5, 13, 11], 2.0, loss::mse, unfused::mse, device);
    check_loss::<B, 4>(&mut out, &mut rng, "mse", [37, 32, 14, 14], 2.0, loss::mse, unfused::mse, device);
    check_loss::<B, 2>(&mut out, &mut rng, "mse", [1, 100_003], 2.0, loss::mse, unfused::mse, device);
    for shape in [[1, 10], [257, 10], [3, 1000], [2, 4099]] {
        let (fused, reference) = (loss::soft_target_cross_entropy, unfused::soft_target_cross_entropy);
        check_loss::<B, 2>(&mut out, &mut rng, "soft-ce", shape, 4.0, fused, reference, device);
    }
    for variant in [MatmulVariant::Fused, MatmulVariant::Split] {
        set_matmul_variant(variant);
        check_layers::<B>(&mut out, &mut rng, variant, device);
    }
    set_matmul_variant(MatmulVariant::Auto);
    for variant in [ConvVariant::Tiled, ConvVariant::Direct] {
        set_conv_variant(variant);
        check_convolutions::<B>(&mut out, &mut rng, variant, device);
    }
    set_conv_variant(ConvVariant::Auto);
    check_max_pool::<B>(&mut out, &mut rng, device);
    check_attention::<B>(&mut out, &mut rng, device);
    check_layer_norm::<B>(&mut out, &mut rng, device);
    crate::check_decoder::run::<B>(&mut out, &mut rng, device);
    check_optimizers::<B>(&mut out, &mut rng, device);
    out
}

/// A `[batch, tokens]` mask with the real tokens of each sequence given by
/// `real(b, t)`.
pub(crate) fn mask_of(batch: usize, tokens: usize, real: impl Fn(usize, usize) -> bool) -> TensorData {
    let values: Vec<f32> =
        (0..batch * tokens).map(|i| if real(i / tokens, i % tokens) { 1.0 } else { 0.0 }).collect();
    TensorData::new(values, vec![batch, tokens])
}

/// The masked attention ([`crate::transformer::masked_attention`]) against
/// the same formula in burn's ops, forward and the gradients of q, k and v:
/// one token and 70, head widths of 4, 7 and 32, and padding at the end (of
/// every length down to one real token), at the start, in the middle, every
/// other token, and none.
fn check_attention<B: DistillBackend>(out: &mut Vec<CheckRow>, rng: &mut StdRng, device: &B::Device) {
    use crate::transformer::{attention_reference, masked_attention};
    let cpu = burn::tensor::Device::<Reference>::default();
    let cases: [(&str, [usize; 4], Box<dyn Fn(usize, usize) -> bool>); 6] = [
        ("no padding", [1, 1, 1, 8], Box::new(|_, _| true)),
        ("padded ends", [3, 32, 12, 32], Box::new(|b, t| t < [32, 1, 17][b])),
        ("padded starts", [2, 9, 3, 4], Box::new(|b, t| t >= 2 + 3 * b)),
        ("padding inside", [2, 70, 2, 7], Box::new(|b, t| !(10 + b..40).contains(&t))),
        ("every other", [2, 13, 4, 8], Box::new(|b, t| (t + b) % 2 == 0)),
        ("one real token", [4, 6, 2, 5], Box::new(|b, t| t == b)),
    ];
    for (pattern, [batch, tokens, heads, head_dim], real) in cases {
        let width = heads * head_dim;
        let inputs: Vec<TensorData> = (0..3).map(|_| random(rng, &[batch, tokens, width], 1.5)).collect();
        let mask = mask_of(batch, tokens, real);
        let probe = random(rng, &[batch, tokens, width], 1.0);
        fn attend<B: DistillBackend>(
            inputs: &[TensorData],
            mask: &TensorData,
            probe: &TensorData,
            f: impl Fn([Tensor<B, 3>; 3], Tensor<B, 2>) -> Tensor<B, 3>,
            device: &B::Device,
        ) -> Vec<Vec<f32>> {
            let qkv: [Tensor<B, 3>; 3] =
                std::array::from_fn(|i| tensor::<B, 3>(&inputs[i], device).require_grad());
            let context = f(qkv.clone(), tensor(mask, device));
            let grads = (context.clone() * tensor::<B, 3>(probe, device)).sum().backward();
            let mut all = vec![values(context)];
            all.extend(qkv.into_iter().map(|x| values(x.grad(&grads).expect("gradient"))));
            all
        }
        let f =
            attend::<B>(&inputs, &mask, &probe, |[q, k, v], m| masked_attention(q, k, v, m, heads), device);
        let reference = |[q, k, v]: [Tensor<Reference, 3>; 3], m: Tensor<Reference, 2>| {
            let prim = |t: Tensor<Reference, 3>| t.into_primitive().tensor();
            let out = attention_reference::<Reference>(
                prim(q),
                prim(k),
                prim(v),
                m.into_primitive().tensor(),
                heads,
                false,
            );
            Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(out.context))
        };
        let r = attend::<Reference>(&inputs, &mask, &probe, reference, &cpu);
        let mut rows = Rows {
            rows: vec![],
            op: "attention",
            case: format!("[{batch}, {tokens}, {heads}x{head_dim}] {pattern}"),
            tolerance: MATMUL_TOLERANCE,
        };
        for (quantity, (f, r)) in ["forward", "d q", "d k", "d v"].iter().zip(f.iter().zip(&r)) {
            rows.add(quantity, f, r);
        }
        out.extend(rows.rows);
    }
}

/// The residual add with its layer norm ([`crate::transformer::add_layer_norm`])
/// against burn's `LayerNorm` of the sum, forward and every gradient.
fn check_layer_norm<B: DistillBackend>(out: &mut Vec<CheckRow>, rng: &mut StdRng, device: &B::Device) {
    use burn::module::Param;
    use burn::nn::{LayerNorm, LayerNormConfig};
    let cpu = burn::tensor::Device::<Reference>::default();
    for [rows_n, hidden] in [[1, 5], [37, 384], [130, 17]] {
        let inputs: Vec<TensorData> = (0..2).map(|_| random(rng, &[rows_n, hidden], 2.0)).collect();
        let (gamma, beta) = (random(rng, &[hidden], 1.5), random(rng, &[hidden], 0.5));
        let probe = random(rng, &[rows_n, hidden], 1.0);
        fn normed<B: DistillBackend>(
            inputs: &[TensorData],
            [gamma, beta]: [&TensorData; 2],
            probe: &TensorData,
            f: impl Fn(Tensor<B, 2>, Tensor<B, 2>, &LayerNorm<B>) -> Tensor<B, 2>,
            device: &B::Device,
        ) -> Vec<Vec<f32>> {
            let [x, residual]: [Tensor<B, 2>; 2] =
                std::array::from_fn(|i| tensor::<B, 2>(&inputs[i], device).require_grad());
            let hidden = gamma.shape[0];
            let mut norm = LayerNormConfig::new(hidden).with_epsilon(1e-12).init::<B>(device);
            norm.gamma = Param::from_tensor(tensor::<B, 1>(gamma, device).require_grad());
            norm.beta = Some(Param::from_tensor(tensor::<B, 1>(beta, device).require_grad()));
            let y = f(x.clone(), residual.clone(), &norm);
            let grads = (y.clone() * tensor::<B, 2>(probe, device)).sum().backward();
            let grad = |t: Tensor<B, 2>| values(t.grad(&grads).expect("gradient"));
            let param = |p: &Param<Tensor<B, 1>>| values(p.val().grad(&grads).expect("gradient"));
            vec![values(y), grad(x), grad(residual), param(&norm.gamma), param(norm.beta.as_ref().unwrap())]
        }
        let scale = [&gamma, &beta];
        let f = normed::<B>(
            &inputs,
            scale,
            &probe,
            |x, r, n| crate::transformer::add_layer_norm(x, r, n, 1e-12),
            device,
        );
        let r = normed::<Reference>(&inputs, scale, &probe, |x, r, n| n.forward(x + r), &cpu);
        let mut rows = Rows {
            rows: vec![],
            op: "add-layer-norm",
            case: format!("[{rows_n}, {hidden}]"),
            tolerance: MATMUL_TOLERANCE,
        };
        let quantities = ["forward", "d x", "d residual", "d gamma", "d beta"];
        for (quantity, (f, r)) in quantities.iter().zip(f.iter().zip(&r)) {
            rows.add(quantity, f, r);
        }
        out.extend(rows.rows);
    }
}

/// Steps of the optimizer checks.
const OPTIMIZER_STEPS: usize = 20;

/// The backend's optimizer update ([`crate::FusedBackend::optimizer_step`],
/// every tensor of a block in one call) against burn's own `Adam` and `Sgd`
/// on the CPU, one tensor at a time: 20 steps on the same random gradients
/// with a learning rate that changes every step (it travels as data), then
/// the parameters and the optimizer state compared.
fn check_optimizers<B: DistillBackend>(out: &mut Vec<CheckRow>, rng: &mut StdRng, device: &B::Device) {
    use crate::optim::{AdamRule, SgdMomentum, SgdRule, UpdateRule};
    let shapes: [&[usize]; 5] = [&[37], &[5, 13], &[16, 8, 3, 3], &[1], &[128, 1152]];
    let adam = |beta_1, beta_2, epsilon, weight_decay| {
        UpdateRule::Adam(AdamRule { beta_1, beta_2, epsilon, weight_decay })
    };
    let sgd = |nesterov, dampening, weight_decay| {
        UpdateRule::Sgd(SgdRule {
            momentum: Some(SgdMomentum { momentum: 0.9, dampening, nesterov }),
            weight_decay,
        })
    };
    let rules = [
        ("adam", adam(0.9, 0.999, 1e-5, None)),
        ("adam decay", adam(0.8, 0.99, 1e-8, Some(0.01))),
        ("sgd nesterov", sgd(true, 0.0, Some(0.001))),
        ("sgd damped", sgd(false, 0.1, None)),
        ("sgd plain", UpdateRule::Sgd(SgdRule { momentum: None, weight_decay: None })),
    ];
    for (name, rule) in rules {
        let params: Vec<TensorData> = shapes.iter().map(|shape| random(rng, shape, 1.0)).collect();
        let steps: Vec<Vec<TensorData>> = (0..OPTIMIZER_STEPS)
            .map(|_| shapes.iter().map(|shape| random(rng, shape, 0.1)).collect())
            .collect();
        let lrs: Vec<f64> =
            (0..OPTIMIZER_STEPS).map(|i| 0.01 * (1.0 + (i as f64 * 0.3).cos()) / 2.0 + 1e-4).collect();
        let fused = fused_updates::<B::InnerBackend>(&params, &steps, &lrs, &rule, device);
        let reference = burn_updates(&params, &steps, &lrs, &rule);
        let mut rows = Rows {
            rows: vec![],
            op: "optimizer",
            case: format!("{name}, 5 tensors, {OPTIMIZER_STEPS} steps"),
            tolerance: OPTIMIZER_TOLERANCE,
        };
        let flat = |v: &[Vec<f32>]| v.concat();
        rows.add("param", &flat(&fused.0), &flat(&reference.0));
        if !reference.1.is_empty() {
            rows.add("state", &flat(&fused.1), &flat(&reference.1));
        }
        out.extend(rows.rows);
    }
}

/// Parameters and state (first moments or velocities, then second moments)
/// after every step through the backend's own update.
fn fused_updates<B: crate::FusedBackend>(
    params: &[TensorData],
    steps: &[Vec<TensorData>],
    lrs: &[f64],
    rule: &crate::UpdateRule,
    device: &B::Device,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    use crate::optim::ParamSlot;
    let primitive = |data: &TensorData| B::float_from_data(data.clone(), device);
    let mut current: Vec<_> = params.iter().map(|p| (primitive(p), None)).collect();
    for (grads, &lr) in steps.iter().zip(lrs) {
        let slots = current
            .into_iter()
            .zip(grads)
            .map(|((param, state), grad)| ParamSlot { param, grad: primitive(grad), state })
            .collect();
        current = B::optimizer_step(slots, rule, lr).into_iter().map(|u| (u.param, u.state)).collect();
    }
    let read = |t: burn::tensor::ops::FloatTensor<B>| {
        Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(B::float_reshape(
            t.clone(),
            [burn::tensor::TensorMetadata::shape(&t).num_elements()].into(),
        )))
        .into_data()
        .to_vec::<f32>()
        .unwrap_or_default()
    };
    let mut state = Vec::new();
    let mut second = Vec::new();
    let values = current
        .into_iter()
        .map(|(param, s)| {
            if let Some(s) = s {
                state.push(read(s.first));
                if let Some(v) = s.second {
                    second.push(read(v));
                }
            }
            read(param)
        })
        .collect();
    state.extend(second);
    (values, state)
}

/// The same through burn's `Adam` / `Sgd` (`SimpleOptimizer::step`, one
/// flattened tensor at a time) on the CPU.
fn burn_updates(
    params: &[TensorData],
    steps: &[Vec<TensorData>],
    lrs: &[f64],
    rule: &crate::UpdateRule,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    use burn::optim::decay::WeightDecayConfig;
    use burn::optim::momentum::MomentumConfig;
    use burn::optim::{AdamConfig, SgdConfig, SimpleOptimizer};
    type Cpu = burn::backend::Flex;
    let device = Default::default();
    let flat = |data: &TensorData| {
        let values = floats(data);
        let n = values.len();
        Tensor::<Cpu, 1>::from_data(TensorData::new(values, [n]), &device)
    };
    let vec = |t: Tensor<Cpu, 1>| t.into_data().to_vec::<f32>().unwrap_or_default();
    let mut values = Vec::new();
    let mut firsts = Vec::new();
    let mut seconds = Vec::new();
    for (k, param) in params.iter().enumerate() {
        let mut tensor = flat(param);
        match rule {
            crate::UpdateRule::Adam(a) => {
                let mut config =
                    AdamConfig::new().with_beta_1(a.beta_1).with_beta_2(a.beta_2).with_epsilon(a.epsilon);
                if let Some(p) = a.weight_decay {
                    config = config.with_weight_decay(Some(WeightDecayConfig::new(p)));
                }
                let adam = config.build();
                let mut state = None;
                for (grads, &lr) in steps.iter().zip(lrs) {
                    let (t, s) = adam.step(lr, tensor, flat(&grads[k]), state);
                    (tensor, state) = (t, s);
                }
                if let Some(state) = state {
                    firsts.push(vec(state.momentum.moment_1));
                    seconds.push(vec(state.momentum.moment_2));
                }
            }
            crate::UpdateRule::Sgd(s) => {
                let momentum = s.momentum.map(|m| MomentumConfig {
                    momentum: m.momentum,
                    dampening: m.dampening,
                    nesterov: m.nesterov,
                });
                let config = SgdConfig::new()
                    .with_momentum(momentum)
                    .with_weight_decay(s.weight_decay.map(WeightDecayConfig::new));
                let sgd = config.build::<Cpu>();
                let mut state = None;
                for (grads, &lr) in steps.iter().zip(lrs) {
                    let (t, st) = sgd.step(lr, tensor, flat(&grads[k]), state);
                    (tensor, state) = (t, st);
                }
                // burn's velocity is private to its record: read it through the record's item.
                if let Some(velocity) = state.and_then(|s| s.momentum) {
                    use burn::record::{FullPrecisionSettings, Record};
                    let item = Record::<Cpu>::into_item::<FullPrecisionSettings>(velocity);
                    let velocity = <Tensor<Cpu, 1> as Record<Cpu>>::from_item::<FullPrecisionSettings>(
                        item.velocity,
                        &device,
                    );
                    firsts.push(vec(velocity));
                }
            }
        }
        values.push(vec(tensor));
    }
    firsts.extend(seconds);
    (values, firsts)
}

/// A convolution's pre-activation `[batch, c_out, oh, ow]` in f64 on the host.
fn conv_kxk_pre(
    inputs: &LayerInputs,
    x_shape: [usize; 4],
    w_shape: [usize; 4],
    options: &ConvOptions<2>,
) -> Vec<f64> {
    let (x, w) = (floats(&inputs.x), floats(&inputs.weight));
    let b = inputs.bias.as_ref().map(floats);
    let ([batch, c_in, h, wd], [c_out, per_group, kh, kw]) = (x_shape, w_shape);
    let filters_per_group = c_out / (c_in / per_group);
    let ([sy, sx], [py, px]) = (options.stride, options.padding);
    let (oh, ow) = ((h + 2 * py - kh) / sy + 1, (wd + 2 * px - kw) / sx + 1);
    let mut pre = vec![0f64; batch * c_out * oh * ow];
    for n in 0..batch {
        for o in 0..c_out {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut sum = b.as_ref().map_or(0.0, |b| b[o] as f64);
                    for g in 0..per_group {
                        // The input channel of this filter's group.
                        let c = o / filters_per_group * per_group + g;
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let (iy, ix) = (
                                    (oy * sy + ky) as isize - py as isize,
                                    (ox * sx + kx) as isize - px as isize,
                                );
                                if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < wd {
                                    let xv = x[((n * c_in + c) * h + iy as usize) * wd + ix as usize] as f64;
                                    sum += xv * w[((o * per_group + g) * kh + ky) * kw + kx] as f64;
                                }
                            }
                        }
                    }
                    pre[((n * c_out + o) * oh + oy) * ow + ox] = sum;
                }
            }
        }
    }
    pre
}

/// The fused convolution (kernels 3x3 and 5x3, strides 1 and 2, with and
/// without padding) against burn's `conv2d` and the activation.
fn check_convolutions<B: DistillBackend>(
    out: &mut Vec<CheckRow>,
    rng: &mut StdRng,
    variant: ConvVariant,
    device: &B::Device,
) {
    let tag = match variant {
        ConvVariant::Direct => " [direct]",
        _ => "",
    };
    let cpu = burn::tensor::Device::<Reference>::default();
    let cases = [
        ([3, 1, 28, 28], [6, 1, 3, 3], [1, 1], [1, 1]),
        ([4, 16, 14, 14], [16, 16, 3, 3], [1, 1], [1, 1]),
        ([2, 5, 9, 8], [7, 5, 3, 3], [2, 2], [1, 1]),
        ([1, 3, 7, 6], [4, 3, 5, 3], [1, 2], [0, 1]),
        // Fewer filter entries than output channels (the weight gradient's
        // transposed product): a 1x1 and a 3x3.
        ([3, 6, 10, 10], [32, 6, 1, 1], [1, 1], [0, 0]),
        ([2, 2, 8, 8], [40, 2, 3, 3], [1, 1], [1, 1]),
        // Depthwise (groups = input channels; the weight's second axis is 1).
        ([3, 4, 9, 9], [8, 1, 3, 3], [1, 1], [1, 1]),
        ([2, 6, 8, 7], [6, 1, 3, 3], [2, 2], [1, 1]),
    ];
    for (i, (x_shape, w_shape, stride, padding)) in cases.into_iter().enumerate() {
        for (epilogue, pooled) in [
            (Epilogue::Identity, false),
            (Epilogue::Relu, false),
            (Epilogue::Relu6, false),
            (Epilogue::Identity, true),
            (Epilogue::Relu, true),
        ] {
            let with_bias = (i + epilogue as usize) % 3 != 1;
            let groups = x_shape[1] / w_shape[1];
            let options = ConvOptions::new(stride, padding, [1, 1], groups);
            let fan_in = (w_shape[1] * w_shape[2] * w_shape[3]) as f32;
            let [batch, _, h, w] = x_shape;
            let (oh, ow) = (
                (h + 2 * padding[0] - w_shape[2]) / stride[0] + 1,
                (w + 2 * padding[1] - w_shape[3]) / stride[1] + 1,
            );
            let mut inputs = LayerInputs {
                x: random(rng, &x_shape, 1.0),
                weight: random(rng, &w_shape, 1.0 / fan_in.sqrt()),
                bias: with_bias.then(|| random(rng, &[w_shape[0]], 0.5)),
                probe: random(rng, &[batch, w_shape[0], oh, ow], 1.0),
            };
            let pre = conv_kxk_pre(&inputs, x_shape, w_shape, &options);
            if pooled {
                inputs.probe = random(rng, &[batch, w_shape[0], oh / 2, ow / 2], 1.0);
                avoid_pool_ties(&mut inputs.probe, &pre, [oh, ow], epilogue);
            } else {
                avoid_kinks(&mut inputs.probe, &pre, epilogue);
            }
            let mut rows = Rows {
                rows: vec![],
                op: if pooled { "conv2d-pool" } else { "conv2d" },
                case: format!(
                    "x {x_shape:?} w {w_shape:?} s{stride:?} p{padding:?} {} bias={with_bias}{tag}",
                    epilogue.name()
                ),
                tolerance: MATMUL_TOLERANCE,
            };
            let opts = options.clone();
            let f = layer_on::<B, 4, 4>(
                &inputs,
                move |x, w, b| match pooled {
                    true => conv2d_pool(x, w, b, opts.clone(), epilogue),
                    false => conv2d(x, w, b, opts.clone(), epilogue),
                },
                device,
            );
            let r = layer_on::<Reference, 4, 4>(
                &inputs,
                move |x, w, b| {
                    let y = crate::reference::activate(
                        burn::tensor::module::conv2d(x, w, b, options.clone()),
                        epilogue,
                    );
                    match pooled {
                        true => burn::tensor::module::max_pool2d(y, [2, 2], [2, 2], [0, 0], [1, 1], false),
                        false => y,
                    }
                },
                &cpu,
            );
            add_layer_rows(&mut rows, f, r);
            out.extend(rows.rows);
        }
    }
}

/// Zeroes the probe of every pooled output whose window's maximum is not
/// clear: two values within a hair of each other (rounding may pick either),
/// or a maximum within a hair of an activation kink.
fn avoid_pool_ties(probe: &mut TensorData, pre: &[f64], [h, w]: [usize; 2], epilogue: Epilogue) {
    let mut values = floats(probe);
    let (ph, pw) = (h / 2, w / 2);
    for (o, v) in values.iter_mut().enumerate() {
        let (plane, oy, ox) = (o / (ph * pw), o / pw % ph, o % pw);
        let at = |dy: usize, dx: usize| pre[plane * h * w + (2 * oy + dy) * w + 2 * ox + dx];
        let mut window = [at(0, 0), at(0, 1), at(1, 0), at(1, 1)];
        window.sort_by(|a, b| b.total_cmp(a));
        let kink = matches!(epilogue, Epilogue::Relu | Epilogue::Relu6) && window[0].abs() < 1e-3;
        if window[0] - window[1] < 1e-3 || kink {
            *v = 0.0;
        }
    }
    *probe = TensorData::new(values, probe.shape.clone());
}

/// The 2x2 max-pool (even and odd sizes) against burn's `max_pool2d`.
fn check_max_pool<B: DistillBackend>(out: &mut Vec<CheckRow>, rng: &mut StdRng, device: &B::Device) {
    let cpu = burn::tensor::Device::<Reference>::default();
    for shape in [[2, 3, 28, 28], [5, 4, 7, 7], [1, 2, 6, 9]] {
        let x = random(rng, &shape, 2.0);
        let probe = random(rng, &[shape[0], shape[1], shape[2] / 2, shape[3] / 2], 1.0);
        fn pooled<B: DistillBackend>(
            x: &TensorData,
            probe: &TensorData,
            pool: impl Fn(Tensor<B, 4>) -> Tensor<B, 4>,
            device: &B::Device,
        ) -> (Vec<f32>, Vec<f32>) {
            let x = tensor::<B, 4>(x, device).require_grad();
            let y = pool(x.clone());
            let grads = (y.clone() * tensor::<B, 4>(probe, device)).sum().backward();
            (values(y), values(x.grad(&grads).expect("x gradient")))
        }
        let f = pooled::<B>(&x, &probe, max_pool2x2, device);
        let r = pooled::<Reference>(
            &x,
            &probe,
            |x| burn::tensor::module::max_pool2d(x, [2, 2], [2, 2], [0, 0], [1, 1], false),
            &cpu,
        );
        let mut rows = Rows {
            rows: vec![],
            op: "max-pool-2x2",
            case: format!("x {shape:?}"),
            tolerance: LOSS_TOLERANCE,
        };
        rows.add("forward", &f.0, &r.0);
        rows.add("d x", &f.1, &r.1);
        out.extend(rows.rows);
    }
}

/// The linear and pointwise-conv cases with the matmul `variant` in force.
fn check_layers<B: DistillBackend>(
    out: &mut Vec<CheckRow>,
    rng: &mut StdRng,
    variant: MatmulVariant,
    device: &B::Device,
) {
    let cpu = burn::tensor::Device::<Reference>::default();
    let tag = match variant {
        MatmulVariant::Split => " [split]",
        _ => "",
    };
    let linear_cases = [(1, 5, 3), (37, 29, 53), (130, 300, 70), (2, 1152, 17)];
    for (i, (rows_n, d_in, d_out)) in linear_cases.into_iter().enumerate() {
        for epilogue in Epilogue::ALL {
            let with_bias = (i + epilogue as usize) % 3 != 2;
            let mut inputs = LayerInputs {
                x: random(rng, &[rows_n, d_in], 1.0),
                weight: random(rng, &[d_in, d_out], 1.0 / (d_in as f32).sqrt()),
                bias: with_bias.then(|| random(rng, &[d_out], 0.5)),
                probe: random(rng, &[rows_n, d_out], 1.0),
            };
            let pre = linear_pre(&inputs, rows_n, d_in, d_out);
            avoid_kinks(&mut inputs.probe, &pre, epilogue);
            let mut rows = Rows {
                rows: vec![],
                op: "linear",
                case: format!(
                    "x [{rows_n}, {d_in}] w [{d_in}, {d_out}] {} bias={with_bias}{tag}",
                    epilogue.name()
                ),
                tolerance: MATMUL_TOLERANCE,
            };
            let f = layer_on::<B, 2, 2>(&inputs, |x, w, b| linear(x, w, b, epilogue), device);
            let r = layer_on::<Reference, 2, 2>(&inputs, |x, w, b| unfused::linear(x, w, b, epilogue), &cpu);
            add_layer_rows(&mut rows, f, r);
            out.extend(rows.rows);
        }
    }
    let conv_cases = [([1, 3, 5, 7], 4), ([17, 24, 7, 7], 40), ([5, 32, 14, 14], 19)];
    for (i, (shape, c_out)) in conv_cases.into_iter().enumerate() {
        for epilogue in Epilogue::ALL {
            let with_bias = (i + epilogue as usize) % 3 != 1;
            let [batch, c_in, h, w] = shape;
            let mut inputs = LayerInputs {
                x: random(rng, &shape, 1.0),
                weight: random(rng, &[c_out, c_in, 1, 1], 1.0 / (c_in as f32).sqrt()),
                bias: with_bias.then(|| random(rng, &[c_out], 0.5)),
                probe: random(rng, &[batch, c_out, h, w], 1.0),
            };
            let pre = conv_pre(&inputs, batch, c_in, c_out, h * w);
            avoid_kinks(&mut inputs.probe, &pre, epilogue);
            let mut rows = Rows {
                rows: vec![],
                op: "pointwise-conv",
                case: format!("x {shape:?} -> {c_out} {} bias={with_bias}{tag}", epilogue.name()),
                tolerance: MATMUL_TOLERANCE,
            };
            let f = layer_on::<B, 4, 4>(&inputs, |x, w, b| pointwise_conv(x, w, b, epilogue), device);
            let r = layer_on::<Reference, 4, 4>(
                &inputs,
                |x, w, b| unfused::pointwise_conv(x, w, b, epilogue),
                &cpu,
            );
            add_layer_rows(&mut rows, f, r);
            out.extend(rows.rows);
        }
    }
}

/// The rows as an aligned text table.
pub fn table(rows: &[CheckRow]) -> String {
    let mut text =
        format!("{:<15} {:<48} {:<10} {:>10} {:>9}  ok\n", "op", "case", "quantity", "rel.error", "bound");
    for row in rows {
        text.push_str(&format!(
            "{:<15} {:<48} {:<10} {:>10.2e} {:>9.0e}  {}\n",
            row.op,
            row.case,
            row.quantity,
            row.relative_error,
            row.tolerance,
            if row.passed() { "yes" } else { "NO" }
        ));
    }
    text
}

/// One line per op and quantity: how many cases, the largest relative error
/// and its bound; then every failing row in full.
pub fn summary(rows: &[CheckRow]) -> String {
    let mut groups: Vec<(String, String, usize, f64, f64)> = Vec::new();
    for row in rows {
        match groups.iter_mut().find(|g| g.0 == row.op && g.1 == row.quantity) {
            Some(g) => {
                g.2 += 1;
                g.3 = g.3.max(row.relative_error);
            }
            None => groups.push((row.op.clone(), row.quantity.clone(), 1, row.relative_error, row.tolerance)),
        }
    }
    let mut text = format!(
        "{:<15} {:<10} {:>6} {:>14} {:>9}  ok\n",
        "op", "quantity", "cases", "max rel.error", "bound"
    );
    for (op, quantity, cases, worst, bound) in groups {
        let ok = if worst <= bound { "yes" } else { "NO" };
        text.push_str(&format!("{op:<15} {quantity:<10} {cases:>6} {worst:>14.2e} {bound:>9.0e}  {ok}\n"));
    }
    let failed: Vec<CheckRow> = rows.iter().filter(|r| !r.passed()).cloned().collect();
    if !failed.is_empty() {
        text.push_str("failing cases:\n");
        text.push_str(&table(&failed));
    }
    text
}
