//! Run configuration: the TOML file behind `pipebd run`.
//!
//! Parsing is strict (unknown fields are errors) and every error names the
//! file, the line and the dotted field it is about. Relative paths in a
//! config are resolved against the current working directory.
//!
//! The engine checks the parts it reads (schedule, devices, training,
//! optimizer, runtime, checkpoints); the parts a [`crate::zoo::Zoo`] reads
//! (dataset, teacher, the `[[students]]` tables, `[custom]`) are checked by
//! that zoo: load configs with [`crate::zoo::Zoo::load_config`] to get both.

use std::path::{Path, PathBuf};

use pipebd_core::Schedule;
use serde::{Deserialize, Serialize};

use pipe_bd::error::{Error, Result};
use pipe_bd::train::optim::OptimizerConfig;
use pipe_bd::train::stitch::{OutputLossKind, StitchedGradients};

/// A whole run: data, teacher, students, training and where to run it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// Name of the run (used in reports).
    #[serde(default = "default_name")]
    pub name: String,
    /// Seed for student initialisation and data order.
    #[serde(default)]
    pub seed: u64,
    /// Generator of the initial student weights and the epoch orders:
    /// `native` (burn's, the default) or `torch` (PyTorch's CPU generator
    /// after `torch.manual_seed(seed)`, layer by layer as `torch.nn` draws:
    /// a PyTorch script with the same seed starts from the same students and
    /// sees the same batches; students of `Conv2d` and `Linear` layers only;
    /// a stitched pass keeps pipe-bd's own shuffle).
    #[serde(default)]
    pub generator: pipe_bd::rng::Generator,
    /// Device: `cpu`, `cuda[:N]` or `wgpu[:N]` (one slot; see `devices`).
    #[serde(default = "default_device")]
    pub device: String,
    /// Device slots for the parallel schedules, e.g. `["cpu", "cpu"]` or
    /// `["cuda:0", "cuda:1"]` (all of one kind). Default: `[device]`.
    #[serde(default)]
    pub devices: Option<Vec<String>>,
    /// Parallel schedule: `ideal`, `dp`, `ls`, `tr`, `tr-dpu` or `hybrid`
    /// (then `[[stages]]` says which blocks each stage trains on how many replicas).
    #[serde(default = "default_schedule")]
    pub schedule: String,
    /// Stages of a `hybrid` schedule, in block order.
    #[serde(default)]
    pub stages: Vec<pipe_bd::plan::StageSpec>,
    /// Pipeline runtime knobs.
    #[serde(default)]
    pub runtime: RuntimeConfig,
    /// The dataset.
    pub data: DataConfig,
    /// The teacher.
    pub teacher: TeacherConfig,
    /// One `[[students]]` table per teacher block, in order, as written:
    /// the zoo parses them (e.g. `kind = "conv"` for the built-in zoo). The
    /// engine reads two keys itself: `weights` (a file of trained weights
    /// for the block, e.g. a candidate saved by a search run; see
    /// [`RunConfig::student_weights`]) and a candidate set's `candidates`.
    pub students: Vec<toml::Table>,
    /// Epochs, batch size and logging.
    pub train: TrainConfig,
    /// The per-block optimizer (every block gets its own instance).
    pub optimizer: OptimizerConfig,
    /// Per-block checkpoints (in `<out>/checkpoints`).
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    /// How the candidates of a search run are scored (`[search]`; used
    /// only when some block lists `candidates`).
    #[serde(default)]
    pub search: SearchConfig,
    /// Injected faults, for testing recovery (`[[faults]]`; see also `PIPEBD_FAULTS`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub faults: Vec<pipe_bd::fault::Fault>,
    /// Settings of a user's zoo (`[custom]`, free-form; the built-in zoo
    /// takes none).
    #[serde(default, skip_serializing_if = "toml::Table::is_empty")]
    pub custom: toml::Table,
}

/// What is wrong with one field of a config, as a zoo reports it
/// ([`crate::zoo::Zoo::check_config`]); the config loader adds the file
/// and line.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigIssue {
    /// The table (`"data"`, `"teacher"`, `"students"`, `"custom"`; `""` for
    /// the top level).
    pub table: String,
    /// The key within it (`""` for the whole table).
    pub key: String,
    /// For `students`: which entry (zero-based).
    pub entry: Option<usize>,
    /// What is wrong, and what was expected.
    pub message: String,
}

impl ConfigIssue {
    /// An issue with `table.key`.
    pub fn new(table: &str, key: &str, message: String) -> Self {
        Self { table: table.into(), key: key.into(), entry: None, message }
    }

    /// An issue with entry `entry` (zero-based) of the array of tables `table`.
    pub fn in_entry(table: &str, entry: usize, message: String) -> Self {
        Self { table: table.into(), key: String::new(), entry: Some(entry), message }
    }

    /// The dotted field name (`data.dataset`, `students[2]`).
    pub fn field(&self) -> String {
        let table = match self.entry {
            Some(k) => format!("{}[{k}]", self.table),
            None => self.table.clone(),
        };
        match (table.is_empty(), self.key.is_empty()) {
            (true, _) => self.key.clone(),
            (false, true) => table,
            (false, false) => format!("{table}.{}", self.key),
        }
    }

    /// The issue as an error about the config at `path` (`line` where known).
    pub fn into_error(self, path: &Path, line: Option<usize>) -> Error {
        Error::Config { path: path.to_path_buf(), line, field: Some(self.field()), message: self.message }
    }

    /// The issue as an error about a config that did not come from a file
    /// (no path or line to give; the field is named).
    pub fn into_plain_error(self) -> Error {
        self.into_error(Path::new("config"), None)
    }

    /// The line of `text` the issue is about, where it can be found.
    fn line_in(&self, text: &str) -> Option<usize> {
        match self.entry {
            Some(k) => {
                let header = text
                    .lines()
                    .enumerate()
                    .filter(|(_, l)| {
                        l.trim().starts_with("[[") && header_name(l.trim()).as_deref() == Some(&self.table)
                    })
                    .nth(k)?
                    .0
                    + 1;
                Some(refine_line(text, header, &self.message))
            }
            None => find_key_line(text, &self.table, &self.key),
        }
    }
}

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

fn default_every_minutes() -> f64 {
    10.0
}
fn default_keep() -> usize {
    2
}

fn default_name() -> String {
    "run".into()
}
fn default_device() -> String {
    "cpu".into()
}
fn default_schedule() -> String {
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

fn default_capacity() -> usize {
    2
}
fn default_timeout() -> f64 {
    120.0
}
fn default_max_failures() -> usize {
    2
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

fn default_temperature() -> f64 {
    1.0
}

fn default_log_every() -> usize {
    10
}

/// A rule of the config that a file breaks: where (the table and key, for
/// the line number) and what was expected.
struct Broken {
    table: &'static str,
    key: &'static str,
    /// The field as the error names it, where it is not `table.key`.
    field: Option<String>,
    message: String,
}

impl Broken {
    fn new(table: &'static str, key: &'static str, message: impl Into<String>) -> Self {
        Self { table, key, field: None, message: message.into() }
    }
}

/// The outcome of one group of config rules.
type Rule = std::result::Result<(), Broken>;

fn broken(table: &'static str, key: &'static str, message: impl Into<String>) -> Rule {
    Err(Broken::new(table, key, message))
}

impl RunConfig {
    /// Reads, parses and validates a config file: the engine's checks only
    /// (see [`crate::zoo::Zoo::load_config`] for the zoo's too).
    pub fn load(path: &Path) -> Result<Self> {
        Self::parse(&Self::read_text(path)?, path)
    }

    /// The text of the config file at `path`.
    pub fn read_text(path: &Path) -> Result<String> {
        pipe_bd::fsio::read_small_text(path).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            line: None,
            field: None,
            message: format!("cannot read the config file: {e}"),
        })
    }

    /// Parses and validates config text, the engine's checks only; `path` is
    /// only used in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        Self::parse_checked(text, path, &|_| Ok(()))
    }

    /// Parses and validates config text: the engine's checks, then `check`
    /// (a zoo's), whose issue becomes an error with the file's line.
    pub fn parse_checked(
        text: &str,
        path: &Path,
        check: &dyn Fn(&RunConfig) -> std::result::Result<(), ConfigIssue>,
    ) -> Result<Self> {
        let config: RunConfig = toml::from_str(text).map_err(|e| parse_error(text, path, &e))?;
        config.validate(text, path)?;
        if let Err(issue) = check(&config) {
            let line = issue.line_in(text);
            return Err(issue.into_error(path, line));
        }
        Ok(config)
    }

    fn validate(&self, text: &str, path: &Path) -> Result<()> {
        let rules = [
            Self::check_train,
            Self::check_placement,
            Self::check_students,
            Self::check_search,
            Self::check_stitched,
            Self::check_checkpoint,
        ];
        for rule in rules {
            if let Err(broken) = rule(self) {
                let field = match (&broken.field, broken.table) {
                    (Some(field), _) => field.clone(),
                    (None, "") => broken.key.to_string(),
                    (None, table) => format!("{table}.{}", broken.key),
                };
                return Err(Error::Config {
                    path: path.to_path_buf(),
                    line: find_key_line(text, broken.table, broken.key),
                    field: Some(field),
                    message: broken.message,
                });
            }
        }
        Ok(())
    }

    /// `[train]`, `[optimizer]` and `[data]`.
    fn check_train(&self) -> Rule {
        if self.train.epochs == 0 && (self.train.stitched_epochs == 0 || self.has_candidates()) {
            let message = if self.has_candidates() {
                "must be at least 1: a search trains its candidates blockwise"
            } else {
                "must be at least 1, or 0 with `stitched_epochs` at least 1 (stitched finetuning only)"
            };
            return broken("train", "epochs", message);
        }
        if self.train.batch_size == 0 {
            return broken("train", "batch_size", "must be at least 1");
        }
        if self.train.log_every == 0 {
            return broken("train", "log_every", "must be at least 1");
        }
        if let Err((key, message)) = validate_optimizer(&self.optimizer) {
            return broken("optimizer", key, message);
        }
        if !(self.train.temperature > 0.0 && self.train.temperature.is_finite()) {
            return broken(
                "train",
                "temperature",
                format!("must be a positive number, got {}", self.train.temperature),
            );
        }
        for (key, limit) in [("train_limit", self.data.train_limit), ("test_limit", self.data.test_limit)] {
            if limit == Some(0) {
                return broken("data", key, "must be at least 1 (leave it out to use every sample)");
            }
        }
        Ok(())
    }

    /// `schedule`, `device`, `devices` and `[runtime]`.
    fn check_placement(&self) -> Rule {
        let schedule = Schedule::parse(&self.schedule).map_err(|e| Broken::new("", "schedule", e.0))?;
        if schedule == Schedule::Hybrid && self.stages.is_empty() {
            return broken("", "schedule", "`hybrid` needs [[stages]] entries (blocks = [..], replicas = N)");
        }
        pipe_bd::device::DeviceSpec::parse(&self.device).map_err(|e| Broken::new("", "device", e))?;
        if let Some(devices) = &self.devices {
            pipe_bd::device::parse_slots(devices).map_err(|e| Broken::new("", "devices", e))?;
        }
        if self.runtime.channel_capacity == 0 {
            return broken("runtime", "channel_capacity", "must be at least 1");
        }
        if !(self.runtime.timeout_seconds > 0.0 && self.runtime.timeout_seconds.is_finite()) {
            let message = format!("must be a positive number, got {}", self.runtime.timeout_seconds);
            return broken("runtime", "timeout_seconds", message);
        }
        Ok(())
    }

    /// `[[students]]`: at least one, and `weights` paths are strings.
    fn check_students(&self) -> Rule {
        if self.students.is_empty() {
            return broken("", "students", "at least one [[students]] block is required");
        }
        for (k, table) in self.students.iter().enumerate() {
            if let Some(value) = table.get("weights").filter(|value| !value.is_str()) {
                let message =
                    format!("`weights` of block {} must be a file path (a string), got {value}", k + 1);
                let mut issue = Broken::new("students", "weights", message);
                issue.field = Some(format!("students[{k}].weights"));
                return Err(issue);
            }
        }
        Ok(())
    }

    /// `[search]`.
    fn check_search(&self) -> Rule {
        let search = &self.search;
        if !(search.held_out > 0.0 && search.held_out < 1.0) {
            return broken("search", "held_out", format!("must be in (0, 1), got {}", search.held_out));
        }
        if search.arch_every == 0 {
            return broken("search", "arch_every", "must be at least 1");
        }
        if !(0.0..=1.0).contains(&search.arch_warmup) {
            return broken("search", "arch_warmup", format!("must be in [0, 1], got {}", search.arch_warmup));
        }
        if !(search.arch_lr > 0.0 && search.arch_lr.is_finite()) {
            return broken("search", "arch_lr", format!("must be a positive number, got {}", search.arch_lr));
        }
        if search.mode == SearchMode::SinglePath && !self.has_candidates() {
            return broken(
                "search",
                "mode",
                "`single-path` searches among candidates, but no [[students]] entry has kind = \"candidates\"",
            );
        }
        Ok(())
    }

    /// The stitched pass's fields of `[train]`.
    fn check_stitched(&self) -> Rule {
        if let Some(lr) = self.train.stitched_lr {
            if !(lr > 0.0 && lr.is_finite()) {
                return broken("train", "stitched_lr", format!("must be a positive number, got {lr}"));
            }
        }
        let weight = self.train.stitched_output_weight;
        if !(weight > 0.0 && weight.is_finite()) {
            return broken(
                "train",
                "stitched_output_weight",
                format!("must be a positive number, got {weight}"),
            );
        }
        let block_weight = self.train.stitched_block_weight;
        if !(block_weight >= 0.0 && block_weight.is_finite()) {
            return broken(
                "train",
                "stitched_block_weight",
                format!("must be a number >= 0, got {block_weight}"),
            );
        }
        if block_weight == 0.0 && self.train.stitched_output_loss.is_none() {
            return broken(
                "train",
                "stitched_block_weight",
                "0 needs a stitched_output_loss: with neither, nothing would train the stitched students",
            );
        }
        if self.train.stitched_output_loss.is_some()
            && self.train.stitched_gradients == StitchedGradients::Local
        {
            return broken(
                "train",
                "stitched_output_loss",
                "needs stitched_gradients = \"end-to-end\" (with `local` the output loss would reach the last block only)",
            );
        }
        Ok(())
    }

    /// `[checkpoint]` and `[[faults]]`.
    fn check_checkpoint(&self) -> Rule {
        if self.checkpoint.keep == 0 {
            return broken("checkpoint", "keep", "must be at least 1");
        }
        let every = self.checkpoint.every_minutes;
        if !(every >= 0.0 && every.is_finite()) {
            return broken(
                "checkpoint",
                "every_minutes",
                format!("must be 0 or a positive number, got {every}"),
            );
        }
        for fault in &self.faults {
            fault.validate().map_err(|message| Broken::new("faults", "kind", message))?;
        }
        Ok(())
    }

    /// The trained weights each student block starts from: its table's
    /// `weights` path, or `None` (the zoo's initialisation).
    pub fn student_weights(&self) -> Vec<Option<PathBuf>> {
        self.students.iter().map(|table| table.get("weights")?.as_str().map(PathBuf::from)).collect()
    }

    /// True when some student block lists `candidates` (a search run).
    pub fn has_candidates(&self) -> bool {
        self.students.iter().any(|table| table.contains_key("candidates"))
    }

    /// The device slots: `devices`, or `[device]`.
    pub fn device_slots(&self) -> Vec<String> {
        self.devices.clone().unwrap_or_else(|| vec![self.device.clone()])
    }

    /// The runtime settings as the runtime takes them.
    pub fn runtime_settings(&self) -> pipe_bd::runtime::RuntimeSettings {
        pipe_bd::runtime::RuntimeSettings {
            channel_capacity: self.runtime.channel_capacity,
            timeout: std::time::Duration::from_secs_f64(self.runtime.timeout_seconds),
            threads_per_worker: self.runtime.threads_per_worker,
            max_failures: self.runtime.max_failures,
            faults: self.faults.clone(),
            memory_per_device: self.runtime.memory_per_device,
            ..Default::default()
        }
    }

    /// Checkpoints in `dir` as `[checkpoint]` asks, with the config fields a
    /// checkpoint must match to be resumed from: the engine's and the zoo's
    /// (`zoo_fields`, [`crate::zoo::Zoo::checkpoint_identity`]); the
    /// runtime adds each block's shapes, parameters, steps, seed and
    /// optimizer.
    pub fn checkpoint_policy(
        &self,
        dir: PathBuf,
        zoo_fields: std::collections::BTreeMap<String, serde_json::Value>,
    ) -> pipe_bd::train::checkpoint::CheckpointPolicy {
        use serde_json::json;
        let mut identity = zoo_fields;
        identity.insert("data.dataset".into(), json!(self.data.dataset));
        identity.insert("data.train_limit".into(), json!(self.data.train_limit));
        identity.insert("teacher.kind".into(), json!(self.teacher.kind));
        identity.insert("train.epochs".into(), json!(self.train.epochs));
        pipe_bd::train::checkpoint::CheckpointPolicy {
            dir,
            every_steps: self.checkpoint.every_steps,
            every_seconds: self.checkpoint.every_minutes * 60.0,
            keep: self.checkpoint.keep,
            identity,
        }
    }

    /// The training settings as the runtime takes them.
    pub fn train_settings(&self) -> pipe_bd::train::TrainSettings {
        pipe_bd::train::TrainSettings {
            epochs: self.train.epochs,
            batch_size: self.train.batch_size,
            seed: self.seed,
            generator: self.generator,
            log_every: self.train.log_every,
            optimizer: self.optimizer.clone(),
            temperature: self.train.temperature,
            single_path: (self.search.mode == SearchMode::SinglePath).then(|| {
                pipe_bd::train::arch::SinglePath {
                    arch_every: self.search.arch_every,
                    warmup: self.search.arch_warmup,
                    arch_lr: self.search.arch_lr,
                }
            }),
        }
    }

    /// The configured schedule (checked by [`RunConfig::parse`]; an error
    /// naming the field for a config built in code with a bad name).
    pub fn schedule(&self) -> Result<Schedule> {
        Schedule::parse(&self.schedule).map_err(|e| Error::Config {
            path: PathBuf::from("<memory>"),
            line: None,
            field: Some("schedule".into()),
            message: e.0,
        })
    }

    /// The config as TOML text (what a report echoes back).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_default()
    }
}

/// Checks the optimizer's numbers: every one finite, the rates positive,
/// `min_lr` within `[0, lr]`, `momentum` within `[0, 1)`, `weight_decay` not
/// negative. On failure, the key within `[optimizer]` and what is wrong.
fn validate_optimizer(optimizer: &OptimizerConfig) -> std::result::Result<(), (&'static str, String)> {
    let positive = |x: f64| x > 0.0 && x.is_finite();
    if !positive(optimizer.lr) {
        return Err(("lr", format!("must be a positive number, got {}", optimizer.lr)));
    }
    // The range excludes NaN and (lr being finite) infinity.
    if !(0.0..=optimizer.lr).contains(&optimizer.min_lr) {
        return Err((
            "min_lr",
            format!("must be a number between 0 and lr ({}), got {}", optimizer.lr, optimizer.min_lr),
        ));
    }
    if !(0.0..1.0).contains(&optimizer.momentum) {
        return Err(("momentum", format!("must be a number in [0, 1), got {}", optimizer.momentum)));
    }
    if !positive(optimizer.epsilon) {
        return Err(("epsilon", format!("must be a positive number, got {}", optimizer.epsilon)));
    }
    if !(optimizer.weight_decay >= 0.0 && optimizer.weight_decay.is_finite()) {
        let message = format!("must be 0 or a positive number, got {}", optimizer.weight_decay);
        return Err(("weight_decay", message));
    }
    Ok(())
}

/// Turns a TOML parse error into an [`Error::Config`] with line and field.
fn parse_error(text: &str, path: &Path, error: &toml::de::Error) -> Error {
    let message = error.message().trim().to_string();
    let line = error.span().map(|span| refine_line(text, line_of(text, span.start), &message));
    let field = line.and_then(|l| field_at_line(text, l));
    Error::Config { path: path.to_path_buf(), line, field, message }
}

/// serde reports errors inside internally tagged tables (the `[[students]]`
/// entries) at the start of the whole array; move such an error to the line
/// that holds the offending key (`unknown field `x``) or value (`unknown
/// variant `x``), searching forward from `line`.
fn refine_line(text: &str, line: usize, message: &str) -> usize {
    let Some(token) = message.split('`').nth(1) else {
        return line;
    };
    let is_key = message.contains("unknown field");
    let is_value = message.contains("unknown variant");
    if !is_key && !is_value {
        return line;
    }
    text.lines()
        .enumerate()
        .skip(line.saturating_sub(1))
        .find(|(_, raw)| {
            let mut parts = raw.splitn(2, '=');
            let key = parts.next().unwrap_or("").trim();
            let value = parts.next().unwrap_or("").trim();
            if is_key {
                key == token
            } else {
                value.trim_matches('"') == token
            }
        })
        .map_or(line, |(i, _)| i + 1)
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// The dotted `table.key` written on `line` (one-based), if that line is a
/// `key = value` entry; the table name if it is a header or inside a table.
/// Entries of an array of tables are numbered: `students[2].rank`.
fn field_at_line(text: &str, line: usize) -> Option<String> {
    let mut table = String::new();
    let mut array_counts: std::collections::HashMap<String, usize> = Default::default();
    for (i, raw) in text.lines().enumerate() {
        let l = raw.trim();
        if let Some(name) = header_name(l) {
            table = if l.starts_with("[[") {
                let count = array_counts.entry(name.clone()).or_insert(0);
                *count += 1;
                format!("{name}[{}]", *count - 1)
            } else {
                name
            };
            if i + 1 == line {
                return Some(table);
            }
            continue;
        }
        if i + 1 == line {
            let key = l.split('=').next()?.trim();
            if key.is_empty() || key.starts_with('#') {
                return (!table.is_empty()).then_some(table);
            }
            return Some(if table.is_empty() { key.to_string() } else { format!("{table}.{key}") });
        }
    }
    None
}

fn header_name(line: &str) -> Option<String> {
    let inner = line
        .strip_prefix("[[")
        .and_then(|s| s.split("]]").next())
        .or_else(|| line.strip_prefix('[').and_then(|s| s.split(']').next()))?;
    Some(inner.trim().to_string())
}

/// Line (one-based) where `key` is set inside `[table]` ("" for the top level).
fn find_key_line(text: &str, table: &str, key: &str) -> Option<usize> {
    let mut current = String::new();
    for (i, raw) in text.lines().enumerate() {
        let l = raw.trim();
        if let Some(name) = header_name(l) {
            current = name;
            if current == table && key.is_empty() {
                return Some(i + 1);
            }
            continue;
        }
        if current == table && l.split('=').next().map(str::trim) == Some(key) {
            return Some(i + 1);
        }
    }
    None
}

/// Overrides of a config's fields from the command line (`--device`,
/// `--devices`, `--schedule`, `--epochs`); errors name the flag.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// One device for every slot (clears `devices`).
    pub device: Option<String>,
    /// The device slots.
    pub devices: Option<Vec<String>>,
    /// The schedule, by name.
    pub schedule: Option<String>,
    /// `train.epochs`.
    pub epochs: Option<usize>,
}

impl RunConfig {
    /// Reads, parses and validates a config file (the engine's checks only:
    /// see [`crate::zoo::Zoo::load_config`]), then applies `overrides`.
    pub fn load_with(path: &Path, overrides: Overrides) -> Result<Self> {
        let mut config = Self::load(path)?;
        config.apply(overrides)?;
        Ok(config)
    }

    /// Applies command-line overrides, checking each.
    pub fn apply(&mut self, overrides: Overrides) -> Result<()> {
        let config = self;
        let flag_error = |flag: &str, field: &str, message: String| Error::Config {
            path: flag.into(),
            line: None,
            field: Some(field.into()),
            message,
        };
        if let Some(device) = overrides.device {
            pipe_bd::device::DeviceSpec::parse(&device).map_err(|m| flag_error("--device", "device", m))?;
            config.devices = None;
            config.device = device;
        }
        if let Some(devices) = overrides.devices {
            pipe_bd::device::parse_slots(&devices).map_err(|m| flag_error("--devices", "devices", m))?;
            config.devices = Some(devices);
        }
        if let Some(schedule) = overrides.schedule {
            if let Err(e) = pipe_bd::plan::Schedule::parse(&schedule) {
                return Err(flag_error("--schedule", "schedule", e.0));
            }
            config.schedule = schedule;
        }
        let epochs = overrides.epochs;
        if let Some(epochs) = epochs {
            if epochs == 0 {
                return Err(Error::Config {
                    path: "--epochs".into(),
                    line: None,
                    field: Some("train.epochs".into()),
                    message: "must be at least 1".into(),
                });
            }
            config.train.epochs = epochs;
        }
        Ok(())
    }
}
