//! The built-in teachers and students behind the block API: [`Block`]
//! implementations for the `teachers` and `students` crates, and builders
//! that turn config sections into a [`Teacher`] and [`Students`].

use burn::module::Module;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::Backend;
use pipebd_kernels::{DistillBackend, FusedBackend};
use pipebd_students::{StudentBlock, StudentBlockConfig, StudentOutput};
use pipebd_teachers::mnist_cnn::{self, MnistBlock, MnistCnn};

use crate::block::{
    check_against_teacher, check_block_count, Activation, Block, BlockSpec, LossKind, Students, Teacher,
};
use crate::config::TeacherConfig;
use crate::error::{Error, Result};

impl<B: Backend> Block<B> for MnistBlock<B> {
    fn forward(&self, input: Activation<B>) -> Result<Activation<B>> {
        let x = input.into_maps(0)?;
        Ok(match self {
            MnistBlock::Conv(stage) => Activation::Maps(stage.forward(x)),
            MnistBlock::Head(head) => Activation::Flat(head.forward(x)),
        })
    }
}

impl<B: FusedBackend> Block<B> for StudentBlock<B> {
    fn forward(&self, input: Activation<B>) -> Result<Activation<B>> {
        let x = input.into_maps(0)?;
        Ok(match StudentBlock::forward(self, x) {
            StudentOutput::Maps(t) => Activation::Maps(t),
            StudentOutput::Logits(t) => Activation::Flat(t),
        })
    }
}

/// The loss for a block whose per-sample output has `shape`: soft-target
/// cross-entropy for a final logits vector, MSE otherwise.
fn loss_for(shape: &[usize], last: bool) -> LossKind {
    if last && shape.len() == 1 {
        LossKind::SoftTargetCrossEntropy
    } else {
        LossKind::Mse
    }
}

/// Block specs of the MNIST CNN teacher (parameters counted on `blocks`).
fn mnist_specs<B: Backend>(blocks: &[MnistBlock<B>]) -> Vec<BlockSpec> {
    let outputs = mnist_cnn::block_output_shapes();
    let flops = mnist_cnn::block_flops();
    let mut input = mnist_cnn::INPUT_SHAPE.to_vec();
    let names = ["conv1", "conv2", "conv3", "head"];
    let mut specs = Vec::new();
    for (k, block) in blocks.iter().enumerate() {
        let output = outputs[k].clone();
        specs.push(BlockSpec {
            name: names[k].to_string(),
            input_shape: input,
            loss: loss_for(&output, k + 1 == blocks.len()),
            output_shape: output.clone(),
            flops: flops[k],
            params: block.num_params(),
        });
        input = output;
    }
    specs
}

/// Builds the teacher named in the config on `device`, with its weights.
pub fn build_teacher<B: Backend>(
    config: &TeacherConfig,
    device: &B::Device,
) -> Result<Teacher<B, MnistBlock<B>>> {
    let blocks = MnistCnn::<B>::load_pytorch(&config.weights, device)?.into_blocks();
    let specs = mnist_specs(&blocks);
    Teacher::new(blocks, specs)
}

/// The teacher's block specs without loading its weights (to check a student
/// config before anything heavy happens).
pub fn teacher_specs(config: &TeacherConfig) -> Vec<BlockSpec> {
    let _ = config;
    let blocks = MnistCnn::<burn::backend::Flex>::init(&Default::default()).into_blocks();
    mnist_specs(&blocks)
}

/// Specs of the student blocks described by `configs`, built for the
/// teacher's input shapes. Fails on a block whose shapes do not match.
pub fn student_specs(configs: &[StudentBlockConfig], teacher: &[BlockSpec]) -> Result<Vec<BlockSpec>> {
    let (_, specs) = init_student_blocks::<burn::backend::Flex>(configs, teacher, &Default::default())?;
    Ok(specs)
}

pub(crate) fn init_student_blocks<B: FusedBackend>(
    configs: &[StudentBlockConfig],
    teacher: &[BlockSpec],
    device: &B::Device,
) -> Result<(Vec<StudentBlock<B>>, Vec<BlockSpec>)> {
    check_block_count(configs.len(), teacher.len())?;
    let mut blocks = Vec::new();
    let mut specs = Vec::new();
    for (k, (config, t)) in configs.iter().zip(teacher).enumerate() {
        let built = config.init::<B>(k + 1, &t.input_shape, device)?;
        specs.push(BlockSpec {
            name: config.kind().to_string(),
            input_shape: t.input_shape.clone(),
            output_shape: built.output_shape.clone(),
            flops: built.flops,
            params: built.module.num_params(),
            loss: t.loss,
        });
        blocks.push(built.module);
    }
    check_against_teacher(&specs, teacher)?;
    Ok((blocks, specs))
}

/// Builds randomly initialised student blocks on `device`, seeded by `seed`,
/// and checks them against the teacher.
///
/// The initial weights are drawn on the CPU (flex) and copied to `device`, so
/// one seed gives the same students on every backend (a wgpu or cuda run
/// starts from exactly the weights of the CPU run).
pub fn build_students<B: DistillBackend>(
    configs: &[StudentBlockConfig],
    teacher: &[BlockSpec],
    seed: u64,
    device: &B::Device,
) -> Result<Students<B, StudentBlock<B>>> {
    let cpu = Default::default();
    // burn's CPU backend draws from one process-wide generator: hold a lock
    // from seeding to the last module built, so that concurrent builds (and
    // the target modules below, built on that backend too) stay reproducible.
    static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = INIT.lock().unwrap_or_else(|p| p.into_inner());
    let (cpu_blocks, specs) = {
        burn::backend::Flex::seed(&cpu, seed);
        let (blocks, specs) = init_student_blocks::<burn::backend::Flex>(configs, teacher, &cpu)?;
        // burn initialises parameters lazily, at first use: draw them now, in order.
        let records: Vec<_> = blocks.into_iter().map(|b| b.into_record()).collect();
        (records, specs)
    };
    // Load into modules of the autodiff backend itself: a record loaded into an
    // inner-backend module would come back untrainable (require_grad unset).
    let (targets, _) = init_student_blocks::<B>(configs, teacher, device)?;
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let blocks = cpu_blocks
        .into_iter()
        .zip(targets)
        .enumerate()
        .map(|(k, (record, target))| {
            let failed = |e: burn::record::RecorderError| Error::Block {
                block: k + 1,
                message: format!("copying the initial student weights to the device failed: {e}"),
            };
            let bytes = recorder.record(record, ()).map_err(failed)?;
            let record = recorder.load(bytes, device).map_err(failed)?;
            Ok(target.load_record(record))
        })
        .collect::<Result<Vec<_>>>()?;
    Students::new(blocks, specs, teacher)
}
