//! The built-in zoo's decoder LLM on text: SmolLM2's tokens through its
//! frozen token embeddings in front of the first decoder block, and the
//! language-model evaluation of a stitched student (held-out perplexity,
//! next-token top-1 agreement and KL to the teacher, through the teacher's
//! frozen final norm and LM head).

use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};
use pipebd_core::{Activation, BlockSpec};
use pipebd_kernels::FusedBackend;
use pipebd_teachers::minilm::PaddedIds;
use pipebd_teachers::smollm2::{LmHead, TokenEmbeddings};

use pipe_bd::data::text::LanguageReport;
use pipe_bd::jobs::eval::{Evaluate, Network, Score};
use pipe_bd::{Error, Result};

/// Sequences scored at once (the logits of a chunk, `chunk * tokens *
/// vocab` floats, dominate the memory: 100 MB at 8 x 64 x 49,152).
const EVAL_CHUNK: usize = 8;

/// The embedded, padded batch of `sequences` (padding masked out).
pub fn embed_tokens<B: FusedBackend>(
    embeddings: &TokenEmbeddings<B>,
    sequences: &[&[u32]],
    max_tokens: usize,
    device: &B::Device,
) -> Activation<B> {
    let padded = PaddedIds::new(sequences.iter().copied(), max_tokens);
    let (ids, mask) = padded.tensors::<B>(device);
    Activation::Tokens { hidden: embeddings.forward(ids), mask }
}

/// Next-token figures summed over the scored positions of some batches.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Tally {
    /// Positions scored: each real token but a sequence's first, predicted
    /// from the tokens before it.
    pub predicted: usize,
    /// Summed negative log-likelihood of the true next token, teacher.
    pub teacher_nll: f64,
    /// The same for the student.
    pub student_nll: f64,
    /// Positions where the student's most likely token is the teacher's.
    pub agree: usize,
    /// Summed `KL(teacher || student)` of the next-token distributions.
    pub kl: f64,
}

impl Tally {
    /// Adds another tally.
    pub fn add(&mut self, other: Tally) {
        self.predicted += other.predicted;
        self.teacher_nll += other.teacher_nll;
        self.student_nll += other.student_nll;
        self.agree += other.agree;
        self.kl += other.kl;
    }

    /// `exp` of the teacher's mean next-token negative log-likelihood.
    pub fn teacher_perplexity(&self) -> f64 {
        (self.teacher_nll / self.predicted.max(1) as f64).exp()
    }

    /// The student's perplexity.
    pub fn student_perplexity(&self) -> f64 {
        (self.student_nll / self.predicted.max(1) as f64).exp()
    }
}

/// Per-row log-probabilities `[rows, vocab]` of the final states `hidden`
/// `[batch, tokens, width]` through `head`.
fn log_probs<B: FusedBackend>(head: &LmHead<B>, hidden: Tensor<B, 3>) -> Tensor<B, 2> {
    let [batch, tokens, width] = hidden.dims();
    log_softmax(head.forward(hidden.reshape([batch * tokens, width])), 1)
}

fn host_f32<B: FusedBackend>(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

fn host_ids<B: FusedBackend>(t: Tensor<B, 2, Int>) -> Vec<i64> {
    t.into_data().iter::<i64>().collect()
}

/// Scores the final states of the teacher (and of a student, if given) on
/// `sequences`: position `i` of sequence `b` predicts token `i + 1`.
pub fn tally<B: FusedBackend>(
    head: &LmHead<B>,
    sequences: &[&[u32]],
    teacher: Tensor<B, 3>,
    student: Option<Tensor<B, 3>>,
) -> Tally {
    let [batch, tokens, _] = teacher.dims();
    let device = teacher.device();
    let mut targets = vec![0i64; batch * tokens];
    let mut scored = vec![false; batch * tokens];
    for (b, sequence) in sequences.iter().enumerate() {
        for i in 0..sequence.len().min(tokens).saturating_sub(1) {
            targets[b * tokens + i] = i64::from(sequence[i + 1]);
            scored[b * tokens + i] = true;
        }
    }
    let targets = Tensor::<B, 2, Int>::from_data(TensorData::new(targets, [batch * tokens, 1]), &device);
    let teacher = log_probs(head, teacher);
    let teacher_nll = host_f32(teacher.clone().gather(1, targets.clone()));
    let mut tally = Tally { predicted: scored.iter().filter(|&&s| s).count(), ..Tally::default() };
    tally.teacher_nll = sum_scored(&teacher_nll, &scored, |v| -f64::from(v));
    let Some(student) = student else { return tally };
    let student = log_probs(head, student);
    let student_nll = host_f32(student.clone().gather(1, targets));
    tally.student_nll = sum_scored(&student_nll, &scored, |v| -f64::from(v));
    let teacher_top = host_ids(teacher.clone().argmax(1));
    let student_top = host_ids(student.clone().argmax(1));
    tally.agree = (0..scored.len()).filter(|&r| scored[r] && teacher_top[r] == student_top[r]).count();
    let kl = host_f32((teacher.clone().exp() * (teacher - student)).sum_dim(1));
    tally.kl = sum_scored(&kl, &scored, f64::from);
    tally
}

fn sum_scored(values: &[f32], scored: &[bool], f: impl Fn(f32) -> f64) -> f64 {
    values.iter().zip(scored).filter(|(_, &s)| s).map(|(&v, _)| f(v)).sum()
}

/// The final token states of `network` on `sequences` (an error naming the
/// last block if it gives something else).
fn final_states<B: FusedBackend>(network: &Network<'_, B>, input: Activation<B>) -> Result<Tensor<B, 3>> {
    match network.forward(input)? {
        Activation::Tokens { hidden, .. } => Ok(hidden),
        other => Err(Error::block(
            network.blocks(),
            format!("the last block must produce token states, got {:?}", other.dims()),
        )),
    }
}

/// The evaluation of a decoder LLM student: the teacher's and the stitched
/// student's next-token predictions on held-out sentences, through the
/// teacher's frozen embeddings and LM head.
pub struct NextTokenScores<B: FusedBackend> {
    /// The teacher's token embeddings (input preparation).
    pub embeddings: TokenEmbeddings<B>,
    /// The teacher's final norm and LM head.
    pub head: LmHead<B>,
    /// Held-out sentences, tokenised.
    pub heldout: Vec<Vec<u32>>,
    /// Tokens per sequence.
    pub max_tokens: usize,
}

impl<B: FusedBackend> NextTokenScores<B> {
    /// Tallies `teacher` (and `student`) over the held-out sentences.
    pub fn run(
        &self,
        teacher: &Network<'_, B>,
        student: Option<&Network<'_, B>>,
        device: &B::Device,
    ) -> Result<Tally> {
        let mut total = Tally::default();
        for part in self.heldout.chunks(EVAL_CHUNK) {
            let refs: Vec<&[u32]> = part.iter().map(Vec::as_slice).collect();
            let input = embed_tokens(&self.embeddings, &refs, self.max_tokens, device);
            let student = match student {
                Some(student) => Some(final_states(student, input.clone())?),
                None => None,
            };
            let teacher = final_states(teacher, input)?;
            total.add(tally(&self.head, &refs, teacher, student));
        }
        Ok(total)
    }
}

impl<B: FusedBackend> Evaluate<B> for NextTokenScores<B> {
    /// The accuracies are next-token top-1 accuracies (the true next token);
    /// the figures that matter are in the report's `language`.
    fn score(&self, teacher: &Network<'_, B>, student: &Network<'_, B>, device: &B::Device) -> Result<Score> {
        let tally = self.run(teacher, Some(student), device)?;
        let sum = |specs: &[BlockSpec], f: fn(&BlockSpec) -> f64| specs.iter().map(f).sum::<f64>();
        let ratio = |f: fn(&BlockSpec) -> f64| sum(student.specs, f) / sum(teacher.specs, f);
        let predicted = tally.predicted.max(1) as f64;
        Ok(Score {
            teacher_accuracy: 0.0,
            student_accuracy: tally.agree as f64 / predicted,
            test_samples: tally.predicted,
            text: None,
            language: Some(LanguageReport {
                heldout_sequences: self.heldout.len(),
                predicted_tokens: tally.predicted,
                max_tokens: self.max_tokens,
                teacher_perplexity: tally.teacher_perplexity(),
                student_perplexity: tally.student_perplexity(),
                top1_agreement: tally.agree as f64 / predicted,
                mean_kl: tally.kl / predicted,
                params_ratio: ratio(|s| s.params as f64),
                flops_ratio: ratio(|s| s.flops as f64),
            }),
        })
    }

    /// The teacher's perplexity is not an accuracy: this gives 0 and the
    /// positions scored; `pipebd run` and `eval` report the perplexity.
    fn score_teacher(&self, teacher: &Network<'_, B>, device: &B::Device) -> Result<(f64, usize)> {
        let tally = self.run(teacher, None, device)?;
        Ok((0.0, tally.predicted))
    }
}
