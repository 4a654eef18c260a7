//! Grouped-query causal attention with rotary positions on CubeCL backends
//! (wgpu, cuda), forward and backward ([`crate::FusedBackend::causal_attention`]).
//!
//! The projections' layout `[batch, tokens, heads * head_dim]` is kept: each
//! kernel reads the heads in place, the key/value head of query head `h` is
//! `h / group`, and the rotary angles come from one `[tokens, head_dim / 2]`
//! table per call ([`crate::llama::rope_table`], the table of the reference
//! and of the CPU path), applied to each pair as it is read: no rotated
//! copies of Q or K. The weights `[batch, heads, tokens, tokens]` are one
//! buffer (scores, then the softmax in place), and what the backward reads:
//! scores, softmax and context forward; dV, dS, dQ and dK backward, one unit
//! per output element (or rotary pair, or row of weights).

use burn::tensor::Shape;
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::common::{new_output, upload, Cube};
use super::geometry::{elementwise_grid, units};
use crate::llama::{rope_table, CausalAttentionOutput, CausalHeads};
use crate::transformer::MASKED_SCORE;

/// What a padding key's score gets added (the reference's bias).
const PADDING_PENALTY: f32 = -MASKED_SCORE;

/// Turns the gradient pair `(even, odd)` of a rotated pair back by the angle
/// at entry `at` of the rotary tables (the rotation's transpose) into
/// `out[2 e]`, `out[2 e + 1]`.
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
