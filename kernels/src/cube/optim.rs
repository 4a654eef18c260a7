//! The optimizer update on CubeCL backends: one kernel launch updates a
//! group of parameter tensors (a whole block, unless it has more tensors
//! than the device binds at once), each thread walking every tensor of the
//! group with a grid stride. The learning rate and Adam's bias corrections
//! travel as data (`hyper`), so the kernel is compiled once per group size
//! and rule, not per step. Outputs are new buffers: a parameter or moment
//! still held elsewhere (a replica's copy, a checkpoint being written) is
//! never changed under it.

use burn::tensor::Tensor as BurnTensor;
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::common::{contiguous_strides, new_output, upload, Cube};
use crate::optim::{adam_factors, ParamSlot, ParamState, ParamUpdate, UpdateRule};

/// Units per cube of the optimizer kernels.
const UNITS: u32 = 256;
/// Most tensors one launch updates (each binds 7 buffers).
const MAX_GROUP: usize = 8;

/// Adam over every tensor of the group. `hyper` holds `beta_1, 1 - beta_1,
/// beta_2, 1 - beta_2, weight decay` and then, per tensor, the learning
/// rate, the first moment's factor and the epsilon
/// ([`adam_factors`]). The operations and their order are burn's `Adam`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn adam_kernel<F: Float>(
    params: &Sequence<Array<F>>,
    grads: &Sequence<Array<F>>,
    firsts: &Sequence<Array<F>>,
    seconds: &Sequence<Array<F>>,
    new_params: &mut Sequence<Array<F>>,
    new_firsts: &mut Sequence<Array<F>>,
    new_seconds: &mut Sequence<Array<F>>,
    hyper: &Array<F>,
    #[comptime] decay: bool,
) {
    let step = CUBE_COUNT * CUBE_DIM as usize;
    let beta_1 = hyper[0];
    let keep_1 = hyper[1];
    let beta_2 = hyper[2];
    let keep_2 = hyper[3];
    let penalty = hyper[4];
    let count = comptime![params.len()];
    #[unroll]
    for s in 0..count {
        let lr = hyper[5 + 3 * s];
        let factor = hyper[6 + 3 * s];
        let epsilon = hyper[7 + 3 * s];
        let param = params.index(s);
        let grad = grads.index(s);
        let first = firsts.index(s);
        let second = seconds.index(s);
        let new_param = new_params.index_mut(s);
        let new_first = new_firsts.index_mut(s);
        let new_second = new_seconds.index_mut(s);
        let n = param.len();
        let mut i = ABSOLUTE_POS;
        while i < n {
            let p = param[i];
            let mut g = grad[i];
            if decay {
                g = p * penalty + g;
            }
            let m = first[i] * beta_1 + g * keep_1;
            let v = second[i] * beta_2 + g * g * keep_2;
            let update = m * factor / (F::sqrt(v) + epsilon);
            new_param[i] = p - update * lr;
            new_first[i] = m;
            new_second[i] = v;
            i += step;
        }
    }
}

/// SGD over every tensor of the group, burn's `Sgd` to the operation.
/// `hyper` holds `momentum, 1 - dampening, weight decay` and then, per
/// tensor, the learning rate and 1 when it has no velocity yet (the
/// velocity then starts as the gradient). Without momentum `velocities`
/// and `new_velocities` are empty.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn sgd_kernel<F: Float>(
    params: &Sequence<Array<F>>,
    grads: &Sequence<Array<F>>,
    velocities: &Sequence<Array<F>>,
    new_params: &mut Sequence<Array<F>>,
    new_velocities: &mut Sequence<Array<F>>,
    hyper: &Array<F>,
    #[comptime] decay: bool,
    #[comptime] momentum: bool,
    #[comptime] nesterov: bool,
) {
    let step = CUBE_COUNT * CUBE_DIM as usize;
    let mu = hyper[0];
    let keep = hyper[1];
    let penalty = hyper[2];
    let count = comptime![params.len()];
    #[unroll]
    for s in 0..count {
        let lr = hyper[3 + 2 * s];
        let fresh = hyper[4 + 2 * s];
        let param = params.index(s);
        let grad = grads.index(s);
        let new_param = new_params.index_mut(s);
        let n = param.len();
        let mut i = ABSOLUTE_POS;
        while i < n {
            let p = param[i];
            let mut g = grad[i];
            if decay {
                g = p * penalty + g;
            }
            if momentum {
                let mut v = g;
                if fresh < F::new(0.5) {
                    v = g * keep + velocities.index(s)[i] * mu;
                }
                new_velocities.index_mut(s)[i] = v;
                if nesterov {
                    g = v * mu + g;
                } else {
                    g = v;
                }
            }
            new_param[i] = p - g * lr;
            i += step;
        }
    }
}

/// Zeros shaped like `like` (a moment before its first update).
fn zeros_like<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    like: &CubeTensor<R>,
) -> CubeTensor<R> {
    let shape = like.meta.shape().clone();
    let zeros = BurnTensor::<Cube<R, F, I, BT>, 1>::zeros([shape.num_elements()], &like.device);
    let mut tensor = into_contiguous(zeros.into_primitive().tensor());
    let strides = contiguous_strides(&shape);
    *tensor.meta.shape_mut() = shape;
    *tensor.meta.strides_mut() = strides.into();
    tensor
}

/// A launch grid for `elements` spread over grid-stride threads.
fn grid(elements: usize) -> CubeCount {
    CubeCount::Static(elements.div_ceil(UNITS as usize * 4).clamp(1, 1024) as u32, 1, 1)
}

/// How many tensors one launch may bind on this device.
fn group_size<R: CubeRuntime>(like: &CubeTensor<R>, buffers_per_tensor: usize) -> usize {
    let bindings = like.client.properties().hardware.max_bindings as usize;
    (bindings.saturating_sub(1) / buffers_per_tensor).clamp(1, MAX_GROUP)
}

/// [`crate::FusedBackend::optimizer_step`] on a CubeCL backend.
pub(crate) fn optimizer_step<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    slots: Vec<ParamSlot<Cube<R, F, I, BT>>>,
    rule: &UpdateRule,
    lr: f64,
) -> Vec<ParamUpdate<Cube<R, F, I, BT>>> {
    let Some(first) = slots.first() else {
        return Vec::new();
    };
    let per_launch = group_size(&first.param, if matches!(rule, UpdateRule::Adam(_)) { 7 } else { 5 });
    let mut updates = Vec::with_capacity(slots.len());
    let mut slots = slots.into_iter().peekable();
    while slots.peek().is_some() {
        let group: Vec<_> = slots.by_ref().take(per_launch).collect();
        updates.extend(match rule {
            UpdateRule::Adam(adam) => adam_group::<R, F, I, BT>(group, adam, lr),
            UpdateRule::Sgd(sgd) => sgd_group::<R, F, I, BT>(group, sgd, lr),
        });
    }
    updates
}

/// A slot's parameter and gradient as contiguous tensors, and a fresh
/// output shaped like the parameter.
fn prepare<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    param: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let param = into_contiguous(param);
    let grad = into_contiguous(grad);
    let out = new_output::<R, F, I, BT>(&param, param.meta.shape().clone());
    (param, grad, out)
}

fn adam_group<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    group: Vec<ParamSlot<Cube<R, F, I, BT>>>,
    adam: &crate::optim::AdamRule,
    lr: f64,
) -> Vec<ParamUpdate<Cube<R, F, I, BT>>> {
    let mut hyper = vec![
        adam.beta_1,
        1.0 - adam.beta_1,
        adam.beta_2,
        1.0 - adam.beta_2,
        adam.weight_decay.unwrap_or(0.0),
    ];
    let (mut params, mut grads, mut firsts, mut seconds) =
        (SequenceArg::new(), SequenceArg::new(), SequenceArg::new(), SequenceArg::new());
    let (mut new_params, mut new_firsts, mut new_seconds) =
        (SequenceArg::new(), SequenceArg::new(), SequenceArg::new());
    let mut updates = Vec::with_capacity(group.len());
    let mut elements = 0;
    let client = group[0].param.client.clone();
    let like = group[0].param.clone();
    for slot in group {
        let (param, grad, out) = prepare::<R, F, I, BT>(slot.param, slot.grad);
        let (first, second, time) = match slot.state {
            Some(ParamState { first, second: Some(second), time }) => {
                (into_contiguous(first), into_contiguous(second), time)
            }
            _ => (zeros_like::<R, F, I, BT>(&param), zeros_like::<R, F, I, BT>(&param), 0),
        };
        let (factor, epsilon) = adam_factors(adam, time + 1);
        hyper.extend([lr as f32, factor, epsilon]);
        elements = elements.max(param.meta.num_elements());
        let new_first = new_output::<R, F, I, BT>(&param, param.meta.shape().clone());
        let new_second = new_output::<R, F, I, BT>(&param, param.meta.shape().clone());
        params.push(param.into_array_arg());
        grads.push(grad.into_array_arg());
        firsts.push(first.into_array_arg());
        seconds.push(second.into_array_arg());
        new_params.push(out.clone().into_array_arg());
        new_firsts.push(new_first.clone().into_array_arg());
        new_seconds.push(new_second.clone().into_array_arg());
        updates.push(ParamUpdate {
            param: out,
            state: Some(ParamState { first: new_first, second: Some(new_second), time: time + 1 }),
        });
    }
    let hyper = upload::<R, F, I, BT>(hyper, &like);
    adam_kernel::launch::<F, R>(
        &client,
        grid(elements),
        CubeDim::new_1d(UNITS),
        params,
        grads,
        firsts,
        seconds,
        new_params,
        new_firsts,
        new_seconds,
        hyper.into_array_arg(),
        adam.weight_decay.is_some(),
    );
    updates
}

fn sgd_group<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    group: Vec<ParamSlot<Cube<R, F, I, BT>>>,
    sgd: &crate::optim::SgdRule,
    lr: f64,
) -> Vec<ParamUpdate<Cube<R, F, I, BT>>> {
    let (mu, keep, nesterov) = match sgd.momentum {
        Some(m) => (m.momentum as f32, (1.0 - m.dampening) as f32, m.nesterov),
        None => (0.0, 1.0, false),
    };
    let mut hyper = vec![mu, keep, sgd.weight_decay.unwrap_or(0.0)];
    let (mut params, mut grads, mut velocities) =
        (SequenceArg::new(), SequenceArg::new(), SequenceArg::new());
    let (mut new_params, mut new_velocities) = (SequenceArg::new(), SequenceArg::new());
    let mut updates = Vec::with_capacity(group.len());
    let mut elements = 0;
    let client = group[0].param.client.clone();
    let like = group[0].param.clone();
    for slot in group {
        let (param, grad, out) = prepare::<R, F, I, BT>(slot.param, slot.grad);
        let state = slot.state.map(|s| (into_contiguous(s.first), s.time));
        hyper.extend([lr as f32, if state.is_some() { 0.0 } else { 1.0 }]);
        elements = elements.max(param.meta.num_elements());
        let velocity = match sgd.momentum {
            Some(_) => {
                let new_velocity = new_output::<R, F, I, BT>(&param, param.meta.shape().clone());
                // Without a velocity yet the kernel never reads it: bind the gradient.
                let old = state.as_ref().map_or_else(|| grad.clone(), |(v, _)| v.clone());
                velocities.push(old.into_array_arg());
                new_velocities.push(new_velocity.clone().into_array_arg());
                let time = state.as_ref().map_or(0, |(_, t)| *t);
                Some(ParamState { first: new_velocity, second: None, time: time + 1 })
            }
            None => None,
        };
        params.push(param.into_array_arg());
        grads.push(grad.into_array_arg());
        new_params.push(out.clone().into_array_arg());
        updates.push(ParamUpdate { param: out, state: velocity });
    }
    let hyper = upload::<R, F, I, BT>(hyper, &like);
    sgd_kernel::launch::<F, R>(
        &client,
        grid(elements),
        CubeDim::new_1d(UNITS),
        params,
        grads,
        velocities,
        new_params,
        new_velocities,
        hyper.into_array_arg(),
        sgd.weight_decay.is_some(),
        sgd.momentum.is_some(),
        nesterov,
    );
    updates
}
