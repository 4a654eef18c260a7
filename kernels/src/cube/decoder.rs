//! The decoder layer's row and element ops on CubeCL backends (wgpu,
//! cuda): RMSNorm, SwiGLU's gated product and the head's weighted KL, each
//! forward and backward (the attention is `attention.rs`).
//!
//! - Row reductions (RMSNorm, the KL over a vocabulary) take one cube per
//!   row: its units stride over the row (adjacent units, adjacent columns)
//!   and meet in a shared-memory tree ([`cube_sum`], [`cube_max`]).
//! - SwiGLU is one unit per element.

use burn::tensor::Shape;
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::common::{cube_reduce, finish_sum, new_output, sum_chunks_kernel, Cube, REDUCE_UNITS};
use super::geometry::{elementwise_grid, units};
use crate::llama::RmsNormOutput;
use crate::LossWithGrad;

/// At most this many cubes along one axis: the row kernels loop past it.
const MAX_ROW_CUBES: usize = 65_535;

/// The sum of every unit's `value` in the cube (all units must call it).
#[cube]
fn cube_sum<F: Float>(shared: &mut SharedMemory<F>, value: F) -> F {
    cube_reduce::<F>(shared, value, false)
}

/// The maximum of every unit's `value` in the cube (all units must call it).
#[cube]
fn cube_max<F: Float>(shared: &mut SharedMemory<F>, value: F) -> F {
    cube_reduce::<F>(shared, value, true)
}

/// RMSNorm, one cube per row of `[rows, hidden]`: `out = x * rstd * gamma`
/// and `rstd[row] = 1 / sqrt(mean(x^2) + epsilon)`.
#[cube(launch)]
fn rms_norm_kernel<F: Float>(
    x: &Array<F>,
    gamma: &Array<F>,
    out: &mut Array<F>,
    rstd: &mut Array<F>,
    epsilon: f32,
    inverse_hidden: f32,
) {
    let mut shared = SharedMemory::<F>::new(256usize);
    let hidden = gamma.len();
    let rows = x.len() / hidden;
    let unit = UNIT_POS as usize;
    let units = CUBE_DIM as usize;
    let mut row = CUBE_POS;
    while row < rows {
        let base = row * hidden;
        let mut acc = F::new(0.0);
        let mut c = unit;
        while c < hidden {
            let v = x[base + c];
            acc += v * v;
            c += units;
        }
        let total = cube_sum::<F>(&mut shared, acc);
        let r = F::new(1.0) / F::sqrt(total * F::cast_from(inverse_hidden) + F::cast_from(epsilon));
        let mut c = unit;
        while c < hidden {
            out[base + c] = x[base + c] * r * gamma[c];
            c += units;
        }
        if unit == 0 {
            rstd[row] = r;
        }
        row += CUBE_COUNT;
    }
}

/// RMSNorm's input gradient, one cube per row: with `n = x * rstd`,
/// `dx = rstd (g gamma - n mean(g gamma n))`.
#[cube(launch)]
fn rms_norm_dx_kernel<F: Float>(
    x: &Array<F>,
    rstd: &Array<F>,
    gamma: &Array<F>,
    grad: &Array<F>,
    dx: &mut Array<F>,
    inverse_hidden: f32,
) {
    let mut shared = SharedMemory::<F>::new(256usize);
    let hidden = gamma.len();
    let rows = x.len() / hidden;
    let unit = UNIT_POS as usize;
    let units = CUBE_DIM as usize;
    let mut row = CUBE_POS;
    while row < rows {
        let base = row * hidden;
        let r = rstd[row];
        let mut acc = F::new(0.0);
        let mut c = unit;
        while c < hidden {
            acc += grad[base + c] * gamma[c] * x[base + c];
            c += units;
        }
        // mean(g gamma n) = rstd * sum(g gamma x) / hidden.
        let projection = cube_sum::<F>(&mut shared, acc) * r * F::cast_from(inverse_hidden);
        let mut c = unit;
        while c < hidden {
            dx[base + c] = r * (grad[base + c] * gamma[c] - x[base + c] * r * projection);
            c += units;
        }
        row += CUBE_COUNT;
    }
}

/// RMSNorm's `gamma` gradient, first stage: unit `(column, chunk)` sums
/// `g x rstd` over its chunk of rows into `partials[column * chunks +
/// chunk]` (the second stage is the bias gradient's `sum_chunks_kernel`).
#[cube(launch)]
fn rms_norm_dgamma_kernel<F: Float>(
    x: &Array<F>,
    rstd: &Array<F>,
    grad: &Array<F>,
    partials: &mut Array<F>,
    hidden: usize,
    chunks: usize,
) {
    let unit = ABSOLUTE_POS;
    let rows = rstd.len();
    if unit < hidden * chunks {
        let column = unit % hidden;
        let chunk = unit / hidden;
        let per_chunk = rows.div_ceil(chunks);
        let begin = chunk * per_chunk;
        let mut end = begin + per_chunk;
        if end > rows {
            end = rows;
        }
        let mut acc = F::new(0.0);
        let mut row = begin;
        while row < end {
            acc += grad[row * hidden + column] * x[row * hidden + column] * rstd[row];
            row += 1;
        }
        partials[column * chunks + chunk] = acc;
    }
}

/// `sigmoid(g)`.
#[cube]
fn sigmoid<F: Float>(g: F) -> F {
    F::new(1.0) / (F::new(1.0) + F::exp(F::new(0.0) - g))
}

/// `out = SiLU(gate) * up`, one unit per element.
#[cube(launch)]
fn swiglu_kernel<F: Float>(gate: &Array<F>, up: &Array<F>, out: &mut Array<F>) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        let g = gate[i];
        out[i] = g * sigmoid::<F>(g) * up[i];
    }
}

/// SwiGLU's gradients, one unit per element: `dup = d SiLU(g)`, `dgate = d
/// up sigmoid(g) (1 + g (1 - sigmoid(g)))`.
#[cube(launch)]
fn swiglu_backward_kernel<F: Float>(
    gate: &Array<F>,
    up: &Array<F>,
    grad: &Array<F>,
    dgate: &mut Array<F>,
    dup: &mut Array<F>,
) {
    let i = ABSOLUTE_POS;
    if i < dgate.len() {
        let g = gate[i];
        let d = grad[i];
        let s = sigmoid::<F>(g);
        dup[i] = d * g * s;
        dgate[i] = d * up[i] * s * (F::new(1.0) + g * (F::new(1.0) - s));
    }
}

/// The weighted KL, one cube per row of `[rows, classes]` scores: with
/// `s = log_softmax(student / T)`, `t = log_softmax(teacher / T)` and `W =
/// max(sum(weights), 1e-12)`, `partials[row] = w T^2 sum(e^t (t - s)) / W`
/// and the gradient row `w T (e^s - e^t) / W`.
#[cube(launch)]
fn weighted_kl_kernel<F: Float>(
    student: &Array<F>,
    teacher: &Array<F>,
    weights: &Array<F>,
    weight_total: &Array<F>,
    grad: &mut Array<F>,
    partials: &mut Array<F>,
    temperature: f32,
    #[comptime] write_grad: bool,
) {
    let mut shared = SharedMemory::<F>::new(256usize);
    let rows = weights.len();
    let classes = student.len() / rows;
    let unit = UNIT_POS as usize;
    let units = CUBE_DIM as usize;
    let temp = F::cast_from(temperature);
    let inverse_temp = F::new(1.0) / temp;
    let total = F::max(weight_total[0], F::new(1e-12));
    let mut row = CUBE_POS;
    while row < rows {
        let base = row * classes;
        let mut top_s = F::new(f32::MIN);
        let mut top_t = F::new(f32::MIN);
        let mut c = unit;
        while c < classes {
            top_s = F::max(top_s, student[base + c] * inverse_temp);
            top_t = F::max(top_t, teacher[base + c] * inverse_temp);
            c += units;
        }
        let top_s = cube_max::<F>(&mut shared, top_s);
        let top_t = cube_max::<F>(&mut shared, top_t);
        let mut sum_s = F::new(0.0);
        let mut sum_t = F::new(0.0);
        let mut c = unit;
        while c < classes {
            sum_s += F::exp(student[base + c] * inverse_temp - top_s);
            sum_t += F::exp(teacher[base + c] * inverse_temp - top_t);
            c += units;
        }
        let log_z_s = top_s + F::ln(cube_sum::<F>(&mut shared, sum_s));
        let log_z_t = top_t + F::ln(cube_sum::<F>(&mut shared, sum_t));
        let w = weights[row] / total;
        let mut kl = F::new(0.0);
        let mut c = unit;
        while c < classes {
            let log_s = student[base + c] * inverse_temp - log_z_s;
            let log_t = teacher[base + c] * inverse_temp - log_z_t;
            let p_t = F::exp(log_t);
            kl += p_t * (log_t - log_s);
            if write_grad {
                grad[base + c] = w * temp * (F::exp(log_s) - p_t);
            }
            c += units;
        }
        let kl = cube_sum::<F>(&mut shared, kl);
        if unit == 0 {
            partials[row] = kl * w * temp * temp;
        }
        row += CUBE_COUNT;
    }
}

/// One cube per row for `rows` rows (looping past [`MAX_ROW_CUBES`]).
fn row_cubes(rows: usize) -> CubeCount {
    CubeCount::Static(rows.clamp(1, MAX_ROW_CUBES) as u32, 1, 1)
}

/// [`crate::FusedBackend::rms_norm`].
pub(super) fn rms_norm<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    x: CubeTensor<R>,
    gamma: CubeTensor<R>,
    epsilon: f64,
    with_rstd: bool,
) -> RmsNormOutput<Cube<R, F, I, BT>> {
    let x = into_contiguous(x);
    let gamma = into_contiguous(gamma);
    let [rows, hidden] = x.meta.shape().dims::<2>();
    let out = new_output::<R, F, I, BT>(&x, x.meta.shape().clone());
    let rstd = new_output::<R, F, I, BT>(&x, Shape::from(vec![rows.max(1)]));
    rms_norm_kernel::launch::<F, R>(
        &x.client.clone(),
        row_cubes(rows),
        CubeDim::new_1d(REDUCE_UNITS),
        x.into_array_arg(),
        gamma.into_array_arg(),
        out.clone().into_array_arg(),
        rstd.clone().into_array_arg(),
        epsilon as f32,
        1.0 / hidden as f32,
    );
    RmsNormOutput { output: out, rstd: with_rstd.then_some(rstd) }
}

/// [`crate::FusedBackend::rms_norm_backward`]: `[dx, dgamma]`.
pub(super) fn rms_norm_backward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    x: CubeTensor<R>,
    rstd: CubeTensor<R>,
    gamma: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> [CubeTensor<R>; 2] {
    let [x, rstd, gamma, grad] = [x, rstd, gamma, grad].map(into_contiguous);
    let [rows, hidden] = x.meta.shape().dims::<2>();
    let client = x.client.clone();
    let dx = new_output::<R, F, I, BT>(&x, x.meta.shape().clone());
    rms_norm_dx_kernel::launch::<F, R>(
        &client,
        row_cubes(rows),
        CubeDim::new_1d(REDUCE_UNITS),
        x.clone().into_array_arg(),
        rstd.clone().into_array_arg(),
        gamma.clone().into_array_arg(),
        grad.clone().into_array_arg(),
        dx.clone().into_array_arg(),
        1.0 / hidden as f32,
    );
    // About 64 rows per unit, at most 256 chunks per column.
    let chunks = rows.div_ceil(64).clamp(1, 256);
    let partials = new_output::<R, F, I, BT>(&x, Shape::from(vec![hidden * chunks]));
    let dgamma = new_output::<R, F, I, BT>(&x, gamma.meta.shape().clone());
    rms_norm_dgamma_kernel::launch::<F, R>(
        &client,
        elementwise_grid(hidden * chunks),
        units(),
        x.into_array_arg(),
        rstd.into_array_arg(),
        grad.into_array_arg(),
        partials.clone().into_array_arg(),
        hidden,
        chunks,
    );
    sum_chunks_kernel::launch::<F, R>(
        &client,
        elementwise_grid(hidden),
        units(),
        partials.into_array_arg(),
        dgamma.clone().into_array_arg(),
        chunks,
    );
    [dx, dgamma]
}

/// [`crate::FusedBackend::swiglu`].
pub(super) fn swiglu<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    gate: CubeTensor<R>,
    up: CubeTensor<R>,
) -> CubeTensor<R> {
    let [gate, up] = [gate, up].map(into_contiguous);
    let out = new_output::<R, F, I, BT>(&gate, gate.meta.shape().clone());
    swiglu_kernel::launch::<F, R>(
        &gate.client.clone(),
        elementwise_grid(out.meta.num_elements()),
        units(),
        gate.into_array_arg(),
        up.into_array_arg(),
        out.clone().into_array_arg(),
    );
    out
}

/// [`crate::FusedBackend::swiglu_backward`]: `[dgate, dup]`.
pub(super) fn swiglu_backward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    gate: CubeTensor<R>,
    up: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> [CubeTensor<R>; 2] {
    let [gate, up, grad] = [gate, up, grad].map(into_contiguous);
    let dgate = new_output::<R, F, I, BT>(&gate, gate.meta.shape().clone());
    let dup = new_output::<R, F, I, BT>(&gate, gate.meta.shape().clone());
    swiglu_backward_kernel::launch::<F, R>(
        &gate.client.clone(),
        elementwise_grid(dgate.meta.num_elements()),
        units(),
        gate.into_array_arg(),
        up.into_array_arg(),
        grad.into_array_arg(),
        dgate.clone().into_array_arg(),
        dup.clone().into_array_arg(),
    );
    [dgate, dup]
}

/// [`crate::FusedBackend::weighted_kl_loss`].
pub(super) fn weighted_kl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    student: CubeTensor<R>,
    teacher: CubeTensor<R>,
    weights: CubeTensor<R>,
    temperature: f64,
    with_grad: bool,
) -> LossWithGrad<Cube<R, F, I, BT>> {
    let [student, teacher, weights] = [student, teacher, weights].map(into_contiguous);
    let shape = student.meta.shape().clone();
    let rows = shape[0];
    let client = student.client.clone();
    let weight_total = finish_sum::<R, F, I, BT>(weights.clone(), 1.0);
    let partials = new_output::<R, F, I, BT>(&student, Shape::from(vec![rows.max(1)]));
    let grad_shape = if with_grad { shape } else { Shape::from(vec![1, 1]) };
    let grad = new_output::<R, F, I, BT>(&student, grad_shape);
    weighted_kl_kernel::launch::<F, R>(
        &client,
        row_cubes(rows),
        CubeDim::new_1d(REDUCE_UNITS),
        student.into_array_arg(),
        teacher.into_array_arg(),
        weights.into_array_arg(),
        weight_total.into_array_arg(),
        grad.clone().into_array_arg(),
        partials.clone().into_array_arg(),
        temperature as f32,
        with_grad,
    );
    let loss = finish_sum::<R, F, I, BT>(partials, 1.0);
    LossWithGrad { loss, grad: with_grad.then_some(grad) }
}
