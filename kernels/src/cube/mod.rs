//! Our CubeCL kernels and their [`FusedBackend`] implementation for burn's
//! CubeCL backends (`CubeBackend<R, ..>`: wgpu, cuda).
//!
//! - `mse_kernel`: one pass over `s` and `t` that writes `2 (s - t) / n` and
//!   per-unit partial sums of `(s - t)^2`; `sum_kernel` (one cube) adds the
//!   partials into the loss.
//! - `soft_ce_kernel`: one unit per row: both softmaxes (max-shifted), the
//!   row's cross-entropy and its gradient `(softmax(s) - softmax(t)) / batch`;
//!   `sum_kernel` again for the batch mean.
//! - The decoder layer's ops: RMSNorm and the KL over a vocabulary one cube
//!   per row, SwiGLU one unit per element (`decoder.rs`), and the
//!   grouped-query causal attention with rotary positions on the
//!   projections' layout (`attention.rs`), forward and backward.
//! - `matmul_epilogue_kernel`: a register-tiled matmul (4x4 outputs per unit,
//!   64x64 per cube) over strided rank-3 operands, so transposes and weights
//!   shared across the batch need no copies, with bias and activation applied
//!   before the store.
//!
//! Backward helpers: `epilogue_backward_kernel` (the activation's derivative),
//! `bias_grad_kernel` + `sum_chunks_kernel` (the bias gradient, two
//! barrier-free stages), `scale_kernel` (a loss gradient times the upstream
//! scalar).
//!
//! The first-stage kernels use neither shared memory nor barriers: CPU Vulkan
//! drivers (Mesa's lavapipe) pay dearly for barriers, and GPUs do not need
//! them at these sizes.
//!
//! Outputs are allocated uninitialised. [`set_poison_outputs`] makes them start
//! as NaN instead, so that a test sees any element a kernel failed to write.
//!
//! The kernels live by subject, each module depending only on those after
//! it: the losses, the backward helpers and the backend's `impl` here; the
//! decoder layer's ops (`decoder.rs`, `attention.rs`); the matmul
//! (`matmul.rs`); the dense convolutions' forward (`conv.rs`) and
//! gradients (`conv_grad.rs`); the depthwise convolutions (`depthwise.rs`)
//! and the 2x2 max-pool (`pool.rs`); the convolutions' launch geometry and
//! shared index arithmetic (`geometry.rs`); the optimizer update
//! (`optim.rs`); what every kernel shares (`common.rs`); and the choice
//! between measured variants (`tuning.rs`).

mod attention;
mod common;
mod conv;
mod conv_grad;
mod decoder;
mod depthwise;
mod geometry;
mod matmul;
mod optim;
mod pool;
mod tuning;

use burn::tensor::ops::{ConvOptions, FloatTensor, IntTensor};
use burn::tensor::Shape;
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

pub(crate) use self::common::set_poison_outputs;
use self::common::{epilogue_code, erf_accurate, finish_sum, new_output, sum_chunks_kernel, REDUCE_UNITS};
use self::matmul::{choose_variant, fused_matmul, split_matmul, MatmulCall};
use crate::llama::{self, CausalAttentionOutput, CausalHeads, RmsNormOutput};
use crate::{
    reference, BiasAxis, ConvBackwardInputs, ConvGrads, Epilogue, FusedBackend, LossWithGrad, MatmulVariant,
    ParamSlot, ParamUpdate, UpdateRule,
};

/// Whether the user configured CubeCL: a `cubecl.toml` (or `CubeCL.toml`),
/// or a `burn.toml` with a `[cubecl]` table, in the working folder or above
/// (where CubeCL looks).
fn user_configured() -> bool {
    let Ok(mut dir) = std::env::current_dir() else {
        return false;
    };
    loop {
        if ["cubecl.toml", "CubeCL.toml"].iter().any(|name| dir.join(name).is_file()) {
            return true;
        }
        let burn = ["burn.toml", "Burn.toml"].iter().map(|name| dir.join(name)).find(|p| p.is_file());
        if burn.and_then(|p| std::fs::read_to_string(p).ok()).is_some_and(|text| text.contains("[cubecl")) {
            return true;
        }
        if !dir.pop() {
            return false;
        }
    }
}

/// See [`crate::keep_cubecl_caches_in`].
pub(crate) fn keep_caches_in(dir: &std::path::Path) -> bool {
    use cubecl::config::cache::CacheConfig;
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    // Our own choices between kernel variants, whatever CubeCL's settings.
    tuning::keep_in(dir);
    if user_configured() {
        return false;
    }
    let mut settings = CubeClRuntimeConfig::storage().lock();
    if settings.is_some() {
        // CubeCL has read its settings already: too late to change them.
        return false;
    }
    let mut config = CubeClRuntimeConfig::default().override_from_env();
    config.autotune.cache = CacheConfig::File(dir.to_path_buf());
    config.compilation.cache = Some(CacheConfig::File(dir.to_path_buf()));
    *settings = Some(std::sync::Arc::new(config));
    true
}

/// First stage of the MSE: each unit sums `(s - t)^2` over a grid-stride slice
/// into `partials[unit]` (no shared memory, no barriers: cheap everywhere,
/// including CPU Vulkan drivers) and writes the gradient as it goes.
#[cube(launch)]
fn mse_kernel<F: Float>(
    student: &Array<F>,
    teacher: &Array<F>,
    grad: &mut Array<F>,
    partials: &mut Array<F>,
    grad_scale: f32,
    #[comptime] write_grad: bool,
) {
    let n = student.len();
    let step = CUBE_COUNT * CUBE_DIM as usize;
    let scale = F::cast_from(grad_scale);
    let mut acc = F::new(0.0);
    let mut i = ABSOLUTE_POS;
    while i < n {
        let d = student[i] - teacher[i];
        acc += d * d;
        if write_grad {
            grad[i] = d * scale;
        }
        i += step;
    }
    partials[ABSOLUTE_POS] = acc;
}

/// `out[i] = values[i] * factor[0]`, grid-stride.
#[cube(launch)]
fn scale_kernel<F: Float>(values: &Array<F>, factor: &Array<F>, out: &mut Array<F>) {
    let n = values.len();
    let step = CUBE_COUNT * CUBE_DIM as usize;
    let f = factor[0];
    let mut i = ABSOLUTE_POS;
    while i < n {
        out[i] = values[i] * f;
        i += step;
    }
}

/// Bias gradient, first stage: unit `(j, c)` sums chunk `c` (of `chunks`)
/// of `grad[z, j, n]` over `z, n` (`rows`) or of `grad[z, m, j]` over `z, m`
/// into `partials[j * chunks + c]`. No shared memory, no barriers.
#[cube(launch)]
fn bias_grad_kernel<F: Float>(
    grad: &Tensor<F>,
    partials: &mut Array<F>,
    chunks: usize,
    #[comptime] rows: bool,
) {
    let mut outputs = grad.shape(2);
    let mut other = grad.shape(2);
    let mut other_stride = grad.stride(2);
    let mut own_stride = grad.stride(1);
    if rows {
        outputs = grad.shape(1);
    } else {
        other = grad.shape(1);
        other_stride = grad.stride(1);
        own_stride = grad.stride(2);
    }
    let unit = ABSOLUTE_POS;
    if unit < outputs * chunks {
        let j = unit / chunks;
        let c = unit % chunks;
        let total = grad.shape(0) * other;
        let per_chunk = total.div_ceil(chunks);
        let begin = c * per_chunk;
        let mut end = begin + per_chunk;
        if end > total {
            end = total;
        }
        let mut acc = F::new(0.0);
        let mut i = begin;
        while i < end {
            let z = i / other;
            let o = i % other;
            acc += grad[z * grad.stride(0) + o * other_stride + j * own_stride];
            i += 1;
        }
        partials[unit] = acc;
    }
}

/// First stage of the soft-target cross-entropy: one unit per row writes the
/// row's loss to `partials[row]` and its gradient row.
#[cube(launch)]
fn soft_ce_kernel<F: Float>(
    student: &Tensor<F>,
    teacher: &Tensor<F>,
    grad: &mut Tensor<F>,
    partials: &mut Array<F>,
    grad_scale: f32,
    #[comptime] write_grad: bool,
) {
    let rows = student.shape(0);
    let classes = student.shape(1);
    let row = ABSOLUTE_POS;
    if row < rows {
        let s_base = row * student.stride(0);
        let s_col = student.stride(1);
        let t_base = row * teacher.stride(0);
        let t_col = teacher.stride(1);
        let mut max_s = student[s_base];
        let mut max_t = teacher[t_base];
        for j in 1..classes {
            max_s = F::max(max_s, student[s_base + j * s_col]);
            max_t = F::max(max_t, teacher[t_base + j * t_col]);
        }
        let mut sum_s = F::new(0.0);
        let mut sum_t = F::new(0.0);
        for j in 0..classes {
            sum_s += F::exp(student[s_base + j * s_col] - max_s);
            sum_t += F::exp(teacher[t_base + j * t_col] - max_t);
        }
        let log_z = max_s + F::ln(sum_s);
        let inv_sum_t = F::new(1.0) / sum_t;
        let scale = F::cast_from(grad_scale);
        let mut cross = F::new(0.0);
        for j in 0..classes {
            let p = F::exp(teacher[t_base + j * t_col] - max_t) * inv_sum_t;
            let log_q = student[s_base + j * s_col] - log_z;
            cross += p * log_q;
            if write_grad {
                grad[row * grad.stride(0) + j * grad.stride(1)] = (F::exp(log_q) - p) * scale;
            }
        }
        partials[row] = F::new(0.0) - cross;
    }
}

/// `dL/d(pre)` of the epilogue: `saved` is the output (relu, relu6,
/// identity) or the pre-activation (gelu); any strides, contiguous result.
// The nested ifs keep the comptime test (`epilogue`) apart from the runtime one.
#[allow(clippy::collapsible_if)]
#[cube(launch)]
fn epilogue_backward_kernel<F: Float>(
    grad: &Tensor<F>,
    saved: &Tensor<F>,
    out: &mut Tensor<F>,
    #[comptime] epilogue: u32,
) {
    let total = out.len();
    let step = CUBE_COUNT * CUBE_DIM as usize;
    let rows = out.shape(1);
    let cols = out.shape(2);
    let mut i = ABSOLUTE_POS;
    while i < total {
        let z = i / (rows * cols);
        let r = (i / cols) % rows;
        let c = i % cols;
        let g = grad[z * grad.stride(0) + r * grad.stride(1) + c * grad.stride(2)];
        let s = saved[z * saved.stride(0) + r * saved.stride(1) + c * saved.stride(2)];
        let mut d = g;
        if epilogue == 1 {
            if s <= F::new(0.0) {
                d = F::new(0.0);
            }
        }
        if epilogue == 2 {
            if s <= F::new(0.0) || s >= F::new(6.0) {
                d = F::new(0.0);
            }
        }
        if epilogue == 3 {
            let cdf =
                F::new(0.5) * (F::new(1.0) + erf_accurate::<F>(s * F::new(std::f32::consts::FRAC_1_SQRT_2)));
            let pdf = F::exp(F::new(-0.5) * s * s) * F::new(0.398_942_3);
            d = g * (cdf + s * pdf);
        }
        out[i] = d;
        i += step;
    }
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> FusedBackend
    for CubeBackend<R, F, I, BT>
{
    const FUSED_CONV_POOL: bool = true;
    const ASYNC_DEVICE: bool = true;
    const FUSED_OPTIMIZER: bool = true;

    fn conv2d_epilogue(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
        epilogue: Epilogue,
    ) -> FloatTensor<Self> {
        if !geometry::takes(&x, &weight, &options, epilogue, false) {
            return reference::conv2d_epilogue::<Self>(x, weight, bias, options, epilogue);
        }
        conv::conv_forward::<R, F, I, BT>(x, weight, bias, &options, epilogue, false).0
    }

    fn conv2d_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        options: ConvOptions<2>,
        x_grad: bool,
    ) -> (Option<FloatTensor<Self>>, FloatTensor<Self>) {
        if !geometry::takes(&x, &weight, &options, Epilogue::Identity, false) {
            return reference::conv2d_backward::<Self>(x, weight, grad, options, x_grad);
        }
        conv_grad::plain_backward::<R, F, I, BT>(x, weight, grad, None, options, x_grad)
    }

    fn conv2d_pool(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
        epilogue: Epilogue,
    ) -> (FloatTensor<Self>, IntTensor<Self>) {
        if !geometry::takes(&x, &weight, &options, epilogue, true) {
            return Self::max_pool2x2_with_indices(Self::conv2d_epilogue(x, weight, bias, options, epilogue));
        }
        let (output, indices) = conv::conv_forward::<R, F, I, BT>(x, weight, bias, &options, epilogue, true);
        (output, indices.expect("a pooled convolution returns the indices of its maxima"))
    }

    fn conv2d_pool_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
        options: ConvOptions<2>,
        x_grad: bool,
    ) -> (Option<FloatTensor<Self>>, FloatTensor<Self>) {
        if !geometry::takes(&x, &weight, &options, Epilogue::Identity, true) {
            return crate::unpool_then_conv_backward::<Self>(x, weight, grad, indices, options, x_grad);
        }
        conv_grad::plain_backward::<R, F, I, BT>(x, weight, grad, Some(indices), options, x_grad)
    }

    fn conv2d_layer_backward(
        inputs: ConvBackwardInputs<Self>,
        x_grad: bool,
        bias_grad: bool,
    ) -> ConvGrads<Self> {
        let pooled = inputs.pool_indices.is_some();
        if !geometry::takes(&inputs.x, &inputs.weight, &inputs.options, inputs.epilogue, pooled) {
            return crate::layer_backward_in_steps::<Self>(inputs, x_grad, bias_grad);
        }
        conv_grad::conv_backward::<R, F, I, BT>(&inputs, x_grad, bias_grad)
    }

    fn optimizer_step(slots: Vec<ParamSlot<Self>>, rule: &UpdateRule, lr: f64) -> Vec<ParamUpdate<Self>> {
        optim::optimizer_step::<R, F, I, BT>(slots, rule, lr)
    }

    fn max_pool2x2(x: FloatTensor<Self>) -> FloatTensor<Self> {
        pool::max_pool::<R, F, I, BT>(x, false).0
    }

    fn max_pool2x2_with_indices(x: FloatTensor<Self>) -> (FloatTensor<Self>, IntTensor<Self>) {
        pool::max_pool::<R, F, I, BT>(x, true)
    }

    fn max_pool2x2_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        pool::max_pool_backward::<R, F, I, BT>(&x, grad, indices)
    }

    fn mse_loss(
        student: FloatTensor<Self>,
        teacher: FloatTensor<Self>,
        with_grad: bool,
    ) -> LossWithGrad<Self> {
        let student = into_contiguous(student);
        let teacher = into_contiguous(teacher);
        let shape = student.meta.shape().clone();
        let n = shape.num_elements();
        let cubes = n.div_ceil(REDUCE_UNITS as usize * 16).clamp(1, 64);
        let partials = new_output::<R, F, I, BT>(&student, Shape::from(vec![cubes * REDUCE_UNITS as usize]));
        let grad_shape = if with_grad { shape } else { Shape::from(vec![1]) };
        let grad = new_output::<R, F, I, BT>(&student, grad_shape);
        let client = student.client.clone();
        mse_kernel::launch::<F, R>(
            &client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(REDUCE_UNITS),
            student.into_array_arg(),
            teacher.into_array_arg(),
            grad.clone().into_array_arg(),
            partials.clone().into_array_arg(),
            2.0 / n as f32,
            with_grad,
        );
        let loss = finish_sum::<R, F, I, BT>(partials, 1.0 / n as f32);
        LossWithGrad { loss, grad: with_grad.then_some(grad) }
    }

    fn soft_target_ce_loss(
        student: FloatTensor<Self>,
        teacher: FloatTensor<Self>,
        with_grad: bool,
    ) -> LossWithGrad<Self> {
        let student = into_contiguous(student);
        let teacher = into_contiguous(teacher);
        let shape = student.meta.shape().clone();
        let rows = shape[0];
        let cubes = rows.div_ceil(REDUCE_UNITS as usize).max(1);
        let partials = new_output::<R, F, I, BT>(&student, Shape::from(vec![rows]));
        let grad_shape = if with_grad { shape } else { Shape::from(vec![1, 1]) };
        let grad = new_output::<R, F, I, BT>(&student, grad_shape);
        let client = student.client.clone();
        soft_ce_kernel::launch::<F, R>(
            &client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(REDUCE_UNITS),
            student.into_tensor_arg(),
            teacher.into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            partials.clone().into_array_arg(),
            1.0 / rows as f32,
            with_grad,
        );
        let loss = finish_sum::<R, F, I, BT>(partials, 1.0 / rows as f32);
        LossWithGrad { loss, grad: with_grad.then_some(grad) }
    }

    fn scale_by_scalar(grad: FloatTensor<Self>, upstream: FloatTensor<Self>) -> FloatTensor<Self> {
        let values = into_contiguous(grad);
        let out = new_output::<R, F, I, BT>(&values, values.meta.shape().clone());
        let n = values.meta.num_elements();
        let cubes = n.div_ceil(REDUCE_UNITS as usize * 16).clamp(1, 64);
        scale_kernel::launch::<F, R>(
            &values.client.clone(),
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(REDUCE_UNITS),
            values.into_array_arg(),
            into_contiguous(upstream).into_array_arg(),
            out.clone().into_array_arg(),
        );
        out
    }

    fn epilogue_backward(
        grad: FloatTensor<Self>,
        saved: FloatTensor<Self>,
        epilogue: Epilogue,
    ) -> FloatTensor<Self> {
        if epilogue == Epilogue::Identity {
            return grad;
        }
        let out = new_output::<R, F, I, BT>(&grad, grad.meta.shape().clone());
        let n = out.meta.num_elements();
        let cubes = n.div_ceil(REDUCE_UNITS as usize * 16).clamp(1, 64);
        epilogue_backward_kernel::launch::<F, R>(
            &grad.client.clone(),
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(REDUCE_UNITS),
            grad.into_tensor_arg(),
            saved.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            epilogue_code(epilogue),
        );
        out
    }

    fn bias_grad(grad: FloatTensor<Self>, axis: BiasAxis) -> FloatTensor<Self> {
        let [z, m, n] = grad.meta.shape().dims::<3>();
        let (len, summed) = if axis == BiasAxis::Rows { (m, z * n) } else { (n, z * m) };
        // About 1024 elements per unit, at most 256 chunks per output.
        let chunks = summed.div_ceil(1024).clamp(1, 256);
        let partials = new_output::<R, F, I, BT>(&grad, Shape::from(vec![len * chunks]));
        let out = new_output::<R, F, I, BT>(&grad, Shape::from(vec![len]));
        let client = grad.client.clone();
        let units = REDUCE_UNITS as usize;
        bias_grad_kernel::launch::<F, R>(
            &client,
            CubeCount::Static((len * chunks).div_ceil(units) as u32, 1, 1),
            CubeDim::new_1d(REDUCE_UNITS),
            grad.into_tensor_arg(),
            partials.clone().into_array_arg(),
            chunks,
            axis == BiasAxis::Rows,
        );
        sum_chunks_kernel::launch::<F, R>(
            &client,
            CubeCount::Static(len.div_ceil(units) as u32, 1, 1),
            CubeDim::new_1d(REDUCE_UNITS),
            partials.into_array_arg(),
            out.clone().into_array_arg(),
            chunks,
        );
        out
    }

    fn matmul_epilogue(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<(FloatTensor<Self>, BiasAxis)>,
        epilogue: Epilogue,
        sum_batch: bool,
    ) -> FloatTensor<Self> {
        let call = MatmulCall { lhs, rhs, bias, epilogue, sum_batch };
        match choose_variant::<R, F, I, BT>(&call) {
            MatmulVariant::Split => split_matmul::<R, F, I, BT>(call),
            _ => fused_matmul::<R, F, I, BT>(call),
        }
    }

    fn rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
        with_rstd: bool,
    ) -> RmsNormOutput<Self> {
        if x.meta.num_elements() == 0 {
            return llama::rms_norm_reference::<Self>(x, gamma, epsilon, with_rstd);
        }
        decoder::rms_norm::<R, F, I, BT>(x, gamma, epsilon, with_rstd)
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
        grad: FloatTensor<Self>,
    ) -> [FloatTensor<Self>; 2] {
        if x.meta.num_elements() == 0 {
            return llama::rms_norm_backward_reference::<Self>(x, gamma, epsilon, grad);
        }
        decoder::rms_norm_backward::<R, F, I, BT>(x, rstd, gamma, grad)
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        decoder::swiglu::<R, F, I, BT>(gate, up)
    }

    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> [FloatTensor<Self>; 2] {
        decoder::swiglu_backward::<R, F, I, BT>(gate, up, grad)
    }

    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        layout: CausalHeads,
        with_probs: bool,
    ) -> CausalAttentionOutput<Self> {
        if !attention::takes_attention(&q, layout) {
            return llama::causal_attention_reference::<Self>(q, k, v, mask, layout, with_probs);
        }
        attention::causal_attention::<R, F, I, BT>([q, k, v], mask, layout, with_probs)
    }

    fn causal_attention_backward(
        qkv: [FloatTensor<Self>; 3],
        mask: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        layout: CausalHeads,
    ) -> [FloatTensor<Self>; 3] {
        if !attention::takes_attention(&qkv[0], layout) {
            return llama::causal_attention_backward_reference::<Self>(qkv, mask, probs, grad, layout);
        }
        attention::causal_attention_backward::<R, F, I, BT>(qkv, probs, grad, layout)
    }

    fn weighted_kl_loss(
        student: FloatTensor<Self>,
        teacher: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        temperature: f64,
        with_grad: bool,
    ) -> LossWithGrad<Self> {
        if student.meta.num_elements() == 0 {
            return llama::weighted_kl_reference::<Self>(student, teacher, weights, temperature, with_grad);
        }
        decoder::weighted_kl::<R, F, I, BT>(student, teacher, weights, temperature, with_grad)
    }
}
