//! # pipebd-core: the block API of pipe-bd
//!
//! What a teacher or student block is to the pipe-bd engine, and nothing
//! else: the student zoo (`pipebd-students`), the teachers
//! (`pipebd-teachers`) and a user's own crate implement these types
//! directly, and the engine (`pipe-bd`) trains whatever implements them.
//!
//! - [`Activation`]: a batch flowing between blocks (feature maps, token
//!   states with their mask, or flat vectors such as logits);
//! - [`Block`]: a burn module that maps an activation to the next one, with
//!   an overridable distillation [`Block::loss`];
//! - [`BlockSpec`]: shapes, FLOPs, parameters and [`LossKind`] of a block,
//!   inferred from the module with [`BlockSpec::infer`] where possible;
//! - [`Teacher`] / [`Students`]: blocks with their specs, checked against
//!   each other;
//! - [`Dataset`]: the training samples, as the first block's input;
//! - [`OutputHead`]: a frozen head after the last block (an LM head) that
//!   the stitched pass can distil through ([`head_kl`]);
//! - [`plan`]: schedules as data ([`Plan`]), the only place that knows
//!   schedule names.
//!
//! Dependencies point one way: `pipebd-kernels <- pipebd-core <-
//! pipebd-students, pipebd-teachers <- pipe-bd`.
//!
//! # Feature flags
//! None.
#![warn(missing_docs)]

mod activation;
mod block;
mod dataset;
mod error;
mod head;
mod loss;
pub mod plan;

pub use activation::Activation;
pub use block::{
    check_against_teacher, check_block_count, flat_parameters, forward_chain, parameter_tensors, Block,
    BlockSpec, StudentModule, Students, Teacher,
};
pub use dataset::{Dataset, Samples};
pub use error::{panic_message, Error, Result};
pub use head::{head_kl, HeadScores, OutputHead};
pub use loss::{is_valid_temperature, Loss, LossKind};
pub use pipebd_kernels::{DistillBackend, FusedBackend};
pub use plan::{Phase, Plan, PlanError, Schedule, Stage, StageSpec};
