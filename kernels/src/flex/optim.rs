//! The native CPU path of [`crate::FusedBackend::optimizer_step`] on flex:
//! Adam over each parameter tensor in one pass, in place (the parameter and
//! its moments updated where they lie when nothing else holds them), with
//! burn's operations in burn's order, so the values are burn's `Adam`'s to
//! the bit. SGD keeps the reference path.

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, TensorData, TensorMetadata};
use rayon::prelude::*;

use crate::optim::{adam_factors, AdamRule, ParamSlot, ParamState, ParamUpdate};

/// Elements per parallel task (fixed: the same partition on any pool).
const CHUNK: usize = 16 * 1024;

/// Adam's constants for one tensor's update.
#[derive(Debug, Clone, Copy)]
struct AdamStep {
    beta_1: f32,
    beta_2: f32,
    /// `sqrt(1 - beta_2^t) / (1 - beta_1^t)`.
    factor: f32,
    /// `epsilon * sqrt(1 - beta_2^t)`.
    epsilon: f32,
    weight_decay: Option<f32>,
    lr: f32,
}

wide! {
/// One Adam update of a chunk, as burn's `Adam` computes it: the decayed
/// gradient, both moments, then `param - lr * factor * m / (sqrt(v) + eps)`.
fn adam_chunk(param: &mut [f32], grad: &[f32], first: &mut [f32], second: &mut [f32], step: AdamStep) {
    let (keep_1, keep_2) = (1.0 - step.beta_1, 1.0 - step.beta_2);
    for (((p, &g), m), v) in param.iter_mut().zip(grad).zip(first.iter_mut()).zip(second.iter_mut()) {
        let g = match step.weight_decay {
            Some(penalty) => *p * penalty + g,
            None => g,
        };
        *m = *m * step.beta_1 + g * keep_1;
        *v = *v * step.beta_2 + g * g * keep_2;
        let update = *m * step.factor / (v.sqrt() + step.epsilon);
        *p -= update * step.lr;
    }
}
}

fn is_f32(tensor: &FlexTensor) -> bool {
    tensor.dtype() == DType::F32
}

/// `tensor` as a uniquely owned, contiguous `f32` buffer (copied only when
/// shared or strided).
fn owned(tensor: FlexTensor) -> FlexTensor {
    let n = tensor.layout().num_elements();
    let exact = tensor.layout().contiguous_offsets() == Some((0, n)) && tensor.bytes().len() == n * 4;
    if exact && tensor.is_unique() {
        return tensor;
    }
    let contiguous = tensor.to_contiguous();
    let values = contiguous.as_slice::<f32>().unwrap_or_default().to_vec();
    FlexTensor::from_data(TensorData::new(values, tensor.shape()))
}

fn zeros_like(tensor: &FlexTensor) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(vec![0f32; tensor.layout().num_elements()], tensor.shape()))
}

/// Whether every slot can take the native path: `f32` values, and an Adam
/// state (where there is one) with both moments in `f32`.
pub(crate) fn native_adam_applies(slots: &[ParamSlot<burn::backend::Flex>]) -> bool {
    slots.iter().all(|slot| {
        is_f32(&slot.param)
            && is_f32(&slot.grad)
            && slot.state.as_ref().is_none_or(|s| is_f32(&s.first) && s.second.as_ref().is_some_and(is_f32))
    })
}

/// One Adam update of `slot` at learning rate `lr`.
pub(crate) fn adam_slot(
    slot: ParamSlot<burn::backend::Flex>,
    rule: &AdamRule,
    lr: f64,
) -> ParamUpdate<burn::backend::Flex> {
    let ParamSlot { param, grad, state } = slot;
    let (first, second, time) = match state {
        Some(ParamState { first, second: Some(second), time }) => (owned(first), owned(second), time),
        _ => (zeros_like(&param), zeros_like(&param), 0),
    };
    let (factor, epsilon) = adam_factors(rule, time + 1);
    let step = AdamStep {
        beta_1: rule.beta_1,
        beta_2: rule.beta_2,
        factor,
        epsilon,
        weight_decay: rule.weight_decay,
        lr: lr as f32,
    };
    let (mut param, mut first, mut second) = (owned(param), first, second);
    let grad = owned(grad);
    let n = param.layout().num_elements();
    {
        let g = &grad.as_slice::<f32>().expect("f32, contiguous")[..n];
        let p = &mut param.storage_mut::<f32>()[..n];
        let m = &mut first.storage_mut::<f32>()[..n];
        let v = &mut second.storage_mut::<f32>()[..n];
        p.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .for_each(|(((p, g), m), v)| adam_chunk(p, g, m, v, step));
    }
    ParamUpdate { param, state: Some(ParamState { first, second: Some(second), time: time + 1 }) }
}
