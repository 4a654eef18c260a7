//! The engine's one error type.

use std::path::{Path, PathBuf};

/// Everything the engine can fail with. Each variant names the file, field
/// or block it is about.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A run configuration is malformed or inconsistent.
    #[error("{}: {message}", location(path, *line, field.as_deref()))]
    Config {
        /// The config file (or `<memory>` for configs built in code).
        path: PathBuf,
        /// One-based line of the offending entry, when known.
        line: Option<usize>,
        /// Dotted name of the offending field (`train.batch_size`), when known.
        field: Option<String>,
        /// What is wrong and what was expected.
        message: String,
    },
    /// A search's candidates cannot be chosen from (no candidates for a
    /// block, a loss or cost that is not a number).
    #[error("search: {message}")]
    Search {
        /// What is wrong, naming the block and candidate.
        message: String,
    },
    /// A data file is missing, truncated or not what its name says.
    #[error("data file {path}: {message}")]
    Data {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// An I/O operation on a file the user named failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What we were doing ("reading", "writing", "creating directory").
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The block API's errors (`pipebd-core`): a block given input it
    /// cannot process, student shapes or block counts that do not match the
    /// teacher's, a data set that cannot produce a batch.
    #[error(transparent)]
    Core(#[from] pipebd_core::Error),
    /// The run was asked to stop (SIGINT, SIGTERM, or
    /// [`crate::runtime::interrupt::Interrupt::request`]): the steps in
    /// flight were finished and every block's checkpoint written.
    #[error(
        "interrupted by {}: every block has completed {completed_steps}{} of {total_steps} steps; {}{}",
        crate::runtime::interrupt::signal_name(*signal),
        if most_steps > completed_steps { format!(" to {most_steps}") } else { String::new() },
        match checkpoints {
            _ if *most_steps == 0 => "no step was complete, so there is nothing to save yet".to_string(),
            Some(dir) => format!("their checkpoints are in {}", dir.display()),
            None => "no checkpoints were written (the run has none)".to_string(),
        },
        match resume_command {
            Some(command) => format!("\nresume with:\n  {command}"),
            None => String::new(),
        }
    )]
    Interrupted {
        /// The signal number (2 SIGINT, 15 SIGTERM).
        signal: i32,
        /// Steps done by the block that has done the fewest.
        completed_steps: usize,
        /// Steps done by the block that has done the most.
        most_steps: usize,
        /// Steps of the whole run.
        total_steps: usize,
        /// The checkpoint folder the run resumes from.
        checkpoints: Option<PathBuf>,
        /// The command that resumes the run (filled in by the command line).
        resume_command: Option<String>,
    },
    /// Training a block diverged or failed.
    #[error("block {block}, step {step}: {message}")]
    Training {
        /// One-based block number.
        block: usize,
        /// Optimizer step (zero-based) at which it failed.
        step: usize,
        /// What went wrong.
        message: String,
    },
    /// The requested device is unavailable in this build or on this machine.
    #[error("device `{device}`: {message}")]
    Device {
        /// The device as the user wrote it.
        device: String,
        /// Why it cannot be used.
        message: String,
    },
    /// A schedule cannot run as described.
    #[error("schedule `{plan}`: {message}")]
    Plan {
        /// The schedule's name.
        plan: String,
        /// What is wrong.
        message: String,
    },
    /// Processes of a multi-process run (MPI) cannot reach each other, or
    /// sent something this build cannot read.
    #[error("transport: {message}")]
    Transport {
        /// What failed, naming the ranks.
        message: String,
    },
    /// Another process of a multi-process run failed or went silent.
    #[error("rank {rank}: {message}")]
    Peer {
        /// The rank that failed.
        rank: usize,
        /// Its error, as it reported it (or the silence noticed).
        message: String,
    },
    /// A pipeline worker waited longer than the configured timeout.
    #[error("timeout: {message}")]
    Timeout {
        /// Who waited for what.
        message: String,
    },
    /// A pipeline worker failed; the whole run was stopped.
    #[error("stage {stage} replica {replica} (device slot {slot}) failed: {source}")]
    Worker {
        /// One-based stage.
        stage: usize,
        /// Zero-based replica within the stage.
        replica: usize,
        /// Device slot of the worker.
        slot: usize,
        /// The worker's error.
        source: Box<Error>,
    },
    /// A zoo's teacher could not be built (its weight or tokenizer file is
    /// missing, unreadable or not what it should be): the zoo's own error.
    #[error(transparent)]
    Teacher(Box<dyn std::error::Error + Send + Sync>),
    /// A zoo's student block could not be built from its config (a size out
    /// of range, an input shape it cannot take): the zoo's own error.
    #[error(transparent)]
    Student(Box<dyn std::error::Error + Send + Sync>),
    /// A worker panicked (a bug in a block, or a device that failed).
    #[error("{}panicked: {message}", at_block(*block, *step))]
    Panic {
        /// One-based block number (0 when outside a block).
        block: usize,
        /// Step at which it panicked.
        step: usize,
        /// The panic message.
        message: String,
    },
    /// A worker made no progress for the configured time (a hung device).
    #[error("made no progress for {seconds:.1} s at step {step} (hung device?)")]
    Stalled {
        /// How long it had been silent.
        seconds: f64,
        /// The step it was on.
        step: usize,
    },
    /// A fault injected on purpose (`[[faults]]` or `PIPEBD_FAULTS`).
    #[error("injected fault `{kind}` at step {step}")]
    InjectedFault {
        /// The kind of fault.
        kind: String,
        /// The step it fired at.
        step: usize,
    },
    /// A checkpoint is damaged, incomplete, or belongs to another run.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The file (or folder) at fault.
        path: PathBuf,
        /// What does not match, or what is missing.
        message: String,
    },
    /// Saving a trained block's record (burn's weights file) failed.
    #[error("record {path}: {message}")]
    Record {
        /// The record file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A trained block's record the user's input names (a run folder's
    /// student, a config's `weights`) is missing or does not load.
    #[error("record {path}: {message}")]
    RecordInput {
        /// The record file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A zoo of the user's own could not use one of its inputs (a teacher
    /// file, its data): counted as the user's input, like a config error.
    #[error("{}{message}", path.as_ref().map(|p| format!("{}: ", p.display())).unwrap_or_default())]
    Zoo {
        /// The file or folder, when there is one.
        path: Option<PathBuf>,
        /// What went wrong.
        message: String,
    },
}

impl Error {
    /// This error, when it is about the config file at `path` without naming
    /// it (a student that does not fit its teacher block, a config field
    /// checked after parsing), as a config error that names it.
    pub fn in_config(self, path: &Path) -> Error {
        match self {
            // Checks after parsing name the config by its `name` only.
            Error::Config { path: named, line, field, message }
                if named.to_string_lossy().starts_with("config `") =>
            {
                Error::Config { path: path.to_path_buf(), line, field, message }
            }
            e @ (Error::Core(
                pipebd_core::Error::ShapeMismatch { .. } | pipebd_core::Error::BlockCount { .. },
            )
            | Error::Student(_)) => {
                Error::Config { path: path.to_path_buf(), line: None, field: None, message: e.to_string() }
            }
            other => other,
        }
    }

    /// True when the error is the user's input (config, data paths, teacher
    /// weights, shapes, device): the CLI exits with code 2 for those, 1 for
    /// the rest.
    pub fn is_user_error(&self) -> bool {
        matches!(
            self,
            Error::Config { .. }
                | Error::Plan { .. }
                | Error::Core(pipebd_core::Error::ShapeMismatch { .. } | pipebd_core::Error::BlockCount { .. })
                | Error::Device { .. }
                | Error::Student(_)
                | Error::Data { .. }
                | Error::Checkpoint { .. }
                // Missing, unreadable or not-a-checkpoint weight and tokenizer files.
                | Error::Teacher(_)
                | Error::Zoo { .. }
                // A search asked of a run folder without candidates, or
                // with a damaged search.json.
                | Error::Search { .. }
                | Error::RecordInput { .. }
        ) || self.is_missing_input()
    }

    /// A path the user named that is not what it must be: a directory
    /// where a file goes or the other way round, or, read, missing or not
    /// text (other write failures stay runtime failures: a full disk is not
    /// the input's fault).
    fn is_missing_input(&self) -> bool {
        use std::io::ErrorKind::{InvalidData, IsADirectory, NotADirectory, NotFound};
        match self {
            Error::Io { source, .. } if matches!(source.kind(), NotADirectory | IsADirectory) => true,
            Error::Io { action, source, .. } => {
                action.starts_with("reading") && matches!(source.kind(), NotFound | InvalidData)
            }
            _ => false,
        }
    }

    /// True when the failure is the kind a device loss produces (a panic, a
    /// stall, an injected fault, a device error, a peer timeout), so that
    /// re-planning over the surviving devices can help. A diverging loss or
    /// a shape error would only repeat and is not.
    pub fn is_device_failure(&self) -> bool {
        match self {
            Error::Worker { source, .. } => source.is_device_failure(),
            Error::Panic { .. }
            | Error::Stalled { .. }
            | Error::InjectedFault { .. }
            | Error::Device { .. }
            | Error::Timeout { .. } => true,
            _ => false,
        }
    }

    /// Another rank's message of kind `what` that does not decode: the
    /// error names the rank that sent it.
    pub fn damaged_frame(rank: usize, what: &str, error: Error) -> Self {
        Error::Peer { rank, message: format!("sent a damaged {what} message: {error}") }
    }

    /// An I/O failure on the user's file `path` while `action` ("reading",
    /// "writing", "creating directory").
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { action, path: path.into(), source }
    }
}

impl Error {
    /// A zoo's teacher failure ([`Error::Teacher`]): `?` on the error of a
    /// teacher crate that knows nothing of pipe-bd goes through
    /// `.map_err(Error::teacher)`.
    pub fn teacher(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Error::Teacher(Box::new(error))
    }

    /// A zoo's student failure ([`Error::Student`]), as [`Error::teacher`].
    pub fn student(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Error::Student(Box::new(error))
    }

    /// A block error of block `block` (one-based).
    pub fn block(block: usize, message: impl Into<String>) -> Self {
        Error::Core(pipebd_core::Error::Block { block, message: message.into() })
    }

    /// Puts `block` (one-based) on a block error raised without a number.
    pub fn at_block(self, block: usize) -> Self {
        match self {
            Error::Core(e) => Error::Core(e.at_block(block)),
            other => other,
        }
    }
}

/// Puts the right block number on a block error raised with `block: 0`
/// (by the engine or by a block through `pipebd-core`).
pub(crate) fn relabel(error: impl Into<Error>, block: usize) -> Error {
    error.into().at_block(block)
}

pub use pipebd_core::panic_message;

fn at_block(block: usize, step: usize) -> String {
    match block {
        0 => format!("step {step}: "),
        b => format!("block {b}, step {step}: "),
    }
}

fn location(path: &std::path::Path, line: Option<usize>, field: Option<&str>) -> String {
    let mut s = path.display().to_string();
    if let Some(line) = line {
        s.push_str(&format!(":{line}"));
    }
    if let Some(field) = field {
        s.push_str(&format!(": field `{field}`"));
    }
    s
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
