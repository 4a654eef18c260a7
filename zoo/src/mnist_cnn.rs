//! The built-in MNIST CNN teacher (`teacher.kind = "mnist-cnn"` on
//! `data.dataset = "mnist"`): the pretrained CNN cut into its 4 blocks, its
//! specs, its workload (MNIST-format images, top-1 accuracy) and the check
//! of its files. The images themselves are [`crate::mnist`]'s.

use std::path::Path;

use pipe_bd::eval::TopOneAccuracy;
use pipe_bd::Result;
use pipebd_cli::config::RunConfig;
use pipebd_cli::zoo::Workload;
use pipebd_core::{BlockSpec, Teacher};
use pipebd_kernels::FusedBackend;
use pipebd_teachers::blocks::mnist_specs;
use pipebd_teachers::mnist_cnn::MnistCnn;
use pipebd_teachers::TeacherBlock;

use crate::mnist::{self, Split};
use crate::options::with_block_loss;
use crate::Lift;

/// `teacher.kind` of the MNIST CNN.
pub(crate) const KIND: &str = "mnist-cnn";

/// Blocks the MNIST CNN is cut into.
pub(crate) fn blocks() -> usize {
    pipebd_teachers::mnist_cnn::block_output_shapes().len()
}

/// The pretrained MNIST CNN teacher (`scripts/setup-data.sh` installs its
/// weights as `data/teachers/mnist-cnn.pth`), cut into its 4 blocks.
pub fn mnist_teacher<B: FusedBackend>(
    weights: &Path,
    device: &B::Device,
) -> Result<Teacher<B, TeacherBlock<B>>> {
    // As in `build_minilm`: building may draw from burn's generator.
    let rng = pipe_bd::rng::burn_rng_lock();
    let blocks = MnistCnn::<B>::load_pytorch(weights, device).lift()?.into_blocks();
    let specs = mnist_specs(&blocks);
    drop(rng);
    Ok(Teacher::new(blocks.into_iter().map(TeacherBlock::Mnist).collect(), specs)?)
}

/// The MNIST CNN of `config` with its weights, its specs under
/// `teacher.block_loss`.
pub(crate) fn build_teacher<B: FusedBackend>(
    config: &RunConfig,
    device: &B::Device,
) -> Result<Teacher<B, TeacherBlock<B>>> {
    let teacher = mnist_teacher(&config.teacher.weights, device)?;
    let specs = with_block_loss(config, teacher.specs.clone())?;
    Ok(Teacher::new(teacher.blocks, specs)?)
}

/// The MNIST CNN's block specs, without its weights file.
pub(crate) fn specs(config: &RunConfig) -> Result<Vec<BlockSpec>> {
    // An initialised (random) teacher, for its shapes: its draws must not
    // land inside a concurrent seeded build.
    let _rng = pipe_bd::rng::burn_rng_lock();
    let blocks = MnistCnn::<burn::backend::Flex>::init(&Default::default()).into_blocks();
    with_block_loss(config, mnist_specs(&blocks))
}

/// The MNIST workload: the training images, the MNIST CNN, and top-1
/// accuracy on the test images (none read with `with_evaluation = false`).
pub(crate) fn load_workload<B: FusedBackend>(
    config: &RunConfig,
    device: &B::Device,
    with_evaluation: bool,
) -> Result<Workload<B, TeacherBlock<B>>> {
    let data = &config.data;
    let train = mnist::load(&data.dir, Split::Train, data.train_limit)?;
    let test = if with_evaluation {
        mnist::load(&data.dir, Split::Test, data.test_limit)?
    } else {
        mnist::load(&data.dir, Split::Test, Some(0))?
    };
    let teacher = build_teacher::<B>(config, device)?;
    let evaluation = Some(Box::new(TopOneAccuracy(test)) as _);
    Ok(Workload { teacher, train: Box::new(train), evaluation })
}

/// The MNIST files' headers and sizes and the MNIST teacher's weights
/// (loaded on the CPU: 1.5 MB).
pub(crate) fn check_inputs(config: &RunConfig) -> Result<()> {
    let _training_images = mnist::check_mnist_files(&config.data.dir)?;
    MnistCnn::<burn::backend::Flex>::load_pytorch(&config.teacher.weights, &Default::default()).lift()?;
    Ok(())
}

/// Training images of `config`: the training file's, after `data.train_limit`.
pub(crate) fn train_samples(config: &RunConfig) -> Result<Option<usize>> {
    let data = &config.data;
    let images = mnist::check_mnist_files(&data.dir)?;
    Ok(Some(data.train_limit.map_or(images, |limit| limit.min(images))))
}

/// The `[data]`, `[teacher]`, `[train]`, `[optimizer]` and `[[students]]`
/// sections of a small but complete run on real MNIST (a conv, two
/// bottlenecks and a head: about a second per epoch of 640 images on one
/// core), with the images in `mnist_dir` and the pretrained CNN at
/// `weights`: what the tests and the fuzzer start from (the lines before it,
/// name, seed and devices, are the caller's).
pub fn smoke_sections(
    mnist_dir: &std::path::Path,
    weights: &std::path::Path,
    (train_limit, test_limit): (usize, usize),
    epochs: usize,
) -> String {
    format!(
        r#"[data]
dataset = "mnist"
dir = "{mnist}"
train_limit = {train_limit}
test_limit = {test_limit}

[teacher]
kind = "mnist-cnn"
weights = "{weights}"

[train]
epochs = {epochs}
batch_size = 64
log_every = 1

[optimizer]
kind = "adam"
lr = 0.002

[[students]]
kind = "conv"
width = 16
out_channels = 32

[[students]]
kind = "bottleneck"
rank = 16
out_channels = 64

[[students]]
kind = "bottleneck"
rank = 24
out_channels = 128

[[students]]
kind = "head"
hidden = 64
classes = 10
"#,
        mnist = mnist_dir.display(),
        weights = weights.display(),
    )
}
