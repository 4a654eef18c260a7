//! Command-line flags over a config file; errors name the flag.

use std::path::Path;

use pipe_bd::error::{Error, Result};

use super::RunConfig;

/// Overrides of a config's fields from the command line (`--device`,
/// `--devices`, `--schedule`, `--epochs`, `--train-limit`); errors name the
/// flag.
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
    /// `data.train_limit`.
    pub train_limit: Option<usize>,
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
        if let Some(limit) = overrides.train_limit {
            if limit == 0 {
                return Err(flag_error("--train-limit", "data.train_limit", "must be at least 1".into()));
            }
            config.data.train_limit = Some(limit);
        }
        Ok(())
    }
}
