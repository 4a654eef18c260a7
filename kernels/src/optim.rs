//! One optimizer update over many parameter tensors at once:
//! [`FusedBackend::optimizer_step`](crate::FusedBackend::optimizer_step).
//!
//! The update rules are burn's `Adam` and `Sgd` (with momentum and weight
//! decay) to the operation: the same values in the same order, so a block
//! trained with either takes the same steps (up to the rounding of the
//! device's square root and division). [`reference_step`] writes them with
//! burn's tensor ops, one tensor at a time: the default on backends without
//! a fused kernel, and what the checks compare the kernels against. On
//! CubeCL backends one kernel launch updates a whole block.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

/// How parameters are updated from their gradients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UpdateRule {
    /// burn's `Adam` (bias-corrected, epsilon added to the corrected root).
    Adam(AdamRule),
    /// burn's `Sgd`, optionally with momentum.
    Sgd(SgdRule),
}

/// Adam's constants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamRule {
    /// Decay of the first moment.
    pub beta_1: f32,
    /// Decay of the second moment.
    pub beta_2: f32,
    /// Added to the bias-corrected root of the second moment.
    pub epsilon: f32,
    /// L2 penalty added to the gradient (`grad + penalty * param`).
    pub weight_decay: Option<f32>,
}

/// SGD's constants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdRule {
    /// Momentum, when used.
    pub momentum: Option<SgdMomentum>,
    /// L2 penalty added to the gradient (`grad + penalty * param`).
    pub weight_decay: Option<f32>,
}

/// SGD momentum as burn's `MomentumConfig`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdMomentum {
    /// Velocity decay.
    pub momentum: f64,
    /// Share of the gradient left out of the velocity.
    pub dampening: f64,
    /// Nesterov's look-ahead.
    pub nesterov: bool,
}

/// What an optimizer keeps of one parameter tensor between steps.
#[derive(Debug, Clone)]
pub struct ParamState<B: Backend> {
    /// Adam's first moment, or SGD's velocity.
    pub first: FloatTensor<B>,
    /// Adam's second moment (`None` for SGD).
    pub second: Option<FloatTensor<B>>,
    /// Updates taken so far (Adam's bias correction uses it).
    pub time: usize,
}

/// One parameter tensor in an update: its values, its gradient (same shape
/// and device) and its state (`None` before its first update).
#[derive(Debug, Clone)]
pub struct ParamSlot<B: Backend> {
    /// The parameter's values.
    pub param: FloatTensor<B>,
    /// The gradient of the loss with respect to it.
    pub grad: FloatTensor<B>,
    /// The optimizer's state for it.
    pub state: Option<ParamState<B>>,
}

/// One parameter tensor after an update.
#[derive(Debug, Clone)]
pub struct ParamUpdate<B: Backend> {
    /// The new values.
    pub param: FloatTensor<B>,
    /// The new state (`None` for SGD without momentum, which keeps none).
    pub state: Option<ParamState<B>>,
}

/// Adam's per-tensor factors at update number `time` (one-based), as burn
/// computes them in `f32`: the factor of the first moment
/// (`sqrt(1 - beta_2^t) / (1 - beta_1^t)`) and the epsilon added to the
/// root of the second moment (`epsilon * sqrt(1 - beta_2^t)`).
pub fn adam_factors(rule: &AdamRule, time: usize) -> (f32, f32) {
    let t = time as i32;
    let correction_2 = (1.0 - rule.beta_2.powi(t)).sqrt();
    (correction_2 / (1.0 - rule.beta_1.powi(t)), rule.epsilon * correction_2)
}

fn wrap<B: Backend>(primitive: FloatTensor<B>) -> Tensor<B, 1> {
    let n = burn::tensor::TensorMetadata::shape(&primitive).num_elements();
    Tensor::from_primitive(TensorPrimitive::Float(B::float_reshape(primitive, [n].into())))
}

fn unwrap_like<B: Backend>(tensor: Tensor<B, 1>, like: &FloatTensor<B>) -> FloatTensor<B> {
    B::float_reshape(tensor.into_primitive().tensor(), burn::tensor::TensorMetadata::shape(like))
}

/// `rule`'s update of every slot at learning rate `lr`, with burn's tensor
/// ops in burn's order (one tensor at a time).
pub fn reference_step<B: Backend>(
    slots: Vec<ParamSlot<B>>,
    rule: &UpdateRule,
    lr: f64,
) -> Vec<ParamUpdate<B>> {
    slots.into_iter().map(|slot| reference_slot(slot, rule, lr)).collect()
}

fn reference_slot<B: Backend>(slot: ParamSlot<B>, rule: &UpdateRule, lr: f64) -> ParamUpdate<B> {
    let like = slot.param.clone();
    let param = wrap::<B>(slot.param);
    let mut grad = wrap::<B>(slot.grad);
    let (decay, time) = match rule {
        UpdateRule::Adam(adam) => (adam.weight_decay, slot.state.as_ref().map_or(0, |s| s.time)),
        UpdateRule::Sgd(sgd) => (sgd.weight_decay, slot.state.as_ref().map_or(0, |s| s.time)),
    };
    if let Some(penalty) = decay {
        grad = param.clone().mul_scalar(penalty).add(grad);
    }
    let (delta, state) = match rule {
        UpdateRule::Adam(adam) => {
            let (m, v) = match slot.state {
                Some(state) => {
                    let m = wrap::<B>(state.first);
                    let v = wrap::<B>(state.second.expect("an Adam state has a second moment"));
                    (
                        m.mul_scalar(adam.beta_1).add(grad.clone().mul_scalar(1.0 - adam.beta_1)),
                        v.mul_scalar(adam.beta_2).add(grad.square().mul_scalar(1.0 - adam.beta_2)),
                    )
                }
                None => {
                    (grad.clone().mul_scalar(1.0 - adam.beta_1), grad.square().mul_scalar(1.0 - adam.beta_2))
                }
            };
            let (factor, epsilon) = adam_factors(adam, time + 1);
            let update = m.clone().mul_scalar(factor).div(v.clone().sqrt().add_scalar(epsilon));
            let state = ParamState {
                first: unwrap_like(m, &like),
                second: Some(unwrap_like(v, &like)),
                time: time + 1,
            };
            (update, Some(state))
        }
        UpdateRule::Sgd(sgd) => match sgd.momentum {
            Some(momentum) => {
                let velocity = match slot.state {
                    Some(state) => grad
                        .clone()
                        .mul_scalar(1.0 - momentum.dampening)
                        .add(wrap::<B>(state.first).mul_scalar(momentum.momentum as f32)),
                    None => grad.clone(),
                };
                let step = match momentum.nesterov {
                    true => velocity.clone().mul_scalar(momentum.momentum as f32).add(grad),
                    false => velocity.clone(),
                };
                (step, Some(ParamState { first: unwrap_like(velocity, &like), second: None, time: time + 1 }))
            }
            None => (grad, None),
        },
    };
    ParamUpdate { param: unwrap_like(param - delta.mul_scalar(lr), &like), state }
}
