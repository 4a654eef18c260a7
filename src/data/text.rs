//! Text data for transformer teachers: the Brown corpus as distillation
//! corpus, SpamAssassin as a downstream probe, the batches the runtime draws
//! (token states after the teacher's frozen embeddings), and the evaluation
//! of a stitched student: embedding cosine to the teacher and a logistic
//! regression probe on frozen embeddings.

use std::path::{Path, PathBuf};

use pipebd_core::{forward_chain, Activation, Block, Dataset};
use pipebd_kernels::encoder::mean_pool_normalized;
use pipebd_kernels::FusedBackend;
use pipebd_teachers::minilm::{Embeddings, MiniLmTokenizer, PaddedIds};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::data::data_error;
use crate::error::{Error, Result};

/// Seed of the fixed shuffles that split the corpora (independent of a run's
/// seed, so every run of a config sees the same held-out sentences).
const SPLIT_SEED: u64 = 0x5EED_B0B5;
/// One sentence in this many goes to the Brown held-out split.
const HELDOUT_EVERY: usize = 10;
/// Characters of an email body kept before tokenising (the tokens are
/// truncated anyway; this bounds the tokenizer's work).
const EMAIL_CHARS: usize = 4000;

fn missing_hint(path: &Path) -> Error {
    data_error(path, "not found (run scripts/setup-data.sh, or fix the path in the config)")
}

/// One sentence of the Brown corpus with its POS tags stripped: `The/at
/// jury/nn said/vbd ./.` becomes `The jury said .`; the corpus' `` and ''
/// quotes become `"`.
pub fn strip_tags(line: &str) -> String {
    line.split_whitespace()
        .map(|pair| {
            let word = pair.rsplit_once('/').map_or(pair, |(word, _)| word);
            match word {
                "``" | "''" => "\"",
                w => w,
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Every sentence of the Brown corpus in `dir` (files `c[a-r]NN`, one
/// sentence per non-empty line), in file order.
pub fn read_brown(dir: &Path) -> Result<Vec<String>> {
    let mut sentences = Vec::new();
    for file in &brown_files(dir)? {
        let text = std::fs::read_to_string(file).map_err(|e| Error::io("reading", file, e))?;
        sentences.extend(text.lines().map(strip_tags).filter(|s| !s.is_empty()));
    }
    Ok(sentences)
}

/// The Brown corpus files (`ca01` ... `cr09`) in `dir`, sorted; an error
/// naming the folder when it is missing or holds none.
pub fn brown_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|_| missing_hint(dir))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.len() == 4
                && name.starts_with('c')
                && ('a'..='r').contains(&name.as_bytes()[1].into())
                && name[2..].bytes().all(|b| b.is_ascii_digit())
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(data_error(dir, "no Brown corpus files (ca01 ... cr09) in this folder"));
    }
    Ok(files)
}

/// The Brown corpus split into training and held-out sentences: a fixed
/// shuffle (so that a limit takes sentences of every genre), then one in ten
/// held out; each side cut to its limit.
pub fn brown_splits(
    dir: &Path,
    train_limit: Option<usize>,
    heldout_limit: Option<usize>,
) -> Result<(Vec<String>, Vec<String>)> {
    let mut sentences = read_brown(dir)?;
    sentences.shuffle(&mut StdRng::seed_from_u64(SPLIT_SEED));
    let (mut train, mut heldout) = (Vec::new(), Vec::new());
    for (i, s) in sentences.into_iter().enumerate() {
        if i % HELDOUT_EVERY == HELDOUT_EVERY - 1 {
            heldout.push(s);
        } else {
            train.push(s);
        }
    }
    train.truncate(train_limit.unwrap_or(usize::MAX));
    heldout.truncate(heldout_limit.unwrap_or(usize::MAX));
    Ok((train, heldout))
}

/// One SpamAssassin email.
#[derive(Debug, Clone)]
pub struct Email {
    /// The body (headers removed, whitespace collapsed, cut to a few thousand characters).
    pub body: String,
    /// True for spam.
    pub spam: bool,
}

#[derive(Deserialize)]
struct EmailFile {
    group: String,
    text: String,
}

/// The body of a raw email: what follows the first blank line, with
/// whitespace collapsed.
fn email_body(raw: &str) -> String {
    let body = raw.split_once("\n\n").map_or(raw, |(_, body)| body);
    let collapsed = body.split_whitespace().collect::<Vec<_>>().join(" ");
    collapsed.chars().take(EMAIL_CHARS).collect()
}

/// Every email under `dir` (`<group>/*.json` files with `group` and
/// `text`; groups starting with `spam` are spam), in path order.
pub fn read_spam_assassin(dir: &Path) -> Result<Vec<Email>> {
    let groups = std::fs::read_dir(dir).map_err(|_| missing_hint(dir))?;
    let mut files: Vec<PathBuf> = Vec::new();
    for group in groups.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_dir()) {
        let entries = std::fs::read_dir(&group).map_err(|e| Error::io("listing", &group, e))?;
        files.extend(
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "json")),
        );
    }
    files.sort();
    if files.is_empty() {
        return Err(data_error(dir, "no `<group>/*.json` email files in this folder"));
    }
    files
        .iter()
        .map(|file| {
            let text = std::fs::read_to_string(file).map_err(|e| Error::io("reading", file, e))?;
            let email: EmailFile = serde_json::from_str(&text)
                .map_err(|e| data_error(file, format!("not a SpamAssassin email record: {e}")))?;
            Ok(Email { body: email_body(&email.text), spam: email.group.starts_with("spam") })
        })
        .collect()
}

/// Token ids of `texts`, each truncated to `max_tokens`.
pub fn tokenize(tokenizer: &MiniLmTokenizer, texts: &[String], max_tokens: usize) -> Result<Vec<Vec<u32>>> {
    texts.iter().map(|t| Ok(tokenizer.encode(t, max_tokens)?)).collect()
}

/// Tokenised sentences whose batches are the teacher's embeddings: the
/// frozen input preparation in front of the first encoder block.
pub struct TextDataset<B: FusedBackend> {
    sequences: Vec<Vec<u32>>,
    max_tokens: usize,
    embeddings: Embeddings<B>,
}

impl<B: FusedBackend> TextDataset<B> {
    /// Sentences `sequences` (token ids), padded to `max_tokens`, embedded by `embeddings`.
    pub fn new(sequences: Vec<Vec<u32>>, max_tokens: usize, embeddings: Embeddings<B>) -> Self {
        Self { sequences, max_tokens, embeddings }
    }

    /// Mean real tokens per sequence (how much of each padded batch is text).
    pub fn mean_tokens(&self) -> f64 {
        let total: usize = self.sequences.iter().map(|s| s.len().min(self.max_tokens)).sum();
        total as f64 / self.sequences.len().max(1) as f64
    }
}

/// The embedded, padded batch of `sequences` (on `embeddings`' device).
pub fn embed_batch<B: FusedBackend>(
    embeddings: &Embeddings<B>,
    sequences: &[&[u32]],
    max_tokens: usize,
    device: &B::Device,
) -> Activation<B> {
    let padded = PaddedIds::new(sequences.iter().copied(), max_tokens);
    let (ids, mask) = padded.tensors::<B>(device);
    Activation::Tokens { hidden: embeddings.forward(ids), mask }
}

impl<B: FusedBackend> Dataset<B> for TextDataset<B> {
    fn len(&self) -> usize {
        self.sequences.len()
    }

    fn batch(&self, indices: &[usize], device: &B::Device) -> pipebd_core::Result<Activation<B>> {
        let sequences = indices
            .iter()
            .map(|&i| {
                self.sequences.get(i).map(Vec::as_slice).ok_or_else(|| pipebd_core::Error::Data {
                    message: format!("sentence {i} requested, but there are {}", self.sequences.len()),
                })
            })
            .collect::<pipebd_core::Result<Vec<&[u32]>>>()?;
        Ok(embed_batch(&self.embeddings, &sequences, self.max_tokens, device))
    }
}

/// L2-normalised mean-pooled sentence embeddings of `sequences` through
/// `blocks` (teacher blocks or stitched student blocks), `chunk` at a time.
pub fn sentence_embeddings<B: FusedBackend, M: Block<B>>(
    embeddings: &Embeddings<B>,
    blocks: &[M],
    sequences: &[Vec<u32>],
    max_tokens: usize,
    device: &B::Device,
    chunk: usize,
) -> Result<Vec<Vec<f32>>> {
    let mut out = Vec::with_capacity(sequences.len());
    for part in sequences.chunks(chunk.max(1)) {
        let refs: Vec<&[u32]> = part.iter().map(Vec::as_slice).collect();
        let x = forward_chain(blocks, embed_batch(embeddings, &refs, max_tokens, device))?;
        let Activation::Tokens { hidden, mask } = x else {
            return Err(Error::block(
                blocks.len(),
                format!("the last block must produce token states, got {:?}", x.dims()),
            ));
        };
        let [rows, width] = [part.len(), hidden.dims()[2]];
        let pooled: Vec<f32> = mean_pool_normalized(hidden, mask).into_data().iter::<f32>().collect();
        out.extend((0..rows).map(|r| pooled[r * width..(r + 1) * width].to_vec()));
    }
    Ok(out)
}

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

/// The SpamAssassin ham/spam probe: logistic regression on frozen sentence
/// embeddings of the teacher and of the stitched student, same split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeConfig {
    /// Folder with the `<group>/*.json` email files.
    pub dir: PathBuf,
    /// Use at most this many emails (a seeded, fixed sample; default all).
    #[serde(default)]
    pub limit: Option<usize>,
    /// Tokens per email body (default 128).
    #[serde(default = "default_probe_tokens")]
    pub max_tokens: usize,
    /// Share of the emails held out to score the probe (default 0.3).
    #[serde(default = "default_test_fraction")]
    pub test_fraction: f64,
}

fn default_probe_tokens() -> usize {
    128
}
fn default_test_fraction() -> f64 {
    0.3
}

/// The probe's emails, tokenised and split (a fixed shuffle, then the last
/// `test_fraction` held out).
pub struct ProbeData {
    /// Training emails' token ids and labels.
    pub train: (Vec<Vec<u32>>, Vec<bool>),
    /// Test emails' token ids and labels.
    pub test: (Vec<Vec<u32>>, Vec<bool>),
    /// Tokens per email.
    pub max_tokens: usize,
}

impl ProbeData {
    /// Reads, samples, tokenises and splits the configured emails.
    pub fn load(config: &ProbeConfig, tokenizer: &MiniLmTokenizer) -> Result<Self> {
        let mut emails = read_spam_assassin(&config.dir)?;
        emails.shuffle(&mut StdRng::seed_from_u64(SPLIT_SEED));
        emails.truncate(config.limit.unwrap_or(usize::MAX));
        let test = ((emails.len() as f64) * config.test_fraction).round() as usize;
        if test == 0 || test >= emails.len() {
            return Err(data_error(
                &config.dir,
                format!(
                    "{} emails cannot be split with test_fraction {}",
                    emails.len(),
                    config.test_fraction
                ),
            ));
        }
        let bodies: Vec<String> = emails.iter().map(|e| e.body.clone()).collect();
        let mut ids = tokenize(tokenizer, &bodies, config.max_tokens)?;
        let mut labels: Vec<bool> = emails.iter().map(|e| e.spam).collect();
        let split = emails.len() - test;
        let test = (ids.split_off(split), labels.split_off(split));
        Ok(Self { train: (ids, labels), test, max_tokens: config.max_tokens })
    }

    /// Fits the probe on embeddings from `blocks` and scores it.
    pub fn score<B: FusedBackend, M: Block<B>>(
        &self,
        embeddings: &Embeddings<B>,
        blocks: &[M],
        device: &B::Device,
    ) -> Result<f64> {
        let embed =
            |ids: &[Vec<u32>]| sentence_embeddings(embeddings, blocks, ids, self.max_tokens, device, 64);
        let train = embed(&self.train.0)?;
        let test = embed(&self.test.0)?;
        let probe = LogisticProbe::fit(&train, &self.train.1, PROBE_L2, PROBE_ITERATIONS);
        Ok(probe.accuracy(&test, &self.test.1))
    }
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
    fn tags_are_stripped_and_quotes_normalised() {
        assert_eq!(strip_tags("\tThe/at jury/nn said/vbd ``/`` no/at ''/'' ./."), "The jury said \" no \" .");
        assert_eq!(strip_tags("Atlanta's/np$ 1/2/cd"), "Atlanta's 1/2");
        assert_eq!(strip_tags("   "), "");
    }

    #[test]
    fn email_bodies_drop_headers() {
        assert_eq!(email_body("From: a\nSubject: b\n\nHello\n  world\n"), "Hello world");
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
