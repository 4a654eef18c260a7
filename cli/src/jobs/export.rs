//! Models out of pipe-bd (`pipebd export`) and model files scored on a text
//! (`pipebd eval-gguf`): the requests and their results. The engine names
//! no file format: a [`crate::zoo::Zoo`] that can write its students in one
//! implements [`crate::zoo::Zoo::export`] (the built-in zoo writes decoder
//! students as GGUF files that llama.cpp runs) and
//! [`crate::zoo::Zoo::score_model_file`].

use std::path::PathBuf;

/// What to export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExportSource {
    /// The student saved in a run folder (`pipebd run --out`).
    Run(PathBuf),
    /// The teacher of a run config, whole.
    Teacher(PathBuf),
}

/// `pipebd export`: what to write, in which format, where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportRequest {
    /// The run folder or the teacher's config.
    pub source: ExportSource,
    /// The file format (`gguf`).
    pub format: String,
    /// How weights are stored, in the format's terms (`teacher`, `f32`,
    /// `q8_0`...).
    pub kind: String,
    /// The file to write.
    pub out: PathBuf,
    /// With [`ExportSource::Teacher`]: only the teacher's first this many
    /// decoder layers (with its embeddings, final norm and head): a smaller
    /// model of the same layers, itself a teacher (`pipebd run` takes a file
    /// of SmolLM2's first layers).
    pub first_layers: Option<usize>,
}

/// What an export wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Exported {
    /// The file written.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// Lines for the user: sizes, ratios, what was written differently and why.
    pub details: Vec<String>,
}

/// `pipebd eval-gguf`: a model file scored on a text with llama.cpp's
/// perplexity protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextScoreRequest {
    /// The model file.
    pub model: PathBuf,
    /// A plain-text file, tokenized whole; or a corpus folder the zoo knows
    /// (the built-in zoo: a Brown folder, whose held-out sentences, those
    /// no run trains on, are the text, one per line).
    pub text: PathBuf,
    /// Where to write the text as scored (for `llama-perplexity -f`).
    pub save_text: Option<PathBuf>,
    /// Tokens per window: the text is cut into non-overlapping windows of
    /// this many tokens and the second half of each window is scored.
    pub context: usize,
    /// Score at most this many windows (all when `None`).
    pub max_windows: Option<usize>,
}

/// A model's perplexity on a text.
#[derive(Debug, Clone, PartialEq)]
pub struct TextScore {
    /// `exp` of the mean negative log-likelihood of the scored tokens.
    pub perplexity: f64,
    /// Tokens the text tokenizes to.
    pub text_tokens: usize,
    /// Windows scored.
    pub windows: usize,
    /// Tokens scored (`context - 1 - context / 2` per window).
    pub scored_tokens: usize,
    /// Wall time of the scoring, in seconds.
    pub seconds: f64,
}
