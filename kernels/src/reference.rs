//! The fused ops written with ordinary burn tensor ops.
//!
//! These are the fallback of [`FusedBackend`](crate::FusedBackend) on backends
//! without our kernels (flex), the reference the kernel tests compare against,
//! and the "unfused" side of the kernel benchmark.

use burn::tensor::activation::{gelu, log_softmax, relu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::ops::{ConvOptions, FloatTensor, IntTensor};
use burn::tensor::{Tensor, TensorMetadata, TensorPrimitive};

use crate::{BiasAxis, Epilogue, LossWithGrad};

/// A float primitive as a rank-`D` tensor (for the burn-op paths).
pub(crate) fn wrap<B: Backend, const D: usize>(primitive: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

/// A tensor's float primitive (what the [`crate::FusedBackend`] ops take).
pub(crate) fn unwrap<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> FloatTensor<B> {
    tensor.into_primitive().tensor()
}

/// Flattens any-rank primitives to rank 1 (the losses are elementwise).
fn flat<B: Backend>(primitive: FloatTensor<B>) -> Tensor<B, 1> {
    let n = burn::tensor::TensorMetadata::shape(&primitive).num_elements();
    wrap::<B, 1>(B::float_reshape(primitive, [n].into()))
}

/// `mean((s - t)^2)` with burn ops; the gradient `2 (s - t) / n` when asked.
pub fn mse_with_grad<B: Backend>(
    student: FloatTensor<B>,
    teacher: FloatTensor<B>,
    with_grad: bool,
) -> LossWithGrad<B> {
    let shape = burn::tensor::TensorMetadata::shape(&student);
    let n = shape.num_elements();
    let diff = flat::<B>(student) - flat::<B>(teacher);
    let loss = diff.clone().powi_scalar(2).mean();
    let grad = with_grad.then(|| B::float_reshape(unwrap(diff.mul_scalar(2.0 / n as f32)), shape));
    LossWithGrad { loss: unwrap(loss), grad }
}

/// Soft-target cross-entropy with burn ops; the gradient when asked.
pub fn soft_target_ce_with_grad<B: Backend>(
    student: FloatTensor<B>,
    teacher: FloatTensor<B>,
    with_grad: bool,
) -> LossWithGrad<B> {
    let student = wrap::<B, 2>(student);
    let [batch, _] = student.dims();
    let target = softmax(wrap::<B, 2>(teacher), 1);
    let log_probs = log_softmax(student, 1);
    let grad = with_grad.then(|| unwrap((log_probs.clone().exp() - target.clone()).div_scalar(batch as f32)));
    let loss = (target * log_probs).sum().neg().div_scalar(batch as f32);
    LossWithGrad { loss: unwrap(loss), grad }
}

/// `grad * upstream[0]` with burn ops (a broadcast multiply).
pub fn scale_by_scalar<B: Backend>(grad: FloatTensor<B>, upstream: FloatTensor<B>) -> FloatTensor<B> {
    let rank = burn::tensor::TensorMetadata::shape(&grad).num_dims();
    B::float_mul(grad, B::float_reshape(upstream, vec![1; rank].into()))
}

/// The epilogue's backward with burn ops (see
/// [`FusedBackend::epilogue_backward`](crate::FusedBackend::epilogue_backward)).
pub fn epilogue_backward<B: Backend>(
    grad: FloatTensor<B>,
    saved: FloatTensor<B>,
    epilogue: Epilogue,
) -> FloatTensor<B> {
    let (grad, saved) = (wrap::<B, 3>(grad), wrap::<B, 3>(saved));
    let pre_grad = match epilogue {
        Epilogue::Identity => grad,
        Epilogue::Relu => grad.mask_fill(saved.lower_equal_elem(0.0), 0.0),
        Epilogue::Relu6 => {
            let outside = saved.clone().lower_equal_elem(0.0).bool_or(saved.greater_equal_elem(6.0));
            grad.mask_fill(outside, 0.0)
        }
        Epilogue::Gelu => wrap(B::gelu_backward(unwrap(saved), unwrap(grad))),
    };
    unwrap(pre_grad)
}

/// The bias gradient of a fused matmul with burn ops (`sum_dim`).
pub fn bias_grad<B: Backend>(grad: FloatTensor<B>, axis: BiasAxis) -> FloatTensor<B> {
    let summed = wrap::<B, 3>(grad).sum_dim(0);
    let summed = match axis {
        BiasAxis::Rows => summed.sum_dim(2),
        BiasAxis::Cols => summed.sum_dim(1),
    };
    let n = summed.shape().num_elements();
    unwrap(summed.reshape([n]))
}

/// `act(conv2d(x, weight) + bias)` with burn's `conv2d` and the activation.
pub fn conv2d_epilogue<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    options: ConvOptions<2>,
    epilogue: Epilogue,
) -> FloatTensor<B> {
    unwrap(activate(wrap::<B, 4>(B::conv2d(x, weight, bias, options)), epilogue))
}

/// The input gradient (when asked for) and the weight gradient of `conv2d`
/// from the gradient of its output, with burn's backward ops.
pub fn conv2d_backward<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
    options: ConvOptions<2>,
    x_grad: bool,
) -> (Option<FloatTensor<B>>, FloatTensor<B>) {
    let dx = x_grad.then(|| B::conv2d_x_backward(x.clone(), weight.clone(), grad.clone(), options.clone()));
    (dx, B::conv2d_weight_backward(x, weight, grad, options))
}

/// Zeros of the shape of `conv2d(x, weight)`'s output (for ops that need a
/// tensor of that shape, such as burn's max-pool backward).
pub fn conv_output_zeros<B: Backend>(
    x: &FloatTensor<B>,
    weight: &FloatTensor<B>,
    options: &ConvOptions<2>,
) -> FloatTensor<B> {
    let [batch, _, h, w] = x.shape().dims::<4>();
    let [c_out, _, kh, kw] = weight.shape().dims::<4>();
    let size = |i: usize, input: usize, kernel: usize| {
        (input + 2 * options.padding[i]).saturating_sub(options.dilation[i] * (kernel - 1) + 1)
            / options.stride[i]
            + 1
    };
    let shape = [batch, c_out, size(0, h, kh), size(1, w, kw)];
    B::float_zeros(shape.into(), &B::float_device(x), x.dtype().into())
}

/// burn's 2x2, stride-2 max-pool (no padding, floor): output and indices.
pub fn max_pool2x2_with_indices<B: Backend>(x: FloatTensor<B>) -> (FloatTensor<B>, IntTensor<B>) {
    let pooled = B::max_pool2d_with_indices(x, [2, 2], [2, 2], [0, 0], [1, 1], false);
    (pooled.output, pooled.indices)
}

/// The input gradient of [`max_pool2x2_with_indices`] with burn's op.
pub fn max_pool2x2_backward<B: Backend>(
    x: FloatTensor<B>,
    grad: FloatTensor<B>,
    indices: IntTensor<B>,
) -> FloatTensor<B> {
    B::max_pool2d_with_indices_backward(x, [2, 2], [2, 2], [0, 0], [1, 1], false, grad, indices).x_grad
}

/// Applies an epilogue activation with burn ops.
pub fn activate<B: Backend, const D: usize>(x: Tensor<B, D>, epilogue: Epilogue) -> Tensor<B, D> {
    match epilogue {
        Epilogue::Identity => x,
        Epilogue::Relu => relu(x),
        Epilogue::Relu6 => x.clamp(0.0, 6.0),
        Epilogue::Gelu => gelu(x),
    }
}

/// The activation of any-rank `x` with burn's ops.
pub fn activation<B: Backend>(x: FloatTensor<B>, epilogue: Epilogue) -> FloatTensor<B> {
    let shape = x.shape();
    B::float_reshape(unwrap(activate(flat::<B>(x), epilogue)), shape)
}

/// `act(lhs @ rhs + bias)` with burn ops (`matmul`, `add`, the activation),
/// with the shapes of [`FusedBackend::matmul_epilogue`](crate::FusedBackend::matmul_epilogue).
pub fn matmul_epilogue<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    bias: Option<(FloatTensor<B>, BiasAxis)>,
    epilogue: Epilogue,
    sum_batch: bool,
) -> FloatTensor<B> {
    let (lhs, rhs) = (wrap::<B, 3>(lhs), wrap::<B, 3>(rhs));
    let [zl, m, _] = lhs.dims();
    let [zr, _, n] = rhs.dims();
    let mut product = lhs.matmul(rhs);
    if sum_batch && zl.max(zr) > 1 {
        product = product.sum_dim(0);
    }
    let pre = match bias {
        None => product,
        Some((bias, BiasAxis::Rows)) => product + wrap::<B, 1>(bias).reshape([1, m, 1]),
        Some((bias, BiasAxis::Cols)) => product + wrap::<B, 1>(bias).reshape([1, 1, n]),
    };
    unwrap(activate(pre, epilogue))
}

/// The unfused distillation losses and layers as a user would write them with
/// burn ops, differentiated by burn's autodiff: the baseline of the benchmark.
pub mod unfused {
    use super::*;

    /// `mean((s - t)^2)`.
    pub fn mse<B: Backend, const D: usize>(student: Tensor<B, D>, teacher: Tensor<B, D>) -> Tensor<B, 1> {
        let diff = student - teacher;
        (diff.clone() * diff).mean()
    }

    /// Soft-target cross-entropy of `[batch, classes]` logits.
    pub fn soft_target_cross_entropy<B: Backend>(
        student: Tensor<B, 2>,
        teacher: Tensor<B, 2>,
    ) -> Tensor<B, 1> {
        let [batch, _] = student.dims();
        let target = softmax(teacher, 1);
        (target * log_softmax(student, 1)).sum().neg().div_scalar(batch as f32)
    }

    /// `act(x @ weight + bias)`.
    pub fn linear<B: Backend>(
        x: Tensor<B, 2>,
        weight: Tensor<B, 2>,
        bias: Option<Tensor<B, 1>>,
        epilogue: Epilogue,
    ) -> Tensor<B, 2> {
        let product = x.matmul(weight);
        let pre = match bias {
            Some(bias) => product + bias.unsqueeze::<2>(),
            None => product,
        };
        activate(pre, epilogue)
    }

    /// `act(conv1x1(x) + bias)`, as burn's `Conv2d` computes it.
    pub fn pointwise_conv<B: Backend>(
        x: Tensor<B, 4>,
        weight: Tensor<B, 4>,
        bias: Option<Tensor<B, 1>>,
        epilogue: Epilogue,
    ) -> Tensor<B, 4> {
        let options = burn::tensor::ops::ConvOptions::new([1, 1], [0, 0], [1, 1], 1);
        activate(burn::tensor::module::conv2d(x, weight, bias, options), epilogue)
    }
}
