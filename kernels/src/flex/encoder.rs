//! Native CPU paths of the encoder layer's ops on flex
//! ([`crate::transformer`]): masked attention with every head of a sequence
//! in one task (scores, softmax and the weighted sum of values while a
//! sequence's keys and values are in cache; no split or merge copies), and
//! the residual add with its layer norm in one pass over each row, each with
//! its backward. Sequences (attention) and fixed groups of rows (layer norm)
//! run in parallel on the calling thread's rayon pool, in a partition that
//! does not depend on the number of threads.

use rayon::prelude::*;

use super::gemm::{dot, exp_fast, gemm_into, Matrix};
use crate::transformer::MASKED_SCORE;

/// Sizes of one attention call: `[batch, tokens, heads * head_dim]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionSizes {
    pub batch: usize,
    pub tokens: usize,
    pub heads: usize,
    pub head_dim: usize,
}

impl AttentionSizes {
    fn width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Values of one sequence in `[tokens, heads * head_dim]`.
    fn sequence(&self) -> usize {
        self.tokens * self.width()
    }

    /// Attention weights of one sequence, `[heads, tokens, tokens]`.
    fn sequence_probs(&self) -> usize {
        self.heads * self.tokens * self.tokens
    }
}

/// The sum of `values` in eight interleaved lanes (vectorised; a fixed order).
#[inline(always)]
fn lane_sum(values: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = values.chunks_exact(8);
    let rest: f32 = chunks.remainder().iter().sum();
    for chunk in chunks {
        for i in 0..8 {
            lanes[i] += chunk[i];
        }
    }
    lanes.iter().sum::<f32>() + rest
}

/// `dst += alpha * src`.
#[inline(always)]
fn axpy(dst: &mut [f32], alpha: f32, src: &[f32]) {
    dst.iter_mut().zip(src).for_each(|(d, s)| *d += alpha * s);
}

/// Row `t`, head `h` of a sequence's `[tokens, heads * head_dim]` values.
#[inline(always)]
fn head_row(sizes: AttentionSizes, t: usize, h: usize) -> std::ops::Range<usize> {
    let start = t * sizes.width() + h * sizes.head_dim;
    start..start + sizes.head_dim
}

/// Softmax of one row in place (the max subtracted first, as burn's).
#[inline(always)]
fn softmax_row(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    row.iter_mut().for_each(|v| *v = exp_fast(*v - max));
    let sum = lane_sum(row);
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|v| *v *= inv);
}

/// Head `h` of a sequence's `[tokens, heads * head_dim]` values as a
/// `[tokens, head_dim]` matrix (rows `heads * head_dim` apart).
fn head(values: &[f32], sizes: AttentionSizes, h: usize) -> Matrix<'_> {
    Matrix {
        data: values,
        offset: h * sizes.head_dim,
        rows: sizes.tokens,
        cols: sizes.head_dim,
        row_stride: sizes.width(),
        col_stride: 1,
    }
}

/// `dst = lhs @ rhs` on this thread (the caller runs sequences in parallel).
fn product(dst: &mut [f32], lhs: Matrix, rhs: Matrix) {
    gemm_into(dst, lhs, rhs, false, gemm::Parallelism::None);
}

/// Copies a dense `[tokens, head_dim]` block into head `h` of `[tokens,
/// heads * head_dim]` values.
fn scatter_head(dst: &mut [f32], block: &[f32], sizes: AttentionSizes, h: usize) {
    for (t, row) in block.chunks(sizes.head_dim).enumerate() {
        dst[head_row(sizes, t, h)].copy_from_slice(row);
    }
}

wide! {
/// Scales and masks the scores of one head (`[tokens, tokens]`) and turns
/// each row into its softmax.
fn scores_to_probs(scores: &mut [f32], bias: &[f32], scale: f32) {
    for row in scores.chunks_mut(bias.len().max(1)) {
        row.iter_mut().zip(bias).for_each(|(s, b)| *s = *s * scale + b);
        softmax_row(row);
    }
}
}

/// One sequence's attention: `context` and, when not empty, `probs`
/// (`[heads, tokens, tokens]`) from its `qkv` and `mask`. Per head, the
/// scores `Q K^T` and the weighted values `P V` are matrix products on the
/// heads' strided views.
fn attend_sequence(
    qkv: [&[f32]; 3],
    mask: &[f32],
    sizes: AttentionSizes,
    context: &mut [f32],
    probs: &mut [f32],
) {
    let [q, k, v] = qkv;
    let tokens = sizes.tokens;
    let scale = 1.0 / (sizes.head_dim as f32).sqrt();
    let bias: Vec<f32> = mask.iter().map(|m| (1.0 - m) * MASKED_SCORE).collect();
    let mut own = vec![0f32; if probs.is_empty() { tokens * tokens } else { 0 }];
    let mut block = vec![0f32; tokens * sizes.head_dim];
    for h in 0..sizes.heads {
        let p: &mut [f32] = match probs.is_empty() {
            true => &mut own,
            false => &mut probs[h * tokens * tokens..(h + 1) * tokens * tokens],
        };
        product(p, head(q, sizes, h), head(k, sizes, h).transposed());
        scores_to_probs(p, &bias, scale);
        product(&mut block, Matrix::dense(p, tokens, tokens), head(v, sizes, h));
        scatter_head(context, &block, sizes, h);
    }
}

/// [`crate::FusedBackend::masked_attention`] on contiguous `f32` values:
/// the context and, with `with_probs`, the attention weights.
pub(crate) fn attention(
    [q, k, v]: [&[f32]; 3],
    mask: &[f32],
    sizes: AttentionSizes,
    with_probs: bool,
) -> (Vec<f32>, Vec<f32>) {
    let (seq, seq_probs) = (sizes.sequence(), sizes.sequence_probs());
    let mut context = vec![0f32; sizes.batch * seq];
    let mut probs = if with_probs { vec![0f32; sizes.batch * seq_probs] } else { Vec::new() };
    let probs_chunks: Vec<&mut [f32]> = match with_probs {
        true => probs.chunks_mut(seq_probs.max(1)).collect(),
        false => (0..sizes.batch).map(|_| <&mut [f32]>::default()).collect(),
    };
    context.par_chunks_mut(seq.max(1)).zip(probs_chunks).enumerate().for_each(|(b, (context, probs))| {
        let at = b * seq..(b + 1) * seq;
        let inputs = [&q[at.clone()], &k[at.clone()], &v[at]];
        attend_sequence(inputs, &mask[b * sizes.tokens..(b + 1) * sizes.tokens], sizes, context, probs);
    });
    (context, probs)
}

wide! {
/// `dS = P (dP - rowsum(dP P)) * scale` in place of `dP`, row by row.
fn probs_backward(dp: &mut [f32], p: &[f32], tokens: usize, scale: f32) {
    for (d, p) in dp.chunks_mut(tokens.max(1)).zip(p.chunks(tokens.max(1))) {
        let weighted = dot(d, p);
        d.iter_mut().zip(p).for_each(|(d, p)| *d = p * (*d - weighted) * scale);
    }
}
}

/// One sequence's attention backward into its `dq`, `dk`, `dv`: per head,
/// `dV = P^T dO`, `dP = dO V^T`, then `dQ = dS K` and `dK = dS^T Q`.
fn attend_sequence_backward(
    qkv: [&[f32]; 3],
    probs: &[f32],
    grad: &[f32],
    sizes: AttentionSizes,
    grads: [&mut [f32]; 3],
) {
    let [q, k, v] = qkv;
    let [dq, dk, dv] = grads;
    let tokens = sizes.tokens;
    let scale = 1.0 / (sizes.head_dim as f32).sqrt();
    let mut ds = vec![0f32; tokens * tokens];
    let mut block = vec![0f32; tokens * sizes.head_dim];
    for h in 0..sizes.heads {
        let p = Matrix::dense(&probs[h * tokens * tokens..(h + 1) * tokens * tokens], tokens, tokens);
        product(&mut block, p.transposed(), head(grad, sizes, h));
        scatter_head(dv, &block, sizes, h);
        product(&mut ds, head(grad, sizes, h), head(v, sizes, h).transposed());
        probs_backward(&mut ds, p.data, tokens, scale);
        let ds_matrix = Matrix::dense(&ds, tokens, tokens);
        product(&mut block, ds_matrix, head(k, sizes, h));
        scatter_head(dq, &block, sizes, h);
        product(&mut block, ds_matrix.transposed(), head(q, sizes, h));
        scatter_head(dk, &block, sizes, h);
    }
}

/// [`crate::FusedBackend::masked_attention_backward`] on contiguous `f32`
/// values: `[dq, dk, dv]`.
pub(crate) fn attention_backward(
    [q, k, v]: [&[f32]; 3],
    probs: &[f32],
    grad: &[f32],
    sizes: AttentionSizes,
) -> [Vec<f32>; 3] {
    let (seq, seq_probs) = (sizes.sequence(), sizes.sequence_probs());
    let n = sizes.batch * seq;
    let (mut dq, mut dk, mut dv) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    dq.par_chunks_mut(seq.max(1))
        .zip(dk.par_chunks_mut(seq.max(1)))
        .zip(dv.par_chunks_mut(seq.max(1)))
        .enumerate()
        .for_each(|(b, ((dq, dk), dv))| {
            let at = b * seq..(b + 1) * seq;
            let inputs = [&q[at.clone()], &k[at.clone()], &v[at.clone()]];
            let probs = &probs[b * seq_probs..(b + 1) * seq_probs];
            attend_sequence_backward(inputs, probs, &grad[at], sizes, [dq, dk, dv]);
        });
    [dq, dk, dv]
}

/// Rows per task of the layer norm (fixed: the partial sums of the scale
/// and shift gradients do not depend on the thread count).
const ROWS_PER_TASK: usize = 64;

/// `(mean, 1 / sqrt(var + eps))` of one row (two passes: as burn's reference).
fn row_stats(row: &[f32], epsilon: f64) -> (f32, f32) {
    let n = row.len().max(1) as f32;
    let mean = row.iter().sum::<f32>() / n;
    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    (mean, 1.0 / (var + epsilon as f32).sqrt())
}

/// [`crate::FusedBackend::add_layer_norm`] on contiguous `f32` `[rows,
/// hidden]` values: the output and, with `with_saved`, the sum and each
/// row's `1 / std`.
pub(crate) fn add_layer_norm(
    [x, residual]: [&[f32]; 2],
    [gamma, beta]: [&[f32]; 2],
    epsilon: f64,
    with_saved: bool,
) -> (Vec<f32>, Option<(Vec<f32>, Vec<f32>)>) {
    let hidden = gamma.len().max(1);
    let rows = x.len() / hidden;
    let mut sum: Vec<f32> = vec![0f32; x.len()];
    let mut out = vec![0f32; x.len()];
    let mut rstd = vec![0f32; rows];
    let task = ROWS_PER_TASK * hidden;
    out.par_chunks_mut(task)
        .zip(sum.par_chunks_mut(task))
        .zip(rstd.par_chunks_mut(ROWS_PER_TASK))
        .enumerate()
        .for_each(|(t, ((out, sum), rstd))| {
            let at = t * task..t * task + out.len();
            sum.iter_mut().zip(&x[at.clone()]).zip(&residual[at]).for_each(|((s, a), b)| *s = a + b);
            for ((out, row), r) in out.chunks_mut(hidden).zip(sum.chunks(hidden)).zip(rstd.iter_mut()) {
                let (mean, inv) = row_stats(row, epsilon);
                *r = inv;
                for (((o, v), g), b) in out.iter_mut().zip(row).zip(gamma).zip(beta) {
                    *o = (v - mean) * inv * g + b;
                }
            }
        });
    (out, with_saved.then_some((sum, rstd)))
}

/// [`crate::FusedBackend::add_layer_norm_backward`] on contiguous `f32`
/// values: the gradient of the sum, of `gamma` and of `beta`.
pub(crate) fn add_layer_norm_backward(
    sum: &[f32],
    rstd: &[f32],
    gamma: &[f32],
    grad: &[f32],
) -> [Vec<f32>; 3] {
    let hidden = gamma.len().max(1);
    let task = ROWS_PER_TASK * hidden;
    let mut input = vec![0f32; sum.len()];
    let partials: Vec<(Vec<f32>, Vec<f32>)> = input
        .par_chunks_mut(task)
        .enumerate()
        .map(|(t, input)| {
            let (mut dgamma, mut dbeta) = (vec![0f32; hidden], vec![0f32; hidden]);
            let at = t * task..t * task + input.len();
            let rows = sum[at.clone()].chunks(hidden).zip(grad[at].chunks(hidden));
            let mut normalized = vec![0f32; hidden];
            for ((di, (row, dy)), inv) in input.chunks_mut(hidden).zip(rows).zip(&rstd[t * ROWS_PER_TASK..]) {
                let mean = row.iter().sum::<f32>() / hidden as f32;
                let (mut mean_g, mut mean_gx) = (0.0, 0.0);
                for (j, (v, d)) in row.iter().zip(dy).enumerate() {
                    normalized[j] = (v - mean) * inv;
                    let g = d * gamma[j];
                    mean_g += g;
                    mean_gx += g * normalized[j];
                    dgamma[j] += d * normalized[j];
                    dbeta[j] += d;
                }
                let (mean_g, mean_gx) = (mean_g / hidden as f32, mean_gx / hidden as f32);
                for (j, out) in di.iter_mut().enumerate() {
                    *out = inv * (dy[j] * gamma[j] - mean_g - normalized[j] * mean_gx);
                }
            }
            (dgamma, dbeta)
        })
        .collect();
    let (mut dgamma, mut dbeta) = (vec![0f32; hidden], vec![0f32; hidden]);
    for (g, b) in &partials {
        axpy(&mut dgamma, 1.0, g);
        axpy(&mut dbeta, 1.0, b);
    }
    [input, dgamma, dbeta]
}
