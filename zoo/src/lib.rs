//! # pipebd-zoo: pipe-bd's built-in zoo and the `pipebd` command line
//!
//! The teachers of `pipebd-teachers` and the students of `pipebd-students`
//! with the data they are distilled on, behind pipe-bd's
//! [`Zoo`](pipebd_cli::zoo::Zoo) trait like any user's zoo ([`Builtin`]):
//!
//! - the pretrained MNIST CNN on MNIST-format images ([`mnist`]:
//!   `data.dataset = "mnist"`, `teacher.kind = "mnist-cnn"`; the teacher:
//!   [`mnist_teacher`]),
//! - all-MiniLM-L6-v2 on the Brown corpus, evaluated by sentence-embedding
//!   cosine and a SpamAssassin probe ([`text`]: `"brown"`, `"minilm-l6"`;
//!   the teacher: [`build_minilm`]; what it reports: [`text_scores`]),
//! - the decoder LLM SmolLM2-135M from its GGUF file on the Brown corpus,
//!   evaluated by perplexity, top-1 agreement and KL to the teacher ([`lm`]:
//!   `"brown"`, `teacher.kind = "smollm2-135m"`; the teacher:
//!   [`build_smollm2`]), its students leaving as GGUF files for llama.cpp
//!   ([`export`]).
//!
//! Inside, one module per teacher (`mnist_cnn.rs`, `minilm.rs`,
//! `smollm2.rs`: building it, its specs, workload, file checks and students
//! pruned from it) over the data modules above and the zoo's own config
//! keys (`options.rs`: [`DataOptions`], [`TeacherOptions`]); `builtin.rs`
//! holds the [`Zoo`](pipebd_cli::zoo::Zoo) impl, which picks a config's
//! teacher once and asks its module. Imports go one way: `builtin.rs` uses
//! the teacher modules and `export.rs` (which uses `smollm2.rs` only), the
//! teacher modules use the data modules and `options.rs`, and nothing
//! below `builtin.rs` names it. A new teacher is its module, one variant
//! of the dispatching enum in `builtin.rs` with its arms, and its students.
//!
//! The engine (`pipe-bd`) depends on none of this: it names no teacher,
//! student, data set or file format. The `pipebd` binary is [`cli`], that is
//! `pipebd_cli::cli::run_with(Builtin)`.
#![warn(missing_docs)]

mod builtin;
pub mod export;
#[doc(hidden)]
pub mod fuzzing;
mod init;
pub mod lm;
mod minilm;
pub mod mnist;
mod mnist_cnn;
mod options;
mod smollm2;
pub mod text;
pub mod text_scores;

use std::process::ExitCode;

pub use builtin::{build_teacher, eval_builtin_run, layers_per_block, run_builtin, Builtin, BuiltinTeacher};
pub use minilm::build_minilm;
pub use mnist_cnn::{mnist_teacher, smoke_sections};
pub use options::{max_tokens, tokenizer_path, BlockLoss, DataOptions, TeacherOptions, DEFAULT_MAX_TOKENS};
/// The built-in student zoo (`pipebd-students`), for a zoo that reuses its blocks.
pub use pipebd_students as students;
/// The built-in teachers and their weight import (`pipebd-teachers`), for a
/// zoo that reuses them.
pub use pipebd_teachers as teachers;
pub use smollm2::{build_smollm2, Smollm2Parts, SMOLLM2};

/// The `pipebd` command line with the built-in zoo
/// (`pipebd_cli::cli::run_with(Builtin)`).
///
/// Not generic, so this library compiles the whole engine for the built-in
/// zoo once, here, and `pipebd` and the tests link that copy: in a release
/// build every crate that names `Builtin` in a generic call compiles the
/// engine for it again (minutes for each).
pub fn cli() -> ExitCode {
    pipebd_cli::cli::run_with(Builtin)
}

/// Lifts a teacher's or student's own error into pipe-bd's (boxed in
/// [`pipe_bd::Error::Teacher`] / [`pipe_bd::Error::Student`]).
trait Lift<T> {
    /// The same result with pipe-bd's error.
    fn lift(self) -> pipe_bd::Result<T>;
}

impl<T> Lift<T> for Result<T, pipebd_teachers::TeacherError> {
    fn lift(self) -> pipe_bd::Result<T> {
        self.map_err(pipe_bd::Error::teacher)
    }
}

impl<T> Lift<T> for Result<T, pipebd_students::StudentError> {
    fn lift(self) -> pipe_bd::Result<T> {
        self.map_err(pipe_bd::Error::student)
    }
}
