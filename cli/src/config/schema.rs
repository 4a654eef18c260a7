//! The sections of a run config and their defaults: where a default is
//! the engine's, the section takes it from the engine's settings.

use std::path::PathBuf;

use pipebd_core::Schedule;
use serde::{Deserialize, Serialize};

use pipe_bd::train::stitch::{OutputLossKind, StitchedGradients};

use super::{ConfigIssue, RunConfig};

/// When each stage writes its blocks' checkpoints (always also at a block's
/// last step).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Every this many steps of a block (0, the default: not by steps).
    #[serde(default)]
    pub every_steps: usize,
    /// When this many minutes passed since the stage's last checkpoint
    /// (default 10; 0: not by time).
    #[serde(default = "default_every_minutes")]
    pub every_minutes: f64,
    /// Complete checkpoints kept per block (default 2: the newest and one
    /// to fall back to if it is damaged).
    #[serde(default = "default_keep")]
    pub keep: usize,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self { every_steps: 0, every_minutes: default_every_minutes(), keep: default_keep() }
    }
}

// The engine's checkpoint policy owns these defaults.
fn default_every_minutes() -> f64 {
    pipe_bd::train::checkpoint::CheckpointPolicy::default().every_seconds / 60.0
}
fn default_keep() -> usize {
    pipe_bd::train::checkpoint::CheckpointPolicy::default().keep
}

pub(super) fn default_name() -> String {
    "run".into()
}
pub(super) fn default_device() -> String {
    "cpu".into()
}
pub(super) fn default_schedule() -> String {
    Schedule::Ideal.name().into()
}

/// Pipeline runtime knobs (none changes the mathematics).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Batches in flight on each channel between stages (default 2).
    #[serde(default = "default_capacity")]
    pub channel_capacity: usize,
    /// Seconds a worker may go without progress (waits for its peers not
    /// counted) before it is declared failed (default 120).
    #[serde(default = "default_timeout")]
    pub timeout_seconds: f64,
    /// Worker failures the run survives by re-routing or re-planning over
    /// the surviving device slots (default 2); one more stops it cleanly.
    #[serde(default = "default_max_failures")]
    pub max_failures: usize,
    /// Intra-op threads per worker; 0 (default) divides the cores evenly.
    #[serde(default)]
    pub threads_per_worker: usize,
    /// Memory per device slot in bytes, for `schedule = "auto"` (default: no limit).
    #[serde(default)]
    pub memory_per_device: Option<u64>,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            channel_capacity: default_capacity(),
            timeout_seconds: default_timeout(),
            max_failures: default_max_failures(),
            threads_per_worker: 0,
            memory_per_device: None,
        }
    }
}

// The engine's runtime settings own these defaults.
fn default_capacity() -> usize {
    pipe_bd::runtime::RuntimeSettings::default().channel_capacity
}
fn default_timeout() -> f64 {
    pipe_bd::runtime::RuntimeSettings::default().timeout.as_secs_f64()
}
/// The one default of the command line's own: a run from a config file
/// survives two lost workers, where the library's
/// `RuntimeSettings::default()` stops at the first (a library caller
/// chooses its own tolerance; a batch job should not die of one hiccup).
const CONFIG_MAX_FAILURES: usize = 2;
fn default_max_failures() -> usize {
    CONFIG_MAX_FAILURES
}

/// Which dataset, where.
///
/// Besides the keys below, `[data]` may hold keys of the zoo's own (the
/// built-in zoo's `max_tokens` and `[data.probe]` for text): the zoo names
/// them ([`crate::zoo::Zoo::data_options`]; any other key is refused) and
/// parses them from [`DataConfig::options`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataConfig {
    /// The data set's name, as the zoo knows it (the built-in zoo: `mnist`
    /// for MNIST-format images, `brown` for the Brown corpus).
    pub dataset: String,
    /// Folder with the data set's files.
    pub dir: PathBuf,
    /// Use at most this many training samples.
    #[serde(default)]
    pub train_limit: Option<usize>,
    /// Use at most this many test samples.
    #[serde(default)]
    pub test_limit: Option<usize>,
    /// The zoo's own keys of `[data]`, as written.
    #[serde(flatten)]
    pub options: toml::Table,
}

/// Which teacher, with which weights.
///
/// Besides `kind` and `weights`, `[teacher]` may hold keys of the zoo's own
/// (the built-in zoo's `tokenizer` and `layers_per_block` for MiniLM),
/// named by [`crate::zoo::Zoo::teacher_options`] and parsed from
/// [`TeacherConfig::options`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeacherConfig {
    /// Teacher kind, as the zoo knows it (the built-in zoo: `mnist-cnn` or
    /// `minilm-l6`).
    pub kind: String,
    /// The teacher's weight file.
    pub weights: PathBuf,
    /// The zoo's own keys of `[teacher]`, as written.
    #[serde(flatten)]
    pub options: toml::Table,
}

impl TeacherConfig {
    /// A teacher of `kind` with weights at `weights` and no options.
    pub fn new(kind: &str, weights: impl Into<PathBuf>) -> Self {
        Self { kind: kind.into(), weights: weights.into(), options: toml::Table::new() }
    }
}

/// Refuses a key of `[data]` or `[teacher]` that is neither the engine's nor
/// one of the zoo's (`data_keys`, `teacher_keys`), naming what is allowed.
pub fn check_option_keys(
    config: &RunConfig,
    data_keys: &[&str],
    teacher_keys: &[&str],
) -> std::result::Result<(), ConfigIssue> {
    let tables = [
        ("data", &config.data.options, data_keys, "dataset, dir, train_limit, test_limit"),
        ("teacher", &config.teacher.options, teacher_keys, "kind, weights"),
    ];
    for (table, options, zoo_keys, engine_keys) in tables {
        if let Some(key) = options.keys().find(|key| !zoo_keys.contains(&key.as_str())) {
            let mut expected = engine_keys.to_string();
            for zoo_key in zoo_keys {
                expected.push_str(", ");
                expected.push_str(zoo_key);
            }
            return Err(ConfigIssue::new(
                table,
                key,
                format!("unknown field `{key}`, expected one of {expected}"),
            ));
        }
    }
    Ok(())
}

/// A zoo's own keys of a table (`options`: [`DataConfig::options`] or
/// [`TeacherConfig::options`]) parsed as a `C`; the issue names the table
/// (`table`: `data` or `teacher`) and what serde found wrong.
pub fn parse_options<C: serde::de::DeserializeOwned>(
    table: &str,
    options: &toml::Table,
) -> std::result::Result<C, ConfigIssue> {
    C::deserialize(toml::Value::Table(options.clone())).map_err(|e| {
        let message = e.message().trim().to_string();
        // serde names the field in its message (`missing field `x``, `unknown field `x``).
        let key = message.split('`').nth(1).filter(|key| options.contains_key(*key)).unwrap_or("");
        ConfigIssue::new(table, key, message.clone())
    })
}

/// Blockwise architecture search settings (`[search]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SearchConfig {
    /// Fraction of the training samples held out from training to score
    /// the candidates on (the last ones; default 0.1). Only a run with
    /// candidates holds samples out.
    #[serde(default = "default_held_out")]
    pub held_out: f64,
    /// `all` (default): every candidate trains on every step (Puzzle's
    /// replacement library); `single-path`: each block is a supernet, one
    /// candidate sampled per step from `softmax(alpha)`, `alpha` trained on
    /// held-out batches (DNA on a ProxylessNAS supernet).
    #[serde(default)]
    pub mode: SearchMode,
    /// Single-path: an architecture step every this many training steps
    /// (default 5).
    #[serde(default = "default_arch_every")]
    pub arch_every: usize,
    /// Single-path: fraction of the run's steps before the first
    /// architecture step (default 0.25).
    #[serde(default = "default_arch_warmup")]
    pub arch_warmup: f64,
    /// Single-path: Adam's learning rate for `alpha` (betas 0 and 0.999;
    /// default 1e-3).
    #[serde(default = "default_arch_lr")]
    pub arch_lr: f64,
}

/// How the candidates of a block train (`[search] mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SearchMode {
    /// Every candidate on every step.
    #[default]
    All,
    /// One sampled candidate per step; architecture logits on held-out batches.
    SinglePath,
}

impl Default for SearchConfig {
    fn default() -> Self {
        let single_path = pipe_bd::train::arch::SinglePath::default();
        Self {
            held_out: default_held_out(),
            mode: SearchMode::All,
            arch_every: single_path.arch_every,
            arch_warmup: single_path.warmup,
            arch_lr: single_path.arch_lr,
        }
    }
}

fn default_arch_every() -> usize {
    pipe_bd::train::arch::SinglePath::default().arch_every
}
fn default_arch_warmup() -> f64 {
    pipe_bd::train::arch::SinglePath::default().warmup
}
fn default_arch_lr() -> f64 {
    pipe_bd::train::arch::SinglePath::default().arch_lr
}

fn default_held_out() -> f64 {
    0.1
}

/// Epochs, batch size and logging.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Blockwise passes over the training data: 0 skips blockwise training
    /// (with `stitched_epochs` at least 1: finetune blocks that start from
    /// their `weights` stitched only).
    pub epochs: usize,
    /// Global batch size.
    pub batch_size: usize,
    /// Write a metrics row every this many steps (and at the last step).
    #[serde(default = "default_log_every")]
    pub log_every: usize,
    /// Passes of stitched fine-tuning after the blockwise epochs (default
    /// 0): each student block learns from the stitched student's output of
    /// the blocks before it instead of the teacher's, so that errors do not
    /// compound at inference. Runs on the first device slot.
    #[serde(default)]
    pub stitched_epochs: usize,
    /// Peak learning rate of the stitched passes (default: `optimizer.lr` / 3).
    #[serde(default)]
    pub stitched_lr: Option<f64>,
    /// How gradients flow in the stitched passes: `end-to-end` (default: the
    /// sum of every block's loss, backpropagated through the stitched chain,
    /// so blocks learn to correct each other) or `local` (each block's
    /// gradient stops at its input, as in blockwise training).
    #[serde(default)]
    pub stitched_gradients: StitchedGradients,
    /// An extra loss on the stitched student's final output against the
    /// teacher's, added to the sum of the block losses of an `end-to-end`
    /// stitched pass (default none): `pooled-cosine` (one minus the cosine of
    /// the mean-pooled sentence embeddings, for sentence encoders: the
    /// embedding cosine a text student is scored on), `mse`,
    /// `soft-target-cross-entropy` (logits) or `head-kl` (the KL of the
    /// next-token distributions through the teacher's frozen output head,
    /// for teachers whose zoo gives one: a language model's LM head).
    #[serde(default)]
    pub stitched_output_loss: Option<OutputLossKind>,
    /// Weight of `stitched_output_loss` in the summed loss (default 1).
    #[serde(default = "default_loss_weight")]
    pub stitched_output_weight: f64,
    /// Weight of the block losses in the summed loss of an `end-to-end`
    /// stitched pass (default 1). 0 trains on `stitched_output_loss` alone
    /// (Puzzle's global distillation: the head's KL, nothing else).
    #[serde(default = "default_loss_weight")]
    pub stitched_block_weight: f64,
    /// Softmax temperature of the soft-target cross-entropy of logits
    /// blocks (default 1). Both logits are divided by it and the loss is
    /// multiplied by its square.
    #[serde(default = "default_temperature")]
    pub temperature: f64,
}

fn default_loss_weight() -> f64 {
    1.0
}

// The engine's training settings own these defaults.
fn default_temperature() -> f64 {
    pipe_bd::train::TrainSettings::default().temperature
}
fn default_log_every() -> usize {
    pipe_bd::train::TrainSettings::default().log_every
}
