//! The encoder layer's own fused ops: masked multi-head attention and the
//! residual add with its layer norm ([`FusedBackend::masked_attention`],
//! [`FusedBackend::add_layer_norm`]), their burn-op references (the default
//! on any backend without a native path, and what the tests and `pipebd
//! kernels --check` compare against) and the functions the encoder calls.
//!
//! Heads stay side by side in the projections' layout `[batch, tokens,
//! heads * head_dim]`: no split or merge copies around the attention.

use burn::nn::LayerNorm;
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::Tensor;

use crate::reference::{unwrap, wrap};
use crate::FusedBackend;

/// Added to the attention scores of padding keys: their softmax weight
/// underflows to zero (and a sequence of padding only attends uniformly).
pub const MASKED_SCORE: f32 = -1.0e9;

/// What [`FusedBackend::masked_attention`] returns.
#[derive(Debug)]
pub struct AttentionOutput<B: Backend> {
    /// The attention output `[batch, tokens, heads * head_dim]`.
    pub context: FloatTensor<B>,
    /// The attention weights `[batch, heads, tokens, tokens]`, when asked
    /// for (what the backward needs).
    pub probs: Option<FloatTensor<B>>,
}

/// What [`FusedBackend::add_layer_norm`] returns.
#[derive(Debug)]
pub struct LayerNormOutput<B: Backend> {
    /// `LayerNorm(x + residual)`, the input's shape.
    pub output: FloatTensor<B>,
    /// `x + residual` (as `[rows, hidden]`) and `1 / sqrt(var + eps)` per
    /// row (`[rows]`), when asked for (what the backward needs).
    pub saved: Option<(FloatTensor<B>, FloatTensor<B>)>,
}

/// The gradients of [`FusedBackend::add_layer_norm`]: of the sum (so of
/// both `x` and `residual`), of `gamma` and of `beta`.
#[derive(Debug)]
pub struct LayerNormGrads<B: Backend> {
    /// `dL/d(x + residual)`, `[rows, hidden]`.
    pub input: FloatTensor<B>,
    /// `dL/dgamma`, `[hidden]`.
    pub gamma: FloatTensor<B>,
    /// `dL/dbeta`, `[hidden]`.
    pub beta: FloatTensor<B>,
}

/// `[batch, tokens, heads * head_dim]` to `[batch, heads, tokens, head_dim]`.
fn split_heads<B: Backend>(x: Tensor<B, 3>, heads: usize) -> Tensor<B, 4> {
    let [batch, tokens, inner] = x.dims();
    x.reshape([batch, tokens, heads, inner / heads]).swap_dims(1, 2)
}

/// `[batch, heads, tokens, head_dim]` to `[batch, tokens, heads * head_dim]`.
fn merge_heads<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 3> {
    let [batch, heads, tokens, head_dim] = x.dims();
    x.swap_dims(1, 2).reshape([batch, tokens, heads * head_dim])
}

/// [`FusedBackend::masked_attention`] with burn ops: scores `Q K^T /
/// sqrt(head_dim)` plus [`MASKED_SCORE`] on padding keys, softmax, times V.
pub fn attention_reference<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    mask: FloatTensor<B>,
    heads: usize,
    with_probs: bool,
) -> AttentionOutput<B> {
    let (q, k, v) = (split_heads(wrap(q), heads), split_heads(wrap(k), heads), split_heads(wrap(v), heads));
    let mask = wrap::<B, 2>(mask);
    let [batch, _, tokens, head_dim] = q.dims();
    let scale = 1.0 / (head_dim as f32).sqrt();
    let bias = (mask.neg() + 1.0).mul_scalar(MASKED_SCORE).reshape([batch, 1, 1, tokens]);
    let probs = softmax(q.matmul(k.swap_dims(2, 3)).mul_scalar(scale) + bias, 3);
    let context = merge_heads(probs.clone().matmul(v));
    AttentionOutput { context: unwrap(context), probs: with_probs.then(|| unwrap(probs)) }
}

/// [`FusedBackend::masked_attention_backward`] with burn ops.
pub fn attention_backward_reference<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    probs: FloatTensor<B>,
    grad: FloatTensor<B>,
    heads: usize,
) -> [FloatTensor<B>; 3] {
    let (q, k, v) = (split_heads(wrap(q), heads), split_heads(wrap(k), heads), split_heads(wrap(v), heads));
    let (probs, grad) = (wrap::<B, 4>(probs), split_heads(wrap(grad), heads));
    let scale = 1.0 / (q.dims()[3] as f32).sqrt();
    let dv = probs.clone().swap_dims(2, 3).matmul(grad.clone());
    let dp = grad.matmul(v.swap_dims(2, 3));
    let row = (dp.clone() * probs.clone()).sum_dim(3);
    let ds = probs * (dp - row);
    let dq = ds.clone().matmul(k).mul_scalar(scale);
    let dk = ds.swap_dims(2, 3).matmul(q).mul_scalar(scale);
    [unwrap(merge_heads(dq)), unwrap(merge_heads(dk)), unwrap(merge_heads(dv))]
}

/// [`FusedBackend::add_layer_norm`] with burn ops, on `[rows, hidden]`.
pub fn add_layer_norm_reference<B: Backend>(
    x: FloatTensor<B>,
    residual: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    epsilon: f64,
    with_saved: bool,
) -> LayerNormOutput<B> {
    let sum = wrap::<B, 2>(x) + wrap::<B, 2>(residual);
    if !with_saved {
        // The backend's own layer norm (one kernel on some).
        return LayerNormOutput {
            output: B::layer_norm(unwrap(sum), gamma, Some(beta), epsilon),
            saved: None,
        };
    }
    let [rows, _] = sum.dims();
    let centered = sum.clone() - sum.clone().mean_dim(1);
    let rstd = (centered.clone().powi_scalar(2).mean_dim(1) + epsilon).sqrt().recip();
    let output =
        centered * rstd.clone() * wrap::<B, 1>(gamma).unsqueeze_dim(0) + wrap::<B, 1>(beta).unsqueeze_dim(0);
    LayerNormOutput {
        output: unwrap(output),
        saved: with_saved.then(|| (unwrap(sum), unwrap(rstd.reshape([rows])))),
    }
}

/// [`FusedBackend::add_layer_norm_backward`] with burn ops.
pub fn add_layer_norm_backward_reference<B: Backend>(
    sum: FloatTensor<B>,
    rstd: FloatTensor<B>,
    gamma: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> LayerNormGrads<B> {
    let (sum, grad) = (wrap::<B, 2>(sum), wrap::<B, 2>(grad));
    let [rows, hidden] = sum.dims();
    let rstd = wrap::<B, 1>(rstd).reshape([rows, 1]);
    let normalized = (sum.clone() - sum.mean_dim(1)) * rstd.clone();
    let scaled = grad.clone() * wrap::<B, 1>(gamma).unsqueeze_dim(0);
    let projection = (scaled.clone() * normalized.clone()).mean_dim(1);
    let input = (scaled.clone() - scaled.mean_dim(1) - normalized.clone() * projection) * rstd;
    LayerNormGrads {
        input: unwrap(input),
        gamma: unwrap((grad.clone() * normalized).sum_dim(0).reshape([hidden])),
        beta: unwrap(grad.sum_dim(0).reshape([hidden])),
    }
}

/// Multi-head attention of `q`, `k`, `v` (`[batch, tokens, heads *
/// head_dim]`, heads side by side) over the real tokens of `mask`
/// (`[batch, tokens]`, 1 for real tokens, 0 for padding): padding keys get
/// no weight. Returns `[batch, tokens, heads * head_dim]`.
pub fn masked_attention<B: FusedBackend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    mask: Tensor<B, 2>,
    heads: usize,
) -> Tensor<B, 3> {
    let out = B::masked_attention(unwrap(q), unwrap(k), unwrap(v), unwrap(mask), heads, false);
    wrap(out.context)
}

/// `norm(x + residual)` for `[rows, hidden]` inputs, in one pass (and one
/// backward pass), with `norm`'s scale and shift and `epsilon`.
pub fn add_layer_norm<B: FusedBackend>(
    x: Tensor<B, 2>,
    residual: Tensor<B, 2>,
    norm: &LayerNorm<B>,
    epsilon: f64,
) -> Tensor<B, 2> {
    let gamma = norm.gamma.val();
    let beta = match &norm.beta {
        Some(beta) => beta.val(),
        None => gamma.zeros_like(),
    };
    let out = B::add_layer_norm(unwrap(x), unwrap(residual), unwrap(gamma), unwrap(beta), epsilon, false);
    wrap(out.output)
}
