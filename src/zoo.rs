//! The built-in zoo, from config sections: the teachers of `pipebd-teachers`
//! and the students of `pipebd-students` (both implement the block API of
//! `pipebd-core` themselves) built into a [`Teacher`] and [`Students`], with
//! their data.

use std::path::Path;

use burn::module::Module;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use pipebd_core::{check_against_teacher, check_block_count, BlockSpec, Dataset, Students, Teacher};
use pipebd_kernels::encoder::top_indices;
use pipebd_kernels::{DistillBackend, FusedBackend};
use pipebd_students::{EncoderInit, StudentBlock, StudentBlockConfig};
use pipebd_teachers::blocks::{minilm_blocks, minilm_specs, mnist_specs};
use pipebd_teachers::minilm::{self, Embeddings, MiniLm, MiniLmTokenizer};
use pipebd_teachers::mnist_cnn::MnistCnn;
use pipebd_teachers::TeacherBlock;

use crate::config::RunConfig;
use crate::data::text::{brown_splits, tokenize, ProbeData, TextDataset};
use crate::data::{ImageDataset, Split};
use crate::error::{Error, Result};

/// A built-in teacher, cut into blocks.
pub type BuiltinTeacher<B> = Teacher<B, TeacherBlock<B>>;

/// MiniLM layers per block: `teacher.layers_per_block`, or one each.
pub fn layers_per_block(config: &RunConfig) -> Vec<usize> {
    config.teacher.layers_per_block.clone().unwrap_or_else(|| vec![1; minilm::LAYERS])
}

/// Loads MiniLM and cuts it into the configured blocks; returns the frozen
/// embeddings (input preparation) with the teacher.
pub fn build_minilm<B: FusedBackend>(
    config: &RunConfig,
    device: &B::Device,
) -> Result<(Embeddings<B>, BuiltinTeacher<B>)> {
    let (embeddings, layers) = MiniLm::<B>::load(&config.teacher.weights, device)?.into_parts();
    let groups = layers_per_block(config);
    let blocks = minilm_blocks(layers, &groups);
    let specs = minilm_specs(&groups, config.data.max_tokens());
    Ok((embeddings, Teacher::new(blocks, specs)?))
}

/// Builds the teacher named in the config on `device`, with its weights.
pub fn build_teacher<B: FusedBackend>(
    config: &RunConfig,
    device: &B::Device,
) -> Result<Teacher<B, TeacherBlock<B>>> {
    if config.data.is_text() {
        return Ok(build_minilm(config, device)?.1);
    }
    mnist_teacher(&config.teacher.weights, device)
}

/// The pretrained MNIST CNN teacher (`scripts/setup-data.sh` installs its
/// weights as `data/teachers/mnist-cnn.pth`), cut into its 4 blocks.
pub fn mnist_teacher<B: FusedBackend>(
    weights: &Path,
    device: &B::Device,
) -> Result<Teacher<B, TeacherBlock<B>>> {
    let blocks = MnistCnn::<B>::load_pytorch(weights, device)?.into_blocks();
    let specs = mnist_specs(&blocks);
    Ok(Teacher::new(blocks.into_iter().map(TeacherBlock::Mnist).collect(), specs)?)
}

/// The teacher's block specs without loading its weights (to check a student
/// config before anything heavy happens).
pub fn teacher_specs(config: &RunConfig) -> Vec<BlockSpec> {
    if config.data.is_text() {
        return minilm_specs(&layers_per_block(config), config.data.max_tokens());
    }
    let blocks = MnistCnn::<burn::backend::Flex>::init(&Default::default()).into_blocks();
    mnist_specs(&blocks)
}

/// What evaluating a trained student needs besides the blocks.
#[allow(clippy::large_enum_variant)] // one per run
pub enum Evaluation<B: FusedBackend> {
    /// Image classification: top-1 accuracy on the test split.
    Images(ImageDataset),
    /// Sentence embeddings: cosine to the teacher on held-out sentences, and
    /// the optional downstream probe.
    Text {
        /// The teacher's frozen embeddings.
        embeddings: Embeddings<B>,
        /// Held-out sentences, tokenised.
        heldout: Vec<Vec<u32>>,
        /// Tokens per sequence.
        max_tokens: usize,
        /// The probe's data.
        probe: Option<ProbeData>,
        /// Mean real tokens per training sentence.
        mean_tokens: f64,
    },
}

/// A training job's data and teacher, loaded from its config.
pub struct Workload<B: FusedBackend> {
    /// The frozen teacher, cut into blocks.
    pub teacher: Teacher<B, TeacherBlock<B>>,
    /// The training samples.
    pub train: Box<dyn Dataset<B>>,
    /// What evaluation needs.
    pub evaluation: Evaluation<B>,
}

/// Loads the config's training data, teacher and evaluation data on `device`.
/// With `with_evaluation = false` the held-out and probe data are skipped.
pub fn load_workload<B: FusedBackend>(
    config: &RunConfig,
    device: &B::Device,
    with_evaluation: bool,
) -> Result<Workload<B>> {
    let data = &config.data;
    if !data.is_text() {
        let train = ImageDataset::load_mnist(&data.dir, Split::Train, data.train_limit)?;
        let test = if with_evaluation {
            ImageDataset::load_mnist(&data.dir, Split::Test, data.test_limit)?
        } else {
            ImageDataset::load_mnist(&data.dir, Split::Test, Some(0))?
        };
        let teacher = build_teacher::<B>(config, device)?;
        return Ok(Workload { teacher, train: Box::new(train), evaluation: Evaluation::Images(test) });
    }
    let tokenizer = MiniLmTokenizer::load(&config.teacher.tokenizer_path())?;
    let max_tokens = data.max_tokens();
    let (train, heldout) = brown_splits(&data.dir, data.train_limit, data.test_limit)?;
    let train = tokenize(&tokenizer, &train, max_tokens)?;
    let heldout = if with_evaluation { tokenize(&tokenizer, &heldout, max_tokens)? } else { Vec::new() };
    let probe = match (&data.probe, with_evaluation) {
        (Some(probe), true) => Some(ProbeData::load(probe, &tokenizer)?),
        _ => None,
    };
    let (embeddings, teacher) = build_minilm::<B>(config, device)?;
    let dataset = TextDataset::new(train, max_tokens, embeddings.clone());
    let mean_tokens = dataset.mean_tokens();
    Ok(Workload {
        teacher,
        train: Box::new(dataset),
        evaluation: Evaluation::Text { embeddings, heldout, max_tokens, probe, mean_tokens },
    })
}

/// Specs of the student blocks described by `configs`, built for the
/// teacher's input shapes. Fails on a block whose shapes do not match.
/// Students initialised from the teacher are checked against it too.
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

/// Fails unless student `k` (zero-based), if it is an `encoder` with
/// `init = "teacher"`, fits inside the teacher layer it is pruned from.
pub fn check_teacher_init(k: usize, student: &StudentBlockConfig) -> Result<()> {
    let StudentBlockConfig::Encoder { heads, head_dim, ffn, init: EncoderInit::Teacher } = *student else {
        return Ok(());
    };
    let size = minilm::layer_config();
    if heads > size.heads || head_dim != size.head_dim || ffn > size.ffn {
        return Err(Error::block(
            k + 1,
            format!(
                "init = \"teacher\" needs heads <= {}, head_dim = {} and ffn <= {} (the teacher layer's), \
                 got heads {heads}, head_dim {head_dim}, ffn {ffn}; use init = \"random\" otherwise",
                size.heads, size.head_dim, size.ffn
            ),
        ));
    }
    Ok(())
}

/// Sentences whose activations rank the teacher's feed-forward neurons and
/// refit the pruned output projection (about 7k real tokens at 32 tokens).
const CALIBRATION_SENTENCES: usize = 256;
/// Ridge of the output projection's refit, relative to the mean diagonal
/// of the Gram matrix.
const REFIT_RIDGE: f64 = 1e-3;

/// Replaces the `encoder` students with `init = "teacher"` by the first
/// teacher layer of their block, pruned to their size: the heads with the
/// largest weights and the feed-forward neurons that move the residual
/// stream most on the first training sentences are kept.
fn init_from_teacher(config: &RunConfig, blocks: &mut [StudentBlock<burn::backend::Flex>]) -> Result<()> {
    let wanted =
        |c: &StudentBlockConfig| matches!(c, StudentBlockConfig::Encoder { init: EncoderInit::Teacher, .. });
    if !config.students.iter().any(wanted) {
        return Ok(());
    }
    let device = Default::default();
    let (embeddings, layers) =
        MiniLm::<burn::backend::Flex>::load(&config.teacher.weights, &device)?.into_parts();
    let groups = layers_per_block(config);
    // The calibration batch entering each teacher layer.
    let tokenizer = MiniLmTokenizer::load(&config.teacher.tokenizer_path())?;
    let (sentences, _) = brown_splits(&config.data.dir, Some(CALIBRATION_SENTENCES), Some(0))?;
    let ids = tokenize(&tokenizer, &sentences, config.data.max_tokens())?;
    let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
    let (mut hidden, mask) =
        crate::data::text::embed_batch(&embeddings, &refs, config.data.max_tokens(), &device)
            .into_tokens(0)?;
    let mut layer_inputs = Vec::with_capacity(layers.len());
    for layer in &layers {
        layer_inputs.push(hidden.clone());
        hidden = layer.forward(hidden, mask.clone());
    }
    for (k, student) in config.students.iter().enumerate() {
        let StudentBlockConfig::Encoder { heads, ffn, init: EncoderInit::Teacher, .. } = *student else {
            continue;
        };
        let first = groups[..k.min(groups.len())].iter().sum::<usize>();
        let teacher = layers
            .get(first)
            .ok_or_else(|| Error::block(k + 1, "no teacher layer to initialise this student from"))?;
        check_teacher_init(k, student)?;
        let size = teacher.config();
        let kept_heads = top_indices(&teacher.head_importance(), heads);
        let statistics = teacher.neuron_statistics(layer_inputs[first].clone(), mask.clone());
        let kept_neurons = top_indices(&statistics.importance, ffn);
        let mut pruned = teacher.pruned_compensated(&kept_heads, &kept_neurons, &statistics.mean_activation);
        // Least-squares refit of the output projection on the calibration
        // batch (kept as compensated if the system is singular). Nothing
        // pruned: the teacher layer itself.
        if heads < size.heads || ffn < size.ffn {
            pruned.refit_ffn_out(teacher, layer_inputs[first].clone(), mask.clone(), REFIT_RIDGE);
        }
        blocks[k] = StudentBlock::Encoder(pruned);
    }
    Ok(())
}

/// Builds the config's student blocks on `device` (random weights seeded by
/// `config.seed`, or pruned from the teacher where asked) and checks them
/// against the teacher.
///
/// The initial weights are made on the CPU (flex) and copied to `device`, so
/// one seed gives the same students on every backend (a wgpu or cuda run
/// starts from exactly the weights of the CPU run).
pub fn build_students<B: DistillBackend>(
    config: &RunConfig,
    teacher: &[BlockSpec],
    device: &B::Device,
) -> Result<Students<B, StudentBlock<B>>> {
    let (configs, seed) = (&config.students, config.seed);
    let cpu = Default::default();
    // burn's CPU backend draws from one process-wide generator: hold a lock
    // from seeding to the last module built, so that concurrent builds (and
    // the target modules below, built on that backend too) stay reproducible.
    static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = INIT.lock().unwrap_or_else(|p| p.into_inner());
    let (cpu_blocks, specs) = {
        <burn::backend::Flex as burn::tensor::backend::Backend>::seed(&cpu, seed);
        let (mut blocks, specs) = init_student_blocks::<burn::backend::Flex>(configs, teacher, &cpu)?;
        init_from_teacher(config, &mut blocks)?;
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
            let failed = |e: burn::record::RecorderError| {
                Error::block(k + 1, format!("copying the initial student weights to the device failed: {e}"))
            };
            let bytes = recorder.record(record, ()).map_err(failed)?;
            let record = recorder.load(bytes, device).map_err(failed)?;
            Ok(target.load_record(record))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Students::new(blocks, specs, teacher)?)
}
