//! A config as the engine's settings: training, runtime, checkpoints,
//! devices and schedule.

use std::path::PathBuf;

use pipebd_core::Schedule;

use pipe_bd::error::{Error, Result};

use super::{RunConfig, SearchMode};

impl RunConfig {
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
