//! The built-in zoo ([`Builtin`]), from config sections: the teachers of
//! `pipebd-teachers` and the students of `pipebd-students` (both implement
//! the block API of `pipebd-core` themselves) built into a [`Teacher`] and
//! [`Students`], with their data.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use pipebd_core::{
    check_against_teacher, check_block_count, BlockSpec, LossKind, OutputHead, Students, Teacher,
};
use pipebd_kernels::decoder::{DecoderLayer, MixerKind};
use pipebd_kernels::encoder::EncoderLayer;
use pipebd_kernels::encoder::{top_indices, NeuronStatistics};
use pipebd_kernels::{DistillBackend, FusedBackend};
use pipebd_students::{Candidate, EncoderInit, StudentBlock, StudentBlockConfig};
use pipebd_teachers::blocks::{decoder_blocks, decoder_specs, minilm_blocks, minilm_specs, mnist_specs};
use pipebd_teachers::minilm::{self, Embeddings, MiniLm, MiniLmTokenizer};
use pipebd_teachers::mnist_cnn::MnistCnn;
use pipebd_teachers::smollm2::{LlamaSizes, LmHead, SmolLm2, SmolTokenizer, TokenEmbeddings, SMOLLM2_135M};
use pipebd_teachers::TeacherBlock;

use pipebd_cli::config::{ConfigIssue, RunConfig};
use pipe_bd::eval::TopOneAccuracy;
use pipebd_cli::jobs::export::{ExportRequest, Exported, TextScore, TextScoreRequest};
use pipebd_cli::zoo::{parse_options, parse_students, Workload, Zoo};
use pipe_bd::{Error, Result};
use serde::{Deserialize, Serialize};

use crate::lm::{ffn_importance, prune_decoder, tokenize_lm, NextTokenHead, NextTokenScores};
use crate::mnist::{self, Split};
use crate::text::{brown_splits, tokenize, ProbeConfig, ProbeData, SentenceEmbeddings, TextDataset};
use crate::Lift;

/// True for the built-in text corpus (Brown: MiniLM and token-state blocks);
/// every other dataset is MNIST-format images.
fn is_text(config: &RunConfig) -> bool {
    config.data.dataset == "brown"
}

/// `teacher.kind` of the decoder LLM SmolLM2-135M-Instruct.
pub const SMOLLM2: &str = "smollm2-135m";

/// True for the decoder LLM teacher (on text).
pub(crate) fn is_decoder(config: &RunConfig) -> bool {
    config.teacher.kind == SMOLLM2
}

/// Layers of the configured text teacher.
fn teacher_layers(config: &RunConfig) -> usize {
    if is_decoder(config) {
        SMOLLM2_135M.layers
    } else {
        minilm::LAYERS
    }
}

/// `config` with every student built at random (`init = "random"`, no
/// `weights` file): the saved records replace the weights anyway, and the
/// teacher init (pruning and a least-squares refit on the training data)
/// would take half a minute for nothing.
pub(crate) fn architecture_only(config: &RunConfig) -> RunConfig {
    fn shapes_only(table: &mut toml::Table) {
        table.remove("weights");
        let kind = table.get("kind").and_then(|k| k.as_str());
        if table.contains_key("init") || matches!(kind, Some("decoder" | "encoder")) {
            table.insert("init".into(), toml::Value::String("random".into()));
        }
        if let Some(toml::Value::Array(candidates)) = table.get_mut("candidates") {
            candidates.iter_mut().filter_map(toml::Value::as_table_mut).for_each(shapes_only);
        }
    }
    let mut shapes = config.clone();
    shapes.students.iter_mut().for_each(shapes_only);
    shapes
}

/// [`pipebd_cli::jobs::run::run`] with the built-in zoo, compiled once in this
/// library (see [`crate::cli`]): callers outside it should prefer this to
/// `run(&Builtin, ...)`.
pub fn run_builtin(
    config: &RunConfig,
    out_dir: &Path,
    options: &pipebd_cli::jobs::run::RunFlags,
    observer: &mut dyn FnMut(&pipe_bd::train::Progress),
) -> Result<pipebd_cli::report::RunReport> {
    pipebd_cli::jobs::run::run(&Builtin, config, out_dir, options, observer)
}

/// [`pipebd_cli::jobs::eval::eval_run`] with the built-in zoo.
pub fn eval_builtin_run(run_dir: &Path) -> Result<pipebd_cli::jobs::eval::EvalResult> {
    pipebd_cli::jobs::eval::eval_run(&Builtin, run_dir)
}

/// A built-in teacher, cut into blocks.
pub type BuiltinTeacher<B> = Teacher<B, TeacherBlock<B>>;

/// The built-in zoo's own keys of `[data]` (for text: the Brown corpus).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DataOptions {
    /// Every sentence is truncated or padded to this many tokens, `[CLS]`
    /// and `[SEP]` included (default [`DEFAULT_MAX_TOKENS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    /// The downstream probe on frozen sentence embeddings (`[data.probe]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe: Option<ProbeConfig>,
}

/// Default `data.max_tokens`.
pub const DEFAULT_MAX_TOKENS: usize = 64;

impl DataOptions {
    /// The keys, as [`Zoo::data_options`] declares them.
    const KEYS: &'static [&'static str] = &["max_tokens", "probe"];

    /// `config`'s `[data]` options (checked when the config was loaded).
    pub fn of(config: &RunConfig) -> Result<Self> {
        parse_options("data", &config.data.options).map_err(ConfigIssue::into_plain_error)
    }

    /// Tokens per sequence for text data.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS)
    }
}

/// The built-in zoo's own keys of `[teacher]` (for `minilm-l6`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TeacherOptions {
    /// The tokenizer (default: `tokenizer.json` beside the weights).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// Teacher layers per block, in order (default one each: six blocks).
    /// `[2, 2, 2]` cuts three blocks of two layers, so that one student
    /// block replaces two teacher layers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers_per_block: Option<Vec<usize>>,
    /// The loss of every block whose default is the MSE: `mse`, `nmse`
    /// (normalized per sequence: every block's loss on the same scale,
    /// Puzzle's BLD loss) or `nmse-token` (normalized per token vector).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_loss: Option<BlockLoss>,
}

/// The losses `teacher.block_loss` may name: those that compare any two
/// block outputs of one shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BlockLoss {
    /// [`LossKind::Mse`].
    Mse,
    /// [`LossKind::Nmse`].
    Nmse,
    /// [`LossKind::NmseToken`].
    NmseToken,
}

impl From<BlockLoss> for LossKind {
    fn from(loss: BlockLoss) -> Self {
        match loss {
            BlockLoss::Mse => LossKind::Mse,
            BlockLoss::Nmse => LossKind::Nmse,
            BlockLoss::NmseToken => LossKind::NmseToken,
        }
    }
}

impl TeacherOptions {
    /// The keys, as [`Zoo::teacher_options`] declares them.
    const KEYS: &'static [&'static str] = &["tokenizer", "layers_per_block", "block_loss"];

    /// `config`'s `[teacher]` options (checked when the config was loaded).
    pub fn of(config: &RunConfig) -> Result<Self> {
        parse_options("teacher", &config.teacher.options).map_err(ConfigIssue::into_plain_error)
    }
}

/// The tokenizer file of the text teacher of `config`.
pub fn tokenizer_path(config: &RunConfig) -> Result<PathBuf> {
    let weights = &config.teacher.weights;
    Ok(TeacherOptions::of(config)?
        .tokenizer
        .unwrap_or_else(|| weights.parent().unwrap_or(Path::new(".")).join("tokenizer.json")))
}

/// `specs` with `teacher.block_loss` in place of each MSE (the students
/// and the search's scores take their loss from the teacher's specs).
pub fn with_block_loss(config: &RunConfig, specs: Vec<BlockSpec>) -> Result<Vec<BlockSpec>> {
    let Some(kind) = TeacherOptions::of(config)?.block_loss.map(LossKind::from) else { return Ok(specs) };
    Ok(specs
        .into_iter()
        .map(|spec| if spec.loss == LossKind::Mse { spec.with_loss(kind) } else { spec })
        .collect())
}

/// Text teacher layers per block: `teacher.layers_per_block`, or one each.
pub fn layers_per_block(config: &RunConfig) -> Result<Vec<usize>> {
    Ok(TeacherOptions::of(config)?.layers_per_block.unwrap_or_else(|| vec![1; teacher_layers(config)]))
}

/// SmolLM2 as a run uses it: cut into blocks, with what stays frozen around them.
pub struct Smollm2Parts<B: FusedBackend> {
    /// The tokenizer (from the same file).
    pub tokenizer: SmolTokenizer,
    /// Token embeddings: the input preparation.
    pub embeddings: TokenEmbeddings<B>,
    /// Final norm and LM head: what scores the last block's states.
    pub head: LmHead<B>,
    /// The decoder layers, cut into the configured blocks.
    pub teacher: BuiltinTeacher<B>,
}

/// Loads SmolLM2 (one read of the file) and cuts it into the configured blocks.
pub fn build_smollm2<B: FusedBackend>(config: &RunConfig, device: &B::Device) -> Result<Smollm2Parts<B>> {
    let model = SmolLm2::<B>::load(&config.teacher.weights, device).lift()?;
    check_smollm2_sizes(&model.sizes, &config.teacher.weights)?;
    let groups = layers_per_block(config)?;
    let specs = with_block_loss(config, decoder_specs(&model.sizes, &groups, max_tokens(config)?))?;
    let blocks = decoder_blocks(model.layers, &groups);
    Ok(Smollm2Parts {
        tokenizer: model.tokenizer,
        embeddings: model.embeddings,
        head: model.head,
        teacher: Teacher::new(blocks, specs)?,
    })
}

/// Fails unless `sizes` (read from `path`) are SmolLM2-135M's, which the
/// specs and the student defaults assume.
fn check_smollm2_sizes(sizes: &LlamaSizes, path: &Path) -> Result<()> {
    if *sizes != SMOLLM2_135M {
        return Err(Error::teacher(pipebd_teachers::TeacherError::BadWeights {
            path: path.to_path_buf(),
            message: format!(
                "a Llama of other sizes ({sizes:?}); teacher `{SMOLLM2}` is SmolLM2-135M ({SMOLLM2_135M:?})"
            ),
        }));
    }
    Ok(())
}

/// Tokens per sequence of the text data of `config` (`data.max_tokens`).
pub fn max_tokens(config: &RunConfig) -> Result<usize> {
    Ok(DataOptions::of(config)?.max_tokens())
}

/// Loads MiniLM and cuts it into the configured blocks; returns the frozen
/// embeddings (input preparation) with the teacher.
pub fn build_minilm<B: FusedBackend>(
    config: &RunConfig,
    device: &B::Device,
) -> Result<(Embeddings<B>, BuiltinTeacher<B>)> {
    // Building modules may draw from burn's generator (before the weights
    // replace the draws): not from under a concurrent seeded build.
    let rng = pipe_bd::rng::burn_rng_lock();
    let (embeddings, layers) = MiniLm::<B>::load(&config.teacher.weights, device).lift()?.into_parts();
    drop(rng);
    let groups = layers_per_block(config)?;
    let blocks = minilm_blocks(layers, &groups);
    let specs = with_block_loss(config, minilm_specs(&groups, max_tokens(config)?))?;
    Ok((embeddings, Teacher::new(blocks, specs)?))
}

/// Builds the teacher named in the config on `device`, with its weights.
pub fn build_teacher<B: FusedBackend>(
    config: &RunConfig,
    device: &B::Device,
) -> Result<Teacher<B, TeacherBlock<B>>> {
    if is_decoder(config) {
        return Ok(build_smollm2(config, device)?.teacher);
    }
    if is_text(config) {
        return Ok(build_minilm(config, device)?.1);
    }
    let teacher = mnist_teacher(&config.teacher.weights, device)?;
    let specs = with_block_loss(config, teacher.specs.clone())?;
    Ok(Teacher::new(teacher.blocks, specs)?)
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

/// Loads the config's training data, teacher and evaluation data on `device`.
/// With `with_evaluation = false` the held-out and probe data are skipped.
fn load_workload<B: FusedBackend>(
    config: &RunConfig,
    device: &B::Device,
    with_evaluation: bool,
) -> Result<Workload<B, TeacherBlock<B>>> {
    let data = &config.data;
    if !is_text(config) {
        let train = mnist::load(&data.dir, Split::Train, data.train_limit)?;
        let test = if with_evaluation {
            mnist::load(&data.dir, Split::Test, data.test_limit)?
        } else {
            mnist::load(&data.dir, Split::Test, Some(0))?
        };
        let teacher = build_teacher::<B>(config, device)?;
        let evaluation = Some(Box::new(TopOneAccuracy(test)) as _);
        return Ok(Workload { teacher, train: Box::new(train), evaluation });
    }
    if is_decoder(config) {
        return load_decoder_workload(config, device, with_evaluation);
    }
    let tokenizer = MiniLmTokenizer::load(&tokenizer_path(config)?).lift()?;
    let options = DataOptions::of(config)?;
    let max_tokens = options.max_tokens();
    let (train, heldout) = brown_splits(&data.dir, data.train_limit, data.test_limit)?;
    let train = tokenize(&tokenizer, &train, max_tokens)?;
    let heldout = if with_evaluation { tokenize(&tokenizer, &heldout, max_tokens)? } else { Vec::new() };
    let probe = match (&options.probe, with_evaluation) {
        (Some(probe), true) => Some(ProbeData::load(probe, &tokenizer)?),
        _ => None,
    };
    let (embeddings, teacher) = build_minilm::<B>(config, device)?;
    let dataset = TextDataset::new(train, max_tokens, embeddings.clone());
    let mean_tokens = dataset.mean_tokens();
    Ok(Workload {
        teacher,
        train: Box::new(dataset),
        evaluation: Some(Box::new(SentenceEmbeddings {
            embeddings,
            heldout,
            max_tokens,
            probe,
            mean_tokens,
        })),
    })
}

/// The decoder LLM's workload: Brown sentences by SmolLM2's tokenizer, its
/// token embeddings in front of the first block, next-token scores.
fn load_decoder_workload<B: FusedBackend>(
    config: &RunConfig,
    device: &B::Device,
    with_evaluation: bool,
) -> Result<Workload<B, TeacherBlock<B>>> {
    let data = &config.data;
    let max_tokens = max_tokens(config)?;
    let (train, heldout) = brown_splits(&data.dir, data.train_limit, data.test_limit)?;
    let Smollm2Parts { tokenizer, embeddings, head, teacher } = build_smollm2::<B>(config, device)?;
    let train = tokenize_lm(&tokenizer, &train, max_tokens)?;
    let heldout = if with_evaluation { tokenize_lm(&tokenizer, &heldout, max_tokens)? } else { Vec::new() };
    Ok(Workload {
        teacher,
        train: Box::new(TextDataset::new(train, max_tokens, embeddings.clone())),
        evaluation: Some(Box::new(NextTokenScores { embeddings, head, heldout, max_tokens })),
    })
}

/// Specs of the student blocks described by `configs`, built for the
/// teacher's input shapes. Fails on a block whose shapes do not match.
/// Students initialised from the teacher are checked against it too.
fn specs_of(configs: &[StudentBlockConfig], teacher: &[BlockSpec]) -> Result<Vec<BlockSpec>> {
    // Building draws initial weights: not from under a concurrent build.
    let _rng = pipe_bd::rng::burn_rng_lock();
    let (_, specs) = init_student_blocks::<burn::backend::Flex>(configs, teacher, &Default::default())?;
    Ok(specs)
}

fn init_student_blocks<B: FusedBackend>(
    configs: &[StudentBlockConfig],
    teacher: &[BlockSpec],
    device: &B::Device,
) -> Result<(Vec<StudentBlock<B>>, Vec<BlockSpec>)> {
    check_block_count(configs.len(), teacher.len())?;
    let mut blocks = Vec::new();
    let mut specs = Vec::new();
    for (k, (config, t)) in configs.iter().zip(teacher).enumerate() {
        let built = config.init::<B>(k + 1, &t.input_shape, device).lift()?;
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

/// A student block's config that the teacher cannot serve: the user's
/// error (`pipebd` exits with 2 and names the config file).
fn config_block_error(block: usize, message: impl std::fmt::Display) -> Error {
    Error::Student(format!("student block {block}: {message}").into())
}

/// Fails unless student `k` (zero-based), if it is an `encoder` with
/// `init = "teacher"`, fits inside the teacher layer it is pruned from.
fn check_teacher_init(k: usize, student: &StudentBlockConfig) -> Result<()> {
    if let StudentBlockConfig::Decoder { init: EncoderInit::Teacher, .. } = student {
        return check_decoder_init(k, student);
    }
    let StudentBlockConfig::Encoder { heads, head_dim, ffn, init: EncoderInit::Teacher } = *student else {
        return Ok(());
    };
    let size = minilm::layer_config();
    if heads > size.heads || head_dim != size.head_dim || ffn > size.ffn {
        return Err(config_block_error(
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

/// Fails unless the `decoder` student `student` of block `k` (zero-based)
/// fits inside the SmolLM2 layer it is pruned from: no more key/value heads
/// or query heads per key/value head, the same head width, no wider a
/// feed-forward.
fn check_decoder_init(k: usize, student: &StudentBlockConfig) -> Result<()> {
    let teacher = SMOLLM2_135M.layer;
    let Some(size) = student.decoder_config(teacher.hidden) else { return Ok(()) };
    // A layer that cannot exist is the clearer error.
    size.validate().map_err(|message| config_block_error(k + 1, message))?;
    let group = teacher.heads / teacher.kv_heads;
    let attention_fits = size.mixer != MixerKind::Attention
        || (size.kv_heads <= teacher.kv_heads
            && size.heads / size.kv_heads.max(1) <= group
            && size.head_dim == teacher.head_dim);
    if !attention_fits || size.ffn > teacher.ffn {
        return Err(config_block_error(
            k + 1,
            format!(
                "init = \"teacher\" needs kv_heads <= {}, heads / kv_heads <= {group}, head_dim = {} and \
                 ffn <= {} (the teacher layer's), got heads {}, kv_heads {}, head_dim {}, ffn {}; use init = \"random\" otherwise",
                teacher.kv_heads, teacher.head_dim, teacher.ffn, size.heads, size.kv_heads, size.head_dim, size.ffn
            ),
        ));
    }
    Ok(())
}

/// Calibration sentences of the decoder's pruning (about 7k real tokens at
/// 32): they rank the feed-forward neurons and refit the pruned layers.
const DECODER_CALIBRATION_SENTENCES: usize = 256;
/// Ridge of the decoder's least-squares refit, relative to the mean
/// diagonal of each Gram matrix (toward the pruned weights).
const DECODER_REFIT_RIDGE: f64 = 1e-2;

/// Replaces the `decoder` students with `init = "teacher"` by the first
/// SmolLM2 layer of their block, pruned to their size
/// ([`crate::lm::prune_decoder`]) and refitted by least squares to the
/// teacher layer on the first training sentences (a linear mixer's map and
/// the feed-forward's down projection: `DecoderLayer::refit`); the
/// feed-forward neurons are ranked on the same sentences.
fn init_decoders_from_teacher(
    config: &RunConfig,
    students: &[StudentBlockConfig],
    blocks: &mut [StudentBlock<burn::backend::Flex>],
) -> Result<()> {
    type Cpu = burn::backend::Flex;
    let wanted =
        |c: &StudentBlockConfig| matches!(c, StudentBlockConfig::Decoder { init: EncoderInit::Teacher, .. });
    let groups = layers_per_block(config)?;
    let first_layer = |k: usize| groups[..k.min(groups.len())].iter().sum::<usize>();
    // A block that starts from saved `weights` gets them after this: no
    // need to prune it (nor to load the teacher for it).
    let saved = config.student_weights();
    let pruned = |k: usize| {
        saved.get(k).is_none_or(Option::is_none)
            && (wanted(&students[k]) || students[k].candidates().iter().any(wanted))
    };
    let needed: Vec<usize> = (0..students.len()).filter(|&k| pruned(k)).collect();
    let Some(deepest) = needed.iter().map(|&k| first_layer(k)).max() else { return Ok(()) };
    let device = Default::default();
    let model = SmolLm2::<Cpu>::load(&config.teacher.weights, &device).lift()?;
    if deepest >= model.layers.len() {
        let k = needed.iter().copied().find(|&k| first_layer(k) == deepest).unwrap_or_default();
        return Err(Error::block(k + 1, "no teacher layer to initialise this student from"));
    }
    let (sentences, _) = brown_splits(&config.data.dir, Some(DECODER_CALIBRATION_SENTENCES), Some(0))?;
    let max_tokens = max_tokens(config)?;
    let ids = tokenize_lm(&model.tokenizer, &sentences, max_tokens)?;
    let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
    let (mut hidden, mask) =
        crate::text::embed_batch(&model.embeddings, &refs, max_tokens, &device).into_tokens(0)?;
    // Layer by layer, the students that start from it, on the calibration
    // batch entering it (minutes for a search's 30 layers: a line every
    // half minute).
    let (start, mut last_line) = (std::time::Instant::now(), std::time::Instant::now());
    for (n, teacher) in model.layers.iter().enumerate().take(deepest + 1) {
        if last_line.elapsed().as_secs() >= 30 {
            last_line = std::time::Instant::now();
            let seconds = start.elapsed().as_secs_f64();
            eprintln!(
                "init: pruned and refitted the students of {n}/{} SmolLM2 layers after {seconds:.0}s",
                deepest + 1
            );
        }
        let here: Vec<usize> = needed.iter().copied().filter(|&k| first_layer(k) == n).collect();
        let targets = (!here.is_empty()).then(|| teacher.refit_targets(hidden.clone(), mask.clone()));
        if let Some(targets) = &targets {
            let neurons = ffn_importance(teacher, hidden.clone(), mask.clone());
            let full = model.sizes.layer;
            let prune = |k: usize, c: &StudentBlockConfig| -> Result<Option<DecoderLayer<Cpu>>> {
                if !wanted(c) {
                    return Ok(None);
                }
                check_decoder_init(k, c)?;
                let size =
                    c.decoder_config(full.hidden).ok_or_else(|| Error::block(k + 1, "not a decoder"))?;
                let mut student = prune_decoder(teacher, &size, neurons.as_deref(), &device);
                let whole = (size.mixer, size.heads, size.kv_heads, size.ffn)
                    == (full.mixer, full.heads, full.kv_heads, full.ffn);
                if !whole {
                    student.refit(targets, hidden.clone(), mask.clone(), DECODER_REFIT_RIDGE);
                }
                Ok(Some(student))
            };
            for k in here {
                if let Some(student) = prune(k, &students[k])? {
                    blocks[k] = StudentBlock::Decoder(student);
                }
                if let StudentBlock::Candidates(set) = &mut blocks[k] {
                    for (c, candidate) in students[k].candidates().iter().enumerate() {
                        if let Some(student) = prune(k, candidate)? {
                            set.candidates[c] = Candidate::Decoder(student);
                        }
                    }
                }
            }
        }
        hidden = match targets {
            Some(targets) => targets.next,
            None => teacher.forward(hidden, mask.clone()),
        };
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
fn init_from_teacher(
    config: &RunConfig,
    students: &[StudentBlockConfig],
    blocks: &mut [StudentBlock<burn::backend::Flex>],
) -> Result<()> {
    if is_decoder(config) {
        return init_decoders_from_teacher(config, students, blocks);
    }
    let wanted =
        |c: &StudentBlockConfig| matches!(c, StudentBlockConfig::Encoder { init: EncoderInit::Teacher, .. });
    if !students.iter().any(|s| wanted(s) || s.candidates().iter().any(wanted)) {
        return Ok(());
    }
    let device = Default::default();
    let (embeddings, layers) =
        MiniLm::<burn::backend::Flex>::load(&config.teacher.weights, &device).lift()?.into_parts();
    let groups = layers_per_block(config)?;
    // The calibration batch entering each teacher layer.
    let tokenizer = MiniLmTokenizer::load(&tokenizer_path(config)?).lift()?;
    let (sentences, _) = brown_splits(&config.data.dir, Some(CALIBRATION_SENTENCES), Some(0))?;
    let max_tokens = max_tokens(config)?;
    let ids = tokenize(&tokenizer, &sentences, max_tokens)?;
    let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
    let (mut hidden, mask) =
        crate::text::embed_batch(&embeddings, &refs, max_tokens, &device).into_tokens(0)?;
    let mut layer_inputs = Vec::with_capacity(layers.len());
    for layer in &layers {
        layer_inputs.push(hidden.clone());
        hidden = layer.forward(hidden, mask.clone());
    }
    // Each teacher layer's neuron statistics, computed once however many
    // students and candidates are pruned from it.
    let mut layer_statistics = vec![None; layers.len()];
    for (k, student) in students.iter().enumerate() {
        let first = groups[..k.min(groups.len())].iter().sum::<usize>();
        let mut prune = |config: &StudentBlockConfig| -> Result<Option<EncoderLayer<burn::backend::Flex>>> {
            let StudentBlockConfig::Encoder { heads, ffn, init: EncoderInit::Teacher, .. } = *config else {
                return Ok(None);
            };
            let teacher = layers
                .get(first)
                .ok_or_else(|| Error::block(k + 1, "no teacher layer to initialise this student from"))?;
            check_teacher_init(k, config)?;
            let size = teacher.config();
            let kept_heads = top_indices(&teacher.head_importance(), heads);
            let statistics: &NeuronStatistics = layer_statistics[first]
                .get_or_insert_with(|| teacher.neuron_statistics(layer_inputs[first].clone(), mask.clone()));
            let kept_neurons = top_indices(&statistics.importance, ffn);
            let mut pruned =
                teacher.pruned_compensated(&kept_heads, &kept_neurons, &statistics.mean_activation);
            // Least-squares refit of the output projection on the calibration
            // batch (kept as compensated if the system is singular). Nothing
            // pruned: the teacher layer itself.
            if heads < size.heads || ffn < size.ffn {
                pruned.refit_ffn_out(teacher, layer_inputs[first].clone(), mask.clone(), REFIT_RIDGE);
            }
            Ok(Some(pruned))
        };
        if let Some(pruned) = prune(student)? {
            blocks[k] = StudentBlock::Encoder(pruned);
        }
        if let StudentBlock::Candidates(set) = &mut blocks[k] {
            for (c, candidate) in student.candidates().iter().enumerate() {
                if let Some(pruned) = prune(candidate)? {
                    set.candidates[c] = Candidate::Encoder(pruned);
                }
            }
        }
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
fn build_students<B: DistillBackend>(
    config: &RunConfig,
    teacher: &[BlockSpec],
    device: &B::Device,
) -> Result<Students<B, StudentBlock<B>>> {
    let (configs, seed) = (&student_configs(config)?, config.seed);
    let cpu = Default::default();
    // burn's CPU backend draws from one process-wide generator: hold it from
    // seeding to the last module built (the target modules below, built on
    // that backend too, included), so that concurrent builds stay reproducible.
    let _rng = pipe_bd::rng::burn_rng_lock();
    let (cpu_blocks, specs) = {
        <burn::backend::Flex as burn::tensor::backend::Backend>::seed(&cpu, seed);
        let (mut blocks, specs) = init_student_blocks::<burn::backend::Flex>(configs, teacher, &cpu)?;
        init_from_teacher(config, configs, &mut blocks)?;
        if config.generator == pipe_bd::rng::Generator::Torch {
            let mut rng = pipe_bd::rng::TorchRng::new(seed);
            blocks = blocks
                .into_iter()
                .enumerate()
                .map(|(k, block)| {
                    pipe_bd::rng::init_like_torch(block, &mut rng).map_err(|e| Error::block(k + 1, e))
                })
                .collect::<Result<Vec<_>>>()?;
        }
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

/// Checks that the files a config names are there and what they should be,
/// without reading what training reads: the MNIST files' headers and sizes
/// and the MNIST teacher's weights (loaded on the CPU: 1.5 MB), or the
/// Brown corpus' file list, the probe's folder, MiniLM's safetensors header and its
/// tokenizer. Every error names the file.
fn check_builtin_inputs(config: &RunConfig) -> Result<()> {
    let data = &config.data;
    if !is_text(config) {
        let _training_images = mnist::check_mnist_files(&data.dir)?;
        pipebd_teachers::mnist_cnn::MnistCnn::<burn::backend::Flex>::load_pytorch(
            &config.teacher.weights,
            &Default::default(),
        )
        .lift()?;
        return Ok(());
    }
    crate::text::brown_files(&data.dir)?;
    if is_decoder(config) {
        // The header, metadata and tensor table (the tensors are not read).
        let file = pipebd_teachers::gguf::Gguf::open(&config.teacher.weights).lift()?;
        check_smollm2_sizes(&LlamaSizes::of(&file).lift()?, &config.teacher.weights)?;
        SmolTokenizer::from_gguf(&file).lift()?;
        return Ok(());
    }
    if let Some(probe) = &DataOptions::of(config)?.probe {
        if !probe.dir.is_dir() {
            return Err(pipe_bd::data::data_error(
                &probe.dir,
                "folder not found (run scripts/setup-data.sh, or fix `data.probe.dir` in the config)",
            ));
        }
    }
    check_safetensors_header(&config.teacher.weights)?;
    pipebd_teachers::minilm::MiniLmTokenizer::load(&tokenizer_path(config)?).lift()?;
    Ok(())
}

/// Checks that `path` is laid out as a safetensors file (an 8-byte header
/// length, a JSON header, tensor data up to the last offset it announces)
/// without reading the tensors.
fn check_safetensors_header(path: &Path) -> Result<()> {
    use pipebd_teachers::TeacherError;
    use std::io::Read;
    let bad =
        |message: String| Error::teacher(TeacherError::BadWeights { path: path.to_path_buf(), message });
    if path.is_dir() {
        return Err(bad("is a folder, expected the `model.safetensors` file".into()));
    }
    if !path.is_file() {
        return Err(Error::teacher(TeacherError::MissingWeights { path: path.to_path_buf() }));
    }
    let mut file = std::fs::File::open(path).map_err(|e| bad(format!("cannot read: {e}")))?;
    let size = file.metadata().map_err(|e| bad(format!("cannot read: {e}")))?.len();
    let not_safetensors = |what: String| bad(format!("not a safetensors file: {what}"));
    let mut word = [0u8; 8];
    file.read_exact(&mut word)
        .map_err(|_| not_safetensors(format!("{size} bytes, too short for the header length")))?;
    let header_len = u64::from_le_bytes(word);
    if header_len > size.saturating_sub(8) {
        return Err(not_safetensors(format!(
            "the header length {header_len} exceeds the file's {size} bytes"
        )));
    }
    let mut header = Vec::new();
    file.take(header_len).read_to_end(&mut header).map_err(|e| bad(format!("cannot read: {e}")))?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|e| not_safetensors(format!("the header is not a JSON object ({e})")))?;
    let tensors: Vec<&serde_json::Value> =
        header.iter().filter(|(name, _)| name.as_str() != "__metadata__").map(|(_, t)| t).collect();
    if tensors.is_empty() {
        return Err(not_safetensors("the header lists no tensors".into()));
    }
    let data_end =
        tensors.iter().filter_map(|tensor| tensor.get("data_offsets")?.get(1)?.as_u64()).max().unwrap_or(0);
    let needed = header_len.saturating_add(data_end).saturating_add(8);
    if needed > size {
        return Err(bad(format!("truncated: the tensors end at byte {needed}, the file has {size}")));
    }
    Ok(())
}

/// The built-in zoo: the MNIST CNN teacher on MNIST/Fashion-MNIST images
/// (`data.dataset = "mnist"`, `teacher.kind = "mnist-cnn"`), MiniLM and
/// SmolLM2 on the Brown corpus (`"brown"`; `"minilm-l6"`, `"smollm2-135m"`),
/// with the students of `pipebd-students` (`[[students]] kind = "conv" |
/// "separable" | "bottleneck" | "inverted" | "head" | "encoder" | "decoder"
/// | "skip"`). `pipebd` itself is `cli::run_with(Builtin)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Builtin;

impl Zoo for Builtin {
    type Teacher<B: FusedBackend> = TeacherBlock<B>;
    type Student<B: DistillBackend> = StudentBlock<B>;

    fn data_options(&self) -> &'static [&'static str] {
        DataOptions::KEYS
    }

    fn teacher_options(&self) -> &'static [&'static str] {
        TeacherOptions::KEYS
    }

    /// Students built at random: pruning and the refit are skipped.
    fn config_for_saved_weights(&self, config: &RunConfig) -> RunConfig {
        architecture_only(config)
    }

    /// Decoder students (and SmolLM2 itself) as GGUF files for llama.cpp.
    fn export(&self, request: &ExportRequest) -> Result<Exported> {
        crate::export::export(request)
    }

    /// A Llama or `deci` GGUF file's perplexity, llama.cpp's way.
    fn score_model_file(&self, request: &TextScoreRequest) -> Result<TextScore> {
        crate::export::score_model_file(request)
    }

    /// `data.max_tokens` and `teacher.layers_per_block` (the probe and the
    /// tokenizer's path do not change what the students learn).
    fn checkpoint_identity(&self, config: &RunConfig) -> BTreeMap<String, serde_json::Value> {
        let option = |options: &toml::Table, key: &str| serde_json::json!(options.get(key));
        BTreeMap::from([
            ("data.max_tokens".to_string(), option(&config.data.options, "max_tokens")),
            ("teacher.layers_per_block".to_string(), option(&config.teacher.options, "layers_per_block")),
            ("teacher.block_loss".to_string(), option(&config.teacher.options, "block_loss")),
        ])
    }

    fn check_config(&self, config: &RunConfig) -> std::result::Result<(), ConfigIssue> {
        let data = &config.data;
        if !["mnist", "brown"].contains(&data.dataset.as_str()) {
            return Err(ConfigIssue::new(
                "data",
                "dataset",
                format!("unknown dataset `{}`: expected `mnist` or `brown`", data.dataset),
            ));
        }
        let expected: &[&str] = if is_text(config) { &["minilm-l6", SMOLLM2] } else { &["mnist-cnn"] };
        if !expected.contains(&config.teacher.kind.as_str()) {
            let expected_teacher = expected.join("` or `");
            return Err(ConfigIssue::new(
                "teacher",
                "kind",
                format!(
                    "teacher `{}` does not fit dataset `{}`: expected `{expected_teacher}`",
                    config.teacher.kind, data.dataset
                ),
            ));
        }
        if config.generator == pipe_bd::rng::Generator::Torch && is_text(config) {
            return Err(ConfigIssue::new(
                "",
                "generator",
                "`torch` draws students built of Conv2d and Linear layers only (the MNIST zoo); \
                 MiniLM's students have embeddings and layer norms: use `native`"
                    .into(),
            ));
        }
        if !config.custom.is_empty() {
            return Err(ConfigIssue::new(
                "custom",
                "",
                "the built-in teachers and students take no [custom] settings".into(),
            ));
        }
        let options: DataOptions = parse_options("data", &data.options)?;
        let teacher_options: TeacherOptions = parse_options("teacher", &config.teacher.options)?;
        let positions = 2..=minilm::MAX_POSITIONS;
        if let Some(tokens) = options.max_tokens {
            if !positions.contains(&tokens) {
                return Err(ConfigIssue::new(
                    "data",
                    "max_tokens",
                    format!("must be in 2..=512, got {tokens}"),
                ));
            }
        }
        if let Some(probe) = &options.probe {
            check_probe(config, probe)?;
        }
        if let Some(groups) = &teacher_options.layers_per_block {
            let layers = teacher_layers(config);
            if groups.contains(&0) || groups.iter().sum::<usize>() != layers {
                return Err(ConfigIssue::new(
                    "teacher",
                    "layers_per_block",
                    format!("must be positive and add up to the teacher's {layers} layers, got {groups:?}"),
                ));
            }
        }
        let students: Vec<StudentBlockConfig> = parse_students(config)?;
        check_student_kinds(config, &students)?;
        let teacher_blocks = if is_text(config) {
            teacher_options.layers_per_block.as_ref().map_or(teacher_layers(config), Vec::len)
        } else {
            pipebd_teachers::mnist_cnn::block_output_shapes().len()
        };
        if students.len() != teacher_blocks {
            return Err(ConfigIssue::new(
                "students",
                "",
                format!(
                    "the teacher `{}` has {teacher_blocks} blocks but {} student blocks are configured: \
                     give one [[students]] entry per teacher block",
                    config.teacher.kind,
                    students.len()
                ),
            ));
        }
        Ok(())
    }

    fn teacher_specs(&self, config: &RunConfig) -> Result<Vec<BlockSpec>> {
        if is_decoder(config) {
            let specs = decoder_specs(&SMOLLM2_135M, &layers_per_block(config)?, max_tokens(config)?);
            return with_block_loss(config, specs);
        }
        if is_text(config) {
            return with_block_loss(config, minilm_specs(&layers_per_block(config)?, max_tokens(config)?));
        }
        // An initialised (random) teacher, for its shapes: its draws must not
        // land inside a concurrent seeded build.
        let _rng = pipe_bd::rng::burn_rng_lock();
        let blocks = MnistCnn::<burn::backend::Flex>::init(&Default::default()).into_blocks();
        with_block_loss(config, mnist_specs(&blocks))
    }

    fn student_specs(&self, config: &RunConfig, teacher: &[BlockSpec]) -> Result<Vec<BlockSpec>> {
        let configs = student_configs(config)?;
        for (k, student) in configs.iter().enumerate() {
            check_teacher_init(k, student)?;
            for candidate in student.candidates() {
                check_teacher_init(k, candidate)?;
            }
        }
        specs_of(&configs, teacher)
    }

    fn candidate_specs(&self, config: &RunConfig, teacher: &[BlockSpec]) -> Result<Vec<Vec<BlockSpec>>> {
        let configs = student_configs(config)?;
        check_block_count(configs.len(), teacher.len())?;
        let device = Default::default();
        let _rng = pipe_bd::rng::burn_rng_lock();
        configs
            .iter()
            .zip(teacher)
            .enumerate()
            .map(|(k, (student, t))| {
                student
                    .candidates()
                    .iter()
                    .map(|candidate| {
                        let built =
                            candidate.init::<burn::backend::Flex>(k + 1, &t.input_shape, &device).lift()?;
                        Ok(BlockSpec {
                            name: candidate.kind().to_string(),
                            input_shape: t.input_shape.clone(),
                            output_shape: built.output_shape,
                            flops: built.flops,
                            params: built.module.num_params(),
                            loss: t.loss,
                        })
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect()
    }

    fn check_inputs(&self, config: &RunConfig) -> Result<()> {
        check_builtin_inputs(config)
    }

    fn train_samples(&self, config: &RunConfig) -> Result<Option<usize>> {
        let data = &config.data;
        if is_text(config) {
            // Counting the corpus's sentences means reading it: only a limit is known.
            return Ok(data.train_limit);
        }
        let images = mnist::check_mnist_files(&data.dir)?;
        Ok(Some(data.train_limit.map_or(images, |limit| limit.min(images))))
    }

    fn workload<B: FusedBackend>(
        &self,
        config: &RunConfig,
        device: &B::Device,
        with_evaluation: bool,
    ) -> Result<Workload<B, TeacherBlock<B>>> {
        load_workload(config, device, with_evaluation)
    }

    fn students<B: DistillBackend>(
        &self,
        config: &RunConfig,
        teacher: &[BlockSpec],
        device: &B::Device,
    ) -> Result<Students<B, StudentBlock<B>>> {
        build_students(config, teacher, device)
    }

    fn has_output_head(&self, config: &RunConfig) -> bool {
        is_decoder(config)
    }

    fn output_head<B: DistillBackend>(
        &self,
        config: &RunConfig,
        device: &B::Device,
    ) -> Result<Option<Box<dyn OutputHead<B>>>> {
        if !is_decoder(config) {
            return Ok(None);
        }
        let head = LmHead::<B>::load(&config.teacher.weights, device).lift()?;
        Ok(Some(Box::new(NextTokenHead::new(head))))
    }
}

/// Checks the `[data.probe]` table of `config`.
fn check_probe(config: &RunConfig, probe: &ProbeConfig) -> std::result::Result<(), ConfigIssue> {
    if is_decoder(config) {
        return Err(ConfigIssue::new(
            "data",
            "probe",
            format!("the spam probe scores sentence embeddings of `minilm-l6`, not of `{SMOLLM2}`"),
        ));
    }
    if !(2..=minilm::MAX_POSITIONS).contains(&probe.max_tokens) {
        let message = format!("must be in 2..=512, got {}", probe.max_tokens);
        return Err(ConfigIssue::new("data.probe", "max_tokens", message));
    }
    if !(probe.test_fraction > 0.0 && probe.test_fraction < 1.0) {
        let message = format!("must be in (0, 1), got {}", probe.test_fraction);
        return Err(ConfigIssue::new("data.probe", "test_fraction", message));
    }
    if probe.limit == Some(0) {
        let message = "must be at least 1 (leave it out to use every email)".to_string();
        return Err(ConfigIssue::new("data.probe", "limit", message));
    }
    Ok(())
}

/// Refuses student kinds that cannot stand in for the teacher's layers: a
/// bidirectional `encoder` for a decoder LLM (it would see the tokens it
/// predicts), a `decoder` for MiniLM.
fn check_student_kinds(
    config: &RunConfig,
    students: &[StudentBlockConfig],
) -> std::result::Result<(), ConfigIssue> {
    let decoder = is_decoder(config);
    for (k, student) in students.iter().enumerate() {
        for kind in std::iter::once(student).chain(student.candidates()).map(StudentBlockConfig::kind) {
            let message = match kind {
                "encoder" if decoder => format!(
                    "block {}: `encoder` students attend both ways and would see the tokens a decoder LLM \
                     predicts: use `decoder` (or `skip`) for teacher `{SMOLLM2}`",
                    k + 1
                ),
                "decoder" if !decoder => format!(
                    "block {}: `decoder` students are causal Llama layers for teacher `{SMOLLM2}`; use `encoder` for `{}`",
                    k + 1,
                    config.teacher.kind
                ),
                _ => continue,
            };
            return Err(ConfigIssue::in_entry("students", k, message));
        }
    }
    Ok(())
}

/// The config's `[[students]]` tables as the built-in student configs.
fn student_configs(config: &RunConfig) -> Result<Vec<StudentBlockConfig>> {
    parse_students(config).map_err(ConfigIssue::into_plain_error)
}
