//! A frozen head after a teacher's last block: what turns its final
//! activation into the scores a prediction is read from (a language model's
//! final norm and LM head, say). The stitched pass can distil through it
//! (`train.stitched_output_loss = "head-kl"`): the student's final
//! activation goes through the same frozen head, and the loss is the KL of
//! the teacher's and the student's distributions over those scores.

use burn::tensor::Tensor;

use crate::{Activation, FusedBackend, Result};

/// Class scores read from a network's final activation, one row per
/// prediction, with each row's weight.
#[derive(Debug, Clone)]
pub struct HeadScores<B: burn::tensor::backend::Backend> {
    /// `[rows, classes]` unnormalised scores (logits).
    pub scores: Tensor<B, 2>,
    /// `[rows]` weights: 1 for a row that counts, 0 for one that must not
    /// (a padding token's).
    pub weights: Tensor<B, 1>,
}

/// A frozen map from the last block's output to class scores. Implement it
/// for a teacher whose blocks end before its prediction (a decoder's hidden
/// states before the LM head); the head's parameters take no gradient, but
/// gradients flow through it to the activation.
pub trait OutputHead<B: FusedBackend> {
    /// The scores of `output`, the last block's output for a batch.
    fn scores(&self, output: Activation<B>) -> Result<HeadScores<B>>;
}

/// `KL(teacher || student)` of the softmax distributions over `head`'s
/// scores of the two final activations, at `temperature` (times its square),
/// averaged over the teacher's row weights. Gradients reach `student` only.
pub fn head_kl<B: FusedBackend>(
    head: &dyn OutputHead<B>,
    student: Activation<B>,
    teacher: Activation<B>,
    temperature: f64,
) -> Result<Tensor<B, 1>> {
    crate::loss::check_temperature(temperature)?;
    let student = head.scores(student)?;
    let teacher = head.scores(teacher)?;
    if student.scores.dims() != teacher.scores.dims() {
        return Err(crate::Error::block(format!(
            "the head scores the student as {:?} and the teacher as {:?}",
            student.scores.dims(),
            teacher.scores.dims()
        )));
    }
    Ok(pipebd_kernels::loss::weighted_kl(student.scores, teacher.scores, teacher.weights, temperature))
}
