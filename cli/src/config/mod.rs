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
//!
//! Its parts: [`schema`] (the sections and their defaults), `validate` (the
//! engine's rules), `locate` (which line and field an error is about),
//! `settings` (the engine's settings a config becomes) and `overrides`
//! (command-line flags over a file).

mod locate;
mod overrides;
pub mod schema;
mod settings;
mod validate;

use std::path::Path;

use serde::{Deserialize, Serialize};

use pipe_bd::error::{Error, Result};
use pipe_bd::train::optim::OptimizerConfig;

use locate::parse_error;
pub use locate::ConfigIssue;
pub use overrides::Overrides;
pub use schema::{
    check_option_keys, parse_options, CheckpointConfig, DataConfig, RuntimeConfig, SearchConfig, SearchMode,
    TeacherConfig, TrainConfig,
};

/// A whole run: data, teacher, students, training and where to run it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// Name of the run (used in reports).
    #[serde(default = "schema::default_name")]
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
    #[serde(default = "schema::default_device")]
    pub device: String,
    /// Device slots for the parallel schedules, e.g. `["cpu", "cpu"]` or
    /// `["cuda:0", "cuda:1"]` (all of one kind). Default: `[device]`.
    #[serde(default)]
    pub devices: Option<Vec<String>>,
    /// Parallel schedule: `ideal`, `dp`, `ls`, `tr`, `tr-dpu` or `hybrid`
    /// (then `[[stages]]` says which blocks each stage trains on how many replicas).
    #[serde(default = "schema::default_schedule")]
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
}

/// A plan as the part of a run config that asks for it: `schedule =
/// "hybrid"` and its `[[stages]]` (written by serde, so that it is read back
/// as written), under a comment with the prediction.
pub fn plan_as_toml(plan: &pipe_bd::planning::planner::Candidate, blocks: usize, slots: usize) -> String {
    #[derive(Serialize)]
    struct PlanPart {
        schedule: &'static str,
        stages: Vec<pipe_bd::plan::StageSpec>,
    }
    let part = PlanPart {
        schedule: pipebd_core::Schedule::Hybrid.name(),
        stages: plan
            .stages
            .iter()
            .map(|s| pipe_bd::plan::StageSpec {
                blocks: s.blocks.clone().map(|k| k + 1).collect(),
                replicas: s.replicas,
            })
            .collect(),
    };
    format!(
        "# Written by `pipebd plan`: {blocks} blocks on {slots} device slots, predicted {:.2} ms per step.\n\
         # Use it in a run config with {slots} entries in `devices`.\n{}",
        1e3 * plan.step_seconds,
        toml::to_string(&part).unwrap_or_default()
    )
}
