//! The built-in decoder LLM teacher SmolLM2-135M (`teacher.kind =
//! "smollm2-135m"` on `data.dataset = "brown"`), from its GGUF file: cut
//! into blocks of decoder layers ([`Smollm2Parts`]), its specs, its
//! workload (Brown sentences by its tokenizer, scored by next-token
//! figures through its frozen LM head, also the `head-kl` output head),
//! its `decoder` students pruned from its layers and refitted (`init =
//! "teacher"`), and the check of its file. The language-model data,
//! evaluation and pruning are [`crate::lm`]'s; its students leave as GGUF
//! files through `export.rs` (which uses this module, not the other way).

use std::path::Path;

use burn::tensor::Tensor;
use pipe_bd::{Error, Result};
use pipebd_cli::config::RunConfig;
use pipebd_cli::zoo::Workload;
use pipebd_core::{BlockSpec, OutputHead, Teacher};
use pipebd_kernels::decoder::{DecoderLayer, DecoderLayerConfig, MixerKind, RefitTargets};
use pipebd_kernels::{DistillBackend, FusedBackend};
use pipebd_students::{Candidate, EncoderInit, StudentBlock, StudentBlockConfig};
use pipebd_teachers::blocks::{decoder_blocks, decoder_specs};
use pipebd_teachers::smollm2::{LlamaSizes, LmHead, SmolLm2, SmolTokenizer, TokenEmbeddings, SMOLLM2_135M};
use pipebd_teachers::TeacherBlock;

use crate::init::{blocks_from_teacher, init_from_layers, Calibrated, Cpu, PrunedFrom};
use crate::lm::{ffn_importance, prune_decoder, tokenize_lm, NextTokenHead, NextTokenScores};
use crate::options::{config_block_error, grouped_layers, max_tokens, with_block_loss};
use crate::text::{brown_splits, TextDataset};
use crate::Lift;

/// `teacher.kind` of the decoder LLM SmolLM2-135M-Instruct.
pub const SMOLLM2: &str = "smollm2-135m";

/// True for the decoder LLM teacher (on text).
pub(crate) fn is_decoder(config: &RunConfig) -> bool {
    config.teacher.kind == SMOLLM2
}

/// SmolLM2's layers per block: `teacher.layers_per_block`, or one each.
pub(crate) fn layers_per_block(config: &RunConfig) -> Result<Vec<usize>> {
    grouped_layers(config, teacher_layers(config))
}

/// Decoder layers in the teacher file of `config`: the file's own count
/// (SmolLM2-135M's 30, or fewer in a file of its first layers, such as
/// `pipebd export` writes for a student whose last blocks are skipped), or
/// 30 while the file cannot be read (loading it then says why). Reads the
/// file's header only.
pub(crate) fn teacher_layers(config: &RunConfig) -> usize {
    pipebd_teachers::gguf::Gguf::open(&config.teacher.weights)
        .and_then(|file| pipebd_teachers::smollm2::layer_configs(&file))
        .map_or(SMOLLM2_135M.layers, |layers| layers.len().max(1))
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
    pub teacher: Teacher<B, TeacherBlock<B>>,
}

/// Loads SmolLM2 (one read of the file) and cuts it into the configured blocks.
pub fn build_smollm2<B: FusedBackend>(config: &RunConfig, device: &B::Device) -> Result<Smollm2Parts<B>> {
    let model = SmolLm2::<B>::load(&config.teacher.weights, device).lift()?;
    check_smollm2_sizes(&model.sizes, &model.layer_sizes, &config.teacher.weights)?;
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

/// Fails unless every layer of the model read from `path` (`sizes`, and
/// each layer's own) is SmolLM2-135M's, which the specs and the student
/// defaults assume; the count of layers may be any (SmolLM2's first layers).
fn check_smollm2_sizes(sizes: &LlamaSizes, layers: &[DecoderLayerConfig], path: &Path) -> Result<()> {
    let bad = |message: String| {
        Err(Error::teacher(pipebd_teachers::TeacherError::BadWeights { path: path.to_path_buf(), message }))
    };
    if sizes.vocab != SMOLLM2_135M.vocab || sizes.layer != SMOLLM2_135M.layer {
        return bad(format!(
            "a Llama of other sizes ({sizes:?}); teacher `{SMOLLM2}` is SmolLM2-135M ({SMOLLM2_135M:?}) or its first layers"
        ));
    }
    if let Some(n) = layers.iter().position(|layer| *layer != SMOLLM2_135M.layer) {
        return bad(format!(
            "layer {} has other sizes ({:?}) than SmolLM2-135M's ({:?}): a pruned model is a student, not teacher `{SMOLLM2}`",
            n + 1,
            layers[n],
            SMOLLM2_135M.layer
        ));
    }
    Ok(())
}

/// SmolLM2's block specs, without its weights file (the sizes are
/// SmolLM2-135M's, which [`build_smollm2`] checks the file against).
pub(crate) fn specs(config: &RunConfig) -> Result<Vec<BlockSpec>> {
    let specs = decoder_specs(&SMOLLM2_135M, &layers_per_block(config)?, max_tokens(config)?);
    with_block_loss(config, specs)
}

/// The decoder LLM's workload: Brown sentences by SmolLM2's tokenizer, its
/// token embeddings in front of the first block, next-token scores.
pub(crate) fn load_decoder_workload<B: FusedBackend>(
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

/// SmolLM2's frozen final norm and LM head as the stitched pass's output
/// head (`stitched_output_loss = "head-kl"`).
pub(crate) fn output_head<B: DistillBackend>(
    config: &RunConfig,
    device: &B::Device,
) -> Result<Box<dyn OutputHead<B>>> {
    let head = LmHead::<B>::load(&config.teacher.weights, device).lift()?;
    Ok(Box::new(NextTokenHead::new(head)))
}

/// SmolLM2's files: the Brown corpus' file list, and the GGUF file's
/// header, metadata and tensor table (the tensors are not read), its sizes
/// and its tokenizer.
pub(crate) fn check_inputs(config: &RunConfig) -> Result<()> {
    crate::text::brown_files(&config.data.dir)?;
    // The header, metadata and tensor table (the tensors are not read).
    let file = pipebd_teachers::gguf::Gguf::open(&config.teacher.weights).lift()?;
    let layers = pipebd_teachers::smollm2::layer_configs(&file).lift()?;
    check_smollm2_sizes(&LlamaSizes::of(&file).lift()?, &layers, &config.teacher.weights)?;
    SmolTokenizer::from_gguf(&file).lift()?;
    Ok(())
}

/// Fails unless the `decoder` student `student` of block `k` (zero-based)
/// fits inside the SmolLM2 layer it is pruned from: no more key/value heads
/// or query heads per key/value head, the same head width, no wider a
/// feed-forward.
pub(crate) fn check_decoder_init(k: usize, student: &StudentBlockConfig) -> Result<()> {
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
/// feed-forward neurons are ranked on the same sentences ([`crate::init`]'s
/// loop over [`TeacherDecoder`]s).
pub(crate) fn init_decoders_from_teacher(
    config: &RunConfig,
    students: &[StudentBlockConfig],
    blocks: &mut [StudentBlock<Cpu>],
) -> Result<()> {
    let wanted =
        |c: &StudentBlockConfig| matches!(c, StudentBlockConfig::Decoder { init: EncoderInit::Teacher, .. });
    let needed = blocks_from_teacher(config, students, wanted);
    if needed.is_empty() {
        return Ok(());
    }
    let groups = layers_per_block(config)?;
    let first_layer = |k: usize| groups[..k.min(groups.len())].iter().sum::<usize>();
    let device = Default::default();
    let model = SmolLm2::<Cpu>::load(&config.teacher.weights, &device).lift()?;
    let (sentences, _) = brown_splits(&config.data.dir, Some(DECODER_CALIBRATION_SENTENCES), Some(0))?;
    let max_tokens = max_tokens(config)?;
    let ids = tokenize_lm(&model.tokenizer, &sentences, max_tokens)?;
    let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
    let (hidden, mask) =
        crate::text::embed_batch(&model.embeddings, &refs, max_tokens, &device).into_tokens(0)?;
    let full = model.sizes.layer;
    let layers: Vec<TeacherDecoder<'_>> =
        model.layers.iter().map(|layer| TeacherDecoder { layer, full }).collect();
    let teacher = Calibrated { layers: &layers, hidden, mask, teacher: "SmolLM2" };
    init_from_layers(teacher, &needed, &first_layer, students, blocks)
}

/// A SmolLM2 layer that `decoder` students are pruned from, with the sizes
/// of the teacher's layers (a student of those sizes is the layer itself,
/// not refitted).
pub(crate) struct TeacherDecoder<'a> {
    layer: &'a DecoderLayer<Cpu>,
    full: DecoderLayerConfig,
}

/// The calibration ranks the SwiGLU's neurons and computes the refit
/// targets (the residual stream after the attention half and the layer's
/// output, whose batch form is the next layer's input: no second forward).
impl PrunedFrom for TeacherDecoder<'_> {
    type Calibration = (RefitTargets<Cpu>, Option<Vec<f32>>);
    type Student = DecoderLayer<Cpu>;

    fn calibrate(&self, hidden: &Tensor<Cpu, 3>, mask: &Tensor<Cpu, 2>) -> Self::Calibration {
        let targets = self.layer.refit_targets(hidden.clone(), mask.clone());
        (targets, ffn_importance(self.layer, hidden.clone(), mask.clone()))
    }

    fn prune(
        &self,
        k: usize,
        config: &StudentBlockConfig,
        (targets, neurons): &Self::Calibration,
        hidden: &Tensor<Cpu, 3>,
        mask: &Tensor<Cpu, 2>,
    ) -> Result<Option<DecoderLayer<Cpu>>> {
        if !matches!(config, StudentBlockConfig::Decoder { init: EncoderInit::Teacher, .. }) {
            return Ok(None);
        }
        check_decoder_init(k, config)?;
        let full = self.full;
        let size = config.decoder_config(full.hidden).ok_or_else(|| Error::block(k + 1, "not a decoder"))?;
        let mut student = prune_decoder(self.layer, &size, neurons.as_deref(), &hidden.device());
        let whole = (size.mixer, size.heads, size.kv_heads, size.ffn)
            == (full.mixer, full.heads, full.kv_heads, full.ffn);
        if !whole {
            student.refit(targets, hidden.clone(), mask.clone(), DECODER_REFIT_RIDGE);
        }
        Ok(Some(student))
    }

    fn next(
        &self,
        calibration: Option<Self::Calibration>,
        hidden: Tensor<Cpu, 3>,
        mask: &Tensor<Cpu, 2>,
    ) -> Tensor<Cpu, 3> {
        match calibration {
            Some((targets, _)) => targets.next,
            None => self.layer.forward(hidden, mask.clone()),
        }
    }

    fn block(student: DecoderLayer<Cpu>) -> StudentBlock<Cpu> {
        StudentBlock::Decoder(student)
    }

    fn candidate(student: DecoderLayer<Cpu>) -> Candidate<Cpu> {
        Candidate::Decoder(student)
    }
}

/// The message refusing an `encoder` student of block `k` (zero-based)
/// for SmolLM2: it attends both ways and would see the tokens it predicts.
pub(crate) fn encoder_student_refused(k: usize) -> String {
    format!(
        "block {}: `encoder` students attend both ways and would see the tokens a decoder LLM \
         predicts: use `decoder` (or `skip`) for teacher `{SMOLLM2}`",
        k + 1
    )
}

/// The message refusing a `decoder` student of block `k` (zero-based) for
/// the teacher `teacher` (any but SmolLM2): decoders are SmolLM2's layers.
pub(crate) fn decoder_student_refused(k: usize, teacher: &str) -> String {
    format!(
        "block {}: `decoder` students are causal Llama layers for teacher `{SMOLLM2}`; use `encoder` for `{}`",
        k + 1,
        teacher
    )
}
