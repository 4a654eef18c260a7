//! Per-block checkpoints: written so that a crash never leaves one that
//! loads wrong, and read back newest-first, skipping damaged ones.
//!
//! Layout, one folder per block and step:
//!
//! ```text
//! <dir>/block-02/step-00000120/weights.mpk     module record
//!                             /optimizer.mpk   optimizer record (moments per parameter)
//!                             /arch.mpk        architecture optimizer record (single-path search only)
//!                             /manifest.json   step, plan, identity, sha256 of both files
//! ```
//!
//! A checkpoint is written into `.step-00000120.tmp`, every file flushed to
//! disk, the manifest last, then the folder is renamed into place and the
//! parent folder flushed: a folder named `step-*` is complete or absent.
//! Reading verifies the manifest's sizes and sha256 sums before anything is
//! decoded. A damaged checkpoint is refused (the reason names the file) and
//! the next older one is tried; one whose identity (config fields, block
//! shapes, total steps) differs from the run's is refused too, naming each
//! field that does not match.
//!
//! The data order depends only on the seed and the epoch
//! ([`crate::data::epoch_order`]), and the learning rate only on the step,
//! so the step counter is the whole data-order and schedule position; the
//! training loop draws no other random numbers.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::fsio::{sync_dir, write_synced};
use crate::train::TrainerState;

/// Version of the on-disk format.
pub const FORMAT: u32 = 1;
const WEIGHTS: &str = "weights.mpk";
const OPTIMIZER: &str = "optimizer.mpk";
const ARCH_OPTIMIZER: &str = "arch.mpk";
const MANIFEST: &str = "manifest.json";

/// When and where to write checkpoints.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointPolicy {
    /// The checkpoint folder (`<run>/checkpoints`).
    pub dir: PathBuf,
    /// Write every this many steps of a block (0: not by steps).
    pub every_steps: usize,
    /// Write when this many seconds passed since a stage's last checkpoint
    /// (0: not by time).
    pub every_seconds: f64,
    /// Complete checkpoints kept per block (at least 1; older ones are deleted).
    pub keep: usize,
    /// Run-level fields a checkpoint must match to be resumed from (config
    /// fields by dotted name); the runtime adds the block's own.
    pub identity: BTreeMap<String, Value>,
}

impl Default for CheckpointPolicy {
    /// [`CheckpointPolicy::in_dir`]`("checkpoints")`, under the working folder.
    fn default() -> Self {
        Self::in_dir("checkpoints")
    }
}

impl CheckpointPolicy {
    /// Checkpoints in `dir`, every 10 minutes (as a config's default
    /// `checkpoint.every_minutes`) and at each block's last step, the newest
    /// 2 kept, no run-level identity fields. Set `every_steps` for a short
    /// run that should write more often.
    pub fn in_dir(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into(), every_steps: 0, every_seconds: 600.0, keep: 2, identity: BTreeMap::new() }
    }
}

/// One file of a checkpoint with its checksum.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name inside the checkpoint folder.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// sha256, lower-case hex.
    pub sha256: String,
}

/// `manifest.json` of one block checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: u32,
    /// One-based block.
    pub block: usize,
    /// Optimizer steps the block had taken.
    pub step: usize,
    /// Where the block is in the data and the schedule: epoch, batch within
    /// the epoch, next learning rate, data-order seed (all follow from
    /// `step` and the identity; written out for people reading the file).
    #[serde(default)]
    pub position: BTreeMap<String, Value>,
    /// The plan in force when it was written (`{1-2 x2 | 3-4}`).
    pub plan: String,
    /// Seconds since the Unix epoch at writing.
    pub written_unix: f64,
    /// What must match for a resume: config fields and block facts.
    pub identity: BTreeMap<String, Value>,
    /// Recent losses (for the report's final loss after a resume).
    pub recent_losses: Vec<f32>,
    /// The weight and optimizer files (and the architecture optimizer's).
    pub files: Vec<FileEntry>,
}

/// The folder of block `block` (one-based) inside `dir`.
pub fn block_dir(dir: &Path, block: usize) -> PathBuf {
    dir.join(format!("block-{block:02}"))
}

/// Whether a complete checkpoint of `block` (one-based) at `step` is in `dir`.
pub fn has_step(dir: &Path, block: usize, step: usize) -> bool {
    block_dir(dir, block).join(step_name(step)).join(MANIFEST).is_file()
}

fn step_name(step: usize) -> String {
    format!("step-{step:08}")
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A pause injected into the middle of a write (tests kill the process there).
pub type WritePause<'a> = &'a dyn Fn(&Path);

/// Writes block `block`'s state at its current step; `identity` is the
/// policy's plus the block's own fields, `position` its data and schedule
/// position. Returns the checkpoint folder.
/// `pause` (fault injection) runs after half of the weights are on disk.
pub fn write(
    policy: &CheckpointPolicy,
    block: usize,
    state: &TrainerState,
    plan: &str,
    identity: BTreeMap<String, Value>,
    position: BTreeMap<String, Value>,
    pause: Option<WritePause<'_>>,
) -> Result<PathBuf> {
    let parent = block_dir(&policy.dir, block);
    std::fs::create_dir_all(&parent).map_err(|e| Error::io("creating directory", &parent, e))?;
    let name = step_name(state.step);
    let tmp = parent.join(format!(".{name}.tmp"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io("removing", &tmp, e))?;
    }
    std::fs::create_dir(&tmp).map_err(|e| Error::io("creating directory", &tmp, e))?;
    if let Some(pause) = pause {
        write_synced(&tmp.join(WEIGHTS), &state.weights[..state.weights.len() / 2])?;
        pause(&tmp);
    }
    write_synced(&tmp.join(WEIGHTS), &state.weights)?;
    write_synced(&tmp.join(OPTIMIZER), &state.optimizer)?;
    if let Some(arch) = &state.arch_optimizer {
        write_synced(&tmp.join(ARCH_OPTIMIZER), arch)?;
    }
    let entry = |name: &str, bytes: &[u8]| FileEntry {
        name: name.into(),
        bytes: bytes.len() as u64,
        sha256: sha256_hex(bytes),
    };
    let manifest = Manifest {
        format: FORMAT,
        block,
        step: state.step,
        position,
        plan: plan.into(),
        written_unix: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()),
        identity,
        recent_losses: state.recent_losses.clone(),
        files: [
            (WEIGHTS, Some(&state.weights)),
            (OPTIMIZER, Some(&state.optimizer)),
            (ARCH_OPTIMIZER, state.arch_optimizer.as_ref()),
        ]
        .into_iter()
        .filter_map(|(name, bytes)| Some(entry(name, bytes?)))
        .collect(),
    };
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| Error::Checkpoint {
        path: tmp.join(MANIFEST),
        message: format!("cannot serialise the manifest: {e}"),
    })?;
    write_synced(&tmp.join(MANIFEST), &json)?;
    sync_dir(&tmp);
    let target = parent.join(&name);
    if target.exists() {
        std::fs::remove_dir_all(&target).map_err(|e| Error::io("replacing", &target, e))?;
    }
    std::fs::rename(&tmp, &target).map_err(|e| Error::io("renaming into", &target, e))?;
    sync_dir(&parent);
    for (_, old) in list(&policy.dir, block).into_iter().skip(policy.keep.max(1)) {
        std::fs::remove_dir_all(&old).map_err(|e| Error::io("removing old checkpoint", &old, e))?;
    }
    Ok(target)
}

/// Complete checkpoint folders of one block, newest (highest step) first.
pub fn list(dir: &Path, block: usize) -> Vec<(usize, PathBuf)> {
    let parent = block_dir(dir, block);
    let mut found: Vec<(usize, PathBuf)> = std::fs::read_dir(&parent)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().to_string();
            let step = name.strip_prefix("step-")?.parse::<usize>().ok()?;
            Some((step, entry.path()))
        })
        .collect();
    found.sort_by_key(|f| std::cmp::Reverse(f.0));
    found
}

/// Reads and verifies one checkpoint folder against `identity`. A damaged
/// folder gives [`Refusal::Damaged`], one of another run [`Refusal::Mismatch`].
pub fn read(
    folder: &Path,
    identity: &BTreeMap<String, Value>,
) -> std::result::Result<(Manifest, TrainerState), Refusal> {
    let manifest_path = folder.join(MANIFEST);
    let damaged =
        |path: &Path, message: String| Refusal::Damaged(Error::Checkpoint { path: path.into(), message });
    let text =
        std::fs::read(&manifest_path).map_err(|e| damaged(&manifest_path, format!("unreadable: {e}")))?;
    let manifest: Manifest = serde_json::from_slice(&text)
        .map_err(|e| damaged(&manifest_path, format!("not a valid manifest: {e}")))?;
    if manifest.format != FORMAT {
        return Err(Refusal::Mismatch(Error::Checkpoint {
            path: manifest_path,
            message: format!("format {} (this pipebd reads format {FORMAT})", manifest.format),
        }));
    }
    let mut differences = Vec::new();
    for (key, expected) in identity {
        match manifest.identity.get(key) {
            Some(found) if found == expected => {}
            Some(found) => {
                differences.push(format!("`{key}` is {found} in the checkpoint, {expected} in this run"))
            }
            None => differences.push(format!("`{key}` is missing from the checkpoint")),
        }
    }
    if !differences.is_empty() {
        return Err(Refusal::Mismatch(Error::Checkpoint {
            path: manifest_path,
            message: format!("written by another run: {}", differences.join("; ")),
        }));
    }
    let mut contents = BTreeMap::new();
    for entry in &manifest.files {
        // Only the files a checkpoint holds, inside its folder: a damaged
        // name must not make the reader open `/dev/zero` or `../../x`.
        if ![WEIGHTS, OPTIMIZER, ARCH_OPTIMIZER].contains(&entry.name.as_str()) {
            return Err(damaged(
                &manifest_path,
                format!("lists a file {:?}, not one of {WEIGHTS}, {OPTIMIZER}, {ARCH_OPTIMIZER}", entry.name),
            ));
        }
        let path = folder.join(&entry.name);
        // At most one byte more than the manifest says is read: enough to
        // tell a longer file, never the whole of a huge one.
        let mut bytes = Vec::new();
        std::fs::File::open(&path)
            .and_then(|file| file.take(entry.bytes.saturating_add(1)).read_to_end(&mut bytes))
            .map_err(|e| damaged(&path, format!("unreadable: {e}")))?;
        if bytes.len() as u64 != entry.bytes {
            let how = if (bytes.len() as u64) < entry.bytes { "truncated" } else { "longer than written" };
            return Err(damaged(
                &path,
                format!("{how}: {} bytes, the manifest says {}", bytes.len(), entry.bytes),
            ));
        }
        let sum = sha256_hex(&bytes);
        if sum != entry.sha256 {
            return Err(damaged(
                &path,
                format!("sha256 {sum} does not match the manifest's {}", entry.sha256),
            ));
        }
        contents.insert(entry.name.clone(), bytes);
    }
    let mut take = |name: &str| {
        contents.remove(name).ok_or_else(|| damaged(&manifest_path, format!("lists no `{name}`")))
    };
    let state = TrainerState {
        weights: take(WEIGHTS)?,
        optimizer: take(OPTIMIZER)?,
        arch_optimizer: contents.remove(ARCH_OPTIMIZER),
        step: manifest.step,
        recent_losses: manifest.recent_losses.clone(),
    };
    Ok((manifest, state))
}

/// Why a checkpoint folder was not used.
#[derive(Debug)]
pub enum Refusal {
    /// Truncated, corrupt or unreadable: an older checkpoint may be used.
    Damaged(Error),
    /// Written by another run (other config or shapes): resuming is refused.
    Mismatch(Error),
}

/// What a resume did for one block (written in the report).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResumedBlock {
    /// One-based block.
    pub block: usize,
    /// The step it resumed at (0: from scratch, no usable checkpoint).
    pub step: usize,
    /// The checkpoint folder used, if any.
    pub checkpoint: Option<PathBuf>,
    /// Newer checkpoints refused as damaged, with the reason.
    pub refused: Vec<String>,
}

/// The checkpoint folder inside a run folder, or `dir` itself if it is one.
pub fn resolve_dir(dir: &Path) -> PathBuf {
    let inner = dir.join("checkpoints");
    if inner.is_dir() {
        inner
    } else {
        dir.to_path_buf()
    }
}
