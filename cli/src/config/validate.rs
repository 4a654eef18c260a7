//! The engine's rules for a run config; each broken rule names its table
//! and key, which `locate` turns into a line.

use std::path::Path;

use pipe_bd::error::{Error, Result};
use pipe_bd::train::optim::OptimizerConfig;

use super::locate::find_key_line;
use pipe_bd::train::stitch::StitchedGradients;
use pipebd_core::Schedule;

use super::{RunConfig, SearchMode};

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
    pub(super) fn validate(&self, text: &str, path: &Path) -> Result<()> {
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
        if !pipebd_core::is_valid_temperature(self.train.temperature) {
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
