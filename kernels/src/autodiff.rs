//! The fused ops under `Autodiff<B>`: a custom backward step for each.
//!
//! The losses compute their gradient in the forward pass (one fused kernel on
//! CubeCL backends), so their backward only scales it by the upstream
//! gradient. The fused matmul's backward runs the same fused matmul on
//! transposed views (no copies): `dlhs = G @ rhs^T`, `drhs = lhs^T @ G`, with
//! the batch summed for an operand shared across the batch.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::{ConvOptions, FloatTensor, IntTensor};
use burn::tensor::{Tensor, TensorMetadata, TensorPrimitive};

use crate::llama::{CausalAttentionOutput, CausalHeads, RmsNormOutput};
use crate::transformer::{AttentionOutput, LayerNormGrads, LayerNormOutput};
use crate::{BiasAxis, ConvBackwardInputs, ConvGrads, Epilogue, FusedBackend, LossWithGrad};

/// Backward of a loss whose gradient with respect to the student was computed
/// in the forward pass; the teacher (usually untracked) gets its negation.
#[derive(Debug)]
struct PrecomputedLossBackward;

impl<B: FusedBackend> Backward<B, 2> for PrecomputedLossBackward {
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [student, teacher] = ops.parents;
        let upstream = grads.consume::<B>(&ops.node);
        let grad = B::scale_by_scalar(ops.state, upstream);
        if let Some(teacher) = teacher {
            grads.register::<B>(teacher.id, B::float_neg(grad.clone()));
        }
        if let Some(student) = student {
            grads.register::<B>(student.id, grad);
        }
    }
}

fn loss_op<B: FusedBackend, C: CheckpointStrategy>(
    student: FloatTensor<Autodiff<B, C>>,
    teacher: FloatTensor<Autodiff<B, C>>,
    fused: fn(FloatTensor<B>, FloatTensor<B>, bool) -> LossWithGrad<B>,
) -> LossWithGrad<Autodiff<B, C>> {
    let loss = match PrecomputedLossBackward
        .prepare::<C>([student.node.clone(), teacher.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let out = fused(student.primitive, teacher.primitive, true);
            let grad = out.grad.expect("the fused loss was asked for its gradient");
            prep.finish(grad, out.loss)
        }
        OpsKind::UnTracked(prep) => prep.finish(fused(student.primitive, teacher.primitive, false).loss),
    };
    LossWithGrad { loss, grad: None }
}

/// What the matmul backward needs: the operands, the output (for the
/// activation's derivative) and how the op was called.
#[derive(Debug, Clone)]
struct MatmulState<B: FusedBackend> {
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    bias: Option<(FloatTensor<B>, BiasAxis)>,
    output: FloatTensor<B>,
    epilogue: Epilogue,
}

/// Gradients of `act(lhs @ rhs + bias)`: `(dlhs, drhs, dbias)`, each only
/// where `wanted` (lhs, rhs, bias) asks for it.
fn matmul_grads<B: FusedBackend>(
    state: MatmulState<B>,
    grad: FloatTensor<B>,
    wanted: [bool; 3],
) -> (Option<FloatTensor<B>>, Option<FloatTensor<B>>, Option<FloatTensor<B>>) {
    let MatmulState { lhs, rhs, bias, output, epilogue } = state;
    // G = dL/d(pre-activation). A GELU is never recorded here (its own op
    // keeps its input), so the output is what the epilogue's derivative reads.
    debug_assert!(epilogue != Epilogue::Gelu, "the fused matmul records no GELU");
    let saved = output;
    let pre_grad =
        Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(B::epilogue_backward(grad, saved, epilogue)));
    let [zl, _, _] = lhs.shape().dims::<3>();
    let [zr, _, _] = rhs.shape().dims::<3>();
    let [zg, _, _] = pre_grad.dims();
    let bias_grad = match (bias, wanted[2]) {
        (Some((_, axis)), true) => Some(B::bias_grad(pre_grad.clone().into_primitive().tensor(), axis)),
        _ => None,
    };
    let g = pre_grad.into_primitive().tensor();
    let dlhs = wanted[0].then(|| {
        let rhs_t = B::float_swap_dims(rhs, 1, 2);
        B::matmul_epilogue(g.clone(), rhs_t, None, Epilogue::Identity, zl == 1 && zg.max(zr) > 1)
    });
    let drhs = wanted[1].then(|| {
        let lhs_t = B::float_swap_dims(lhs, 1, 2);
        B::matmul_epilogue(lhs_t, g, None, Epilogue::Identity, zr == 1 && zl.max(zg) > 1)
    });
    (dlhs, drhs, bias_grad)
}

/// Backward of the fused matmul with `N` parents (2 without a bias, 3 with).
#[derive(Debug)]
struct MatmulBackward;

fn register_matmul_grads<B: FusedBackend, const N: usize>(
    ops: Ops<MatmulState<B>, N>,
    grads: &mut Gradients,
) {
    let grad = grads.consume::<B>(&ops.node);
    let parents: Vec<_> = ops.parents.into_iter().collect();
    let tracked = |i: usize| parents.get(i).is_some_and(Option::is_some);
    let (dlhs, drhs, dbias) = matmul_grads(ops.state, grad, [tracked(0), tracked(1), tracked(2)]);
    if let (Some(node), Some(dlhs)) = (&parents[0], dlhs) {
        grads.register::<B>(node.id, dlhs);
    }
    if let (Some(node), Some(drhs)) = (&parents[1], drhs) {
        grads.register::<B>(node.id, drhs);
    }
    if let (Some(Some(node)), Some(dbias)) = (parents.get(2), dbias) {
        grads.register::<B>(node.id, dbias);
    }
}

impl<B: FusedBackend> Backward<B, 2> for MatmulBackward {
    type State = MatmulState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        register_matmul_grads(ops, grads);
    }
}

impl<B: FusedBackend> Backward<B, 3> for MatmulBackward {
    type State = MatmulState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        register_matmul_grads(ops, grads);
    }
}

/// Runs the forward and, when tracked, records the backward state.
fn finish_matmul<B: FusedBackend, C: CheckpointStrategy, const N: usize>(
    kind: OpsKind<MatmulBackward, B, MatmulState<B>, C, N>,
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    bias: Option<(FloatTensor<B>, BiasAxis)>,
    epilogue: Epilogue,
    sum_batch: bool,
) -> FloatTensor<Autodiff<B, C>>
where
    MatmulBackward: Backward<B, N, State = MatmulState<B>>,
{
    match kind {
        OpsKind::Tracked(prep) => {
            let output = B::matmul_epilogue(lhs.clone(), rhs.clone(), bias.clone(), epilogue, sum_batch);
            let state = MatmulState { lhs, rhs, bias, output: output.clone(), epilogue };
            prep.finish(state, output)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::matmul_epilogue(lhs, rhs, bias, epilogue, sum_batch)),
    }
}

/// What the convolution backward needs: the operands, the output (for the
/// activation's derivative), the options and, for a convolution followed by
/// the 2x2 max-pool, where each maximum came from.
#[derive(Debug, Clone)]
struct ConvState<B: FusedBackend> {
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    output: FloatTensor<B>,
    options: ConvOptions<2>,
    epilogue: Epilogue,
    pool_indices: Option<IntTensor<B>>,
}

/// Backward of the fused convolution (pooled or not) with `N` parents (x,
/// weight[, bias]).
#[derive(Debug)]
struct ConvBackward;

fn register_conv_grads<B: FusedBackend, const N: usize>(ops: Ops<ConvState<B>, N>, grads: &mut Gradients) {
    let grad = grads.consume::<B>(&ops.node);
    let ConvState { x, weight, output, options, epilogue, pool_indices } = ops.state;
    let parents: Vec<_> = ops.parents.into_iter().collect();
    let has_bias = parents.get(2).and_then(Option::as_ref).is_some();
    let inputs = ConvBackwardInputs { x, weight, output_grad: grad, output, epilogue, pool_indices, options };
    let ConvGrads { x: x_grad, weight: weight_grad, bias: bias_grad } =
        B::conv2d_layer_backward(inputs, parents[0].is_some(), has_bias);
    if let (Some(node), Some(x_grad)) = (&parents[0], x_grad) {
        grads.register::<B>(node.id, x_grad);
    }
    if let Some(node) = &parents[1] {
        grads.register::<B>(node.id, weight_grad);
    }
    if let (Some(Some(node)), Some(bias_grad)) = (parents.get(2), bias_grad) {
        grads.register::<B>(node.id, bias_grad);
    }
}

impl<B: FusedBackend> Backward<B, 2> for ConvBackward {
    type State = ConvState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        register_conv_grads(ops, grads);
    }
}

impl<B: FusedBackend> Backward<B, 3> for ConvBackward {
    type State = ConvState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        register_conv_grads(ops, grads);
    }
}

/// Runs the convolution (followed by the 2x2 max-pool when `pool`: then with
/// the indices of the maxima) and, when tracked, records the backward state.
#[allow(clippy::too_many_arguments)]
fn finish_conv<B: FusedBackend, C: CheckpointStrategy, const N: usize>(
    kind: OpsKind<ConvBackward, B, ConvState<B>, C, N>,
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    options: ConvOptions<2>,
    epilogue: Epilogue,
    pool: bool,
) -> (FloatTensor<Autodiff<B, C>>, Option<IntTensor<B>>)
where
    ConvBackward: Backward<B, N, State = ConvState<B>>,
{
    let forward = |x, weight| match pool {
        true => {
            let (output, indices) = B::conv2d_pool(x, weight, bias, options.clone(), epilogue);
            (output, Some(indices))
        }
        false => (B::conv2d_epilogue(x, weight, bias, options.clone(), epilogue), None),
    };
    match kind {
        OpsKind::Tracked(prep) => {
            let (output, indices) = forward(x.clone(), weight.clone());
            let pool_indices = indices.clone();
            let state = ConvState { x, weight, output: output.clone(), options, epilogue, pool_indices };
            (prep.finish(state, output), indices)
        }
        OpsKind::UnTracked(prep) => {
            let (output, indices) = forward(x, weight);
            (prep.finish(output), indices)
        }
    }
}

/// The fused convolution (pooled when `pool`) under autodiff: with two or
/// three parents depending on the bias.
fn tracked_conv<B: FusedBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    weight: FloatTensor<Autodiff<B, C>>,
    bias: Option<FloatTensor<Autodiff<B, C>>>,
    options: ConvOptions<2>,
    epilogue: Epilogue,
    pool: bool,
) -> (FloatTensor<Autodiff<B, C>>, Option<IntTensor<B>>) {
    match bias {
        None => {
            let kind =
                ConvBackward.prepare::<C>([x.node.clone(), weight.node.clone()]).compute_bound().stateful();
            finish_conv(kind, x.primitive, weight.primitive, None, options, epilogue, pool)
        }
        Some(bias) => {
            let kind = ConvBackward
                .prepare::<C>([x.node.clone(), weight.node.clone(), bias.node.clone()])
                .compute_bound()
                .stateful();
            finish_conv(kind, x.primitive, weight.primitive, Some(bias.primitive), options, epilogue, pool)
        }
    }
}

/// Backward of the 2x2 max-pool: the input (for its shape) and the indices of
/// the maxima, in the inner backend's format.
#[derive(Debug)]
struct MaxPoolBackward;

impl<B: FusedBackend> Backward<B, 1> for MaxPoolBackward {
    type State = (FloatTensor<B>, IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [parent] = ops.parents;
        if let Some(parent) = parent {
            let (x, indices) = ops.state;
            grads.register::<B>(parent.id, B::max_pool2x2_backward(x, grad, indices));
        }
    }
}

/// Backward of an activation; the state is its input.
#[derive(Debug)]
struct ActivationBackward(Epilogue);

impl<B: FusedBackend> Backward<B, 1> for ActivationBackward {
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(node)] = ops.parents {
            grads.register::<B>(node.id, B::epilogue_backward(grad, ops.state, self.0));
        }
    }
}

/// What the attention backward needs: its inputs and weights.
#[derive(Debug, Clone)]
struct AttentionState<B: FusedBackend> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    probs: FloatTensor<B>,
    heads: usize,
}

/// Backward of the masked attention (parents q, k, v; the mask is data).
#[derive(Debug)]
struct AttentionBackward;

impl<B: FusedBackend> Backward<B, 3> for AttentionBackward {
    type State = AttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let AttentionState { q, k, v, probs, heads } = ops.state;
        let [dq, dk, dv] = B::masked_attention_backward(q, k, v, probs, grad, heads);
        for (parent, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// What the layer norm backward needs: the sum, each row's `1 / std`, the scale.
#[derive(Debug, Clone)]
struct LayerNormState<B: FusedBackend> {
    sum: FloatTensor<B>,
    rstd: FloatTensor<B>,
    gamma: FloatTensor<B>,
}

/// Backward of the residual add with its layer norm (parents x, residual,
/// gamma, beta: x and residual get the same gradient).
#[derive(Debug)]
struct LayerNormBackward;

impl<B: FusedBackend> Backward<B, 4> for LayerNormBackward {
    type State = LayerNormState<B>;

    fn backward(self, ops: Ops<Self::State, 4>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let LayerNormState { sum, rstd, gamma } = ops.state;
        let LayerNormGrads { input, gamma, beta } = B::add_layer_norm_backward(sum, rstd, gamma, grad);
        let [x, residual, gamma_node, beta_node] = ops.parents;
        let gradients = [
            (x, Some(input.clone())),
            (residual, Some(input)),
            (gamma_node, Some(gamma)),
            (beta_node, Some(beta)),
        ];
        for (parent, grad) in gradients {
            if let (Some(node), Some(grad)) = (parent, grad) {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// Registers each gradient with its parent, where the parent is tracked
/// (burn's node type is private: a macro instead of a function).
macro_rules! register_each {
    ($backend:ty, $parents:expr, $outputs:expr, $grads:expr) => {
        for (parent, grad) in $parents.into_iter().zip($outputs) {
            if let Some(node) = parent {
                $grads.register::<$backend>(node.id, grad);
            }
        }
    };
}

/// What the RMSNorm backward needs: its input, each row's `1 / rms`, the scale.
#[derive(Debug, Clone)]
struct RmsNormState<B: FusedBackend> {
    x: FloatTensor<B>,
    rstd: FloatTensor<B>,
    gamma: FloatTensor<B>,
    epsilon: f64,
}

/// Backward of the RMSNorm (parents x, gamma).
#[derive(Debug)]
struct RmsNormBackward;

impl<B: FusedBackend> Backward<B, 2> for RmsNormBackward {
    type State = RmsNormState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let RmsNormState { x, rstd, gamma, epsilon } = ops.state;
        register_each!(B, ops.parents, B::rms_norm_backward(x, rstd, gamma, epsilon, grad), grads);
    }
}

/// Backward of SwiGLU's gated product (parents gate, up; the state is both).
#[derive(Debug)]
struct SwigluBackward;

impl<B: FusedBackend> Backward<B, 2> for SwigluBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (gate, up) = ops.state;
        register_each!(B, ops.parents, B::swiglu_backward(gate, up, grad), grads);
    }
}

/// What the causal attention backward needs: its inputs and weights.
#[derive(Debug, Clone)]
struct CausalState<B: FusedBackend> {
    qkv: [FloatTensor<B>; 3],
    mask: FloatTensor<B>,
    probs: FloatTensor<B>,
    layout: CausalHeads,
}

/// Backward of the causal attention (parents q, k, v; the mask is data).
#[derive(Debug)]
struct CausalBackward;

impl<B: FusedBackend> Backward<B, 3> for CausalBackward {
    type State = CausalState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let CausalState { qkv, mask, probs, layout } = ops.state;
        register_each!(B, ops.parents, B::causal_attention_backward(qkv, mask, probs, grad, layout), grads);
    }
}

/// Backward of a loss whose gradient with respect to its one tracked input
/// was computed in the forward pass (the KL: the teacher is data).
#[derive(Debug)]
struct PrecomputedSingleBackward;

impl<B: FusedBackend> Backward<B, 1> for PrecomputedSingleBackward {
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let upstream = grads.consume::<B>(&ops.node);
        if let [Some(student)] = ops.parents {
            grads.register::<B>(student.id, B::scale_by_scalar(ops.state, upstream));
        }
    }
}

impl<B: FusedBackend, C: CheckpointStrategy> FusedBackend for Autodiff<B, C> {
    const FUSED_CONV_POOL: bool = B::FUSED_CONV_POOL;
    const ASYNC_DEVICE: bool = B::ASYNC_DEVICE;
    const FUSED_OPTIMIZER: bool = B::FUSED_OPTIMIZER;

    fn mse_loss(
        student: FloatTensor<Self>,
        teacher: FloatTensor<Self>,
        _with_grad: bool,
    ) -> LossWithGrad<Self> {
        loss_op::<B, C>(student, teacher, B::mse_loss)
    }

    fn soft_target_ce_loss(
        student: FloatTensor<Self>,
        teacher: FloatTensor<Self>,
        _with_grad: bool,
    ) -> LossWithGrad<Self> {
        loss_op::<B, C>(student, teacher, B::soft_target_ce_loss)
    }

    fn matmul_epilogue(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<(FloatTensor<Self>, BiasAxis)>,
        epilogue: Epilogue,
        sum_batch: bool,
    ) -> FloatTensor<Self> {
        if epilogue == Epilogue::Gelu {
            // The GELU keeps the pre-activation its derivative needs: the
            // backward then runs no product a second time to get it back.
            let pre = Self::matmul_epilogue(lhs, rhs, bias, Epilogue::Identity, sum_batch);
            return Self::activation(pre, Epilogue::Gelu);
        }
        match bias {
            None => {
                let kind = MatmulBackward
                    .prepare::<C>([lhs.node.clone(), rhs.node.clone()])
                    .compute_bound()
                    .stateful();
                finish_matmul(kind, lhs.primitive, rhs.primitive, None, epilogue, sum_batch)
            }
            Some((bias, axis)) => {
                let kind = MatmulBackward
                    .prepare::<C>([lhs.node.clone(), rhs.node.clone(), bias.node.clone()])
                    .compute_bound()
                    .stateful();
                finish_matmul(
                    kind,
                    lhs.primitive,
                    rhs.primitive,
                    Some((bias.primitive, axis)),
                    epilogue,
                    sum_batch,
                )
            }
        }
    }

    fn conv2d_epilogue(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
        epilogue: Epilogue,
    ) -> FloatTensor<Self> {
        if epilogue == Epilogue::Gelu {
            // Its derivative needs the pre-activation: burn's ops record it.
            return crate::reference::conv2d_epilogue::<Self>(x, weight, bias, options, epilogue);
        }
        tracked_conv::<B, C>(x, weight, bias, options, epilogue, false).0
    }

    fn conv2d_pool(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
        epilogue: Epilogue,
    ) -> (FloatTensor<Self>, IntTensor<Self>) {
        if epilogue == Epilogue::Gelu {
            let output = Self::conv2d_epilogue(x, weight, bias, options, epilogue);
            return Self::max_pool2x2_with_indices(output);
        }
        match tracked_conv::<B, C>(x, weight, bias, options, epilogue, true) {
            (output, Some(indices)) => (output, indices),
            (_, None) => unreachable!("a pooled convolution returns the indices of its maxima"),
        }
    }

    fn activation(x: FloatTensor<Self>, epilogue: Epilogue) -> FloatTensor<Self> {
        match ActivationBackward(epilogue).prepare::<C>([x.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let output = B::activation(x.primitive.clone(), epilogue);
                prep.finish(x.primitive, output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::activation(x.primitive, epilogue)),
        }
    }

    fn masked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        heads: usize,
        _with_probs: bool,
    ) -> AttentionOutput<Self> {
        let parents = [q.node.clone(), k.node.clone(), v.node.clone()];
        let context = match AttentionBackward.prepare::<C>(parents).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (q, k, v) = (q.primitive, k.primitive, v.primitive);
                let out = B::masked_attention(q.clone(), k.clone(), v.clone(), mask.primitive, heads, true);
                let probs = out.probs.expect("the attention was asked for its weights");
                prep.finish(AttentionState { q, k, v, probs, heads }, out.context)
            }
            OpsKind::UnTracked(prep) => {
                let out =
                    B::masked_attention(q.primitive, k.primitive, v.primitive, mask.primitive, heads, false);
                prep.finish(out.context)
            }
        };
        AttentionOutput { context, probs: None }
    }

    fn add_layer_norm(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        _with_saved: bool,
    ) -> LayerNormOutput<Self> {
        let parents = [x.node.clone(), residual.node.clone(), gamma.node.clone(), beta.node.clone()];
        let output = match LayerNormBackward.prepare::<C>(parents).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let gamma = gamma.primitive;
                let out = B::add_layer_norm(
                    x.primitive,
                    residual.primitive,
                    gamma.clone(),
                    beta.primitive,
                    epsilon,
                    true,
                );
                let (sum, rstd) = out.saved.expect("the layer norm was asked for its statistics");
                prep.finish(LayerNormState { sum, rstd, gamma }, out.output)
            }
            OpsKind::UnTracked(prep) => prep.finish(
                B::add_layer_norm(
                    x.primitive,
                    residual.primitive,
                    gamma.primitive,
                    beta.primitive,
                    epsilon,
                    false,
                )
                .output,
            ),
        };
        LayerNormOutput { output, saved: None }
    }

    fn rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
        _with_rstd: bool,
    ) -> RmsNormOutput<Self> {
        let parents = [x.node.clone(), gamma.node.clone()];
        let output = match RmsNormBackward.prepare::<C>(parents).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (x, gamma) = (x.primitive, gamma.primitive);
                let out = B::rms_norm(x.clone(), gamma.clone(), epsilon, true);
                let rstd = out.rstd.expect("the RMSNorm was asked for its statistics");
                prep.finish(RmsNormState { x, rstd, gamma, epsilon }, out.output)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::rms_norm(x.primitive, gamma.primitive, epsilon, false).output)
            }
        };
        RmsNormOutput { output, rstd: None }
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let parents = [gate.node.clone(), up.node.clone()];
        match SwigluBackward.prepare::<C>(parents).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (gate, up) = (gate.primitive, up.primitive);
                let output = B::swiglu(gate.clone(), up.clone());
                prep.finish((gate, up), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::swiglu(gate.primitive, up.primitive)),
        }
    }

    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        layout: CausalHeads,
        _with_probs: bool,
    ) -> CausalAttentionOutput<Self> {
        let parents = [q.node.clone(), k.node.clone(), v.node.clone()];
        let context = match CausalBackward.prepare::<C>(parents).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let qkv = [q.primitive, k.primitive, v.primitive];
                let mask = mask.primitive;
                let [q, k, v] = qkv.clone();
                let out = B::causal_attention(q, k, v, mask.clone(), layout, true);
                let probs = out.probs.expect("the attention was asked for its weights");
                prep.finish(CausalState { qkv, mask, probs, layout }, out.context)
            }
            OpsKind::UnTracked(prep) => prep.finish(
                B::causal_attention(q.primitive, k.primitive, v.primitive, mask.primitive, layout, false)
                    .context,
            ),
        };
        CausalAttentionOutput { context, probs: None }
    }

    fn weighted_kl_loss(
        student: FloatTensor<Self>,
        teacher: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        temperature: f64,
        _with_grad: bool,
    ) -> LossWithGrad<Self> {
        let loss =
            match PrecomputedSingleBackward.prepare::<C>([student.node.clone()]).compute_bound().stateful() {
                OpsKind::Tracked(prep) => {
                    let out = B::weighted_kl_loss(
                        student.primitive,
                        teacher.primitive,
                        weights.primitive,
                        temperature,
                        true,
                    );
                    prep.finish(out.grad.expect("the KL was asked for its gradient"), out.loss)
                }
                OpsKind::UnTracked(prep) => prep.finish(
                    B::weighted_kl_loss(
                        student.primitive,
                        teacher.primitive,
                        weights.primitive,
                        temperature,
                        false,
                    )
                    .loss,
                ),
            };
        LossWithGrad { loss, grad: None }
    }

    fn max_pool2x2(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match MaxPoolBackward.prepare::<C>([x.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (output, indices) = B::max_pool2x2_with_indices(x.primitive.clone());
                prep.finish((x.primitive, indices), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::max_pool2x2(x.primitive)),
        }
    }
}
