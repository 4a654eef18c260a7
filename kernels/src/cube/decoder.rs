//! The decoder layer's ops on CubeCL backends (wgpu, cuda): RMSNorm,
//! SwiGLU's gated product, grouped-query causal attention with rotary
//! positions, and the head's weighted KL, each forward and backward.
//!
//! - Row reductions (RMSNorm, the KL over a vocabulary) take one cube per
//!   row: its units stride over the row (adjacent units, adjacent columns)
//!   and meet in a shared-memory tree ([`cube_sum`], [`cube_max`]).
//! - The attention keeps the projections' layout `[batch, tokens, heads *
//!   head_dim]`: each kernel reads the heads in place, the key/value head of
//!   query head `h` is `h / group`, and the rotary angles come from one
//!   `[tokens, head_dim / 2]` table per call ([`crate::llama::rope_table`],
//!   the table of the reference and of the CPU path), applied to each pair
//!   as it is read: no rotated copies of Q or K. The weights
//!   `[batch, heads, tokens, tokens]` are one buffer (scores, then softmax in
//!   place), and what the backward reads.
//! - Everything else is one unit per output element.

use burn::tensor::Shape;
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::common::{cube_reduce, new_output, upload, Cube, REDUCE_UNITS};
use super::geometry::{elementwise_grid, UNITS};
use crate::llama::{rope_table, CausalAttentionOutput, CausalHeads, RmsNormOutput};
use crate::transformer::MASKED_SCORE;
use crate::LossWithGrad;

/// At most this many cubes along one axis: the row kernels loop past it.
const MAX_ROW_CUBES: usize = 65_535;

/// What a padding key's score gets added (the reference's bias).
const PADDING_PENALTY: f32 = -MASKED_SCORE;

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

/// Turns the gradient pair `(even, odd)` of rotated pair `p` back by the
/// angle of position `pos` (the rotation's transpose) into `out[2 e]`,
/// `out[2 e + 1]`.
#[allow(clippy::too_many_arguments)]
#[cube]
fn store_rotated_back<F: Float>(
    out: &mut Array<F>,
    e: usize,
    even: F,
    odd: F,
    cos: &Array<F>,
    sin: &Array<F>,
    at: usize,
) {
    let c = cos[at];
    let s = sin[at];
    out[2 * e] = even * c + odd * s;
    out[2 * e + 1] = odd * c - even * s;
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

/// The sizes of one attention call, as the kernels read them.
#[derive(CubeLaunch, CubeType, Clone)]
struct Heads {
    /// Query heads.
    heads: usize,
    /// Key/value heads.
    kv_heads: usize,
    /// Width of a head (even).
    head_dim: usize,
    /// Tokens per sequence.
    tokens: usize,
}

/// One rotary pair `(x[2i], x[2i + 1])`.
#[derive(CubeType)]
struct Pair<F: Float> {
    even: F,
    odd: F,
}

/// The rotated pair `p` of head `head` (of `count` side by side) of token
/// `t` in `x` `[batch, tokens, count * head_dim]`, sequence `b`.
#[allow(clippy::too_many_arguments)]
#[cube]
fn rotated_pair<F: Float>(
    x: &Array<F>,
    cos: &Array<F>,
    sin: &Array<F>,
    shape: &Heads,
    count: usize,
    b: usize,
    t: usize,
    head: usize,
    p: usize,
) -> Pair<F> {
    let half = shape.head_dim / 2;
    let at = ((b * shape.tokens + t) * count + head) * shape.head_dim + 2 * p;
    let even = x[at];
    let odd = x[at + 1];
    let c = cos[t * half + p];
    let s = sin[t * half + p];
    Pair::<F> { even: even * c - odd * s, odd: even * s + odd * c }
}

/// The attention scores, one unit per `(b, h, i, j)` of `scores` `[batch,
/// heads, tokens, tokens]`: `rot(q_i) . rot(k_j) * scale` plus
/// `MASKED_SCORE` on a padding key, for `j <= i`; 0 after the query (the
/// softmax skips them).
#[cube(launch)]
fn causal_scores_kernel<F: Float>(
    q: &Array<F>,
    k: &Array<F>,
    mask: &Array<F>,
    cos: &Array<F>,
    sin: &Array<F>,
    scores: &mut Array<F>,
    shape: &Heads,
    scale: f32,
) {
    let e = ABSOLUTE_POS;
    if e < scores.len() {
        let t = shape.tokens;
        let j = e % t;
        let i = (e / t) % t;
        let h = (e / (t * t)) % shape.heads;
        let b = e / (t * t * shape.heads);
        let mut value = F::new(0.0);
        if j <= i {
            let kv = h / (shape.heads / shape.kv_heads);
            let mut acc = F::new(0.0);
            for p in 0..shape.head_dim / 2 {
                let qp = rotated_pair::<F>(q, cos, sin, shape, shape.heads, b, i, h, p);
                let kp = rotated_pair::<F>(k, cos, sin, shape, shape.kv_heads, b, j, kv, p);
                acc += qp.even * kp.even + qp.odd * kp.odd;
            }
            // As the reference: the score, then the padding bias added.
            value = acc * F::cast_from(scale) + (mask[b * t + j] - F::new(1.0)) * F::new(PADDING_PENALTY);
        }
        scores[e] = value;
    }
}

/// The softmax over the keys up to each query, in place, one unit per
/// `(b, h, i)` row of `probs` `[batch, heads, tokens, tokens]` (what lies
/// after the query is already 0).
#[cube(launch)]
fn causal_softmax_kernel<F: Float>(probs: &mut Array<F>, tokens: usize) {
    let row = ABSOLUTE_POS;
    if row < probs.len() / tokens {
        let i = row % tokens;
        let base = row * tokens;
        let mut top = probs[base];
        for j in 1..i + 1 {
            top = F::max(top, probs[base + j]);
        }
        let mut total = F::new(0.0);
        for j in 0..i + 1 {
            let e = F::exp(probs[base + j] - top);
            probs[base + j] = e;
            total += e;
        }
        let inverse = F::new(1.0) / total;
        for j in 0..i + 1 {
            probs[base + j] = probs[base + j] * inverse;
        }
    }
}

/// The context, one unit per element of `out` `[batch, tokens, heads *
/// head_dim]`: `sum over j <= i of P[b, h, i, j] v[b, j, kv(h), d]`.
#[cube(launch)]
fn causal_context_kernel<F: Float>(probs: &Array<F>, v: &Array<F>, out: &mut Array<F>, shape: &Heads) {
    let e = ABSOLUTE_POS;
    if e < out.len() {
        let t = shape.tokens;
        let hd = shape.head_dim;
        let d = e % hd;
        let h = (e / hd) % shape.heads;
        let i = (e / (hd * shape.heads)) % t;
        let b = e / (hd * shape.heads * t);
        let kv = h / (shape.heads / shape.kv_heads);
        let row = ((b * shape.heads + h) * t + i) * t;
        let mut acc = F::new(0.0);
        for j in 0..i + 1 {
            acc += probs[row + j] * v[((b * t + j) * shape.kv_heads + kv) * hd + d];
        }
        out[e] = acc;
    }
}

/// The value gradient, one unit per element of `dv` `[batch, tokens,
/// kv_heads * head_dim]`: `sum over the group's heads h and i >= j of
/// P[b, h, i, j] g[b, i, h, d]`.
#[cube(launch)]
fn causal_dv_kernel<F: Float>(probs: &Array<F>, grad: &Array<F>, dv: &mut Array<F>, shape: &Heads) {
    let e = ABSOLUTE_POS;
    if e < dv.len() {
        let t = shape.tokens;
        let hd = shape.head_dim;
        let group = shape.heads / shape.kv_heads;
        let d = e % hd;
        let kv = (e / hd) % shape.kv_heads;
        let j = (e / (hd * shape.kv_heads)) % t;
        let b = e / (hd * shape.kv_heads * t);
        let mut acc = F::new(0.0);
        for g in 0..group {
            let h = kv * group + g;
            for i in j..t {
                acc += probs[((b * shape.heads + h) * t + i) * t + j]
                    * grad[((b * t + i) * shape.heads + h) * hd + d];
            }
        }
        dv[e] = acc;
    }
}

/// The scores' gradient, one unit per `(b, h, i)` row of `ds` `[batch,
/// heads, tokens, tokens]`: with `dP_j = g_i . v_j`, `dS_j = P_j (dP_j -
/// sum_j P_j dP_j) * scale` for `j <= i`, 0 after the query.
#[cube(launch)]
fn causal_ds_kernel<F: Float>(
    probs: &Array<F>,
    grad: &Array<F>,
    v: &Array<F>,
    ds: &mut Array<F>,
    shape: &Heads,
    scale: f32,
) {
    let row = ABSOLUTE_POS;
    let t = shape.tokens;
    let hd = shape.head_dim;
    if row < probs.len() / t {
        let i = row % t;
        let h = (row / t) % shape.heads;
        let b = row / (t * shape.heads);
        let kv = h / (shape.heads / shape.kv_heads);
        let base = row * t;
        let g_at = ((b * t + i) * shape.heads + h) * hd;
        let mut weighted = F::new(0.0);
        for j in 0..i + 1 {
            let v_at = ((b * t + j) * shape.kv_heads + kv) * hd;
            let mut dp = F::new(0.0);
            for d in 0..hd {
                dp += grad[g_at + d] * v[v_at + d];
            }
            ds[base + j] = dp;
            weighted += probs[base + j] * dp;
        }
        for j in 0..i + 1 {
            ds[base + j] = probs[base + j] * (ds[base + j] - weighted) * F::cast_from(scale);
        }
        for j in i + 1..t {
            ds[base + j] = F::new(0.0);
        }
    }
}

/// The query gradient, one unit per rotary pair `(b, i, h, p)`: `sum over
/// j <= i of dS[b, h, i, j] rot(k_j)`, rotated back by `i`'s angle.
#[cube(launch)]
fn causal_dq_kernel<F: Float>(
    ds: &Array<F>,
    k: &Array<F>,
    cos: &Array<F>,
    sin: &Array<F>,
    dq: &mut Array<F>,
    shape: &Heads,
) {
    let e = ABSOLUTE_POS;
    let t = shape.tokens;
    let half = shape.head_dim / 2;
    if e < dq.len() / 2 {
        let p = e % half;
        let h = (e / half) % shape.heads;
        let i = (e / (half * shape.heads)) % t;
        let b = e / (half * shape.heads * t);
        let kv = h / (shape.heads / shape.kv_heads);
        let row = ((b * shape.heads + h) * t + i) * t;
        let mut even = F::new(0.0);
        let mut odd = F::new(0.0);
        for j in 0..i + 1 {
            let kp = rotated_pair::<F>(k, cos, sin, shape, shape.kv_heads, b, j, kv, p);
            let w = ds[row + j];
            even += w * kp.even;
            odd += w * kp.odd;
        }
        store_rotated_back::<F>(dq, e, even, odd, cos, sin, i * half + p);
    }
}

/// The key gradient, one unit per rotary pair `(b, j, kv, p)`: `sum over
/// the group's heads h and i >= j of dS[b, h, i, j] rot(q_i)`, rotated back
/// by `j`'s angle.
#[cube(launch)]
fn causal_dk_kernel<F: Float>(
    ds: &Array<F>,
    q: &Array<F>,
    cos: &Array<F>,
    sin: &Array<F>,
    dk: &mut Array<F>,
    shape: &Heads,
) {
    let e = ABSOLUTE_POS;
    let t = shape.tokens;
    let half = shape.head_dim / 2;
    if e < dk.len() / 2 {
        let group = shape.heads / shape.kv_heads;
        let p = e % half;
        let kv = (e / half) % shape.kv_heads;
        let j = (e / (half * shape.kv_heads)) % t;
        let b = e / (half * shape.kv_heads * t);
        let mut even = F::new(0.0);
        let mut odd = F::new(0.0);
        for g in 0..group {
            let h = kv * group + g;
            for i in j..t {
                let qp = rotated_pair::<F>(q, cos, sin, shape, shape.heads, b, i, h, p);
                let w = ds[((b * shape.heads + h) * t + i) * t + j];
                even += w * qp.even;
                odd += w * qp.odd;
            }
        }
        store_rotated_back::<F>(dk, e, even, odd, cos, sin, j * half + p);
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

fn units() -> CubeDim {
    CubeDim::new_1d(UNITS)
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
    super::sum_chunks_kernel::launch::<F, R>(
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

/// Whether the kernels take this attention: heads in whole groups and an
/// even head width (anything else goes to the reference).
pub(super) fn takes_attention<R: CubeRuntime>(q: &CubeTensor<R>, layout: CausalHeads) -> bool {
    let width = q.meta.shape().dims::<3>()[2];
    let (heads, kv_heads) = (layout.heads, layout.kv_heads);
    heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && width % heads == 0 && (width / heads) % 2 == 0
}

/// The sizes of `q` `[batch, tokens, heads * head_dim]` under `layout`, and
/// the rotary tables on its device.
fn attention_setup<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    q: &CubeTensor<R>,
    layout: CausalHeads,
) -> (Heads, [usize; 2], [CubeTensor<R>; 2]) {
    let [batch, tokens, width] = q.meta.shape().dims::<3>();
    let head_dim = width / layout.heads;
    let shape = Heads { heads: layout.heads, kv_heads: layout.kv_heads, head_dim, tokens };
    let (cos, sin) = rope_table(tokens, head_dim, layout.rope_base);
    let tables = [upload::<R, F, I, BT>(cos, q), upload::<R, F, I, BT>(sin, q)];
    (shape, [batch, tokens], tables)
}

fn heads_arg<R: CubeRuntime>(shape: &Heads) -> HeadsLaunch<R> {
    HeadsLaunch::<R>::new(shape.heads, shape.kv_heads, shape.head_dim, shape.tokens)
}

/// [`crate::FusedBackend::causal_attention`] (for layouts
/// [`takes_attention`] accepts).
pub(super) fn causal_attention<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    [q, k, v]: [CubeTensor<R>; 3],
    mask: CubeTensor<R>,
    layout: CausalHeads,
    with_probs: bool,
) -> CausalAttentionOutput<Cube<R, F, I, BT>> {
    let [q, k, v, mask] = [q, k, v, mask].map(into_contiguous);
    let (shape, [batch, tokens], [cos, sin]) = attention_setup::<R, F, I, BT>(&q, layout);
    let client = q.client.clone();
    let probs = new_output::<R, F, I, BT>(&q, Shape::from(vec![batch, layout.heads, tokens, tokens]));
    causal_scores_kernel::launch::<F, R>(
        &client,
        elementwise_grid(probs.meta.num_elements()),
        units(),
        q.clone().into_array_arg(),
        k.into_array_arg(),
        mask.into_array_arg(),
        cos.into_array_arg(),
        sin.into_array_arg(),
        probs.clone().into_array_arg(),
        heads_arg(&shape),
        1.0 / (shape.head_dim as f32).sqrt(),
    );
    causal_softmax_kernel::launch::<F, R>(
        &client,
        elementwise_grid(batch * layout.heads * tokens),
        units(),
        probs.clone().into_array_arg(),
        tokens,
    );
    let context = new_output::<R, F, I, BT>(&q, q.meta.shape().clone());
    causal_context_kernel::launch::<F, R>(
        &client,
        elementwise_grid(context.meta.num_elements()),
        units(),
        probs.clone().into_array_arg(),
        v.into_array_arg(),
        context.clone().into_array_arg(),
        heads_arg(&shape),
    );
    CausalAttentionOutput { context, probs: with_probs.then_some(probs) }
}

/// [`crate::FusedBackend::causal_attention_backward`]: `[dq, dk, dv]` from
/// the weights of the forward.
pub(super) fn causal_attention_backward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    [q, k, v]: [CubeTensor<R>; 3],
    probs: CubeTensor<R>,
    grad: CubeTensor<R>,
    layout: CausalHeads,
) -> [CubeTensor<R>; 3] {
    let [q, k, v, probs, grad] = [q, k, v, probs, grad].map(into_contiguous);
    let (shape, [batch, tokens], [cos, sin]) = attention_setup::<R, F, I, BT>(&q, layout);
    let client = q.client.clone();
    let dv = new_output::<R, F, I, BT>(&v, v.meta.shape().clone());
    causal_dv_kernel::launch::<F, R>(
        &client,
        elementwise_grid(dv.meta.num_elements()),
        units(),
        probs.clone().into_array_arg(),
        grad.clone().into_array_arg(),
        dv.clone().into_array_arg(),
        heads_arg(&shape),
    );
    let ds = new_output::<R, F, I, BT>(&q, probs.meta.shape().clone());
    causal_ds_kernel::launch::<F, R>(
        &client,
        elementwise_grid(batch * layout.heads * tokens),
        units(),
        probs.into_array_arg(),
        grad.into_array_arg(),
        v.into_array_arg(),
        ds.clone().into_array_arg(),
        heads_arg(&shape),
        1.0 / (shape.head_dim as f32).sqrt(),
    );
    let dq = new_output::<R, F, I, BT>(&q, q.meta.shape().clone());
    causal_dq_kernel::launch::<F, R>(
        &client,
        elementwise_grid(dq.meta.num_elements() / 2),
        units(),
        ds.clone().into_array_arg(),
        k.clone().into_array_arg(),
        cos.clone().into_array_arg(),
        sin.clone().into_array_arg(),
        dq.clone().into_array_arg(),
        heads_arg(&shape),
    );
    let dk = new_output::<R, F, I, BT>(&k, k.meta.shape().clone());
    causal_dk_kernel::launch::<F, R>(
        &client,
        elementwise_grid(dk.meta.num_elements() / 2),
        units(),
        ds.into_array_arg(),
        q.into_array_arg(),
        cos.into_array_arg(),
        sin.into_array_arg(),
        dk.clone().into_array_arg(),
        heads_arg(&shape),
    );
    [dq, dk, dv]
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
    let weight_total = new_output::<R, F, I, BT>(&weights, Shape::from(vec![1]));
    super::sum_kernel::launch::<F, R>(
        &client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(REDUCE_UNITS),
        weights.clone().into_array_arg(),
        weight_total.clone().into_array_arg(),
        1.0,
    );
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
    let loss = super::finish_sum::<R, F, I, BT>(partials, 1.0);
    LossWithGrad { loss, grad: with_grad.then_some(grad) }
}
