//! The core crate's one error type.

/// What can go wrong in the block API itself. Every variant names the block
/// (one-based; 0 while the caller has not said which) or the data set.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// A block received an activation it cannot process, or its output does
    /// not fit its loss.
    #[error("block {block}: {message}")]
    Block {
        /// One-based block number (0: not known yet, see [`Error::at_block`]).
        block: usize,
        /// What went wrong.
        message: String,
    },
    /// A student block's shapes do not match its teacher block's.
    #[error("block {block}: student {what} shape {student:?} does not match the teacher's {teacher:?}")]
    ShapeMismatch {
        /// One-based block number.
        block: usize,
        /// "input", "output" or "input (teacher chain)".
        what: &'static str,
        /// The student's per-sample shape.
        student: Vec<usize>,
        /// The teacher's per-sample shape.
        teacher: Vec<usize>,
    },
    /// The teacher and the students have different numbers of blocks.
    #[error("the teacher has {teacher} blocks but {students} student blocks are configured")]
    BlockCount {
        /// Student blocks.
        students: usize,
        /// Teacher blocks.
        teacher: usize,
    },
    /// A data set could not produce a batch.
    #[error("data set: {message}")]
    Data {
        /// What went wrong (name the file or sample where there is one).
        message: String,
    },
}

impl Error {
    /// A block error of block 0 (not known yet); the engine fills the
    /// number in with [`Error::at_block`].
    pub fn block(message: impl Into<String>) -> Self {
        Error::Block { block: 0, message: message.into() }
    }

    /// Puts `block` (one-based) on a block error raised without a number.
    pub fn at_block(self, block: usize) -> Self {
        match self {
            Error::Block { block: 0, message } => Error::Block { block, message },
            other => other,
        }
    }
}

/// The message of a caught panic (`&str` or `String` payloads).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// The core crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
