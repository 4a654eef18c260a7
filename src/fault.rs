//! Fault injection, so that every recovery path is tested for real.
//!
//! A fault makes the worker on one device slot fail at one step, in one of
//! four ways; it comes from the config (`[[faults]]`) or from the
//! environment variable [`ENV`], e.g.
//!
//! ```text
//! PIPEBD_FAULTS="panic slot=1 step=12; hang slot=2 step=30; stall-checkpoint block=2 step=10"
//! ```

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The environment variable read by [`from_env`].
pub const ENV: &str = "PIPEBD_FAULTS";

/// How the chosen worker fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// The worker returns an error (a device error).
    Error,
    /// The worker panics (a crash inside a kernel or block).
    Panic,
    /// The worker stops making progress (a hung device); the runtime's
    /// progress timeout must notice it.
    Hang,
    /// The checkpoint write of `block` at `step` stops half-way (printing
    /// `pipebd: fault: checkpoint write stalled` on stderr) for an hour:
    /// tests kill the process there.
    StallCheckpoint,
}

/// One injected fault.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    /// What happens.
    pub kind: FaultKind,
    /// The device slot whose worker fails (`error`, `panic`, `hang`).
    #[serde(default)]
    pub slot: Option<usize>,
    /// The one-based block whose checkpoint write stalls (`stall-checkpoint`).
    #[serde(default)]
    pub block: Option<usize>,
    /// The zero-based step it happens at (for `stall-checkpoint`: the block's
    /// step count when the checkpoint is written).
    pub step: usize,
}

impl Fault {
    /// Checks that the fault names what its kind needs.
    pub fn validate(&self) -> std::result::Result<(), String> {
        match (self.kind, self.slot, self.block) {
            (FaultKind::StallCheckpoint, _, None) => Err("`stall-checkpoint` needs `block`".into()),
            (FaultKind::StallCheckpoint, _, Some(_)) => Ok(()),
            (_, None, _) => Err("`error`, `panic` and `hang` need `slot`".into()),
            _ => Ok(()),
        }
    }

    /// True when this fault makes the worker on `slot` fail at `step`.
    pub fn hits_worker(&self, slot: usize, step: usize) -> bool {
        self.kind != FaultKind::StallCheckpoint && self.slot == Some(slot) && self.step == step
    }

    /// True when this fault stalls the checkpoint of `block` (one-based) at `step`.
    pub fn hits_checkpoint(&self, block: usize, step: usize) -> bool {
        self.kind == FaultKind::StallCheckpoint && self.block == Some(block) && self.step == step
    }
}

/// Parses `kind key=value ...; ...` (the [`ENV`] syntax).
pub fn parse_list(text: &str) -> Result<Vec<Fault>> {
    let bad = |message: String| Error::Config { path: ENV.into(), line: None, field: None, message };
    let mut faults = Vec::new();
    for item in text.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        let mut words = item.split_whitespace();
        let kind = match words.next().unwrap_or_default() {
            "error" => FaultKind::Error,
            "panic" => FaultKind::Panic,
            "hang" => FaultKind::Hang,
            "stall-checkpoint" => FaultKind::StallCheckpoint,
            other => {
                return Err(bad(format!(
                    "`{item}`: unknown fault `{other}`; expected error, panic, hang or stall-checkpoint"
                )))
            }
        };
        let mut fault = Fault { kind, slot: None, block: None, step: usize::MAX };
        for word in words {
            let (key, value) = word
                .split_once('=')
                .ok_or_else(|| bad(format!("`{item}`: expected key=value, got `{word}`")))?;
            let number: usize = value
                .parse()
                .map_err(|_| bad(format!("`{item}`: `{key}` must be a number, got `{value}`")))?;
            match key {
                "slot" => fault.slot = Some(number),
                "block" => fault.block = Some(number),
                "step" => fault.step = number,
                other => return Err(bad(format!("`{item}`: unknown key `{other}` (slot, block, step)"))),
            }
        }
        if fault.step == usize::MAX {
            return Err(bad(format!("`{item}`: `step` is required")));
        }
        fault.validate().map_err(|m| bad(format!("`{item}`: {m}")))?;
        faults.push(fault);
    }
    Ok(faults)
}

/// The faults named in [`ENV`] (none when it is unset).
pub fn from_env() -> Result<Vec<Fault>> {
    match std::env::var(ENV) {
        Ok(text) => parse_list(&text),
        Err(_) => Ok(Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_environment_syntax_and_names_what_is_wrong() {
        let faults = parse_list("panic slot=1 step=12; stall-checkpoint block=2 step=10").unwrap();
        assert_eq!(faults.len(), 2);
        assert!(
            faults[0].hits_worker(1, 12) && !faults[0].hits_worker(1, 11) && !faults[0].hits_worker(0, 12)
        );
        assert!(faults[1].hits_checkpoint(2, 10) && !faults[1].hits_worker(2, 10));
        let error = parse_list("explode slot=1 step=2").unwrap_err().to_string();
        assert!(error.contains("unknown fault `explode`"), "{error}");
        let error = parse_list("hang step=2").unwrap_err().to_string();
        assert!(error.contains("need `slot`"), "{error}");
        let error = parse_list("hang slot=1").unwrap_err().to_string();
        assert!(error.contains("`step` is required"), "{error}");
    }
}
