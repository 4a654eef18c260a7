//! Where a block's training restarts: the identity its checkpoints must
//! match, and loading its newest usable checkpoint (for `--resume`, and for
//! blocks lost with a device).

use std::collections::BTreeMap;

use pipebd_core::{BlockSpec, StudentModule};
use pipebd_kernels::DistillBackend;

use super::RuntimeSettings;
use crate::error::{Error, Result};
use crate::train::checkpoint::{self, Refusal, ResumedBlock};
use crate::train::{BlockTrainer, TrainSettings};

/// What a block checkpoint must match besides the run's own fields.
pub(super) fn block_identity(
    runtime: &RuntimeSettings,
    settings: &TrainSettings,
    spec: &BlockSpec,
    total_steps: usize,
) -> BTreeMap<String, serde_json::Value> {
    use serde_json::json;
    let mut identity = runtime.checkpoints.as_ref().map(|p| p.identity.clone()).unwrap_or_default();
    identity.insert("block.name".into(), json!(spec.name));
    identity.insert("block.input_shape".into(), json!(spec.input_shape));
    identity.insert("block.output_shape".into(), json!(spec.output_shape));
    identity.insert("block.params".into(), json!(spec.params));
    identity.insert("train.total_steps".into(), json!(total_steps));
    identity.insert("train.batch_size".into(), json!(settings.batch_size));
    identity.insert("seed".into(), json!(settings.seed));
    if settings.generator != crate::rng::Generator::Native {
        identity.insert("generator".into(), serde_json::to_value(settings.generator).unwrap_or_default());
    }
    identity.insert("optimizer".into(), serde_json::to_value(&settings.optimizer).unwrap_or_default());
    if let Some(single_path) = &settings.single_path {
        identity.insert("search.single_path".into(), serde_json::to_value(single_path).unwrap_or_default());
    }
    identity
}

/// Loads the newest usable checkpoint of `trainer`'s block from `dir`,
/// falling back past damaged ones. A checkpoint of another run is an error.
/// With `required`, a block whose checkpoints are all damaged is an error;
/// a block with none starts from scratch either way.
pub(super) fn restore_newest<B: DistillBackend, S: StudentModule<B>>(
    trainer: &mut BlockTrainer<B, S>,
    dir: &std::path::Path,
    identity: &BTreeMap<String, serde_json::Value>,
    device: &B::Device,
    required: bool,
) -> Result<ResumedBlock> {
    let block = trainer.index + 1;
    let mut refused = Vec::new();
    for (_, folder) in checkpoint::list(dir, block) {
        match checkpoint::read(&folder, identity) {
            Ok((_, state)) => match trainer.load_state(state, device) {
                Ok(()) => {
                    return Ok(ResumedBlock { block, step: trainer.step, checkpoint: Some(folder), refused })
                }
                Err(why) => refused.push(format!("{}: {why}", folder.display())),
            },
            Err(Refusal::Damaged(e)) => refused.push(e.to_string()),
            Err(Refusal::Mismatch(e)) => return Err(e),
        }
    }
    if required && !refused.is_empty() {
        return Err(Error::Checkpoint {
            path: checkpoint::block_dir(dir, block),
            message: format!("no usable checkpoint of block {block}: {}", refused.join("; ")),
        });
    }
    Ok(ResumedBlock { block, step: 0, checkpoint: None, refused })
}
