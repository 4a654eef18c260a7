//! Per-block distillation losses.
//!
//! Both losses reduce to a one-element tensor so that `backward()` can be
//! called on the result directly. They go through [`FusedBackend`], so on
//! wgpu and cuda they run as one fused kernel that also writes the gradient.

use burn::tensor::{Tensor, TensorPrimitive};

use crate::FusedBackend;

/// Mean squared error between a student block's output and the teacher's,
/// averaged over every element (batch included).
pub fn mse<B: FusedBackend, const D: usize>(student: Tensor<B, D>, teacher: Tensor<B, D>) -> Tensor<B, 1> {
    let out = B::mse_loss(student.into_primitive().tensor(), teacher.into_primitive().tensor(), false);
    Tensor::from_primitive(TensorPrimitive::Float(out.loss))
}

/// Soft-target cross-entropy of student logits against the teacher's softmax
/// (temperature 1), averaged over the batch.
///
/// `student` and `teacher` are `[batch, classes]` logits.
pub fn soft_target_cross_entropy<B: FusedBackend>(
    student: Tensor<B, 2>,
    teacher: Tensor<B, 2>,
) -> Tensor<B, 1> {
    let out =
        B::soft_target_ce_loss(student.into_primitive().tensor(), teacher.into_primitive().tensor(), false);
    Tensor::from_primitive(TensorPrimitive::Float(out.loss))
}

/// MSE over the real tokens of a batch of sequences: `student` and `teacher`
/// are `[batch, tokens, hidden]`, `mask` is `[batch, tokens]` with 1 for real
/// tokens and 0 for padding. Padding positions contribute neither to the
/// loss nor to its gradient; the mean is over real tokens times `hidden`.
pub fn masked_mse<B: FusedBackend>(
    student: Tensor<B, 3>,
    teacher: Tensor<B, 3>,
    mask: Tensor<B, 2>,
) -> Tensor<B, 1> {
    let [batch, tokens, _] = student.dims();
    let weights = mask.clone().unsqueeze_dim::<3>(2);
    let over_all = mse(student * weights.clone(), teacher * weights);
    // mse averaged over batch * tokens * hidden; rescale to the real tokens.
    over_all.mul_scalar((batch * tokens) as f32) / mask.sum().clamp_min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn masked_mse_ignores_padding_and_averages_over_real_tokens() {
        let device = Default::default();
        // Two tokens of width 2; the second is padding with a huge error.
        let student = Tensor::<Flex, 3>::from_floats([[[1.0, 2.0], [100.0, -100.0]]], &device);
        let teacher = Tensor::<Flex, 3>::from_floats([[[0.0, 0.0], [0.0, 0.0]]], &device);
        let mask = Tensor::<Flex, 2>::from_floats([[1.0, 0.0]], &device);
        let loss = masked_mse(student, teacher, mask).into_scalar();
        assert!((loss - 2.5).abs() < 1e-6, "{loss}");
    }
}
