//! What the text teachers' evaluations report, as sections of the engine's
//! [`Score`](pipe_bd::eval::Score) (`text` for sentence embeddings,
//! `language` for a decoder LLM), and the arithmetic behind them: the
//! cosine of sentence embeddings, its breakdown by sentence length, and a
//! logistic-regression probe fitted on frozen embeddings (a downstream task
//! scored for teacher and student alike). Which corpus, tokenizer and
//! teacher produce the embeddings, and the probe's settings, are in
//! [`text`](crate::text) and [`lm`](crate::lm).

use pipe_bd::eval::ScoreSection;
use serde::{Deserialize, Serialize};

/// Cosine similarity of two vectors.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb).max(1e-30)
}

/// A binary logistic regression fitted by full-batch gradient descent (with
/// Nesterov momentum) on standardised features, L2-regularised.
#[derive(Debug, Clone)]
pub struct LogisticProbe {
    mean: Vec<f64>,
    scale: Vec<f64>,
    weights: Vec<f64>,
    bias: f64,
}

impl LogisticProbe {
    /// Fits on `features` with labels `labels` (true = positive class).
    pub fn fit(features: &[Vec<f32>], labels: &[bool], l2: f64, iterations: usize) -> Self {
        let n = features.len().max(1) as f64;
        let dims = features.first().map_or(0, Vec::len);
        let mut mean = vec![0.0; dims];
        for f in features {
            for (m, x) in mean.iter_mut().zip(f) {
                *m += *x as f64 / n;
            }
        }
        let mut scale = vec![0.0; dims];
        for f in features {
            for ((s, x), m) in scale.iter_mut().zip(f).zip(&mean) {
                *s += (*x as f64 - m).powi(2) / n;
            }
        }
        let scale: Vec<f64> = scale.into_iter().map(|v| 1.0 / v.sqrt().max(1e-8)).collect();
        let standard: Vec<Vec<f64>> = features
            .iter()
            .map(|f| f.iter().zip(&mean).zip(&scale).map(|((x, m), s)| (*x as f64 - m) * s).collect())
            .collect();
        let mut probe = Self { mean, scale, weights: vec![0.0; dims], bias: 0.0 };
        let (mut velocity, mut velocity_bias) = (vec![0.0; dims], 0.0);
        let (lr, momentum) = (0.5, 0.9);
        for _ in 0..iterations {
            // Nesterov: the gradient at the look-ahead point.
            let ahead: Vec<f64> =
                probe.weights.iter().zip(&velocity).map(|(w, v)| w + momentum * v).collect();
            let ahead_bias = probe.bias + momentum * velocity_bias;
            let mut grad = vec![0.0; dims];
            let mut grad_bias = 0.0;
            for (x, &y) in standard.iter().zip(labels) {
                let z = x.iter().zip(&ahead).map(|(a, b)| a * b).sum::<f64>() + ahead_bias;
                let err = 1.0 / (1.0 + (-z).exp()) - if y { 1.0 } else { 0.0 };
                for (g, xi) in grad.iter_mut().zip(x) {
                    *g += err * xi / n;
                }
                grad_bias += err / n;
            }
            for ((v, g), w) in velocity.iter_mut().zip(&grad).zip(&ahead) {
                *v = momentum * *v - lr * (g + l2 * w);
            }
            velocity_bias = momentum * velocity_bias - lr * grad_bias;
            for (w, v) in probe.weights.iter_mut().zip(&velocity) {
                *w += v;
            }
            probe.bias += velocity_bias;
        }
        probe
    }

    /// True where the probe predicts the positive class.
    pub fn predict(&self, features: &[f32]) -> bool {
        let z: f64 = features
            .iter()
            .zip(&self.mean)
            .zip(&self.scale)
            .zip(&self.weights)
            .map(|(((x, m), s), w)| (*x as f64 - m) * s * w)
            .sum::<f64>()
            + self.bias;
        z > 0.0
    }

    /// Share of `features` classified as `labels`.
    pub fn accuracy(&self, features: &[Vec<f32>], labels: &[bool]) -> f64 {
        let correct = features.iter().zip(labels).filter(|(f, &y)| self.predict(f) == y).count();
        correct as f64 / features.len().max(1) as f64
    }
}

/// L2 penalty of the probe (on standardised features).
pub const PROBE_L2: f64 = 1e-3;
/// Gradient steps of the probe.
pub const PROBE_ITERATIONS: usize = 300;

/// The text part of a run's report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TextReport {
    /// Mean cosine similarity of student and teacher sentence embeddings on
    /// the held-out sentences.
    pub embedding_cosine: f64,
    /// Lowest per-sentence cosine.
    pub min_embedding_cosine: f64,
    /// Held-out sentences compared.
    pub heldout_sentences: usize,
    /// Tokens per sequence (padding included).
    pub max_tokens: usize,
    /// Mean real tokens per training sentence.
    pub mean_tokens: f64,
    /// Student parameters over teacher parameters (encoder layers only).
    pub params_ratio: f64,
    /// Student forward FLOPs over teacher forward FLOPs (encoder layers only).
    pub flops_ratio: f64,
    /// The downstream probe, if configured.
    pub probe: Option<ProbeReport>,
    /// Mean cosine of the held-out sentences grouped by their length in
    /// tokens: where the student falls short (short sentences weigh on
    /// the mean more than their share of tokens suggests).
    #[serde(default)]
    pub cosine_by_length: Vec<LengthBucket>,
}

/// How a stitched decoder LLM predicts the next token next to its teacher,
/// on held-out text (a zoo's language-model evaluation fills it in).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LanguageReport {
    /// Held-out sequences scored.
    pub heldout_sequences: usize,
    /// Next-token predictions scored (every real token but each sequence's first).
    pub predicted_tokens: usize,
    /// Tokens per sequence (padding included).
    pub max_tokens: usize,
    /// The teacher's perplexity on the held-out text: `exp` of its mean
    /// next-token negative log-likelihood.
    pub teacher_perplexity: f64,
    /// The stitched student's perplexity.
    pub student_perplexity: f64,
    /// Share of positions where the student's most likely next token is the
    /// teacher's.
    pub top1_agreement: f64,
    /// Mean `KL(teacher || student)` of the next-token distributions, in
    /// nats per token.
    pub mean_kl: f64,
    /// Student parameters over teacher parameters (decoder layers only).
    pub params_ratio: f64,
    /// Student forward FLOPs over teacher forward FLOPs (decoder layers only).
    pub flops_ratio: f64,
    /// The same with the LM head counted on both sides (what inference pays
    /// per token; the head is a fifth of SmolLM2-135M's work). 0 in reports
    /// written before it was recorded.
    #[serde(default)]
    pub whole_model_flops_ratio: f64,
}

impl TextReport {
    /// The key of this section in `report.json`.
    pub const SECTION: &'static str = "text";

    /// This report as a score section: printed as the lines `pipebd run`
    /// and `eval` show, standing for the student with its mean cosine when
    /// there is no probe.
    pub fn section(&self) -> ScoreSection {
        let mut lines = vec![format!(
            "embedding cosine student/teacher {:.4} (lowest {:.4}) on {} held-out sentences",
            self.embedding_cosine, self.min_embedding_cosine, self.heldout_sentences
        )];
        if !self.cosine_by_length.is_empty() {
            let parts: Vec<String> = self
                .cosine_by_length
                .iter()
                .map(|b| format!("{}-{}: {:.4} ({})", b.min_tokens, b.max_tokens, b.mean_cosine, b.sentences))
                .collect();
            lines.push(format!("  by length in tokens (sentences): {}", parts.join(", ")));
        }
        if let Some(p) = &self.probe {
            lines.push(format!(
                "spam probe: teacher {:.2}%  student {:.2}%  ({} train / {} test emails, {:.0}% spam)",
                100.0 * p.teacher_accuracy,
                100.0 * p.student_accuracy,
                p.train_emails,
                p.test_emails,
                100.0 * p.test_spam_fraction
            ));
        }
        lines.push(format!(
            "student/teacher: {:.2}x parameters, {:.2}x FLOPs (encoder layers, {} tokens per sequence)",
            self.params_ratio, self.flops_ratio, self.max_tokens
        ));
        ScoreSection::new(Self::SECTION, self, lines)
            .with_figure("embedding_cosine", self.embedding_cosine)
            .with_headline(self.embedding_cosine)
    }
}

impl LanguageReport {
    /// The key of this section in `report.json`.
    pub const SECTION: &'static str = "language";

    /// This report as a score section: printed as the lines `pipebd run`
    /// and `eval` show, with the figures `perplexity` (the student's) and
    /// `kl` for a search's Pareto table.
    pub fn section(&self) -> ScoreSection {
        let lines = vec![
            format!(
                "perplexity: teacher {:.2}  student {:.2} ({:+.1}%)  on {} held-out sequences ({} predicted tokens)",
                self.teacher_perplexity,
                self.student_perplexity,
                100.0 * (self.student_perplexity / self.teacher_perplexity - 1.0),
                self.heldout_sequences,
                self.predicted_tokens
            ),
            format!(
                "next token: student agrees with the teacher's top-1 on {:.2}%, mean KL(teacher || student) {:.4} nats",
                100.0 * self.top1_agreement,
                self.mean_kl
            ),
            format!(
                "student/teacher: {:.2}x parameters, {:.2}x FLOPs (decoder layers, {} tokens per sequence), \
                 {:.2}x FLOPs with the LM head",
                self.params_ratio, self.flops_ratio, self.max_tokens, self.whole_model_flops_ratio
            ),
        ];
        ScoreSection::new(Self::SECTION, self, lines)
            .with_figure("perplexity", self.student_perplexity)
            .with_figure("kl", self.mean_kl)
    }
}

/// Held-out sentences whose token count (special tokens included, cut at
/// the sequence length) lies in `min_tokens..=max_tokens`, and their mean
/// student/teacher embedding cosine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LengthBucket {
    /// Fewest tokens a sentence of this bucket may have.
    pub min_tokens: usize,
    /// Most tokens a sentence of this bucket may have.
    pub max_tokens: usize,
    /// Sentences in the bucket.
    pub sentences: usize,
    /// Their mean cosine.
    pub mean_cosine: f64,
}

/// Groups per-sentence `cosines` by `tokens` (each sentence's token count,
/// at most `max_tokens`) into four equal ranges of length up to
/// `max_tokens`; empty ranges are left out.
pub fn cosine_by_length(cosines: &[f64], tokens: &[usize], max_tokens: usize) -> Vec<LengthBucket> {
    const BUCKETS: usize = 4;
    let width = max_tokens.div_ceil(BUCKETS).max(1);
    (0..BUCKETS)
        .filter_map(|b| {
            let (low, high) = (b * width + 1, (b + 1) * width);
            let inside: Vec<f64> = cosines
                .iter()
                .zip(tokens)
                .filter(|(_, t)| (low..=high).contains(&(**t).max(1)))
                .map(|(&c, _)| c)
                .collect();
            (!inside.is_empty()).then(|| LengthBucket {
                min_tokens: low,
                max_tokens: high,
                sentences: inside.len(),
                mean_cosine: inside.iter().sum::<f64>() / inside.len() as f64,
            })
        })
        .collect()
}

/// The SpamAssassin probe: teacher vs student on one split.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProbeReport {
    /// Emails the probe was fitted on.
    pub train_emails: usize,
    /// Emails it was scored on.
    pub test_emails: usize,
    /// Share of spam among the scored emails.
    pub test_spam_fraction: f64,
    /// Accuracy with the teacher's embeddings.
    pub teacher_accuracy: f64,
    /// Accuracy with the stitched student's embeddings.
    pub student_accuracy: f64,
}

/// Cosine of each pair of embeddings.
pub fn cosines(a: &[Vec<f32>], b: &[Vec<f32>]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| cosine(x, y)).collect()
}

/// Mean and lowest cosine between two lists of embeddings.
pub fn mean_and_min_cosine(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f64, f64) {
    let cosines = cosines(a, b);
    let mean = cosines.iter().sum::<f64>() / cosines.len().max(1) as f64;
    (mean, cosines.iter().copied().fold(f64::INFINITY, f64::min))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosines_are_grouped_by_length_in_four_ranges() {
        let tokens = [3, 8, 9, 16, 17, 32, 32, 5];
        let cos = [0.5, 0.7, 0.9, 0.8, 0.6, 0.95, 0.85, 0.6];
        let buckets = cosine_by_length(&cos, &tokens, 32);
        let ranges: Vec<(usize, usize, usize)> =
            buckets.iter().map(|b| (b.min_tokens, b.max_tokens, b.sentences)).collect();
        assert_eq!(ranges, [(1, 8, 3), (9, 16, 2), (17, 24, 1), (25, 32, 2)]);
        for b in &buckets {
            let inside: Vec<f64> = tokens
                .iter()
                .zip(cos)
                .filter(|(t, _)| **t >= b.min_tokens && **t <= b.max_tokens)
                .map(|(_, c)| c)
                .collect();
            let mean = inside.iter().sum::<f64>() / inside.len() as f64;
            assert!((b.mean_cosine - mean).abs() < 1e-12, "{b:?}");
        }
        // Every sentence lands in exactly one bucket; empty ranges are left out.
        let only_long = cosine_by_length(&[0.5, 0.7], &[30, 31], 32);
        assert_eq!(only_long.len(), 1);
        assert_eq!(only_long[0].sentences, 2);
    }

    #[test]
    fn the_probe_separates_separable_classes_and_fails_on_noise() {
        // Class depends on the sign of feature 0; feature 1 is noise.
        let features: Vec<Vec<f32>> =
            (0..200).map(|i| vec![(i as f32 - 99.5) / 50.0, ((i * 37) % 11) as f32]).collect();
        let labels: Vec<bool> = (0..200).map(|i| i >= 100).collect();
        let probe = LogisticProbe::fit(&features, &labels, PROBE_L2, PROBE_ITERATIONS);
        assert!(probe.accuracy(&features, &labels) > 0.97);
        let flipped: Vec<bool> = labels.iter().map(|l| !l).collect();
        assert!(probe.accuracy(&features, &flipped) < 0.03);
    }
}
