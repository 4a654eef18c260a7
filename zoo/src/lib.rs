//! # pipebd-zoo: pipe-bd's built-in zoo and the `pipebd` command line
//!
//! The teachers of `pipebd-teachers` and the students of `pipebd-students`
//! with the data they are distilled on, behind pipe-bd's
//! [`Zoo`](pipebd_cli::zoo::Zoo) trait like any user's zoo ([`Builtin`]):
//!
//! - the pretrained MNIST CNN on MNIST-format images ([`mnist`]:
//!   `data.dataset = "mnist"`, `teacher.kind = "mnist-cnn"`),
//! - all-MiniLM-L6-v2 on the Brown corpus, evaluated by sentence-embedding
//!   cosine and a SpamAssassin probe ([`text`]: `"brown"`, `"minilm-l6"`),
//! - the decoder LLM SmolLM2-135M from its GGUF file on the Brown corpus,
//!   evaluated by perplexity, top-1 agreement and KL to the teacher ([`lm`]:
//!   `"brown"`, `teacher.kind = "smollm2-135m"`), its students leaving as GGUF
//!   files for llama.cpp ([`export`]).
//!
//! The engine (`pipe-bd`) depends on none of this: it names no teacher,
//! student, data set or file format. The `pipebd` binary is [`cli`], that is
//! `pipebd_cli::cli::run_with(Builtin)`.
#![warn(missing_docs)]

mod builtin;
pub mod export;
#[doc(hidden)]
pub mod fuzzing;
pub mod lm;
pub mod mnist;
pub mod text;

use std::process::ExitCode;

pub use builtin::{
    build_minilm, build_smollm2, build_teacher, eval_builtin_run, layers_per_block, max_tokens,
    mnist_teacher, run_builtin, tokenizer_path, BlockLoss, Builtin, BuiltinTeacher, DataOptions,
    Smollm2Parts, TeacherOptions, DEFAULT_MAX_TOKENS, SMOLLM2,
};
/// The built-in student zoo (`pipebd-students`), for a zoo that reuses its blocks.
pub use pipebd_students as students;
/// The built-in teachers and their weight import (`pipebd-teachers`), for a
/// zoo that reuses them.
pub use pipebd_teachers as teachers;

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
