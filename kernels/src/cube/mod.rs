//! Our CubeCL kernels and their [`FusedBackend`] implementation for burn's
//! CubeCL backends (`CubeBackend<R, ..>`: wgpu, cuda).
//!
//! - `mse_kernel`: one pass over `s` and `t` that writes `2 (s - t) / n` and
//!   per-unit partial sums of `(s - t)^2`; `sum_kernel` (one cube) adds the
//!   partials into the loss.
//! - `soft_ce_kernel`: one unit per row: both softmaxes (max-shifted), the
//!   row's cross-entropy and its gradient `(softmax(s) - softmax(t)) / batch`;
//!   `sum_kernel` again for the batch mean.
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

mod conv;
mod optim;
mod tuning;

use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::ops::{ConvOptions, FloatTensor, IntTensor};
use burn::tensor::{Shape, Tensor as BurnTensor, TensorPrimitive};
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use crate::{
    reference, BiasAxis, ConvBackwardInputs, ConvGrads, Epilogue, FusedBackend, LossWithGrad, MatmulVariant,
    ParamSlot, ParamUpdate, UpdateRule,
};

/// Units per cube of the reduction kernels (a power of two).
const REDUCE_UNITS: u32 = 256;
/// Most units in a matmul cube (each unit computes 4x4 outputs).
const MATMUL_UNITS: u32 = 256;

static POISON_OUTPUTS: AtomicBool = AtomicBool::new(false);

/// Fill every kernel output with NaN before the launch (for tests: an element
/// the kernel does not write then shows up as NaN). Off by default.
pub fn set_poison_outputs(on: bool) {
    POISON_OUTPUTS.store(on, Ordering::SeqCst);
}

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

/// Second stage of the loss reductions: one cube of [`REDUCE_UNITS`] units
/// sums `partials` (strided per unit, then a shared-memory tree) and writes
/// `sum * scale` to `out[0]`.
#[cube(launch)]
fn sum_kernel<F: Float>(partials: &Array<F>, out: &mut Array<F>, scale: f32) {
    let mut shared = SharedMemory::<F>::new(256usize);
    let unit = UNIT_POS as usize;
    let mut acc = F::new(0.0);
    let mut i = unit;
    while i < partials.len() {
        acc += partials[i];
        i += 256;
    }
    shared[unit] = acc;
    sync_cube();
    let mut half = CUBE_DIM as usize / 2;
    while half > 0 {
        if unit < half {
            shared[unit] = shared[unit] + shared[unit + half];
        }
        sync_cube();
        half /= 2;
    }
    if unit == 0 {
        out[0] = shared[0] * F::cast_from(scale);
    }
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

/// Bias gradient, second stage: `out[j] = sum of partials[j * chunks ..][..chunks]`.
#[cube(launch)]
fn sum_chunks_kernel<F: Float>(partials: &Array<F>, out: &mut Array<F>, chunks: usize) {
    let j = ABSOLUTE_POS;
    if j < out.len() {
        let mut acc = F::new(0.0);
        for c in 0..chunks {
            acc += partials[j * chunks + c];
        }
        out[j] = acc;
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

/// `erf(x)` to about 1e-7 relative: the Chebyshev fit of `erfc` from
/// Numerical Recipes (`erfcc`), more accurate than the usual polynomial
/// polyfill, so that GELU's derivative matches a CPU's libm.
#[cube]
fn erf_accurate<F: Float>(x: F) -> F {
    let z = F::abs(x);
    let t = F::new(1.0) / (F::new(1.0) + F::new(0.5) * z);
    let poly = F::new(-1.265_512_2)
        + t * (F::new(1.000_023_7)
            + t * (F::new(0.374_091_96)
                + t * (F::new(0.096_784_18)
                    + t * (F::new(-0.186_288_06)
                        + t * (F::new(0.278_868_07)
                            + t * (F::new(-1.135_204)
                                + t * (F::new(1.488_516)
                                    + t * (F::new(-0.822_152_23) + t * F::new(0.170_872_77)))))))));
    let erfc = t * F::exp(F::new(0.0) - z * z + poly);
    let mut out = F::new(1.0) - erfc;
    if x < F::new(0.0) {
        out = erfc - F::new(1.0);
    }
    out
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

/// The epilogue activation (`epilogue`: see [`epilogue_code`]). NaN stays
/// NaN (as burn's and PyTorch's activations), so that a diverging block
/// shows in its loss.
// The nested ifs keep the comptime test (`epilogue`) apart from the runtime one.
#[allow(clippy::collapsible_if)]
#[cube]
fn activate<F: Float>(v: F, #[comptime] epilogue: u32) -> F {
    let mut out = v;
    if epilogue == 1 || epilogue == 2 {
        if v < F::new(0.0) {
            out = F::new(0.0);
        }
    }
    if epilogue == 2 {
        if v > F::new(6.0) {
            out = F::new(6.0);
        }
    }
    if epilogue == 3 {
        out =
            F::new(0.5) * v * (F::new(1.0) + erf_accurate::<F>(v * F::new(std::f32::consts::FRAC_1_SQRT_2)));
    }
    out
}

/// The epilogue alone over a contiguous `[z, m, n]` product (the second pass
/// of [`MatmulVariant::Split`]).
#[cube(launch)]
fn epilogue_kernel<F: Float>(
    values: &Array<F>,
    bias: &Array<F>,
    out: &mut Array<F>,
    rows: usize,
    cols: usize,
    #[comptime] bias_axis: u32,
    #[comptime] epilogue: u32,
) {
    let total = values.len();
    let step = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < total {
        let mut v = values[i];
        if bias_axis == 1 {
            v += bias[(i / cols) % rows];
        }
        if bias_axis == 2 {
            v += bias[i % cols];
        }
        out[i] = activate::<F>(v, epilogue);
        i += step;
    }
}

/// `acc[4 i + j] += a_i * b_j`: a 4x4 register tile's update by one column
/// of the left operand and one row of the right one (every register-tiled
/// product kernel's inner step).
#[allow(clippy::too_many_arguments)]
#[cube]
fn outer_product_add<F: Float>(acc: &mut Array<F>, a0: F, a1: F, a2: F, a3: F, b0: F, b1: F, b2: F, b3: F) {
    acc[0] += a0 * b0;
    acc[1] += a0 * b1;
    acc[2] += a0 * b2;
    acc[3] += a0 * b3;
    acc[4] += a1 * b0;
    acc[5] += a1 * b1;
    acc[6] += a1 * b2;
    acc[7] += a1 * b3;
    acc[8] += a2 * b0;
    acc[9] += a2 * b1;
    acc[10] += a2 * b2;
    acc[11] += a2 * b3;
    acc[12] += a3 * b0;
    acc[13] += a3 * b1;
    acc[14] += a3 * b2;
    acc[15] += a3 * b3;
}

/// `min(i, len - 1)`: operand indices past the edge are read clamped, so the
/// matmul's inner loop has no branches (their products are never stored).
#[cube]
fn clamp_index(i: usize, len: usize) -> usize {
    let mut j = i;
    if j >= len {
        j = len - 1;
    }
    j
}

/// `bias_axis`: 0 none, 1 rows, 2 cols. `epilogue`: [`epilogue_code`].
///
/// Each unit computes 4x4 outputs in registers, reading its operands straight
/// from memory (no shared memory, no barriers); a cube of 16x16 units covers
/// a 64x64 output tile. Out-of-range rows and columns are read clamped and
/// never stored.
#[cube(launch_unchecked)]
fn matmul_epilogue_kernel<F: Float>(
    lhs: &Tensor<F>,
    rhs: &Tensor<F>,
    bias: &Array<F>,
    out: &mut Tensor<F>,
    #[comptime] bias_axis: u32,
    #[comptime] epilogue: u32,
    #[comptime] sum_batch: bool,
) {
    let m = lhs.shape(1);
    let k = lhs.shape(2);
    let n = rhs.shape(2);
    // With a cube of DX x DY units, unit (x, y) of cube (X, Y) owns rows
    // 4*DY*Y + y + DY*i and columns 4*DX*X + x + DX*j (i, j < 4): neighbouring
    // units touch neighbouring columns, so their loads and stores are contiguous.
    let dx = CUBE_DIM_X as usize;
    let dy = CUBE_DIM_Y as usize;
    let row0 = CUBE_POS_Y as usize * 4 * dy + UNIT_POS_Y as usize;
    let col0 = CUBE_POS_X as usize * 4 * dx + UNIT_POS_X as usize;
    if row0 < m && col0 < n {
        let lhs_batches = lhs.shape(0);
        let rhs_batches = rhs.shape(0);
        let mut z_begin = CUBE_POS_Z as usize;
        let mut z_end = z_begin + 1;
        if sum_batch {
            z_begin = 0usize;
            z_end = lhs_batches;
            if rhs_batches > lhs_batches {
                z_end = rhs_batches;
            }
        }
        let (ls_row, ls_k) = (lhs.stride(1), lhs.stride(2));
        let (rs_k, rs_col) = (rhs.stride(1), rhs.stride(2));
        let r0 = clamp_index(row0, m) * ls_row;
        let r1 = clamp_index(row0 + dy, m) * ls_row;
        let r2 = clamp_index(row0 + 2 * dy, m) * ls_row;
        let r3 = clamp_index(row0 + 3 * dy, m) * ls_row;
        let c0 = clamp_index(col0, n) * rs_col;
        let c1 = clamp_index(col0 + dx, n) * rs_col;
        let c2 = clamp_index(col0 + 2 * dx, n) * rs_col;
        let c3 = clamp_index(col0 + 3 * dx, n) * rs_col;
        let mut acc = Array::<F>::new(16usize);
        #[unroll]
        for i in 0..16usize {
            acc[i] = F::new(0.0);
        }
        for z in z_begin..z_end {
            let mut lz = z * lhs.stride(0);
            if lhs_batches == 1 {
                lz = 0usize;
            }
            let mut rz = z * rhs.stride(0);
            if rhs_batches == 1 {
                rz = 0usize;
            }
            let mut la = lz;
            let mut rb = rz;
            for _ in 0..k {
                let a0 = lhs[la + r0];
                let a1 = lhs[la + r1];
                let a2 = lhs[la + r2];
                let a3 = lhs[la + r3];
                let b0 = rhs[rb + c0];
                let b1 = rhs[rb + c1];
                let b2 = rhs[rb + c2];
                let b3 = rhs[rb + c3];
                outer_product_add::<F>(&mut acc, a0, a1, a2, a3, b0, b1, b2, b3);
                la += ls_k;
                rb += rs_k;
            }
        }
        let mut out_z = CUBE_POS_Z as usize;
        if sum_batch {
            out_z = 0usize;
        }
        let base = out_z * out.stride(0);
        #[unroll]
        for i in 0..4usize {
            #[unroll]
            for j in 0..4usize {
                let row = row0 + i * dy;
                let col = col0 + j * dx;
                if row < m && col < n {
                    let mut v = acc[i * 4 + j];
                    if bias_axis == 1 {
                        v += bias[row];
                    }
                    if bias_axis == 2 {
                        v += bias[col];
                    }
                    v = activate::<F>(v, epilogue);
                    out[base + row * out.stride(1) + col * out.stride(2)] = v;
                }
            }
        }
    }
}

/// Row-major strides of `shape`.
fn contiguous_strides(shape: &Shape) -> Vec<usize> {
    let mut strides = vec![1; shape.num_dims()];
    for d in (0..shape.num_dims().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    strides
}

fn epilogue_code(epilogue: Epilogue) -> u32 {
    match epilogue {
        Epilogue::Identity => 0,
        Epilogue::Relu => 1,
        Epilogue::Relu6 => 2,
        Epilogue::Gelu => 3,
    }
}

type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// A contiguous output tensor shaped like `shape` on `like`'s device: left
/// uninitialised, or NaN-filled when poisoning is on.
fn new_output<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    like: &CubeTensor<R>,
    shape: Shape,
) -> CubeTensor<R> {
    if POISON_OUTPUTS.load(Ordering::SeqCst) {
        let n = shape.num_elements();
        let filled = BurnTensor::<Cube<R, F, I, BT>, 1>::full([n], f32::NAN, &like.device);
        let mut tensor = into_contiguous(filled.into_primitive().tensor());
        let strides = contiguous_strides(&shape);
        *tensor.meta.shape_mut() = shape;
        *tensor.meta.strides_mut() = strides.into();
        tensor
    } else {
        empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, like.dtype)
    }
}

/// `sum(partials) * scale` as a `[1]` tensor (the small final reduction).
fn finish_sum<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    partials: CubeTensor<R>,
    scale: f32,
) -> CubeTensor<R> {
    let out = new_output::<R, F, I, BT>(&partials, Shape::from(vec![1]));
    sum_kernel::launch::<F, R>(
        &partials.client.clone(),
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(REDUCE_UNITS),
        partials.into_array_arg(),
        out.clone().into_array_arg(),
        scale,
    );
    out
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
        if !conv::takes(&x, &weight, &options, epilogue, false) {
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
        if !conv::takes(&x, &weight, &options, Epilogue::Identity, false) {
            return reference::conv2d_backward::<Self>(x, weight, grad, options, x_grad);
        }
        conv::plain_backward::<R, F, I, BT>(x, weight, grad, None, options, x_grad)
    }

    fn conv2d_pool(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
        epilogue: Epilogue,
    ) -> (FloatTensor<Self>, IntTensor<Self>) {
        if !conv::takes(&x, &weight, &options, epilogue, true) {
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
        if !conv::takes(&x, &weight, &options, Epilogue::Identity, true) {
            return crate::unpool_then_conv_backward::<Self>(x, weight, grad, indices, options, x_grad);
        }
        conv::plain_backward::<R, F, I, BT>(x, weight, grad, Some(indices), options, x_grad)
    }

    fn conv2d_layer_backward(
        inputs: ConvBackwardInputs<Self>,
        x_grad: bool,
        bias_grad: bool,
    ) -> ConvGrads<Self> {
        let pooled = inputs.pool_indices.is_some();
        if !conv::takes(&inputs.x, &inputs.weight, &inputs.options, inputs.epilogue, pooled) {
            return crate::layer_backward_in_steps::<Self>(inputs, x_grad, bias_grad);
        }
        conv::conv_backward::<R, F, I, BT>(&inputs, x_grad, bias_grad)
    }

    fn optimizer_step(slots: Vec<ParamSlot<Self>>, rule: &UpdateRule, lr: f64) -> Vec<ParamUpdate<Self>> {
        optim::optimizer_step::<R, F, I, BT>(slots, rule, lr)
    }

    fn max_pool2x2(x: FloatTensor<Self>) -> FloatTensor<Self> {
        conv::max_pool::<R, F, I, BT>(x, false).0
    }

    fn max_pool2x2_with_indices(x: FloatTensor<Self>) -> (FloatTensor<Self>, IntTensor<Self>) {
        conv::max_pool::<R, F, I, BT>(x, true)
    }

    fn max_pool2x2_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        conv::max_pool_backward::<R, F, I, BT>(&x, grad, indices)
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
}

/// The arguments of one fused matmul call.
#[derive(Clone)]
struct MatmulCall<R: CubeRuntime> {
    lhs: CubeTensor<R>,
    rhs: CubeTensor<R>,
    bias: Option<(CubeTensor<R>, BiasAxis)>,
    epilogue: Epilogue,
    sum_batch: bool,
}

impl<R: CubeRuntime> MatmulCall<R> {
    /// The bias buffer and its axis code. Without a bias the kernels still
    /// need a buffer (never read) other than their output.
    fn bias_arg<F: FloatElement, I: IntElement, BT: BoolElement>(&self) -> (CubeTensor<R>, u32) {
        match &self.bias {
            Some((bias, BiasAxis::Rows)) => (into_contiguous(bias.clone()), 1),
            Some((bias, BiasAxis::Cols)) => (into_contiguous(bias.clone()), 2),
            None => (new_output::<R, F, I, BT>(&self.lhs, Shape::from(vec![1])), 0),
        }
    }

    /// What the autotuner tells calls apart by: device, shapes, strides, options.
    fn key(&self) -> String {
        let bias = self.bias.as_ref().map(|(_, axis)| *axis);
        format!(
            "{:?} {:?} {:?} {:?} {:?} {bias:?} {:?} {}",
            self.lhs.device,
            self.lhs.meta.shape(),
            self.lhs.meta.strides(),
            self.rhs.meta.shape(),
            self.rhs.meta.strides(),
            self.epilogue,
            self.sum_batch
        )
    }
}

/// The matmul variant in force, or the faster one for this call's shapes on
/// this device ([`tuning::faster`]).
fn choose_variant<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    call: &MatmulCall<R>,
) -> MatmulVariant {
    let forced = crate::matmul_variant();
    if forced != MatmulVariant::Auto {
        return forced;
    }
    let timed = |variant: MatmulVariant| {
        move || {
            let out = match variant {
                MatmulVariant::Split => split_matmul::<R, F, I, BT>(call.clone()),
                _ => fused_matmul::<R, F, I, BT>(call.clone()),
            };
            let _ = <Cube<R, F, I, BT> as burn::tensor::backend::Backend>::sync(&out.device);
        }
    };
    let (fused, split) = (timed(MatmulVariant::Fused), timed(MatmulVariant::Split));
    match tuning::faster(format!("matmul {}", call.key()), [("fused", &fused), ("split", &split)]) {
        "split" => MatmulVariant::Split,
        _ => MatmulVariant::Fused,
    }
}

/// Our one-kernel matmul with the epilogue.
fn fused_matmul<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    call: MatmulCall<R>,
) -> CubeTensor<R> {
    let (bias, bias_axis) = call.bias_arg::<F, I, BT>();
    let MatmulCall { lhs, rhs, epilogue, sum_batch, .. } = call;
    let [zl, m, _] = lhs.meta.shape().dims::<3>();
    let [zr, _, n] = rhs.meta.shape().dims::<3>();
    let out_batches = if sum_batch { 1 } else { zl.max(zr) };
    let out = new_output::<R, F, I, BT>(&lhs, Shape::from(vec![out_batches, m, n]));
    let client = lhs.client.clone();
    // Fit the cube to the output: few rows (a pointwise conv's channels)
    // or few columns (a 3x3 map) should not leave most units idle.
    let units = (MATMUL_UNITS as usize).min(client.properties().hardware.max_units_per_cube as usize);
    let dx = n.div_ceil(4).next_power_of_two().clamp(1, units);
    let dy = m.div_ceil(4).next_power_of_two().clamp(1, units / dx);
    let count = CubeCount::Static(n.div_ceil(4 * dx) as u32, m.div_ceil(4 * dy) as u32, out_batches as u32);
    // SAFETY: every read is clamped to the operands' shapes and every
    // store is guarded by `row < m && col < n`; `bias` is only read when
    // `bias_axis` says it has `m` or `n` elements, so no access leaves its
    // buffer.
    unsafe {
        matmul_epilogue_kernel::launch_unchecked::<F, R>(
            &client,
            count,
            CubeDim::new_2d(dx as u32, dy as u32),
            lhs.into_tensor_arg(),
            rhs.into_tensor_arg(),
            bias.into_array_arg(),
            out.clone().into_tensor_arg(),
            bias_axis,
            epilogue_code(epilogue),
            sum_batch,
        );
    }
    out
}

/// burn's matmul, then our in-place epilogue kernel.
fn split_matmul<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    call: MatmulCall<R>,
) -> CubeTensor<R> {
    let (bias, bias_axis) = call.bias_arg::<F, I, BT>();
    let MatmulCall { lhs, rhs, epilogue, sum_batch, .. } = call;
    let [zl, m, _] = lhs.meta.shape().dims::<3>();
    let [zr, _, n] = rhs.meta.shape().dims::<3>();
    let lhs = BurnTensor::<Cube<R, F, I, BT>, 3>::from_primitive(TensorPrimitive::Float(lhs));
    let rhs = BurnTensor::<Cube<R, F, I, BT>, 3>::from_primitive(TensorPrimitive::Float(rhs));
    let mut product = if zl == 1 && zr == 1 {
        // A plain 2-D product (a linear layer): burn picks its 2-D kernel.
        let [_, _, k] = lhs.dims();
        lhs.reshape([m, k]).matmul(rhs.reshape([k, n])).reshape([1, m, n])
    } else {
        lhs.matmul(rhs)
    };
    if sum_batch && zl.max(zr) > 1 {
        product = product.sum_dim(0);
    }
    let values = into_contiguous(product.into_primitive().tensor());
    if bias_axis == 0 && epilogue == Epilogue::Identity {
        return values;
    }
    let total = values.meta.num_elements();
    let cubes = total.div_ceil(REDUCE_UNITS as usize * 16).clamp(1, 64);
    let out = new_output::<R, F, I, BT>(&values, values.meta.shape().clone());
    epilogue_kernel::launch::<F, R>(
        &values.client.clone(),
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_1d(REDUCE_UNITS),
        values.into_array_arg(),
        bias.into_array_arg(),
        out.clone().into_array_arg(),
        m,
        n,
        bias_axis,
        epilogue_code(epilogue),
    );
    out
}
