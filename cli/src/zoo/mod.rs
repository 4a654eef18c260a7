//! Where teachers, students and datasets come from: the [`Zoo`] trait, the
//! one door through which `pipebd run`, `bench`, `profile`, `sweep`, `eval`
//! and `check` build a job's blocks and data from its config.
//!
//! The built-in zoo (`pipebd_zoo::Builtin`, its own crate: the MNIST CNN and
//! MiniLM teachers, the students of `pipebd-students`, their data) goes
//! through this door like any other. A user crate implements [`Zoo`] for its
//! own kinds and calls [`crate::cli::run_with`] (the whole `pipebd` command
//! line) or the job functions ([`crate::jobs::run::run`], ...) with it; see
//! `examples/custom_zoo/`.

use std::collections::BTreeMap;
use std::path::Path;

use pipebd_core::{Block, BlockSpec, Dataset, OutputHead, Students};
use pipebd_kernels::{DistillBackend, FusedBackend};
use serde::de::DeserializeOwned;

pub use crate::config::parse_options;
use crate::config::{check_option_keys, ConfigIssue, Overrides, RunConfig};
use crate::jobs::export::{ExportRequest, Exported, TextScore, TextScoreRequest};
use pipe_bd::error::{Error, Result};
use pipe_bd::eval::Evaluate;

/// A family of teachers, students and datasets that configs can name.
///
/// The engine reads the generic parts of a [`RunConfig`] (schedule, devices,
/// training, optimizer, runtime, checkpoints); a zoo reads the rest:
/// `data.dataset` and `data.dir`, the `[teacher]` table, each `[[students]]`
/// table (kept as raw TOML in [`RunConfig::students`]; parse them with
/// [`parse_students`]) and the free `[custom]` table ([`parse_custom`]).
///
/// Backend-generic like the blocks themselves: a job picks burn's backend
/// from the config's devices and asks the zoo for blocks on it.
pub trait Zoo: Sync {
    /// The teacher's block type on backend `B` (frozen: forward only).
    type Teacher<B: FusedBackend>: Block<B> + Send + Sync;
    /// The students' block type on the training backend `B`.
    type Student<B: DistillBackend>: pipebd_core::StudentModule<B>;

    /// Checks the parts of `config` this zoo reads (dataset name, teacher
    /// kind, each student table, `[custom]`) before anything runs. Name the
    /// field in the issue: errors then point at the file's line.
    fn check_config(&self, config: &RunConfig) -> std::result::Result<(), ConfigIssue>;

    /// The keys of `[data]` this zoo reads beyond the engine's (`dataset`,
    /// `dir`, `train_limit`, `test_limit`), parsed from
    /// [`DataConfig::options`](crate::config::DataConfig::options) (e.g. with
    /// [`parse_options`]); any other key is refused before
    /// [`Zoo::check_config`] runs. None by default.
    fn data_options(&self) -> &'static [&'static str] {
        &[]
    }

    /// The keys of `[teacher]` this zoo reads beyond `kind` and `weights`,
    /// as [`Zoo::data_options`]. None by default.
    fn teacher_options(&self) -> &'static [&'static str] {
        &[]
    }

    /// The config fields of this zoo that a checkpoint must match to be
    /// resumed from (name -> value as written; a checkpoint written under
    /// other values is refused, one that lacks a name too). By default every
    /// `[data]` and `[teacher]` option as `data.<key>` / `teacher.<key>`, and
    /// `custom` when `[custom]` is not empty; leave out what does not change
    /// training (an evaluation setting).
    fn checkpoint_identity(&self, config: &RunConfig) -> BTreeMap<String, serde_json::Value> {
        let mut identity = BTreeMap::new();
        for (table, options) in [("data", &config.data.options), ("teacher", &config.teacher.options)] {
            for (key, value) in options {
                identity.insert(format!("{table}.{key}"), serde_json::json!(value));
            }
        }
        if !config.custom.is_empty() {
            identity.insert("custom".into(), serde_json::json!(config.custom));
        }
        identity
    }

    /// The teacher's block specs, cheaply (without reading large weight files
    /// where possible): configs are checked against them before heavy work.
    fn teacher_specs(&self, config: &RunConfig) -> Result<Vec<BlockSpec>>;

    /// The students' block specs for `teacher`'s (fails on a block whose
    /// shapes do not fit). By default the students are built on the CPU and
    /// their specs taken; override it where that is costly.
    fn student_specs(&self, config: &RunConfig, teacher: &[BlockSpec]) -> Result<Vec<BlockSpec>> {
        type Cpu = burn::backend::Autodiff<burn::backend::Flex>;
        Ok(self.students::<Cpu>(config, teacher, &Default::default())?.specs)
    }

    /// The specs of every block's candidates (blockwise architecture
    /// search): for block k, one spec per candidate its student trains
    /// ([`Block::candidates`], in order), empty for an ordinary block. By
    /// default the students are built on the CPU and each candidate's spec
    /// inferred (FLOPs unknown: 0); override it to give their FLOPs.
    fn candidate_specs(&self, config: &RunConfig, teacher: &[BlockSpec]) -> Result<Vec<Vec<BlockSpec>>> {
        type Cpu = burn::backend::Autodiff<burn::backend::Flex>;
        let device = Default::default();
        let students = self.students::<Cpu>(config, teacher, &device)?;
        let mut specs = Vec::with_capacity(students.blocks.len());
        for (k, (block, t)) in students.blocks.iter().zip(teacher).enumerate() {
            let candidates = block
                .candidates()
                .iter()
                .enumerate()
                .map(|(c, candidate)| {
                    BlockSpec::infer(format!("candidate{}", c + 1), candidate, &t.input_shape, &device)
                        .map(|spec| spec.with_loss(t.loss))
                        .map_err(|e| Error::from(e).at_block(k + 1))
                })
                .collect::<Result<Vec<_>>>()?;
            specs.push(candidates);
        }
        Ok(specs)
    }

    /// Checks that the files `config` names (data, weights) are there and
    /// readable, without reading what training reads; every error should
    /// name the file. By default nothing is checked.
    fn check_inputs(&self, config: &RunConfig) -> Result<()> {
        let _ = config;
        Ok(())
    }

    /// How many training samples `config` gives (after its own limits, before
    /// a search holds some out), if that is known without loading them: the
    /// preflight then refuses a batch larger than that. By default unknown.
    fn train_samples(&self, config: &RunConfig) -> Result<Option<usize>> {
        let _ = config;
        Ok(None)
    }

    /// Loads the teacher, the training data and (with `with_evaluation`) the
    /// evaluation data on `device`.
    fn workload<B: FusedBackend>(
        &self,
        config: &RunConfig,
        device: &B::Device,
        with_evaluation: bool,
    ) -> Result<Workload<B, Self::Teacher<B>>>;

    /// Builds the config's student blocks on `device`, initialised from
    /// `config.seed` (the same weights on every backend where possible), and
    /// checks them against the teacher's specs.
    fn students<B: DistillBackend>(
        &self,
        config: &RunConfig,
        teacher: &[BlockSpec],
        device: &B::Device,
    ) -> Result<Students<B, Self::Student<B>>>;

    /// Whether the teacher of `config` has a frozen head after its last
    /// block ([`Zoo::output_head`]: a language model's LM head), cheaply:
    /// `train.stitched_output_loss = "head-kl"` is refused before anything
    /// runs when it has none. None by default.
    fn has_output_head(&self, config: &RunConfig) -> bool {
        let _ = config;
        false
    }

    /// The frozen head after the teacher's last block, on the training
    /// backend `B` (parameters without gradients), that a `head-kl` stitched
    /// output loss scores both final activations through; `None` when the
    /// teacher has none (the default).
    fn output_head<B: DistillBackend>(
        &self,
        config: &RunConfig,
        device: &B::Device,
    ) -> Result<Option<Box<dyn OutputHead<B>>>> {
        let _ = (config, device);
        Ok(None)
    }

    /// `config` as it builds students whose weights saved ones then replace
    /// (a finished run's records, [`crate::jobs::eval::load_students`]): a
    /// zoo whose students start from a costly init (pruning, a refit on
    /// training data) returns a config that skips it. `config` by default.
    fn config_for_saved_weights(&self, config: &RunConfig) -> RunConfig {
        config.clone()
    }

    /// Writes a trained student, or the teacher, as a file another tool runs
    /// (`pipebd export`). None by default: the error says so.
    fn export(&self, request: &ExportRequest) -> Result<Exported> {
        let _ = request;
        Err(Error::Zoo { path: None, message: "this zoo exports no models (`pipebd export`)".into() })
    }

    /// Scores a model file on a text with llama.cpp's perplexity protocol
    /// (`pipebd eval-gguf`). None by default: the error says so.
    fn score_model_file(&self, request: &TextScoreRequest) -> Result<TextScore> {
        let _ = request;
        Err(Error::Zoo { path: None, message: "this zoo scores no model files (`pipebd eval-gguf`)".into() })
    }

    /// Parses and validates config text: the engine's checks, then this
    /// zoo's ([`Zoo::check_config`]); `path` is only used in errors.
    fn parse_config(&self, text: &str, path: &Path) -> Result<RunConfig> {
        RunConfig::parse_checked(text, path, &|config| self.check_all(config))
    }

    /// Reads, parses and validates a config file ([`Zoo::parse_config`]),
    /// then applies command-line `overrides`.
    fn load_config(&self, path: &Path, overrides: Overrides) -> Result<RunConfig> {
        let text = RunConfig::read_text(path)?;
        let mut config = self.parse_config(&text, path)?;
        config.apply(overrides)?;
        Ok(config)
    }

    /// [`Zoo::check_config`] for a config that did not come from a file (a
    /// library user's): the error names the field but no line.
    fn check(&self, config: &RunConfig) -> Result<()> {
        self.check_all(config).map_err(ConfigIssue::into_plain_error)
    }

    /// The zoo's checks of `config`: only declared option keys
    /// ([`Zoo::data_options`], [`Zoo::teacher_options`]), then
    /// [`Zoo::check_config`].
    fn check_all(&self, config: &RunConfig) -> std::result::Result<(), ConfigIssue> {
        check_option_keys(config, self.data_options(), self.teacher_options())?;
        self.check_config(config)
    }
}

/// A job's data and teacher, loaded from its config by a [`Zoo`].
pub struct Workload<B: FusedBackend, T: Block<B>> {
    /// The frozen teacher, cut into blocks.
    pub teacher: pipebd_core::Teacher<B, T>,
    /// The training samples.
    pub train: Box<dyn Dataset<B>>,
    /// How a trained student is scored after training, next to the teacher
    /// (`None`: nothing to score; the report's accuracies are then 0).
    pub evaluation: Option<Box<dyn Evaluate<B>>>,
}

/// Parses each `[[students]]` table of `config` as a `C` (a zoo's student
/// config type, usually a `#[serde(tag = "kind")]` enum); the issue names
/// the entry (`students[3]`) and what serde found wrong.
pub fn parse_students<C: DeserializeOwned>(config: &RunConfig) -> std::result::Result<Vec<C>, ConfigIssue> {
    config
        .students
        .iter()
        .enumerate()
        .map(|(k, table)| {
            // `weights` is the engine's (see `RunConfig::student_weights`).
            let mut table = table.clone();
            table.remove("weights");
            C::deserialize(toml::Value::Table(table)).map_err(|e| {
                ConfigIssue::in_entry("students", k, format!("block {}: {}", k + 1, e.message().trim()))
            })
        })
        .collect()
}

/// Parses the `[custom]` table of `config` as a `C` (a zoo's own settings;
/// an absent table parses as an empty one).
pub fn parse_custom<C: DeserializeOwned>(config: &RunConfig) -> std::result::Result<C, ConfigIssue> {
    C::deserialize(toml::Value::Table(config.custom.clone()))
        .map_err(|e| ConfigIssue::new("custom", "", e.message().to_string()))
}

/// A student config as the raw TOML table [`RunConfig::students`] holds
/// (to build configs in code).
pub fn student_table<C: serde::Serialize>(student: &C) -> Result<toml::Table> {
    toml::Table::try_from(student).map_err(|e| Error::Config {
        path: "students".into(),
        line: None,
        field: Some("students".into()),
        message: format!("cannot be written as a TOML table: {e}"),
    })
}
