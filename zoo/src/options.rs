//! The built-in zoo's own keys of `[data]` ([`DataOptions`]) and
//! `[teacher]` ([`TeacherOptions`]), and the helpers every teacher module
//! reads them through: tokens per sequence, teacher layers per block, the
//! configured block loss, the tokenizer's path, and the error for a student
//! block the teacher cannot serve. Below every other module of the zoo: it
//! names no teacher.

use std::path::{Path, PathBuf};

use pipe_bd::{Error, Result};
use pipebd_cli::config::{ConfigIssue, RunConfig};
use pipebd_cli::zoo::parse_options;
use pipebd_core::{BlockSpec, LossKind};
use serde::{Deserialize, Serialize};

use crate::text::ProbeConfig;

/// The built-in zoo's own keys of `[data]` (for text: the Brown corpus).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DataOptions {
    /// Every sentence is truncated or padded to this many tokens, `[CLS]`
    /// and `[SEP]` included (default [`DEFAULT_MAX_TOKENS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    /// The downstream probe on frozen sentence embeddings (`[data.probe]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe: Option<ProbeConfig>,
}

/// Default `data.max_tokens`.
pub const DEFAULT_MAX_TOKENS: usize = 64;

impl DataOptions {
    /// The keys, as [`Zoo::data_options`](pipebd_cli::zoo::Zoo::data_options) declares them.
    pub(crate) const KEYS: &'static [&'static str] = &["max_tokens", "probe"];

    /// `config`'s `[data]` options (checked when the config was loaded).
    pub fn of(config: &RunConfig) -> Result<Self> {
        parse_options("data", &config.data.options).map_err(ConfigIssue::into_plain_error)
    }

    /// Tokens per sequence for text data.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS)
    }
}

/// The built-in zoo's own keys of `[teacher]` (for `minilm-l6`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TeacherOptions {
    /// The tokenizer (default: `tokenizer.json` beside the weights).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// Teacher layers per block, in order (default one each: six blocks).
    /// `[2, 2, 2]` cuts three blocks of two layers, so that one student
    /// block replaces two teacher layers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers_per_block: Option<Vec<usize>>,
    /// The loss of every block whose default is the MSE: `mse`, `nmse`
    /// (normalized per sequence: every block's loss on the same scale,
    /// Puzzle's BLD loss) or `nmse-token` (normalized per token vector).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_loss: Option<BlockLoss>,
}

/// The losses `teacher.block_loss` may name: those that compare any two
/// block outputs of one shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BlockLoss {
    /// [`LossKind::Mse`].
    Mse,
    /// [`LossKind::Nmse`].
    Nmse,
    /// [`LossKind::NmseToken`].
    NmseToken,
}

impl From<BlockLoss> for LossKind {
    fn from(loss: BlockLoss) -> Self {
        match loss {
            BlockLoss::Mse => LossKind::Mse,
            BlockLoss::Nmse => LossKind::Nmse,
            BlockLoss::NmseToken => LossKind::NmseToken,
        }
    }
}

impl TeacherOptions {
    /// The keys, as [`Zoo::teacher_options`](pipebd_cli::zoo::Zoo::teacher_options) declares them.
    pub(crate) const KEYS: &'static [&'static str] = &["tokenizer", "layers_per_block", "block_loss"];

    /// `config`'s `[teacher]` options (checked when the config was loaded).
    pub fn of(config: &RunConfig) -> Result<Self> {
        parse_options("teacher", &config.teacher.options).map_err(ConfigIssue::into_plain_error)
    }
}

/// The tokenizer file of the text teacher of `config`.
pub fn tokenizer_path(config: &RunConfig) -> Result<PathBuf> {
    let weights = &config.teacher.weights;
    Ok(TeacherOptions::of(config)?
        .tokenizer
        .unwrap_or_else(|| weights.parent().unwrap_or(Path::new(".")).join("tokenizer.json")))
}

/// `specs` with `teacher.block_loss` in place of each MSE (the students
/// and the search's scores take their loss from the teacher's specs).
pub fn with_block_loss(config: &RunConfig, specs: Vec<BlockSpec>) -> Result<Vec<BlockSpec>> {
    let Some(kind) = TeacherOptions::of(config)?.block_loss.map(LossKind::from) else { return Ok(specs) };
    Ok(specs
        .into_iter()
        .map(|spec| if spec.loss == LossKind::Mse { spec.with_loss(kind) } else { spec })
        .collect())
}

/// Layers per block of a teacher of `layers` layers:
/// `teacher.layers_per_block`, or one each.
pub(crate) fn grouped_layers(config: &RunConfig, layers: usize) -> Result<Vec<usize>> {
    Ok(TeacherOptions::of(config)?.layers_per_block.unwrap_or_else(|| vec![1; layers]))
}

/// Tokens per sequence of the text data of `config` (`data.max_tokens`).
pub fn max_tokens(config: &RunConfig) -> Result<usize> {
    Ok(DataOptions::of(config)?.max_tokens())
}

/// A student block's config that the teacher cannot serve: the user's
/// error (`pipebd` exits with 2 and names the config file).
pub(crate) fn config_block_error(block: usize, message: impl std::fmt::Display) -> Error {
    Error::Student(format!("student block {block}: {message}").into())
}
