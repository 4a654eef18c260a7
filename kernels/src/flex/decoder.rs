//! Native CPU paths of the decoder layer's ops on flex
//! ([`crate::llama`]): RMSNorm in one pass per row, SwiGLU's `SiLU(gate) *
//! up` in one pass, grouped-query causal attention with the rotary
//! positions applied while a head's rows are packed for its products (the
//! key/value heads read in place by each of their query heads, the causal
//! and padding masks in the same pass), and the KL of two score tables in
//! one pass per row that also writes its gradient; each with its backward.
//! Work runs in parallel on the calling thread's rayon pool, in a partition
//! that does not depend on the number of threads (fixed groups of rows; one
//! task per sequence and key/value head), so results are the same on any
//! pool.

use rayon::prelude::*;

use super::gemm::{dot, exp_fast};
use crate::llama::rope_table;
use crate::transformer::MASKED_SCORE;

/// Rows per task of the row-wise passes (fixed: partial sums of parameter
/// gradients do not depend on the thread count).
const ROWS_PER_TASK: usize = 32;

/// Sizes of one causal attention call: `q` is `[batch, tokens, heads *
/// head_dim]`, `k` and `v` are `[batch, tokens, kv_heads * head_dim]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct CausalSizes {
    pub batch: usize,
    pub tokens: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl CausalSizes {
    fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }
    fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }
    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Sequence `b` of q, k and v (each `[tokens, width]` of its own width).
    fn sequence<'a>(&self, [q, k, v]: [&'a [f32]; 3], b: usize) -> [&'a [f32]; 3] {
        let (qn, kn) = (self.tokens * self.q_width(), self.tokens * self.kv_width());
        [&q[b * qn..][..qn], &k[b * kn..][..kn], &v[b * kn..][..kn]]
    }
}

/// Copies head `h` (`head_dim` wide) of each row of `src` (rows `width`
/// apart) into the dense `[tokens, head_dim]` `dst`, rotating each
/// adjacent pair by its position's angle (`inverse`: by minus the angle,
/// the transpose of the rotation, for gradients).
fn pack_rotated(
    dst: &mut [f32],
    src: &[f32],
    (width, h, d): (usize, usize, usize),
    (cos, sin): (&[f32], &[f32]),
    inverse: bool,
) {
    let half = d / 2;
    for (t, row) in dst.chunks_mut(d).enumerate() {
        let from = &src[t * width + h * d..t * width + (h + 1) * d];
        let (c, s) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
        for i in 0..half {
            let (e, o) = (from[2 * i], from[2 * i + 1]);
            let s = if inverse { -s[i] } else { s[i] };
            row[2 * i] = e * c[i] - o * s;
            row[2 * i + 1] = e * s + o * c[i];
        }
    }
}

/// Copies head `h` of each row of `src` into dense `dst` (no rotation).
fn pack(dst: &mut [f32], src: &[f32], (width, h, d): (usize, usize, usize)) {
    for (t, row) in dst.chunks_mut(d).enumerate() {
        row.copy_from_slice(&src[t * width + h * d..t * width + (h + 1) * d]);
    }
}

/// `dst[row t, head h] (+)= block[t]`: a dense `[tokens, head_dim]` block
/// back into the heads-side-by-side layout, rotated back first with
/// `rope` (the transpose of the forward rotation).
fn unpack_add(
    dst: &mut [f32],
    block: &[f32],
    (width, h, d): (usize, usize, usize),
    rope: Option<(&[f32], &[f32])>,
) {
    let half = d / 2;
    for (t, row) in block.chunks(d).enumerate() {
        let to = &mut dst[t * width + h * d..t * width + (h + 1) * d];
        match rope {
            Some((cos, sin)) => {
                let (c, s) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
                for i in 0..half {
                    let (e, o) = (row[2 * i], row[2 * i + 1]);
                    to[2 * i] += e * c[i] + o * s[i];
                    to[2 * i + 1] += -e * s[i] + o * c[i];
                }
            }
            None => to.iter_mut().zip(row).for_each(|(a, b)| *a += b),
        }
    }
}

wide! {
/// Scores of one query head against its key/value head: row `i` of `p`
/// (`[tokens, tokens]`) gets the softmax over keys `j <= i` of `q_i . k_j *
/// scale` plus [`MASKED_SCORE`] for padding keys; keys after `i` get 0.
fn causal_probs(p: &mut [f32], q: &[f32], k: &[f32], key_bias: &[f32], d: usize, scale: f32) {
    let tokens = key_bias.len();
    for i in 0..tokens {
        let row = &mut p[i * tokens..(i + 1) * tokens];
        let qi = &q[i * d..(i + 1) * d];
        let mut max = f32::NEG_INFINITY;
        for j in 0..=i {
            let s = dot(qi, &k[j * d..(j + 1) * d]) * scale + key_bias[j];
            row[j] = s;
            max = max.max(s);
        }
        let mut sum = 0.0;
        for v in row[..=i].iter_mut() {
            *v = exp_fast(*v - max);
            sum += *v;
        }
        let inv = 1.0 / sum;
        row[..=i].iter_mut().for_each(|v| *v *= inv);
        row[i + 1..].iter_mut().for_each(|v| *v = 0.0);
    }
}
}

wide! {
/// `out[i] = sum_{j <= i} p[i, j] v[j]` for dense `[tokens, d]` `v`.
fn weighted_values(out: &mut [f32], p: &[f32], v: &[f32], tokens: usize, d: usize) {
    for i in 0..tokens {
        let row = &mut out[i * d..(i + 1) * d];
        row.iter_mut().for_each(|o| *o = 0.0);
        for j in 0..=i {
            let w = p[i * tokens + j];
            row.iter_mut().zip(&v[j * d..(j + 1) * d]).for_each(|(o, x)| *o += w * x);
        }
    }
}
}

/// The key bias of one sequence: 0 for real keys, [`MASKED_SCORE`] for padding.
fn key_bias(mask: &[f32]) -> Vec<f32> {
    mask.iter().map(|m| (1.0 - m) * MASKED_SCORE).collect()
}

/// Grouped-query causal attention with rotary positions on contiguous
/// `f32` values (see [`crate::FusedBackend::causal_attention`]): the
/// context `[batch, tokens, heads * head_dim]` and, with `with_probs`, the
/// weights `[batch, heads, tokens, tokens]`. One task per (sequence,
/// key/value head): its rotated keys and values are packed once and read
/// by each query head of its group.
pub(crate) fn causal_attention(
    [q, k, v]: [&[f32]; 3],
    mask: &[f32],
    sizes: CausalSizes,
    rope_base: f64,
    with_probs: bool,
) -> (Vec<f32>, Vec<f32>) {
    let CausalSizes { batch, tokens, heads, kv_heads, head_dim: d } = sizes;
    let (qw, kw, group) = (sizes.q_width(), sizes.kv_width(), sizes.group());
    let (cos, sin) = rope_table(tokens, d, rope_base);
    let scale = 1.0 / (d as f32).sqrt();
    let tt = tokens * tokens;
    // One task per (sequence, kv head): its group's context heads and probs.
    let results: Vec<(Vec<f32>, Vec<f32>)> = (0..batch * kv_heads)
        .into_par_iter()
        .map(|task| {
            let (b, g) = (task / kv_heads, task % kv_heads);
            let [qs, ks, vs] = sizes.sequence([q, k, v], b);
            let bias = key_bias(&mask[b * tokens..(b + 1) * tokens]);
            let (mut kr, mut vd, mut qr) =
                (vec![0f32; tokens * d], vec![0f32; tokens * d], vec![0f32; tokens * d]);
            pack_rotated(&mut kr, ks, (kw, g, d), (&cos, &sin), false);
            pack(&mut vd, vs, (kw, g, d));
            let mut context = vec![0f32; group * tokens * d];
            let mut probs = vec![0f32; group * tt];
            for j in 0..group {
                let h = g * group + j;
                pack_rotated(&mut qr, qs, (qw, h, d), (&cos, &sin), false);
                let p = &mut probs[j * tt..(j + 1) * tt];
                causal_probs(p, &qr, &kr, &bias, d, scale);
                weighted_values(&mut context[j * tokens * d..(j + 1) * tokens * d], p, &vd, tokens, d);
            }
            (context, probs)
        })
        .collect();
    let mut context = vec![0f32; batch * tokens * qw];
    let mut probs = if with_probs { vec![0f32; batch * heads * tt] } else { Vec::new() };
    for (task, (block, p)) in results.into_iter().enumerate() {
        let (b, g) = (task / kv_heads, task % kv_heads);
        let out = &mut context[b * tokens * qw..(b + 1) * tokens * qw];
        for j in 0..group {
            let h = g * group + j;
            for t in 0..tokens {
                out[t * qw + h * d..t * qw + (h + 1) * d]
                    .copy_from_slice(&block[(j * tokens + t) * d..(j * tokens + t + 1) * d]);
            }
        }
        if with_probs {
            let at = (b * heads + g * group) * tt;
            probs[at..at + group * tt].copy_from_slice(&p);
        }
    }
    (context, probs)
}

wide! {
/// The backward of one query head given its probs `p`, the gradient of its
/// context `go` (dense `[tokens, d]`), its rotated query `qr` and its
/// group's rotated keys `kr` and values `vd`: adds `dV` into `dv`, `dK`
/// (rotated) into `dkr`, and writes `dQ` (rotated) into `dqr`. `ds` is
/// scratch of `[tokens, tokens]`.
fn head_backward(
    p: &[f32],
    go: &[f32],
    qr: &[f32],
    kr: &[f32],
    vd: &[f32],
    dqr: &mut [f32],
    dkr: &mut [f32],
    dv: &mut [f32],
    ds: &mut [f32],
    d: usize,
    scale: f32,
) {
    let tokens = qr.len() / d;
    for i in 0..tokens {
        let gi = &go[i * d..(i + 1) * d];
        let prow = &p[i * tokens..(i + 1) * tokens];
        // dP[i, j] = dO_i . V_j, then dS = P (dP - sum_j dP P) * scale.
        let dsrow = &mut ds[i * tokens..(i + 1) * tokens];
        let mut weighted = 0.0;
        for j in 0..=i {
            let g = dot(gi, &vd[j * d..(j + 1) * d]);
            dsrow[j] = g;
            weighted += g * prow[j];
        }
        for j in 0..=i {
            dsrow[j] = prow[j] * (dsrow[j] - weighted) * scale;
        }
        // dV_j += P[i, j] dO_i; dK_j += dS[i, j] Q_i; dQ_i = sum_j dS[i, j] K_j.
        let dq = &mut dqr[i * d..(i + 1) * d];
        dq.iter_mut().for_each(|x| *x = 0.0);
        let qi = &qr[i * d..(i + 1) * d];
        for j in 0..=i {
            let (w, s) = (prow[j], dsrow[j]);
            dv[j * d..(j + 1) * d].iter_mut().zip(gi).for_each(|(a, g)| *a += w * g);
            dkr[j * d..(j + 1) * d].iter_mut().zip(qi).for_each(|(a, q)| *a += s * q);
            dq.iter_mut().zip(&kr[j * d..(j + 1) * d]).for_each(|(a, k)| *a += s * k);
        }
    }
}
}

/// The gradients `[dq, dk, dv]` of [`causal_attention`] from its inputs,
/// its weights and the gradient of its context, on contiguous `f32` values.
pub(crate) fn causal_attention_backward(
    [q, k, v]: [&[f32]; 3],
    probs: &[f32],
    grad: &[f32],
    sizes: CausalSizes,
    rope_base: f64,
) -> [Vec<f32>; 3] {
    let CausalSizes { batch, tokens, heads, kv_heads, head_dim: d } = sizes;
    let (qw, kw, group) = (sizes.q_width(), sizes.kv_width(), sizes.group());
    let (cos, sin) = rope_table(tokens, d, rope_base);
    let scale = 1.0 / (d as f32).sqrt();
    let tt = tokens * tokens;
    // Per (sequence, kv head): the group's dQ heads (dense), and dK, dV.
    let results: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..batch * kv_heads)
        .into_par_iter()
        .map(|task| {
            let (b, g) = (task / kv_heads, task % kv_heads);
            let [qs, ks, vs] = sizes.sequence([q, k, v], b);
            let gs = &grad[b * tokens * qw..][..tokens * qw];
            let (mut kr, mut vd) = (vec![0f32; tokens * d], vec![0f32; tokens * d]);
            pack_rotated(&mut kr, ks, (kw, g, d), (&cos, &sin), false);
            pack(&mut vd, vs, (kw, g, d));
            let (mut qr, mut go, mut ds) = (vec![0f32; tokens * d], vec![0f32; tokens * d], vec![0f32; tt]);
            let (mut dkr, mut dv) = (vec![0f32; tokens * d], vec![0f32; tokens * d]);
            let mut dqr = vec![0f32; group * tokens * d];
            for j in 0..group {
                let h = g * group + j;
                pack_rotated(&mut qr, qs, (qw, h, d), (&cos, &sin), false);
                pack(&mut go, gs, (qw, h, d));
                let p = &probs[(b * heads + h) * tt..][..tt];
                let dq = &mut dqr[j * tokens * d..(j + 1) * tokens * d];
                head_backward(p, &go, &qr, &kr, &vd, dq, &mut dkr, &mut dv, &mut ds, d, scale);
            }
            (dqr, dkr, dv)
        })
        .collect();
    let (mut dq, mut dk, mut dv) =
        (vec![0f32; batch * tokens * qw], vec![0f32; batch * tokens * kw], vec![0f32; batch * tokens * kw]);
    for (task, (dqr, dkr, dvd)) in results.into_iter().enumerate() {
        let (b, g) = (task / kv_heads, task % kv_heads);
        let rope = Some((cos.as_slice(), sin.as_slice()));
        for j in 0..group {
            let h = g * group + j;
            let block = &dqr[j * tokens * d..(j + 1) * tokens * d];
            unpack_add(&mut dq[b * tokens * qw..(b + 1) * tokens * qw], block, (qw, h, d), rope);
        }
        unpack_add(&mut dk[b * tokens * kw..(b + 1) * tokens * kw], &dkr, (kw, g, d), rope);
        unpack_add(&mut dv[b * tokens * kw..(b + 1) * tokens * kw], &dvd, (kw, g, d), None);
    }
    [dq, dk, dv]
}

wide! {
/// RMSNorm of a group of rows into `out`, each row's `1 / rms` into `rstd`.
fn rms_rows(out: &mut [f32], rstd: &mut [f32], x: &[f32], gamma: &[f32], epsilon: f32) {
    let hidden = gamma.len();
    for ((o, row), r) in out.chunks_mut(hidden).zip(x.chunks(hidden)).zip(rstd.iter_mut()) {
        let inv = 1.0 / (dot(row, row) / hidden as f32 + epsilon).sqrt();
        *r = inv;
        o.iter_mut().zip(row).zip(gamma).for_each(|((o, v), g)| *o = v * inv * g);
    }
}
}

/// `x / sqrt(mean(x^2) + eps) * gamma` over the last axis of `[rows,
/// hidden]` `x`: the output and each row's `1 / rms`.
pub(crate) fn rms_norm(x: &[f32], gamma: &[f32], epsilon: f64) -> (Vec<f32>, Vec<f32>) {
    let hidden = gamma.len().max(1);
    let rows = x.len() / hidden;
    let (mut out, mut rstd) = (vec![0f32; x.len()], vec![0f32; rows]);
    let task = ROWS_PER_TASK * hidden;
    out.par_chunks_mut(task)
        .zip(rstd.par_chunks_mut(ROWS_PER_TASK))
        .zip(x.par_chunks(task))
        .for_each(|((out, rstd), x)| rms_rows(out, rstd, x, gamma, epsilon as f32));
    (out, rstd)
}

wide! {
/// The backward of [`rms_rows`] for a group of rows: `dx` into `dx`, this
/// group's share of `dgamma` into `dgamma`.
fn rms_rows_backward(dx: &mut [f32], dgamma: &mut [f32], x: &[f32], rstd: &[f32], gamma: &[f32], grad: &[f32]) {
    let hidden = gamma.len();
    let rows = dx.chunks_mut(hidden).zip(x.chunks(hidden)).zip(grad.chunks(hidden)).zip(rstd);
    for (((dx, row), dy), &inv) in rows {
        // n = x * inv; dx = inv * (dy * gamma - n * mean(dy * gamma * n)).
        let mut projection = 0.0;
        for ((v, d), g) in row.iter().zip(dy).zip(gamma) {
            projection += d * g * v;
        }
        let projection = projection * inv / hidden as f32;
        for ((((o, v), d), g), dg) in dx.iter_mut().zip(row).zip(dy).zip(gamma).zip(dgamma.iter_mut()) {
            let n = v * inv;
            *o = inv * (d * g - n * projection);
            *dg += d * n;
        }
    }
}
}

/// The gradients of [`rms_norm`]: of `x` and of `gamma`.
pub(crate) fn rms_norm_backward(x: &[f32], rstd: &[f32], gamma: &[f32], grad: &[f32]) -> [Vec<f32>; 2] {
    let hidden = gamma.len().max(1);
    let task = ROWS_PER_TASK * hidden;
    let mut dx = vec![0f32; x.len()];
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(task)
        .enumerate()
        .map(|(t, dx)| {
            let mut dgamma = vec![0f32; hidden];
            let at = t * task..t * task + dx.len();
            let rstd = &rstd[t * ROWS_PER_TASK..t * ROWS_PER_TASK + dx.len() / hidden];
            rms_rows_backward(dx, &mut dgamma, &x[at.clone()], rstd, gamma, &grad[at]);
            dgamma
        })
        .collect();
    let mut dgamma = vec![0f32; hidden];
    for partial in &partials {
        dgamma.iter_mut().zip(partial).for_each(|(a, b)| *a += b);
    }
    [dx, dgamma]
}

/// `x * sigmoid(x)` and `sigmoid(x)`.
#[inline(always)]
fn silu_and_sigmoid(x: f32) -> (f32, f32) {
    let sigmoid = 1.0 / (1.0 + exp_fast(-x));
    (x * sigmoid, sigmoid)
}

wide! {
fn swiglu_slice(out: &mut [f32], gate: &[f32], up: &[f32]) {
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu_and_sigmoid(*g).0 * u;
    }
}
}

/// `SiLU(gate) * up`, elementwise.
pub(crate) fn swiglu(gate: &[f32], up: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; gate.len()];
    out.par_chunks_mut(16 * 1024)
        .zip(gate.par_chunks(16 * 1024).zip(up.par_chunks(16 * 1024)))
        .for_each(|(out, (gate, up))| swiglu_slice(out, gate, up));
    out
}

wide! {
fn swiglu_backward_slice(dgate: &mut [f32], dup: &mut [f32], gate: &[f32], up: &[f32], grad: &[f32]) {
    for ((((dg, du), g), u), d) in dgate.iter_mut().zip(dup.iter_mut()).zip(gate).zip(up).zip(grad) {
        let (silu, sigmoid) = silu_and_sigmoid(*g);
        *du = d * silu;
        // SiLU'(g) = sigmoid(g) (1 + g (1 - sigmoid(g))).
        *dg = d * u * sigmoid * (1.0 + g * (1.0 - sigmoid));
    }
}
}

/// The gradients `[dgate, dup]` of [`swiglu`].
pub(crate) fn swiglu_backward(gate: &[f32], up: &[f32], grad: &[f32]) -> [Vec<f32>; 2] {
    let (mut dgate, mut dup) = (vec![0f32; gate.len()], vec![0f32; gate.len()]);
    let n = 16 * 1024;
    dgate
        .par_chunks_mut(n)
        .zip(dup.par_chunks_mut(n))
        .zip(gate.par_chunks(n).zip(up.par_chunks(n)).zip(grad.par_chunks(n)))
        .for_each(|((dg, du), ((g, u), d))| swiglu_backward_slice(dg, du, g, u, d));
    [dgate, dup]
}

wide! {
/// One row of the KL: writes `softmax(s/T) - softmax(t/T)` scaled by
/// `grad_scale` into `grad` (when not empty) and returns
/// `sum p (log p - log q)` at temperature `T` (`inv_t = 1 / T`).
fn kl_row(grad: &mut [f32], s: &[f32], t: &[f32], inv_t: f32, grad_scale: f32) -> f32 {
    let s_max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max) * inv_t;
    let t_max = t.iter().copied().fold(f32::NEG_INFINITY, f32::max) * inv_t;
    let (mut s_sum, mut t_sum, mut cross) = ([0f32; 8], [0f32; 8], [0f32; 8]);
    let (sc, tc) = (s.chunks_exact(8), t.chunks_exact(8));
    let (sr, tr) = (sc.remainder(), tc.remainder());
    for (s8, t8) in sc.zip(tc) {
        for l in 0..8 {
            let (a, b) = (s8[l] * inv_t - s_max, t8[l] * inv_t - t_max);
            let (ea, eb) = (exp_fast(a), exp_fast(b));
            s_sum[l] += ea;
            t_sum[l] += eb;
            cross[l] += eb * (b - a);
        }
    }
    let (mut s_rest, mut t_rest, mut cross_rest) = (0f32, 0f32, 0f32);
    for (a, b) in sr.iter().zip(tr) {
        let (a, b) = (a * inv_t - s_max, b * inv_t - t_max);
        let (ea, eb) = (exp_fast(a), exp_fast(b));
        s_rest += ea;
        t_rest += eb;
        cross_rest += eb * (b - a);
    }
    let s_sum = s_sum.iter().sum::<f32>() + s_rest;
    let t_sum = t_sum.iter().sum::<f32>() + t_rest;
    let cross = cross.iter().sum::<f32>() + cross_rest;
    // KL = sum p (b - a) - log Zt + log Zs, p = e^b / Zt.
    let kl = cross / t_sum - t_sum.ln() + s_sum.ln();
    if !grad.is_empty() {
        let (s_inv, t_inv) = (grad_scale / s_sum, grad_scale / t_sum);
        for ((g, a), b) in grad.iter_mut().zip(s).zip(t) {
            *g = exp_fast(a * inv_t - s_max) * s_inv - exp_fast(b * inv_t - t_max) * t_inv;
        }
    }
    kl
}
}

/// The weighted mean over rows of `KL(softmax(t / T) || softmax(s / T))`
/// times `T^2`, for `[rows, classes]` scores and `[rows]` weights, and,
/// with `with_grad`, its gradient with respect to `s` (`T w_r / W
/// (softmax(s_r / T) - softmax(t_r / T))`), in one pass over each row.
pub(crate) fn weighted_kl(
    s: &[f32],
    t: &[f32],
    weights: &[f32],
    temperature: f64,
    with_grad: bool,
) -> (f32, Vec<f32>) {
    let rows = weights.len().max(1);
    let classes = s.len() / rows;
    let total = weights.iter().map(|&w| w as f64).sum::<f64>().max(1e-12);
    let inv_t = (1.0 / temperature) as f32;
    let mut grad = if with_grad { vec![0f32; s.len()] } else { Vec::new() };
    let row_klds: Vec<f32> = if with_grad {
        grad.par_chunks_mut(classes.max(1))
            .zip(s.par_chunks(classes.max(1)).zip(t.par_chunks(classes.max(1))))
            .zip(weights.par_iter())
            .map(|((g, (s, t)), &w)| {
                let scale = (temperature * w as f64 / total) as f32;
                if w == 0.0 {
                    g.iter_mut().for_each(|g| *g = 0.0);
                    return 0.0;
                }
                kl_row(g, s, t, inv_t, scale)
            })
            .collect()
    } else {
        s.par_chunks(classes.max(1))
            .zip(t.par_chunks(classes.max(1)))
            .zip(weights.par_iter())
            .map(|((s, t), &w)| if w == 0.0 { 0.0 } else { kl_row(&mut [], s, t, inv_t, 0.0) })
            .collect()
    };
    let sum: f64 = row_klds.iter().zip(weights).map(|(&kl, &w)| kl as f64 * w as f64).sum();
    let loss = (sum / total * temperature * temperature) as f32;
    (loss, grad)
}
