//! Per-block distillation losses.
//!
//! Both losses reduce to a one-element tensor so that `backward()` can be
//! called on the result directly.

use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// Mean squared error between a student block's output and the teacher's,
/// averaged over every element (batch included).
pub fn mse<B: Backend, const D: usize>(student: Tensor<B, D>, teacher: Tensor<B, D>) -> Tensor<B, 1> {
    let diff = student - teacher;
    (diff.clone() * diff).mean()
}

/// Soft-target cross-entropy of student logits against the teacher's softmax
/// (temperature 1), averaged over the batch.
///
/// `student` and `teacher` are `[batch, classes]` logits.
pub fn soft_target_cross_entropy<B: Backend>(student: Tensor<B, 2>, teacher: Tensor<B, 2>) -> Tensor<B, 1> {
    let [batch, _] = student.dims();
    let target = softmax(teacher, 1);
    let log_probs = log_softmax(student, 1);
    (target * log_probs).sum().neg().div_scalar(batch as f32)
}
