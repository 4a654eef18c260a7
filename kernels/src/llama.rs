//! The decoder layer's own fused ops: RMSNorm, SwiGLU's gated product,
//! grouped-query causal attention with rotary positions, and the KL of two
//! score tables ([`FusedBackend::rms_norm`], [`FusedBackend::swiglu`],
//! [`FusedBackend::causal_attention`], [`FusedBackend::weighted_kl_loss`]),
//! their burn-op references (the default on any backend without a native
//! path, and what the tests and `pipebd kernels --check` compare against)
//! and the functions the decoder layer calls.
//!
//! The references' backward passes are the gradient formulas in burn ops
//! (never a nested autodiff pass: they run inside one, where a second
//! `backward()` would wait on the graph's lock); `pipebd kernels --check`
//! and the tests hold them and the native paths to burn's autodiff of the
//! reference forward.
//!
//! Heads stay side by side in the projections' layout `[batch, tokens,
//! heads * head_dim]`; each key/value head serves `heads / kv_heads`
//! consecutive query heads; rotary positions turn adjacent pairs
//! `(x[2i], x[2i+1])` by `pos * base^(-2i / head_dim)` (GGUF's layout).

use burn::nn::RmsNorm;
use burn::tensor::activation::{silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorData};

use crate::reference::{unwrap, wrap};
use crate::transformer::MASKED_SCORE;
use crate::FusedBackend;

/// What [`FusedBackend::rms_norm`] returns.
#[derive(Debug)]
pub struct RmsNormOutput<B: Backend> {
    /// The normalised rows, `[rows, hidden]`.
    pub output: FloatTensor<B>,
    /// `1 / sqrt(mean(x^2) + eps)` per row (`[rows]`), when asked for
    /// (what the backward needs besides the input).
    pub rstd: Option<FloatTensor<B>>,
}

/// What [`FusedBackend::causal_attention`] returns.
#[derive(Debug)]
pub struct CausalAttentionOutput<B: Backend> {
    /// The attention output `[batch, tokens, heads * head_dim]`.
    pub context: FloatTensor<B>,
    /// The weights `[batch, heads, tokens, tokens]`, when asked for.
    pub probs: Option<FloatTensor<B>>,
}

/// The head layout of a causal attention call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CausalHeads {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (`heads` is a multiple of them).
    pub kv_heads: usize,
    /// Base of the rotary angles.
    pub rope_base: f64,
}

/// [`FusedBackend::rms_norm`] with burn ops, as burn's `RmsNorm`.
pub fn rms_norm_reference<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    epsilon: f64,
    with_rstd: bool,
) -> RmsNormOutput<B> {
    let x = wrap::<B, 2>(x);
    let [rows, _] = x.dims();
    let rstd = (x.clone().square().mean_dim(1) + epsilon).sqrt().recip();
    let output = x * rstd.clone() * wrap::<B, 1>(gamma).unsqueeze_dim(0);
    RmsNormOutput { output: unwrap(output), rstd: with_rstd.then(|| unwrap(rstd.reshape([rows]))) }
}

/// [`FusedBackend::rms_norm_backward`] in burn ops: the gradients of `x`
/// and of `gamma` (`n = x * rstd`; `dx = rstd (g gamma - n mean(g gamma n))`,
/// `dgamma = sum over rows of g n`).
pub fn rms_norm_backward_reference<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    epsilon: f64,
    grad: FloatTensor<B>,
) -> [FloatTensor<B>; 2] {
    let (x, grad) = (wrap::<B, 2>(x), wrap::<B, 2>(grad));
    let [_, hidden] = x.dims();
    let rstd = (x.clone().square().mean_dim(1) + epsilon).sqrt().recip();
    let normalized = x * rstd.clone();
    let scaled = grad.clone() * wrap::<B, 1>(gamma).unsqueeze_dim(0);
    let projection = (scaled.clone() * normalized.clone()).mean_dim(1);
    let dx = (scaled - normalized.clone() * projection) * rstd;
    let dgamma = (grad * normalized).sum_dim(0).reshape([hidden]);
    [unwrap(dx), unwrap(dgamma)]
}

/// [`FusedBackend::swiglu`] with burn ops: `SiLU(gate) * up`.
pub fn swiglu_reference<B: Backend>(gate: FloatTensor<B>, up: FloatTensor<B>) -> FloatTensor<B> {
    unwrap(silu(wrap::<B, 2>(gate)) * wrap::<B, 2>(up))
}

/// [`FusedBackend::swiglu_backward`] in burn ops: `[dgate, dup]`
/// (`SiLU'(g) = sigmoid(g) (1 + g (1 - sigmoid(g)))`).
pub fn swiglu_backward_reference<B: Backend>(
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> [FloatTensor<B>; 2] {
    let (gate, up, grad) = (wrap::<B, 2>(gate), wrap::<B, 2>(up), wrap::<B, 2>(grad));
    let sigmoid = burn::tensor::activation::sigmoid(gate.clone());
    let dup = grad.clone() * gate.clone() * sigmoid.clone();
    let slope = sigmoid.clone() * (gate * (sigmoid.neg() + 1.0) + 1.0);
    [unwrap(grad * up * slope), unwrap(dup)]
}

/// `[tokens, head_dim / 2]` cosines and sines of the rotary angles `pos *
/// base^(-2i / head_dim)` (angles in f64): the one table every backend's
/// attention reads.
pub(crate) fn rope_table(tokens: usize, head_dim: usize, base: f64) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let angle = |pi: usize| (pi / half) as f64 * base.powf(-2.0 * (pi % half) as f64 / head_dim as f64);
    let cos = (0..tokens * half).map(|pi| angle(pi).cos() as f32).collect();
    let sin = (0..tokens * half).map(|pi| angle(pi).sin() as f32).collect();
    (cos, sin)
}

/// [`rope_table`] as `[1, 1, tokens, head_dim / 2, 1]` tensors.
fn rope_tables<B: Backend>(
    tokens: usize,
    head_dim: usize,
    base: f64,
    device: &B::Device,
) -> (Tensor<B, 5>, Tensor<B, 5>) {
    let half = head_dim / 2;
    let (cos, sin) = rope_table(tokens, head_dim, base);
    let table =
        |values: Vec<f32>| Tensor::from_data(TensorData::new(values, [1, 1, tokens, half, 1]), device);
    (table(cos), table(sin))
}

/// Rotates the adjacent pairs of `x` `[batch, heads, tokens, head_dim]`.
fn rotate<B: Backend>(x: Tensor<B, 4>, cos: &Tensor<B, 5>, sin: &Tensor<B, 5>) -> Tensor<B, 4> {
    let [batch, heads, tokens, d] = x.dims();
    let pairs = x.reshape([batch, heads, tokens, d / 2, 2]);
    let (even, odd) = (pairs.clone().narrow(4, 0, 1), pairs.narrow(4, 1, 1));
    let rotated = Tensor::cat(
        vec![even.clone() * cos.clone() - odd.clone() * sin.clone(), even * sin.clone() + odd * cos.clone()],
        4,
    );
    rotated.reshape([batch, heads, tokens, d])
}

/// Added to the scores of keys after the query: far below
/// [`MASKED_SCORE`], so that a query none of whose keys up to itself is
/// real attends uniformly to those keys (never to later ones).
const FUTURE_SCORE: f32 = -1.0e30;

/// [`rotate`] backwards (by minus each angle): the transpose of the
/// rotation, which carries a gradient from the rotated pairs to the pairs.
fn rotate_back<B: Backend>(x: Tensor<B, 4>, cos: &Tensor<B, 5>, sin: &Tensor<B, 5>) -> Tensor<B, 4> {
    rotate(x, cos, &sin.clone().neg())
}

/// `[tokens, tokens]`: 0 where key `j <= i` may be seen by query `i`,
/// [`FUTURE_SCORE`] above the diagonal.
fn causal_bias<B: Backend>(tokens: usize, device: &B::Device) -> Tensor<B, 2> {
    let values: Vec<f32> =
        (0..tokens * tokens).map(|ij| if ij % tokens > ij / tokens { FUTURE_SCORE } else { 0.0 }).collect();
    Tensor::from_data(TensorData::new(values, [tokens, tokens]), device)
}

/// The reference attention on tensors: the weights and the context.
fn causal_attention_tensors<B: Backend>(
    [q, k, v]: [Tensor<B, 3>; 3],
    mask: Tensor<B, 2>,
    layout: CausalHeads,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let CausalHeads { heads, kv_heads, rope_base } = layout;
    let [batch, tokens, width] = q.dims();
    let d = width / heads.max(1);
    let device = q.device();
    let split = |x: Tensor<B, 3>, count: usize| x.reshape([batch, tokens, count, d]).swap_dims(1, 2);
    let (cos, sin) = rope_tables::<B>(tokens, d, rope_base, &device);
    let q = rotate(split(q, heads), &cos, &sin);
    let k = rotate(split(k, kv_heads), &cos, &sin);
    let v = split(v, kv_heads);
    let group = heads / kv_heads.max(1);
    let widen =
        |x: Tensor<B, 4>| x.unsqueeze_dim::<5>(2).repeat_dim(2, group).reshape([batch, heads, tokens, d]);
    let (k, v) = (widen(k), widen(v));
    let scores = q.matmul(k.swap_dims(2, 3)) / (d as f64).sqrt();
    let bias = causal_bias::<B>(tokens, &device).reshape([1, 1, tokens, tokens])
        + (mask - 1.0).reshape([batch, 1, 1, tokens]) * (-MASKED_SCORE as f64);
    let probs = softmax(scores + bias, 3);
    let context = probs.clone().matmul(v).swap_dims(1, 2).reshape([batch, tokens, heads * d]);
    (probs, context)
}

/// [`FusedBackend::causal_attention`] with burn ops.
pub fn causal_attention_reference<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    mask: FloatTensor<B>,
    layout: CausalHeads,
    with_probs: bool,
) -> CausalAttentionOutput<B> {
    let (probs, context) = causal_attention_tensors::<B>([wrap(q), wrap(k), wrap(v)], wrap(mask), layout);
    CausalAttentionOutput { context: unwrap(context), probs: with_probs.then(|| unwrap(probs)) }
}

/// [`FusedBackend::causal_attention_backward`] in burn ops from the
/// weights `probs` of the forward: `[dq, dk, dv]`. With `Q`, `K` rotated and
/// `K`, `V` widened to every query head: `dV = P^T dO`, `dS = P (dO V^T -
/// rowsum(dO V^T P)) / sqrt(d)`, `dQ = dS K`, `dK = dS^T Q`; the widened
/// gradients summed over each key/value head's group, then rotated back.
pub fn causal_attention_backward_reference<B: Backend>(
    qkv: [FloatTensor<B>; 3],
    mask: FloatTensor<B>,
    probs: FloatTensor<B>,
    grad: FloatTensor<B>,
    layout: CausalHeads,
) -> [FloatTensor<B>; 3] {
    let _ = mask; // The weights already hold the masks.
    let CausalHeads { heads, kv_heads, rope_base } = layout;
    let [q, k, v] = qkv.map(wrap::<B, 3>);
    let [batch, tokens, width] = q.dims();
    let (d, group) = (width / heads.max(1), heads / kv_heads.max(1));
    let device = q.device();
    let split = |x: Tensor<B, 3>, count: usize| x.reshape([batch, tokens, count, d]).swap_dims(1, 2);
    let merge = |x: Tensor<B, 4>| {
        let count = x.dims()[1];
        x.swap_dims(1, 2).reshape([batch, tokens, count * d])
    };
    let widen =
        |x: Tensor<B, 4>| x.unsqueeze_dim::<5>(2).repeat_dim(2, group).reshape([batch, heads, tokens, d]);
    let narrow = |x: Tensor<B, 4>| {
        x.reshape([batch, kv_heads, group, tokens, d]).sum_dim(2).reshape([batch, kv_heads, tokens, d])
    };
    let (cos, sin) = rope_tables::<B>(tokens, d, rope_base, &device);
    let q = rotate(split(q, heads), &cos, &sin);
    let k = widen(rotate(split(k, kv_heads), &cos, &sin));
    let v = widen(split(v, kv_heads));
    let (probs, grad) = (wrap::<B, 4>(probs), split(wrap(grad), heads));
    let dv = probs.clone().swap_dims(2, 3).matmul(grad.clone());
    let dp = grad.matmul(v.swap_dims(2, 3));
    let row = (dp.clone() * probs.clone()).sum_dim(3);
    let ds = (probs * (dp - row)) / (d as f64).sqrt();
    let dq = ds.clone().matmul(k);
    let dk = ds.swap_dims(2, 3).matmul(q);
    let dq = rotate_back(dq, &cos, &sin);
    let dk = rotate_back(narrow(dk), &cos, &sin);
    [unwrap(merge(dq)), unwrap(merge(dk)), unwrap(merge(narrow(dv)))]
}

pub use crate::loss::weighted_kl_reference;

/// RMSNorm of `[rows, hidden]` rows by `norm` (its scale and epsilon), one
/// pass forward and one backward where the backend has a native path.
pub fn rms_norm<B: FusedBackend>(x: Tensor<B, 2>, norm: &RmsNorm<B>) -> Tensor<B, 2> {
    let out = B::rms_norm(unwrap(x), unwrap(norm.gamma.val()), norm.epsilon, false);
    wrap(out.output)
}

/// `SiLU(gate) * up` for `[rows, ffn]` projections.
pub fn swiglu<B: FusedBackend>(gate: Tensor<B, 2>, up: Tensor<B, 2>) -> Tensor<B, 2> {
    wrap(B::swiglu(unwrap(gate), unwrap(up)))
}

/// Grouped-query causal attention with rotary positions: `q` `[batch,
/// tokens, heads * head_dim]`, `k` and `v` `[batch, tokens, kv_heads *
/// head_dim]`, `mask` `[batch, tokens]` (1 for real tokens). Each token
/// attends to the real tokens up to itself. Returns `[batch, tokens, heads
/// * head_dim]`.
pub fn causal_attention<B: FusedBackend>(
    [q, k, v]: [Tensor<B, 3>; 3],
    mask: Tensor<B, 2>,
    layout: CausalHeads,
) -> Tensor<B, 3> {
    let out = B::causal_attention(unwrap(q), unwrap(k), unwrap(v), unwrap(mask), layout, false);
    wrap(out.context)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::Distribution;

    #[test]
    fn rotation_keeps_norms_and_relative_positions() {
        let device = Default::default();
        let (cos, sin) = rope_tables::<Flex>(5, 8, 100.0, &device);
        let x = Tensor::<Flex, 4>::random([1, 1, 5, 8], Distribution::Normal(0.0, 1.0), &device);
        let r = rotate(x.clone(), &cos, &sin);
        let norm = |t: Tensor<Flex, 4>| t.square().sum_dim(3);
        let gap: f32 = (norm(x.clone()) - norm(r.clone())).abs().max().into_scalar();
        assert!(gap < 1e-4, "rotation changed a norm by {gap}");
        // Position 0 is not rotated; pair (0, 1) at position 1 turns by 1 radian.
        let first: f32 = (x.clone().narrow(2, 0, 1) - r.clone().narrow(2, 0, 1)).abs().max().into_scalar();
        assert!(first < 1e-6);
        let v: Vec<f32> = x.narrow(2, 1, 1).into_data().iter::<f32>().collect();
        let w: Vec<f32> = r.narrow(2, 1, 1).into_data().iter::<f32>().collect();
        let (c, s) = (1f32.cos(), 1f32.sin());
        assert!((w[0] - (v[0] * c - v[1] * s)).abs() < 1e-5);
        assert!((w[1] - (v[0] * s + v[1] * c)).abs() < 1e-5);
    }

    type Prim = FloatTensor<Flex>;
    type Ad = burn::backend::Autodiff<Flex>;

    /// burn's autodiff of `f` at `inputs`: the gradients of `sum(f * grad)`.
    fn autodiff_grads<const N: usize, const D: usize>(
        inputs: [Prim; N],
        grad: Prim,
        f: impl FnOnce([Tensor<Ad, D>; N]) -> Tensor<Ad, D>,
    ) -> [Prim; N] {
        let tracked = inputs.map(|t| Tensor::<Ad, D>::from_inner(wrap(t)).require_grad());
        let output = f(tracked.clone());
        let grads = (output * Tensor::from_inner(wrap(grad))).sum().backward();
        tracked.map(|t| unwrap(t.grad(&grads).unwrap()))
    }

    fn random(shape: &[usize], scale: f64) -> Prim {
        let t = Tensor::<Flex, 1>::random(
            [shape.iter().product::<usize>()],
            Distribution::Normal(0.0, scale),
            &Default::default(),
        );
        unwrap(t).reshape_like(shape)
    }

    trait ReshapeLike {
        fn reshape_like(self, shape: &[usize]) -> Prim;
    }

    impl ReshapeLike for Prim {
        fn reshape_like(self, shape: &[usize]) -> Prim {
            <Flex as burn::tensor::ops::FloatTensorOps<Flex>>::float_reshape(self, shape.to_vec().into())
        }
    }

    fn host(t: &Prim) -> Vec<f32> {
        wrap::<Flex, 1>(t.clone().reshape_like(&[burn::tensor::TensorMetadata::shape(t).num_elements()]))
            .into_data()
            .iter::<f32>()
            .collect()
    }

    /// The largest gap between `a` and `b` relative to `b`'s largest value.
    fn relative_gap(what: &str, a: &Prim, b: &Prim) -> f32 {
        let (a, b) = (host(a), host(b));
        assert_eq!(a.len(), b.len(), "{what}: sizes differ");
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
        let gap = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(a.iter().all(|v| v.is_finite()), "{what}: a value is not finite");
        gap / scale
    }

    fn assert_close(what: &str, a: &Prim, b: &Prim, tolerance: f32) {
        let gap = relative_gap(what, a, b);
        assert!(gap <= tolerance, "{what}: relative gap {gap} > {tolerance}");
    }

    #[test]
    fn native_rms_norm_matches_the_reference_forward_and_backward() {
        // 37 rows: the native path's groups of 32 rows end in a short one.
        let (x, gamma, grad) = (random(&[37, 24], 3.0), random(&[24], 1.0), random(&[37, 24], 1.0));
        let native = <Flex as FusedBackend>::rms_norm(x.clone(), gamma.clone(), 1e-5, true);
        let reference = rms_norm_reference::<Flex>(x.clone(), gamma.clone(), 1e-5, true);
        assert_close("rms_norm", &native.output, &reference.output, 1e-6);
        assert_close("rms_norm rstd", native.rstd.as_ref().unwrap(), reference.rstd.as_ref().unwrap(), 1e-6);
        let rstd = native.rstd.unwrap();
        let ours =
            <Flex as FusedBackend>::rms_norm_backward(x.clone(), rstd, gamma.clone(), 1e-5, grad.clone());
        let formula = rms_norm_backward_reference::<Flex>(x.clone(), gamma.clone(), 1e-5, grad.clone());
        let gamma_row = gamma.reshape_like(&[1, 24]);
        let [dx, dgamma] = autodiff_grads([x, gamma_row], grad, |[x, gamma]: [Tensor<Ad, 2>; 2]| {
            wrap(rms_norm_reference::<Ad>(unwrap(x), unwrap(gamma.reshape([24])), 1e-5, false).output)
        });
        let dgamma = dgamma.reshape_like(&[24]);
        for (name, grads) in [("native", &ours), ("formula", &formula)] {
            assert_close(&format!("rms_norm dx, {name}"), &grads[0], &dx, 1e-5);
            assert_close(&format!("rms_norm dgamma, {name}"), &grads[1], &dgamma, 1e-5);
        }
    }

    #[test]
    fn native_swiglu_matches_the_reference_forward_and_backward() {
        // Gates far into both tails of the sigmoid.
        let (gate, up, grad) = (random(&[9, 1000], 12.0), random(&[9, 1000], 1.0), random(&[9, 1000], 1.0));
        let native = <Flex as FusedBackend>::swiglu(gate.clone(), up.clone());
        assert_close("swiglu", &native, &swiglu_reference::<Flex>(gate.clone(), up.clone()), 1e-6);
        let ours = <Flex as FusedBackend>::swiglu_backward(gate.clone(), up.clone(), grad.clone());
        let formula = swiglu_backward_reference::<Flex>(gate.clone(), up.clone(), grad.clone());
        let theirs = autodiff_grads([gate, up], grad, |[gate, up]: [Tensor<Ad, 2>; 2]| {
            wrap(swiglu_reference::<Ad>(unwrap(gate), unwrap(up)))
        });
        for (name, grads) in [("native", &ours), ("formula", &formula)] {
            assert_close(&format!("swiglu dgate, {name}"), &grads[0], &theirs[0], 1e-5);
            assert_close(&format!("swiglu dup, {name}"), &grads[1], &theirs[1], 1e-5);
        }
    }

    /// Four sequences of 7 tokens: all real, 3 real then padding, a real
    /// token after padding, and padding only.
    fn padded_mask() -> Prim {
        let rows = [
            [1.0f32, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0],
            [0.0; 7],
        ];
        let values: Vec<f32> = rows.iter().flatten().copied().collect();
        unwrap(Tensor::<Flex, 2>::from_data(TensorData::new(values, [4, 7]), &Default::default()))
    }

    #[test]
    fn native_causal_attention_matches_the_reference_forward_and_backward() {
        for (heads, kv_heads) in [(6, 2), (3, 3), (4, 1)] {
            let layout = CausalHeads { heads, kv_heads, rope_base: 100.0 };
            let d = 8;
            let q = random(&[4, 7, heads * d], 1.5);
            let (k, v) = (random(&[4, 7, kv_heads * d], 1.5), random(&[4, 7, kv_heads * d], 1.0));
            let mask = padded_mask();
            let what = format!("{heads} heads over {kv_heads}");
            let native = <Flex as FusedBackend>::causal_attention(
                q.clone(),
                k.clone(),
                v.clone(),
                mask.clone(),
                layout,
                true,
            );
            let reference = causal_attention_reference::<Flex>(
                q.clone(),
                k.clone(),
                v.clone(),
                mask.clone(),
                layout,
                true,
            );
            assert_close(&format!("{what}: context"), &native.context, &reference.context, 1e-5);
            let (probs, reference_probs) = (native.probs.unwrap(), reference.probs.unwrap());
            assert_close(&format!("{what}: probs"), &probs, &reference_probs, 1e-5);
            let grad = random(&[4, 7, heads * d], 1.0);
            let qkv = [q, k, v];
            let ours = <Flex as FusedBackend>::causal_attention_backward(
                qkv.clone(),
                mask.clone(),
                probs,
                grad.clone(),
                layout,
            );
            let formula = causal_attention_backward_reference::<Flex>(
                qkv.clone(),
                mask.clone(),
                reference_probs,
                grad.clone(),
                layout,
            );
            let theirs = autodiff_grads(qkv, grad, |[q, k, v]: [Tensor<Ad, 3>; 3]| {
                let mask = unwrap(Tensor::<Ad, 2>::from_inner(wrap(mask.clone())));
                let out =
                    causal_attention_reference::<Ad>(unwrap(q), unwrap(k), unwrap(v), mask, layout, false);
                wrap(out.context)
            });
            for (kind, grads) in [("native", &ours), ("formula", &formula)] {
                for (name, (a, b)) in ["dq", "dk", "dv"].iter().zip(grads.iter().zip(&theirs)) {
                    assert_close(&format!("{what}: {name}, {kind}"), a, b, 1e-4);
                }
            }
        }
    }

    #[test]
    fn native_weighted_kl_matches_the_reference_with_its_gradient() {
        // Rows of 1,003 classes (not a multiple of the 8 lanes), two weighted 0.
        let (s, t) = (random(&[6, 1003], 4.0), random(&[6, 1003], 4.0));
        let weights =
            unwrap(Tensor::<Flex, 1>::from_floats([1.0, 0.0, 2.0, 1.0, 0.0, 0.5], &Default::default()));
        for temperature in [1.0, 2.5] {
            let native = <Flex as FusedBackend>::weighted_kl_loss(
                s.clone(),
                t.clone(),
                weights.clone(),
                temperature,
                true,
            );
            let reference =
                weighted_kl_reference::<Flex>(s.clone(), t.clone(), weights.clone(), temperature, true);
            assert_close("kl", &native.loss, &reference.loss, 1e-5);
            assert_close("kl grad", native.grad.as_ref().unwrap(), reference.grad.as_ref().unwrap(), 1e-5);
            // The gradient is the loss's: a finite difference along it agrees.
            let g = native.grad.unwrap();
            let step = 1e-2 / host(&g).iter().map(|v| v * v).sum::<f32>().sqrt();
            let moved = unwrap(wrap::<Flex, 2>(s.clone()) + wrap::<Flex, 2>(g.clone()).mul_scalar(step));
            let after = <Flex as FusedBackend>::weighted_kl_loss(
                moved,
                t.clone(),
                weights.clone(),
                temperature,
                false,
            );
            let (before, after) = (host(&native.loss)[0], host(&after.loss)[0]);
            let expected = step * host(&g).iter().map(|v| v * v).sum::<f32>();
            assert!(
                ((after - before) - expected).abs() < 0.05 * expected.abs(),
                "KL moved by {} along its gradient, expected {expected}",
                after - before
            );
        }
    }
}
