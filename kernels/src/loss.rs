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
