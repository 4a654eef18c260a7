//! Per-block distillation losses.
//!
//! Both losses reduce to a one-element tensor so that `backward()` can be
//! called on the result directly. They go through [`FusedBackend`], so on
//! wgpu and cuda they run as one fused kernel that also writes the gradient.

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::{FusedBackend, LossWithGrad};

/// `KL(teacher || student)` of each row of `[rows, classes]`
/// log-probabilities: `sum_j exp(t_j) (t_j - s_j)`, as `[rows]`. The one
/// place the formula is written: the distillation loss through an LM head
/// ([`weighted_kl_reference`]) and the language-model evaluation's KL both
/// use it.
pub fn kl_rows<B: Backend>(student_log_probs: Tensor<B, 2>, teacher_log_probs: Tensor<B, 2>) -> Tensor<B, 1> {
    let [rows, _] = student_log_probs.dims();
    (teacher_log_probs.clone().exp() * (teacher_log_probs - student_log_probs)).sum_dim(1).reshape([rows])
}

/// [`FusedBackend::weighted_kl_loss`] with burn ops: the loss and, with
/// `with_grad`, `T w_r / W (softmax(s_r / T) - softmax(t_r / T))`.
pub fn weighted_kl_reference<B: Backend>(
    student: FloatTensor<B>,
    teacher: FloatTensor<B>,
    weights: FloatTensor<B>,
    temperature: f64,
    with_grad: bool,
) -> LossWithGrad<B> {
    let student = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(student));
    let teacher = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(teacher));
    let weights = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(weights));
    let [rows, _] = student.dims();
    let scale = 1.0 / temperature;
    let s = log_softmax(student.mul_scalar(scale), 1);
    let t = log_softmax(teacher.mul_scalar(scale), 1);
    let per_row = kl_rows(s.clone(), t.clone());
    let total = weights.clone().sum().clamp_min(1e-12);
    let loss = (per_row * weights.clone()).sum().div(total.clone()).mul_scalar(temperature * temperature);
    let grad = with_grad.then(|| {
        let row_scale = (weights / total).mul_scalar(temperature).reshape([rows, 1]);
        ((s.exp() - t.exp()) * row_scale).into_primitive().tensor()
    });
    LossWithGrad { loss: loss.into_primitive().tensor(), grad }
}

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
/// tokens and 0 for padding. Each sequence's error is averaged over its own
/// real tokens (times `hidden`), then the sequences are averaged: padding
/// contributes neither to the loss nor to its gradient, and the loss of a
/// batch is the mean of the losses of its parts, so replicas that each take
/// a share of the batch and weight their loss by that share add up to
/// exactly the whole batch's gradient.
pub fn masked_mse<B: FusedBackend>(
    student: Tensor<B, 3>,
    teacher: Tensor<B, 3>,
    mask: Tensor<B, 2>,
) -> Tensor<B, 1> {
    let [_, tokens, _] = student.dims();
    // (s - t)^2 * mask / real == (s * w - t * w)^2 with w = mask / sqrt(real).
    let real = mask.clone().sum_dim(1).clamp_min(1.0);
    let weights = (mask / real.sqrt()).unsqueeze_dim::<3>(2);
    // mse averages over batch * tokens * hidden; the sum over tokens is wanted.
    mse(student * weights.clone(), teacher * weights).mul_scalar(tokens as f32)
}

/// Added to the teacher's squared norm in the normalized MSEs, so that a
/// zero target (a padding row, a dead channel) divides by no zero.
pub const NMSE_EPSILON: f32 = 1e-6;

/// Normalized MSE over the real tokens (ModelOpt puzzletron's relative L2,
/// `sum((s - t)^2) / (sum(t^2) + eps)`), per sequence over its real tokens,
/// then averaged over the sequences: each block's loss has the same scale
/// whatever the norm of its states (a decoder's last layers carry states a
/// hundred times larger than its first). Per sequence rather than per whole
/// batch so that, as for [`masked_mse`], replicas that each take a share of
/// the batch and weight their loss by it add up to the whole batch's loss.
/// Shapes as [`masked_mse`]. Burn ops (autodiff gives the backward).
pub fn masked_nmse<B: FusedBackend>(
    student: Tensor<B, 3>,
    teacher: Tensor<B, 3>,
    mask: Tensor<B, 2>,
) -> Tensor<B, 1> {
    let mask = mask.unsqueeze_dim::<3>(2);
    let error = ((student - teacher.clone()) * mask.clone()).powi_scalar(2).sum_dim(2).sum_dim(1);
    let norm = (teacher * mask).powi_scalar(2).sum_dim(2).sum_dim(1).add_scalar(NMSE_EPSILON);
    (error / norm).mean()
}

/// Normalized MSE per token vector, `|s - t|^2 / (|t|^2 + eps)`, averaged
/// over each sequence's real tokens, then over the sequences: every token
/// counts alike, however large its state (the few tokens that carry a
/// model's massive activations do not dominate). Shapes as [`masked_mse`].
pub fn masked_nmse_token<B: FusedBackend>(
    student: Tensor<B, 3>,
    teacher: Tensor<B, 3>,
    mask: Tensor<B, 2>,
) -> Tensor<B, 1> {
    let [batch, tokens, _] = student.dims();
    let error = (student - teacher.clone()).powi_scalar(2).sum_dim(2).reshape([batch, tokens]);
    let norm = teacher.powi_scalar(2).sum_dim(2).reshape([batch, tokens]).add_scalar(NMSE_EPSILON);
    let real = mask.clone().sum_dim(1).clamp_min(1.0);
    ((error / norm * mask).sum_dim(1) / real).mean()
}

/// Normalized MSE of whole samples (flat vectors or feature maps): each
/// sample's `|s - t|^2 / (|t|^2 + eps)`, averaged over the batch.
pub fn nmse<B: FusedBackend, const D: usize>(student: Tensor<B, D>, teacher: Tensor<B, D>) -> Tensor<B, 1> {
    let batch = student.dims()[0];
    let error = (student - teacher.clone()).powi_scalar(2).reshape([batch as i32, -1]).sum_dim(1);
    let norm = teacher.powi_scalar(2).reshape([batch as i32, -1]).sum_dim(1).add_scalar(NMSE_EPSILON);
    (error / norm).mean()
}

/// One minus the cosine between the mean-pooled sentence embeddings of the
/// student and the teacher, averaged over the batch: `student` and `teacher`
/// are `[batch, tokens, hidden]`, `mask` is `[batch, tokens]` (1 for real
/// tokens). The pooling is [`crate::encoder::mean_pool_normalized`], the
/// sentence embedding of sentence-transformers models, so minimising this
/// loss maximises exactly the embedding cosine that a text student is scored
/// on. Padding reaches neither the loss nor its gradient; like
/// [`masked_mse`] the loss of a batch is the mean of its sequences' losses.
/// Plain burn ops (autodiff), no fused kernel: it runs once per step on the
/// last block only.
pub fn pooled_cosine_distance<B: burn::tensor::backend::Backend>(
    student: Tensor<B, 3>,
    teacher: Tensor<B, 3>,
    mask: Tensor<B, 2>,
) -> Tensor<B, 1> {
    let student = crate::encoder::mean_pool_normalized(student, mask.clone());
    let teacher = crate::encoder::mean_pool_normalized(teacher, mask);
    let cosines = (student * teacher).sum_dim(1);
    cosines.neg().add_scalar(1.0).mean()
}

/// Weighted mean over rows of `KL(softmax(teacher / T) || softmax(student /
/// T))`, times `T²` (Hinton et al.'s scaling, so that gradient sizes do not
/// shrink with the temperature): `student` and `teacher` are `[rows,
/// classes]` scores, `weights` is `[rows]` (0 for rows that must not count,
/// such as padding). The teacher side carries no gradient. Plain burn ops
/// (autodiff): the fused [`FusedBackend::weighted_kl_loss`] matches it in
/// the kernel checks, but a stitched pass through a 7-class head trained
/// worse on it (tests/integration/stitch.rs, not yet understood), so it is
/// not used here yet. Rows with zero total weight give 0.
pub fn weighted_kl<B: FusedBackend>(
    student: Tensor<B, 2>,
    teacher: Tensor<B, 2>,
    weights: Tensor<B, 1>,
    temperature: f64,
) -> Tensor<B, 1> {
    // The reference's burn ops, differentiated by autodiff (the formula
    // lives once, in `weighted_kl_reference`).
    let out = weighted_kl_reference::<B>(
        student.into_primitive().tensor(),
        teacher.detach().into_primitive().tensor(),
        weights.into_primitive().tensor(),
        temperature,
        false,
    );
    Tensor::from_primitive(TensorPrimitive::Float(out.loss))
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

    #[test]
    fn masked_mse_is_the_mean_of_per_sequence_means() {
        let device = Default::default();
        // Sequence 1: one real token, error 2 per element; sequence 2: two
        // real tokens with errors 1 and 3 per element.
        let student = Tensor::<Flex, 3>::from_floats([[[2.0], [9.0]], [[1.0], [3.0]]], &device);
        let teacher = Tensor::<Flex, 3>::zeros([2, 2, 1], &device);
        let mask = Tensor::<Flex, 2>::from_floats([[1.0, 0.0], [1.0, 1.0]], &device);
        let whole = masked_mse(student.clone(), teacher.clone(), mask.clone()).into_scalar();
        assert!((whole - (4.0 + 5.0) / 2.0).abs() < 1e-5, "{whole}");
        // Halves weighted by their share of the batch add up to the whole.
        let half = |i| {
            masked_mse(
                student.clone().narrow(0, i, 1),
                teacher.clone().narrow(0, i, 1),
                mask.clone().narrow(0, i, 1),
            )
            .into_scalar()
        };
        assert!((0.5 * half(0) + 0.5 * half(1) - whole).abs() < 1e-5);
    }

    #[test]
    fn normalized_mses_divide_by_the_teachers_norm_per_sequence_or_token() {
        let device = Default::default();
        // Sequence 1: tokens t = (3, 4) and (0, 1) [padding: (9, 9)], student
        // off by (1, 0) on the first and (0, 1) on the second; sequence 2: one
        // real token t = (2, 0), student off by (0, 1).
        let teacher =
            Tensor::<Flex, 3>::from_floats([[[3.0, 4.0], [0.0, 1.0]], [[2.0, 0.0], [9.0, 9.0]]], &device);
        let student =
            Tensor::<Flex, 3>::from_floats([[[4.0, 4.0], [0.0, 2.0]], [[2.0, 1.0], [0.0, 0.0]]], &device);
        let mask = Tensor::<Flex, 2>::from_floats([[1.0, 1.0], [1.0, 0.0]], &device);
        let eps = f64::from(NMSE_EPSILON);
        // Per sequence: (1 + 1) / (25 + 1) and 1 / 4.
        let per_sequence = (2.0 / (26.0 + eps) + 1.0 / (4.0 + eps)) / 2.0;
        let got = f64::from(masked_nmse(student.clone(), teacher.clone(), mask.clone()).into_scalar());
        assert!((got - per_sequence).abs() < 1e-6, "nmse {got}, by hand {per_sequence}");
        // Per token: (1/25 + 1/1) / 2 for the first sequence, 1/4 for the second.
        let per_token = ((1.0 / (25.0 + eps) + 1.0 / (1.0 + eps)) / 2.0 + 1.0 / (4.0 + eps)) / 2.0;
        let got = f64::from(masked_nmse_token(student.clone(), teacher.clone(), mask.clone()).into_scalar());
        assert!((got - per_token).abs() < 1e-6, "nmse-token {got}, by hand {per_token}");
        // Scaling both sides leaves them unchanged (the point of them).
        let scaled =
            masked_nmse(student.clone().mul_scalar(100.0), teacher.clone().mul_scalar(100.0), mask.clone());
        assert!((f64::from(scaled.into_scalar()) - per_sequence).abs() < 1e-5);
        // Whole samples: sequence 1 = 2 / 26, sequence 2 (padding included) = (1 + 162) / (4 + 162).
        let whole = (2.0 / (26.0 + eps) + 163.0 / (166.0 + eps)) / 2.0;
        let got = f64::from(nmse(student, teacher).into_scalar());
        assert!((got - whole).abs() < 1e-6, "nmse of samples {got}, by hand {whole}");
    }

    #[test]
    fn the_normalized_mse_gradient_is_twice_the_error_over_the_teachers_norm_on_real_tokens_only() {
        type B = burn::backend::Autodiff<Flex>;
        let device = Default::default();
        let teacher = Tensor::<B, 3>::from_floats([[[3.0, 4.0], [5.0, 5.0]]], &device);
        let student = Tensor::<B, 3>::from_floats([[[4.0, 4.0], [1.0, 2.0]]], &device).require_grad();
        let mask = Tensor::<B, 2>::from_floats([[1.0, 0.0]], &device);
        let grads = masked_nmse(student.clone(), teacher, mask).backward();
        let grad = student.grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap();
        // d/ds |s - t|^2 / (|t|^2 + eps) = 2 (s - t) / (|t|^2 + eps) on the real token.
        let expected = [2.0 / (25.0 + NMSE_EPSILON), 0.0, 0.0, 0.0];
        for (g, e) in grad.iter().zip(expected) {
            assert!((g - e).abs() < 1e-7, "{grad:?} vs {expected:?}");
        }
    }

    #[test]
    fn pooled_cosine_distance_is_one_minus_the_cosine_of_the_real_token_means() {
        let device = Default::default();
        // Sequence 1: real tokens [1, 0] and [1, 2] (mean [1, 1]), padding huge;
        // sequence 2: one real token [0, 3].
        let student = Tensor::<Flex, 3>::from_floats(
            [[[1.0, 0.0], [1.0, 2.0], [50.0, -90.0]], [[0.0, 3.0], [7.0, 7.0], [-4.0, 1.0]]],
            &device,
        );
        // Teacher means: [2, 0] and [0, 1]; padding again different.
        let teacher = Tensor::<Flex, 3>::from_floats(
            [[[2.0, 0.0], [2.0, 0.0], [-3.0, 8.0]], [[0.0, 1.0], [0.0, -5.0], [9.0, 9.0]]],
            &device,
        );
        let mask = Tensor::<Flex, 2>::from_floats([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], &device);
        let loss = pooled_cosine_distance(student, teacher, mask).into_scalar();
        // cos([1,1],[2,0]) = 1/sqrt(2); cos([0,3],[0,1]) = 1.
        let expected = ((1.0 - 1.0 / 2f32.sqrt()) + 0.0) / 2.0;
        assert!((loss - expected).abs() < 1e-6, "{loss} vs {expected}");
    }

    #[test]
    fn weighted_kl_matches_a_hand_computation_and_skips_zero_weight_rows() {
        let device = Default::default();
        // Row 1: teacher (0.5, 0.5), student (0.8, 0.2) as log-probabilities;
        // row 2 has weight 0 and wildly different scores.
        let teacher = Tensor::<Flex, 2>::from_floats([[0.0, 0.0], [9.0, -9.0]], &device);
        let student = Tensor::<Flex, 2>::from_floats([[0.8f32.ln(), 0.2f32.ln()], [-9.0, 9.0]], &device);
        let weights = Tensor::<Flex, 1>::from_floats([1.0, 0.0], &device);
        let kl = weighted_kl(student.clone(), teacher.clone(), weights, 1.0).into_scalar();
        let expected = 0.5 * (0.5f32 / 0.8).ln() + 0.5 * (0.5f32 / 0.2).ln();
        assert!((kl - expected).abs() < 1e-6, "{kl} vs {expected}");
        // Equal weights average the rows; a distribution against itself is 0.
        let same = weighted_kl(teacher.clone(), teacher, Tensor::ones([2], &device), 2.0).into_scalar();
        assert!(same.abs() < 1e-6, "{same}");
        // At temperature 2 the scores are halved and the KL multiplied by 4.
        let hot = weighted_kl(
            student.narrow(0, 0, 1),
            Tensor::<Flex, 2>::from_floats([[0.0, 0.0]], &device),
            Tensor::ones([1], &device),
            2.0,
        )
        .into_scalar();
        let (a, b) = (0.8f32.sqrt(), 0.2f32.sqrt());
        let (p, q) = (a / (a + b), b / (a + b));
        let expected = 4.0 * (0.5 * (0.5 / p).ln() + 0.5 * (0.5 / q).ln());
        assert!((hot - expected).abs() < 1e-5, "{hot} vs {expected}");
    }
}
