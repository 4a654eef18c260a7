//! The built-in zoo's text data: the Brown corpus as distillation corpus,
//! SpamAssassin as a downstream probe, MiniLM's tokenizer and frozen
//! embeddings in front of the first encoder block (the batches the runtime
//! draws), and the evaluation of a stitched student: embedding cosine to
//! the teacher and the probe on frozen embeddings.

use std::path::{Path, PathBuf};

use burn::tensor::{Int, Tensor};
use pipebd_core::{Activation, BlockSpec, Dataset, Samples};
use pipebd_kernels::encoder::mean_pool_normalized;
use pipebd_kernels::FusedBackend;
use pipebd_teachers::minilm::{Embeddings, MiniLmTokenizer, PaddedIds};
use pipebd_teachers::smollm2::TokenEmbeddings;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use pipe_bd::data::data_error;
use pipe_bd::eval::{Evaluate, Network, Score};
use pipe_bd::{Error, Result};

use crate::text_scores::{
    cosine_by_length, cosines, mean_and_min_cosine, LogisticProbe, ProbeReport, TextReport, PROBE_ITERATIONS,
    PROBE_L2,
};
use crate::Lift;

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

/// `data.dataset` of the Brown corpus (MiniLM's and SmolLM2's).
pub(crate) const DATASET: &str = "brown";

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
    texts.iter().map(|t| tokenizer.encode(t, max_tokens).lift()).collect()
}

/// A text teacher's frozen input preparation: token ids to the first
/// block's token states (MiniLM's embeddings with positions and layer norm,
/// or a decoder LLM's token embeddings).
pub trait EmbedTokens<B: FusedBackend>: Send + Sync {
    /// `[batch, tokens]` ids to `[batch, tokens, hidden]`.
    fn embed(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3>;
}

impl<B: FusedBackend> EmbedTokens<B> for Embeddings<B> {
    fn embed(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.forward(ids)
    }
}

impl<B: FusedBackend> EmbedTokens<B> for TokenEmbeddings<B> {
    fn embed(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.forward(ids)
    }
}

/// Tokenised sentences whose batches are the teacher's embeddings: the
/// frozen input preparation in front of the first block.
pub struct TextDataset<B: FusedBackend, E: EmbedTokens<B> = Embeddings<B>> {
    sequences: Vec<Vec<u32>>,
    max_tokens: usize,
    embeddings: E,
    backend: std::marker::PhantomData<fn() -> B>,
}

impl<B: FusedBackend, E: EmbedTokens<B>> TextDataset<B, E> {
    /// Sentences `sequences` (token ids), padded to `max_tokens`, embedded by `embeddings`.
    pub fn new(sequences: Vec<Vec<u32>>, max_tokens: usize, embeddings: E) -> Self {
        Self { sequences, max_tokens, embeddings, backend: std::marker::PhantomData }
    }

    /// Mean real tokens per sequence (how much of each padded batch is text).
    pub fn mean_tokens(&self) -> f64 {
        let total: usize = self.sequences.iter().map(|s| s.len().min(self.max_tokens)).sum();
        total as f64 / self.sequences.len().max(1) as f64
    }
}

/// The embedded, padded batch of `sequences` (on `embeddings`' device).
pub fn embed_batch<B: FusedBackend>(
    embeddings: &impl EmbedTokens<B>,
    sequences: &[&[u32]],
    max_tokens: usize,
    device: &B::Device,
) -> Activation<B> {
    let padded = PaddedIds::new(sequences.iter().copied(), max_tokens);
    let (ids, mask) = padded.tensors::<B>(device);
    Activation::Tokens { hidden: embeddings.embed(ids), mask }
}

impl<B: FusedBackend, E: EmbedTokens<B>> Samples for TextDataset<B, E> {
    fn len(&self) -> usize {
        self.sequences.len()
    }
}

impl<B: FusedBackend, E: EmbedTokens<B>> Dataset<B> for TextDataset<B, E> {
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
/// `network` (the teacher or a stitched student), `chunk` at a time.
pub fn sentence_embeddings<B: FusedBackend>(
    embeddings: &Embeddings<B>,
    network: &Network<'_, B>,
    sequences: &[Vec<u32>],
    max_tokens: usize,
    device: &B::Device,
    chunk: usize,
) -> Result<Vec<Vec<f32>>> {
    let mut out = Vec::with_capacity(sequences.len());
    for part in sequences.chunks(chunk.max(1)) {
        let refs: Vec<&[u32]> = part.iter().map(Vec::as_slice).collect();
        let x = network.forward(embed_batch(embeddings, &refs, max_tokens, device))?;
        let Activation::Tokens { hidden, mask } = x else {
            return Err(Error::block(
                network.blocks(),
                format!("the last block must produce token states, got {:?}", x.dims()),
            ));
        };
        let [rows, width] = [part.len(), hidden.dims()[2]];
        let pooled: Vec<f32> = mean_pool_normalized(hidden, mask).into_data().iter::<f32>().collect();
        out.extend((0..rows).map(|r| pooled[r * width..(r + 1) * width].to_vec()));
    }
    Ok(out)
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

    /// Fits the probe on embeddings from `network` and scores it.
    pub fn score<B: FusedBackend>(
        &self,
        embeddings: &Embeddings<B>,
        network: &Network<'_, B>,
        device: &B::Device,
    ) -> Result<f64> {
        let embed =
            |ids: &[Vec<u32>]| sentence_embeddings(embeddings, network, ids, self.max_tokens, device, 64);
        let train = embed(&self.train.0)?;
        let test = embed(&self.test.0)?;
        let probe = LogisticProbe::fit(&train, &self.train.1, PROBE_L2, PROBE_ITERATIONS);
        Ok(probe.accuracy(&test, &self.test.1))
    }
}

/// The evaluation of a text student: the mean (and lowest, and by sentence
/// length) cosine of its sentence embeddings to the teacher's on held-out
/// sentences, the size ratios, and the optional downstream probe.
pub struct SentenceEmbeddings<B: FusedBackend> {
    /// The teacher's frozen embeddings.
    pub embeddings: Embeddings<B>,
    /// Held-out sentences, tokenised.
    pub heldout: Vec<Vec<u32>>,
    /// Tokens per sequence.
    pub max_tokens: usize,
    /// The probe's data.
    pub probe: Option<ProbeData>,
    /// Mean real tokens per training sentence.
    pub mean_tokens: f64,
}

impl<B: FusedBackend> Evaluate<B> for SentenceEmbeddings<B> {
    /// Without a probe the two accuracies are 0 (see the report's `text`).
    fn score(&self, teacher: &Network<'_, B>, student: &Network<'_, B>, device: &B::Device) -> Result<Score> {
        let (heldout, max_tokens) = (&self.heldout, self.max_tokens);
        let ours = sentence_embeddings(&self.embeddings, student, heldout, max_tokens, device, 64)?;
        let theirs = sentence_embeddings(&self.embeddings, teacher, heldout, max_tokens, device, 64)?;
        let (embedding_cosine, min_embedding_cosine) = mean_and_min_cosine(&ours, &theirs);
        let tokens: Vec<usize> = heldout.iter().map(|s| s.len().min(max_tokens)).collect();
        let cosine_by_length = cosine_by_length(&cosines(&ours, &theirs), &tokens, max_tokens);
        let probe = match &self.probe {
            None => None,
            Some(data) => {
                let spam = data.test.1.iter().filter(|&&s| s).count();
                Some(ProbeReport {
                    train_emails: data.train.0.len(),
                    test_emails: data.test.0.len(),
                    test_spam_fraction: spam as f64 / data.test.0.len().max(1) as f64,
                    teacher_accuracy: data.score(&self.embeddings, teacher, device)?,
                    student_accuracy: data.score(&self.embeddings, student, device)?,
                })
            }
        };
        let sum = |specs: &[BlockSpec], f: fn(&BlockSpec) -> f64| specs.iter().map(f).sum::<f64>();
        let ratio = |f: fn(&BlockSpec) -> f64| sum(student.specs, f) / sum(teacher.specs, f);
        Ok(Score {
            teacher_accuracy: probe.as_ref().map_or(0.0, |p| p.teacher_accuracy),
            student_accuracy: probe.as_ref().map_or(0.0, |p| p.student_accuracy),
            test_samples: probe.as_ref().map_or(0, |p| p.test_emails),
            sections: vec![TextReport {
                embedding_cosine,
                min_embedding_cosine,
                heldout_sentences: heldout.len(),
                max_tokens,
                mean_tokens: self.mean_tokens,
                params_ratio: ratio(|s| s.params as f64),
                flops_ratio: ratio(|s| s.flops as f64),
                probe,
                cosine_by_length,
            }
            .section()],
        })
    }

    /// The probe's accuracy with the teacher's embeddings (0 on 0 emails
    /// without a probe: a teacher alone has no cosine to report).
    fn score_teacher(&self, teacher: &Network<'_, B>, device: &B::Device) -> Result<(f64, usize)> {
        match &self.probe {
            None => Ok((0.0, 0)),
            Some(data) => Ok((data.score(&self.embeddings, teacher, device)?, data.test.0.len())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
