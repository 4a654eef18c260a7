//! What the checks of [`super::run`] share: the compared rows and their
//! tolerances, the CPU reference backend, random inputs and masks, and the
//! helpers of the layer checks (inputs, results, probes kept off the
//! activations' kinks).

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use rand::rngs::StdRng;
use rand::Rng;

use crate::{DistillBackend, Epilogue};

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

/// A `[batch, tokens]` mask with the real tokens of each sequence given by
/// `real(b, t)`.
pub(crate) fn mask_of(batch: usize, tokens: usize, real: impl Fn(usize, usize) -> bool) -> TensorData {
    let values: Vec<f32> =
        (0..batch * tokens).map(|i| if real(i / tokens, i % tokens) { 1.0 } else { 0.0 }).collect();
    TensorData::new(values, vec![batch, tokens])
}

/// Inputs of a layer check: x, weight, optional bias, and the random upstream
/// gradient the output is probed with.
pub(super) struct LayerInputs {
    pub(super) x: TensorData,
    pub(super) weight: TensorData,
    pub(super) bias: Option<TensorData>,
    pub(super) probe: TensorData,
}

/// Forward output and the gradients of x, weight and bias on backend `B`.
pub(super) type LayerResults = (Vec<f32>, Vec<f32>, Vec<f32>, Option<Vec<f32>>);

pub(super) fn layer_on<B: DistillBackend, const DX: usize, const DW: usize>(
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

pub(super) fn floats(data: &TensorData) -> Vec<f32> {
    data.to_vec::<f32>().unwrap_or_default()
}

/// Zeroes the probe (the upstream gradient) wherever the pre-activation lies
/// within a hair of an activation kink (0 for relu and relu6, 6 for relu6):
/// there, two correct implementations may round to opposite sides and
/// legitimately disagree on the derivative.
pub(super) fn avoid_kinks(probe: &mut TensorData, pre: &[f64], epilogue: Epilogue) {
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

pub(super) fn add_layer_rows(rows: &mut Rows, f: LayerResults, r: LayerResults) {
    rows.add("forward", &f.0, &r.0);
    rows.add("d x", &f.1, &r.1);
    rows.add("d weight", &f.2, &r.2);
    if let (Some(fb), Some(rb)) = (f.3, r.3) {
        rows.add("d bias", &fb, &rb);
    }
}
