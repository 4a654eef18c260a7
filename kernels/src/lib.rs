//! Distillation losses and fused linear ops for pipe-bd.
//!
//! This crate sits at the bottom of the dependency graph
//! (`kernels <- core <- {teachers, students, engine} <- zoo`). It extends burn's backend with
//! three fused operations, [`FusedBackend`]:
//!
//! - **MSE distillation loss** `mean((s - t)^2)`, computed in one pass that
//!   also writes the gradient `2 (s - t) / n` (no separate backward pass),
//! - **soft-target cross-entropy** of student logits against the teacher's
//!   softmax, with the softmax fused in and the gradient `softmax(s) - p_t`
//!   written by the same pass,
//! - **matmul with an epilogue**: `act(lhs @ rhs + bias)` in one tiled kernel,
//!   `act` in {identity, relu, relu6, gelu}; linear layers and the students'
//!   pointwise (1x1) convolutions use it ([`linear`], [`pointwise_conv`]),
//! - **the encoder layer's ops** ([`transformer`]): masked multi-head
//!   attention on the projections' own layout, and the residual add with its
//!   layer norm, each one pass forward and one backward on the CPU,
//! - **the decoder layer's ops** ([`llama`]): RMSNorm, SwiGLU's gated
//!   product, grouped-query causal attention with rotary positions, and
//!   the KL of two score tables (an LM head's), each one pass forward and
//!   one backward on the CPU,
//! - **layers built on these ops**: the post-LN encoder layer of BERT
//!   ([`encoder`]) and the pre-norm Llama decoder layer ([`decoder`]:
//!   RMSNorm, rotary positions, grouped-query causal attention, SwiGLU),
//!   shared by teachers and students,
//! - **convolutions** with their epilogue and 2x2 max-pool, and **one
//!   optimizer update over a whole block** (Adam, SGD).
//!
//! Every backend gets the ops: burn's CubeCL backends (wgpu, cuda) run our
//! CubeCL kernels (module `cube`, feature `cubecl`), `Autodiff<B>` adds the
//! custom backward, and any other backend (flex, the CPU default) falls back to
//! ordinary burn ops ([`reference`]), which are also what the tests and the
//! benchmark compare the kernels against.
//!
//! Three modules are folders whose `mod.rs` holds the entry points (a
//! backend's `impl`, or the public functions) and depends on its leaf
//! modules, which depend only on the shared modules beneath them, never
//! back up: `cube/` (the CubeCL kernels: matmul, dense and depthwise
//! convolutions, pooling, the optimizer update, over `common.rs` and the
//! convolutions' `geometry.rs`), `flex/` (the native CPU paths on burn's
//! flex backend, over `epilogue.rs` and `gemm.rs`) and [`check`] (the
//! correctness checks by subject, over `common.rs`).
//!
//! # Feature flags
//! - `wgpu`: the kernels on burn's wgpu backend (also Mesa's software Vulkan).
//! - `cuda`: the kernels on burn's CUDA backend.
//! - `cubecl`: the kernels for any CubeCL runtime (implied by the two above).
#![warn(missing_docs)]

#[macro_use]
mod wide;
mod autodiff;
pub mod bench;
pub mod check;
#[cfg(feature = "cubecl")]
mod cube;
pub mod decoder;
pub mod encoder;
mod flex;
pub mod llama;
pub mod loss;
pub mod optim;
pub mod reference;
pub mod token_layer;
pub mod transformer;

use burn::nn::conv::Conv2d;
use burn::nn::PaddingConfig2d;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::{ConvOptions, FloatTensor, IntTensor};
use burn::tensor::{Tensor, TensorMetadata, TensorPrimitive};

pub use optim::{AdamRule, ParamSlot, ParamState, ParamUpdate, SgdMomentum, SgdRule, UpdateRule};
pub use token_layer::TokenLayer;

/// The activation applied in the epilogue of a fused matmul.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// No activation.
    Identity,
    /// `max(x, 0)`.
    Relu,
    /// `min(max(x, 0), 6)`.
    Relu6,
    /// The exact (erf) GELU, as burn's `gelu`.
    Gelu,
}

impl Epilogue {
    /// Every epilogue, for tests and benchmarks.
    pub const ALL: [Epilogue; 4] = [Epilogue::Identity, Epilogue::Relu, Epilogue::Relu6, Epilogue::Gelu];

    /// Lower-case name, as printed in tables.
    pub fn name(self) -> &'static str {
        match self {
            Epilogue::Identity => "identity",
            Epilogue::Relu => "relu",
            Epilogue::Relu6 => "relu6",
            Epilogue::Gelu => "gelu",
        }
    }
}

/// Which axis of a fused matmul's `[z, m, n]` output a bias vector runs along.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BiasAxis {
    /// One bias per output row (`m`): the channel bias of a pointwise conv.
    Rows,
    /// One bias per output column (`n`): the bias of a linear layer.
    Cols,
}

/// A loss value (shape `[1]`) and, when asked for, its gradient with respect
/// to the student tensor (same shape as the student).
#[derive(Debug)]
pub struct LossWithGrad<B: Backend> {
    /// The loss, shape `[1]`.
    pub loss: FloatTensor<B>,
    /// `d loss / d student`, when requested.
    pub grad: Option<FloatTensor<B>>,
}

/// A burn backend with pipe-bd's fused distillation ops.
///
/// The default methods are the unfused burn-op versions ([`reference`]), so a
/// backend without kernels implements this trait with an empty `impl` block.
/// CubeCL backends override them with our kernels; `Autodiff<B>` overrides them
/// to record a custom backward.
pub trait FusedBackend: Backend {
    /// Whether [`conv2d_pool`](FusedBackend::conv2d_pool) is one fused pass
    /// on this backend; where it is not, [`conv2d_layer_pool`] composes the
    /// layer's best unpooled path with [`max_pool2x2`] instead.
    const FUSED_CONV_POOL: bool = false;

    /// Whether the device runs asynchronously from the host, with memory of
    /// its own (a GPU, or wgpu over a software driver): reading a value back
    /// then waits for everything queued before it. The engine keeps the
    /// training data on such a device and reads the losses back once every
    /// `log_every` steps instead of after every step.
    const ASYNC_DEVICE: bool = false;

    /// Whether [`optimizer_step`](FusedBackend::optimizer_step) updates many
    /// tensors in one pass here; where it does not, the engine steps with
    /// burn's own optimizers (the same rule, one tensor at a time).
    const FUSED_OPTIMIZER: bool = false;

    /// `mean((student - teacher)^2)` over all elements; with `with_grad`, also
    /// `2 (student - teacher) / n`. Both tensors have the same shape.
    fn mse_loss(
        student: FloatTensor<Self>,
        teacher: FloatTensor<Self>,
        with_grad: bool,
    ) -> LossWithGrad<Self> {
        reference::mse_with_grad::<Self>(student, teacher, with_grad)
    }

    /// Soft-target cross-entropy `-sum(softmax(t) * log_softmax(s)) / batch`
    /// of `[batch, classes]` logits; with `with_grad`, also
    /// `(softmax(s) - softmax(t)) / batch`.
    fn soft_target_ce_loss(
        student: FloatTensor<Self>,
        teacher: FloatTensor<Self>,
        with_grad: bool,
    ) -> LossWithGrad<Self> {
        reference::soft_target_ce_with_grad::<Self>(student, teacher, with_grad)
    }

    /// `grad * upstream[0]` for a one-element `upstream`: the chain-rule step
    /// of a loss whose gradient was computed in its forward pass.
    fn scale_by_scalar(grad: FloatTensor<Self>, upstream: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::scale_by_scalar::<Self>(grad, upstream)
    }

    /// `dL/d(pre-activation)` of a fused matmul's epilogue from the upstream
    /// gradient and `saved`: the op's output for identity, relu and relu6, its
    /// pre-activation for gelu.
    fn epilogue_backward(
        grad: FloatTensor<Self>,
        saved: FloatTensor<Self>,
        epilogue: Epilogue,
    ) -> FloatTensor<Self> {
        reference::epilogue_backward::<Self>(grad, saved, epilogue)
    }

    /// The activation `epilogue` of any-rank `x`, elementwise.
    fn activation(x: FloatTensor<Self>, epilogue: Epilogue) -> FloatTensor<Self> {
        reference::activation::<Self>(x, epilogue)
    }

    /// The bias gradient of a fused matmul: `grad [z, m, n]` summed over `z`
    /// and the other axis, giving `[m]` ([`BiasAxis::Rows`]) or `[n]`.
    fn bias_grad(grad: FloatTensor<Self>, axis: BiasAxis) -> FloatTensor<Self> {
        reference::bias_grad::<Self>(grad, axis)
    }

    /// `act(lhs @ rhs + bias)` on rank-3 tensors: `lhs [zl, m, k]`, `rhs [zr, k, n]`
    /// with `zl, zr` equal or 1 (a batch of 1 is shared by every batch entry),
    /// any strides. The result is `[max(zl, zr), m, n]`, or with `sum_batch`
    /// `[1, m, n]` holding `act(sum_z lhs_z @ rhs_z + bias)`. `bias` has `m`
    /// ([`BiasAxis::Rows`]) or `n` ([`BiasAxis::Cols`]) elements.
    fn matmul_epilogue(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<(FloatTensor<Self>, BiasAxis)>,
        epilogue: Epilogue,
        sum_batch: bool,
    ) -> FloatTensor<Self> {
        reference::matmul_epilogue::<Self>(lhs, rhs, bias, epilogue, sum_batch)
    }

    /// `act(conv2d(x, weight) + bias)` for `x [batch, c_in, h, w]`, `weight
    /// [c_out, c_in / groups, kh, kw]` and `bias [c_out]`.
    fn conv2d_epilogue(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
        epilogue: Epilogue,
    ) -> FloatTensor<Self> {
        reference::conv2d_epilogue::<Self>(x, weight, bias, options, epilogue)
    }

    /// The gradients of `conv2d(x, weight)` from the gradient of its output
    /// (before any bias or activation): that of `x` when `x_grad`, and that
    /// of `weight`.
    fn conv2d_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        options: ConvOptions<2>,
        x_grad: bool,
    ) -> (Option<FloatTensor<Self>>, FloatTensor<Self>) {
        reference::conv2d_backward::<Self>(x, weight, grad, options, x_grad)
    }

    /// `max_pool2x2(act(conv2d(x, weight) + bias))` and where each maximum
    /// came from (as [`max_pool2x2_with_indices`](FusedBackend::max_pool2x2_with_indices)):
    /// on the CPU the full-resolution output never leaves the cache.
    fn conv2d_pool(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
        epilogue: Epilogue,
    ) -> (FloatTensor<Self>, IntTensor<Self>) {
        Self::max_pool2x2_with_indices(Self::conv2d_epilogue(x, weight, bias, options, epilogue))
    }

    /// The gradients of [`conv2d_pool`](FusedBackend::conv2d_pool) from the
    /// gradient of its pooled output before the activation (the activation's
    /// derivative at a window's maximum is the same at either resolution):
    /// that of `x` when `x_grad`, and that of `weight`.
    fn conv2d_pool_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
        options: ConvOptions<2>,
        x_grad: bool,
    ) -> (Option<FloatTensor<Self>>, FloatTensor<Self>) {
        unpool_then_conv_backward::<Self>(x, weight, grad, indices, options, x_grad)
    }

    /// Every gradient of a fused convolution layer (`act(conv2d(x, weight) +
    /// bias)`, followed by the 2x2 max-pool when `inputs.pool_indices` is
    /// set) from the gradient of its output: that of `x` when `x_grad`, that
    /// of the weight, and that of the bias when `bias_grad`. By default the
    /// backend's separate ops ([`layer_backward_in_steps`]).
    fn conv2d_layer_backward(
        inputs: ConvBackwardInputs<Self>,
        x_grad: bool,
        bias_grad: bool,
    ) -> ConvGrads<Self> {
        layer_backward_in_steps::<Self>(inputs, x_grad, bias_grad)
    }

    /// One update of every slot's parameter by `rule` at learning rate `lr`
    /// (see [`optim`]): burn's `Adam` and `Sgd` to the operation. By default
    /// burn's tensor ops, one tensor at a time ([`optim::reference_step`]).
    fn optimizer_step(slots: Vec<ParamSlot<Self>>, rule: &UpdateRule, lr: f64) -> Vec<ParamUpdate<Self>> {
        optim::reference_step::<Self>(slots, rule, lr)
    }

    /// A 2x2, stride-2 max-pool of `[batch, channels, h, w]` (no padding; an
    /// odd last row or column is dropped, as burn's `MaxPool2d` with kernel 2).
    fn max_pool2x2(x: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::max_pool2x2_with_indices(x).0
    }

    /// [`max_pool2x2`](FusedBackend::max_pool2x2) and where each maximum came
    /// from, for [`max_pool2x2_backward`](FusedBackend::max_pool2x2_backward)
    /// (the index format is the backend's own).
    fn max_pool2x2_with_indices(x: FloatTensor<Self>) -> (FloatTensor<Self>, IntTensor<Self>) {
        reference::max_pool2x2_with_indices::<Self>(x)
    }

    /// The input gradient of the 2x2 max-pool: `grad` routed to the maxima.
    fn max_pool2x2_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::max_pool2x2_backward::<Self>(x, grad, indices)
    }

    /// Multi-head attention over the real tokens: `q`, `k`, `v` are
    /// `[batch, tokens, heads * head_dim]` (heads side by side, as the
    /// projections write them), `mask` is `[batch, tokens]` (1 for real
    /// tokens, 0 for padding). Scores `q k^T / sqrt(head_dim)` plus
    /// [`transformer::MASKED_SCORE`] on padding keys, softmax over keys,
    /// times `v`: the context `[batch, tokens, heads * head_dim]` and, with
    /// `with_probs`, the weights `[batch, heads, tokens, tokens]`.
    fn masked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        heads: usize,
        with_probs: bool,
    ) -> transformer::AttentionOutput<Self> {
        transformer::attention_reference::<Self>(q, k, v, mask, heads, with_probs)
    }

    /// The gradients `[dq, dk, dv]` of [`masked_attention`](FusedBackend::masked_attention)
    /// from its inputs, its weights and the gradient of its context.
    fn masked_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        heads: usize,
    ) -> [FloatTensor<Self>; 3] {
        transformer::attention_backward_reference::<Self>(q, k, v, probs, grad, heads)
    }

    /// `LayerNorm(x + residual) * gamma + beta` over the last axis of
    /// `[rows, hidden]` inputs (biased variance, `epsilon` inside the square
    /// root, as burn's `LayerNorm`); with `with_saved`, also what the
    /// backward needs.
    fn add_layer_norm(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        with_saved: bool,
    ) -> transformer::LayerNormOutput<Self> {
        transformer::add_layer_norm_reference::<Self>(x, residual, gamma, beta, epsilon, with_saved)
    }

    /// The gradients of [`add_layer_norm`](FusedBackend::add_layer_norm)
    /// from what it saved (`sum = x + residual`, `rstd` per row), `gamma`
    /// and the gradient of its output.
    fn add_layer_norm_backward(
        sum: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> transformer::LayerNormGrads<Self> {
        transformer::add_layer_norm_backward_reference::<Self>(sum, rstd, gamma, grad)
    }

    /// RMSNorm over the last axis of `[rows, hidden]` `x`: `x / sqrt(mean(x^2)
    /// + epsilon) * gamma`, as burn's `RmsNorm`; with `with_rstd`, also each
    /// row's `1 / sqrt(mean(x^2) + epsilon)` for the backward.
    fn rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
        with_rstd: bool,
    ) -> llama::RmsNormOutput<Self> {
        llama::rms_norm_reference::<Self>(x, gamma, epsilon, with_rstd)
    }

    /// The gradients `[dx, dgamma]` of [`rms_norm`](FusedBackend::rms_norm)
    /// from its input, the `rstd` it saved, `gamma` and the gradient of its
    /// output.
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
        grad: FloatTensor<Self>,
    ) -> [FloatTensor<Self>; 2] {
        let _ = rstd;
        llama::rms_norm_backward_reference::<Self>(x, gamma, epsilon, grad)
    }

    /// SwiGLU's gated product `SiLU(gate) * up` of two same-shape tensors.
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        llama::swiglu_reference::<Self>(gate, up)
    }

    /// The gradients `[dgate, dup]` of [`swiglu`](FusedBackend::swiglu).
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> [FloatTensor<Self>; 2] {
        llama::swiglu_backward_reference::<Self>(gate, up, grad)
    }

    /// Grouped-query causal attention with rotary positions: `q` is
    /// `[batch, tokens, heads * head_dim]`, `k` and `v` `[batch, tokens,
    /// kv_heads * head_dim]` (heads side by side, as the projections write
    /// them), `mask` `[batch, tokens]` (1 for real tokens). The queries and
    /// keys are rotated by their positions, each key/value head serves
    /// `heads / kv_heads` consecutive query heads, and each token attends to
    /// the real tokens up to itself. The context `[batch, tokens, heads *
    /// head_dim]` and, with `with_probs`, the weights `[batch, heads, tokens,
    /// tokens]`. A query none of whose keys up to itself is real (left
    /// padding) attends uniformly to those keys.
    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        layout: llama::CausalHeads,
        with_probs: bool,
    ) -> llama::CausalAttentionOutput<Self> {
        llama::causal_attention_reference::<Self>(q, k, v, mask, layout, with_probs)
    }

    /// The gradients `[dq, dk, dv]` of
    /// [`causal_attention`](FusedBackend::causal_attention) from its inputs,
    /// its weights and the gradient of its context.
    fn causal_attention_backward(
        qkv: [FloatTensor<Self>; 3],
        mask: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        layout: llama::CausalHeads,
    ) -> [FloatTensor<Self>; 3] {
        llama::causal_attention_backward_reference::<Self>(qkv, mask, probs, grad, layout)
    }

    /// The weighted mean over rows of `KL(softmax(teacher / T) ||
    /// softmax(student / T))` times `T^2`, for `[rows, classes]` scores and
    /// `[rows]` weights (0: the row does not count; all 0 gives 0); with
    /// `with_grad`, also its gradient with respect to `student`. The
    /// teacher takes no gradient.
    fn weighted_kl_loss(
        student: FloatTensor<Self>,
        teacher: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        temperature: f64,
        with_grad: bool,
    ) -> LossWithGrad<Self> {
        llama::weighted_kl_reference::<Self>(student, teacher, weights, temperature, with_grad)
    }
}

/// What the backward pass of a fused convolution layer needs from its
/// forward pass ([`FusedBackend::conv2d_layer_backward`]).
#[derive(Debug, Clone)]
pub struct ConvBackwardInputs<B: Backend> {
    /// The layer's input `[batch, c_in, h, w]`.
    pub x: FloatTensor<B>,
    /// Its weight `[c_out, c_in / groups, kh, kw]`.
    pub weight: FloatTensor<B>,
    /// The gradient of its output (of the pooled output when pooled).
    pub output_grad: FloatTensor<B>,
    /// Its output after the activation (pooled when pooled): the
    /// activation's derivative is read from it, so `epilogue` is identity,
    /// relu or relu6 (gelu needs the pre-activation).
    pub output: FloatTensor<B>,
    /// The layer's activation.
    pub epilogue: Epilogue,
    /// For a layer followed by the 2x2 max-pool: where each pooled maximum
    /// came from ([`FusedBackend::conv2d_pool`]).
    pub pool_indices: Option<IntTensor<B>>,
    /// Stride, padding, dilation and groups.
    pub options: ConvOptions<2>,
}

/// The gradients of a convolution layer.
#[derive(Debug, Clone)]
pub struct ConvGrads<B: Backend> {
    /// Of its input, when asked for.
    pub x: Option<FloatTensor<B>>,
    /// Of its weight.
    pub weight: FloatTensor<B>,
    /// Of its bias, when asked for.
    pub bias: Option<FloatTensor<B>>,
}

/// [`FusedBackend::conv2d_layer_backward`] as the backend's separate ops:
/// the activation's backward, the bias gradient, then the (pooled)
/// convolution's backward.
pub fn layer_backward_in_steps<B: FusedBackend>(
    inputs: ConvBackwardInputs<B>,
    x_grad: bool,
    bias_grad: bool,
) -> ConvGrads<B> {
    let ConvBackwardInputs { x, weight, output_grad, output, epilogue, pool_indices, options } = inputs;
    // A pooled output is the activation's output at each window's maximum.
    let pre_grad = conv_epilogue_backward::<B>(output_grad, output, epilogue);
    let bias = bias_grad.then(|| {
        let [b, c, h, w] = pre_grad.shape().dims::<4>();
        B::bias_grad(B::float_reshape(pre_grad.clone(), [b, c, h * w].into()), BiasAxis::Rows)
    });
    let (x, weight) = match pool_indices {
        Some(indices) => B::conv2d_pool_backward(x, weight, pre_grad, indices, options, x_grad),
        None => B::conv2d_backward(x, weight, pre_grad, options, x_grad),
    };
    ConvGrads { x, weight, bias }
}

/// [`FusedBackend::epilogue_backward`] (which takes `[z, m, n]`) for a
/// convolution's `[b, c, h, w]` output and its gradient, as `[b, c, h * w]`.
fn conv_epilogue_backward<B: FusedBackend>(
    grad: FloatTensor<B>,
    saved: FloatTensor<B>,
    epilogue: Epilogue,
) -> FloatTensor<B> {
    let shape = grad.shape();
    let [b, c, h, w] = shape.dims::<4>();
    let flat = |t: FloatTensor<B>| B::float_reshape(t, [b, c, h * w].into());
    B::float_reshape(B::epilogue_backward(flat(grad), flat(saved), epilogue), shape)
}

/// [`FusedBackend::conv2d_pool_backward`] as two of the backend's own ops:
/// the pool's backward into the convolution's output shape, then
/// [`FusedBackend::conv2d_backward`].
fn unpool_then_conv_backward<B: FusedBackend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
    indices: IntTensor<B>,
    options: ConvOptions<2>,
    x_grad: bool,
) -> (Option<FloatTensor<B>>, FloatTensor<B>) {
    let like = reference::conv_output_zeros::<B>(&x, &weight, &options);
    let unpooled = B::max_pool2x2_backward(like, grad, indices);
    B::conv2d_backward(x, weight, unpooled, options, x_grad)
}

/// The backends the engine trains on: autodiff over a [`FusedBackend`], with
/// the fused ops available both with and without gradient tracking.
pub trait DistillBackend: AutodiffBackend<InnerBackend: FusedBackend> + FusedBackend {}

impl<B> DistillBackend for B where B: AutodiffBackend<InnerBackend: FusedBackend> + FusedBackend {}

/// How [`FusedBackend::matmul_epilogue`] runs on CubeCL backends (other
/// backends have one way: burn's ops).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulVariant {
    /// Time both variants at the first call of each shape on each device and
    /// keep the faster one (the default).
    Auto,
    /// Our register-tiled matmul kernel with the epilogue applied before the
    /// store: one kernel.
    Fused,
    /// burn's matmul kernel, then our epilogue kernel (bias and activation in
    /// one in-place pass instead of two).
    Split,
}

static MATMUL_VARIANT: std::sync::Mutex<MatmulVariant> = std::sync::Mutex::new(MatmulVariant::Auto);

/// How a dense convolution's forward (pooled or not) runs on CubeCL
/// backends (other backends have one way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvVariant {
    /// Time both variants at the first call of each shape on each device and
    /// keep the faster one (the default).
    Auto,
    /// An implicit matrix product whose operand tiles are staged in shared
    /// memory (each input value gathered once per cube).
    Tiled,
    /// No shared memory and no barriers: each unit gathers its own inputs
    /// (cheaper on CPU Vulkan drivers, and for few channels).
    Direct,
}

static CONV_VARIANT: std::sync::Mutex<ConvVariant> = std::sync::Mutex::new(ConvVariant::Auto);

/// Forces a convolution variant (tests, benchmarks) or restores [`ConvVariant::Auto`].
pub fn set_conv_variant(variant: ConvVariant) {
    *CONV_VARIANT.lock().unwrap_or_else(|p| p.into_inner()) = variant;
}

/// The convolution variant in force.
pub fn conv_variant() -> ConvVariant {
    *CONV_VARIANT.lock().unwrap_or_else(|p| p.into_inner())
}

/// Forces a matmul variant (tests, benchmarks) or restores [`MatmulVariant::Auto`].
pub fn set_matmul_variant(variant: MatmulVariant) {
    *MATMUL_VARIANT.lock().unwrap_or_else(|p| p.into_inner()) = variant;
}

/// The matmul variant in force.
pub fn matmul_variant() -> MatmulVariant {
    *MATMUL_VARIANT.lock().unwrap_or_else(|p| p.into_inner())
}

/// Keeps CubeCL's autotune results and compiled kernels in `dir`, so that a
/// second start on the same machine reuses them wherever the binary runs
/// (CubeCL's default keeps autotune results under the nearest cargo
/// project's `target/` and compiles every kernel again). Leaves CubeCL's
/// settings alone where the user wrote their own (a `cubecl.toml`, or
/// `burn.toml` with a `[cubecl]` table, in the working folder or above)
/// or CubeCL has already read them. Returns whether `dir` is now in use.
/// Without CubeCL backends compiled in, does nothing.
pub fn keep_cubecl_caches_in(dir: &std::path::Path) -> bool {
    #[cfg(feature = "cubecl")]
    return cube::keep_caches_in(dir);
    #[cfg(not(feature = "cubecl"))]
    {
        let _ = dir;
        false
    }
}

/// Fill every kernel output with NaN before the launch, so that a test sees any
/// element a kernel failed to write (CubeCL backends; a no-op elsewhere).
pub fn set_poison_outputs(on: bool) {
    #[cfg(feature = "cubecl")]
    cube::set_poison_outputs(on);
    #[cfg(not(feature = "cubecl"))]
    let _ = on;
}

/// `act(x @ weight + bias)` for `x [rows, in]`, `weight [in, out]` (burn's
/// `Linear` layout) and `bias [out]`.
pub fn linear<B: FusedBackend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    epilogue: Epilogue,
) -> Tensor<B, 2> {
    let [rows, _] = x.dims();
    let [_, out] = weight.dims();
    let output = B::matmul_epilogue(
        x.unsqueeze::<3>().into_primitive().tensor(),
        weight.unsqueeze::<3>().into_primitive().tensor(),
        bias.map(|b| (b.into_primitive().tensor(), BiasAxis::Cols)),
        epilogue,
        false,
    );
    Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(output)).reshape([rows, out])
}

/// `act(conv1x1(x) + bias)` for `x [batch, in, h, w]`, `weight [out, in, 1, 1]`
/// (burn's `Conv2d` layout) and `bias [out]`, as one batched matmul
/// `weight [out, in] @ x_b [in, h*w]` per sample, without layout copies.
pub fn pointwise_conv<B: FusedBackend>(
    x: Tensor<B, 4>,
    weight: Tensor<B, 4>,
    bias: Option<Tensor<B, 1>>,
    epilogue: Epilogue,
) -> Tensor<B, 4> {
    let [batch, channels, h, w] = x.dims();
    let [out, _, _, _] = weight.dims();
    let output = B::matmul_epilogue(
        weight.reshape([1, out, channels]).into_primitive().tensor(),
        x.reshape([batch, channels, h * w]).into_primitive().tensor(),
        bias.map(|b| (b.into_primitive().tensor(), BiasAxis::Rows)),
        epilogue,
        false,
    );
    Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(output)).reshape([batch, out, h, w])
}

/// `act(conv2d(x, weight) + bias)`: one op (on the CPU, an im2col and one
/// batched matmul with the bias and activation applied in the same pass;
/// the backward reuses both).
pub fn conv2d<B: FusedBackend>(
    x: Tensor<B, 4>,
    weight: Tensor<B, 4>,
    bias: Option<Tensor<B, 1>>,
    options: ConvOptions<2>,
    epilogue: Epilogue,
) -> Tensor<B, 4> {
    let output = B::conv2d_epilogue(
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        bias.map(|b| b.into_primitive().tensor()),
        options,
        epilogue,
    );
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// `max_pool2x2(act(conv2d(x, weight) + bias))`: one op (see
/// [`FusedBackend::conv2d_pool`]).
pub fn conv2d_pool<B: FusedBackend>(
    x: Tensor<B, 4>,
    weight: Tensor<B, 4>,
    bias: Option<Tensor<B, 1>>,
    options: ConvOptions<2>,
    epilogue: Epilogue,
) -> Tensor<B, 4> {
    let (output, _) = B::conv2d_pool(
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        bias.map(|b| b.into_primitive().tensor()),
        options,
        epilogue,
    );
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// The options of a burn `Conv2d` layer for the fused ops: `None` when its
/// padding is asymmetric (or `Same`), it has dilation, or groups other than
/// depthwise ones.
fn fused_options<B: Backend>(layer: &Conv2d<B>) -> Option<ConvOptions<2>> {
    let padding = match layer.padding {
        PaddingConfig2d::Valid => [0, 0],
        PaddingConfig2d::Explicit(top, left, bottom, right) if top == bottom && left == right => [top, left],
        _ => return None,
    };
    // No groups, or depthwise (one input channel per filter).
    let [_, per_group, _, _] = layer.weight.dims();
    let grouping = layer.groups == 1 || per_group == 1;
    (grouping && layer.dilation == [1, 1])
        .then(|| ConvOptions::new(layer.stride, padding, [1, 1], layer.groups))
}

/// A burn `Conv2d` layer followed by `epilogue`, through [`conv2d`] when its
/// padding is symmetric (or none) and it has no dilation and no groups other
/// than depthwise;
/// otherwise the layer's own forward and the activation as burn ops.
/// A 1x1 layer (stride 1, no padding) goes through [`pointwise_conv`].
pub fn conv2d_layer<B: FusedBackend>(layer: &Conv2d<B>, x: Tensor<B, 4>, epilogue: Epilogue) -> Tensor<B, 4> {
    let bias = layer.bias.as_ref().map(|b| b.val());
    match fused_options(layer) {
        Some(options)
            if layer.kernel_size == [1, 1] && options.stride == [1, 1] && options.padding == [0, 0] =>
        {
            pointwise_conv(x, layer.weight.val(), bias, epilogue)
        }
        Some(options) => conv2d(x, layer.weight.val(), bias, options, epilogue),
        None => reference::activate(layer.forward(x), epilogue),
    }
}

/// [`conv2d_layer`] followed by a 2x2 max-pool, as one op ([`conv2d_pool`])
/// where the backend fuses them ([`FusedBackend::FUSED_CONV_POOL`]) and the
/// layer qualifies.
pub fn conv2d_layer_pool<B: FusedBackend>(
    layer: &Conv2d<B>,
    x: Tensor<B, 4>,
    epilogue: Epilogue,
) -> Tensor<B, 4> {
    match fused_options(layer) {
        Some(options) if B::FUSED_CONV_POOL && epilogue != Epilogue::Gelu => {
            conv2d_pool(x, layer.weight.val(), layer.bias.as_ref().map(|b| b.val()), options, epilogue)
        }
        _ => max_pool2x2(conv2d_layer(layer, x, epilogue)),
    }
}

/// A 2x2, stride-2 max-pool of `[batch, channels, h, w]`, as burn's
/// `MaxPool2d` with kernel 2 (no padding, odd edges dropped).
pub fn max_pool2x2<B: FusedBackend>(x: Tensor<B, 4>) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(B::max_pool2x2(x.into_primitive().tensor())))
}

/// burn's wgpu backend without burn's op fusion, so that our [`FusedBackend`]
/// kernels are the ones that run (`Autodiff<Wgpu>` is what the engine trains on).
#[cfg(feature = "wgpu")]
pub type Wgpu = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;

/// burn's CUDA backend without burn's op fusion (see [`Wgpu`]).
#[cfg(feature = "cuda")]
pub type Cuda = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
