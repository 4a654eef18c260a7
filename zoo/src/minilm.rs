//! The built-in MiniLM teacher (`teacher.kind = "minilm-l6"` on
//! `data.dataset = "brown"`): all-MiniLM-L6-v2 cut into blocks of encoder
//! layers, its specs, its workload (Brown sentences by its tokenizer,
//! scored by sentence-embedding cosine and the SpamAssassin probe), its
//! `encoder` students pruned from its layers (`init = "teacher"`), and the
//! check of its files. The text data itself is [`crate::text`]'s.

use std::path::Path;

use burn::tensor::Tensor;
use pipe_bd::{Error, Result};
use pipebd_cli::config::RunConfig;
use pipebd_cli::zoo::Workload;
use pipebd_core::{BlockSpec, Teacher};
use pipebd_kernels::encoder::{top_indices, EncoderLayer, NeuronStatistics};
use pipebd_kernels::FusedBackend;
use pipebd_students::{Candidate, EncoderInit, StudentBlock, StudentBlockConfig};
use pipebd_teachers::blocks::{minilm_blocks, minilm_specs};
use pipebd_teachers::minilm::{Embeddings, MiniLm, MiniLmTokenizer};
use pipebd_teachers::TeacherBlock;

use crate::init::{blocks_from_teacher, init_from_layers, Calibrated, Cpu, PrunedFrom};
use crate::options::{
    config_block_error, grouped_layers, max_tokens, tokenizer_path, with_block_loss, DataOptions,
};
use crate::text::{brown_splits, tokenize, ProbeData, SentenceEmbeddings, TextDataset};
use crate::Lift;

/// `teacher.kind` of MiniLM (all-MiniLM-L6-v2).
pub(crate) const KIND: &str = "minilm-l6";

/// MiniLM's layers per block: `teacher.layers_per_block`, or one each.
pub(crate) fn layers_per_block(config: &RunConfig) -> Result<Vec<usize>> {
    grouped_layers(config, pipebd_teachers::minilm::LAYERS)
}

/// Loads MiniLM and cuts it into the configured blocks; returns the frozen
/// embeddings (input preparation) with the teacher.
pub fn build_minilm<B: FusedBackend>(
    config: &RunConfig,
    device: &B::Device,
) -> Result<(Embeddings<B>, Teacher<B, TeacherBlock<B>>)> {
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

/// MiniLM's block specs, without its weights file.
pub(crate) fn specs(config: &RunConfig) -> Result<Vec<BlockSpec>> {
    with_block_loss(config, minilm_specs(&layers_per_block(config)?, max_tokens(config)?))
}

/// MiniLM's workload: Brown sentences by its tokenizer, its embeddings in
/// front of the first block, sentence-embedding cosine and the probe (the
/// held-out and probe data skipped with `with_evaluation = false`).
pub(crate) fn load_workload<B: FusedBackend>(
    config: &RunConfig,
    device: &B::Device,
    with_evaluation: bool,
) -> Result<Workload<B, TeacherBlock<B>>> {
    let data = &config.data;
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

/// Fails unless student `k` (zero-based), if it is an `encoder` with
/// `init = "teacher"`, fits inside the teacher layer it is pruned from.
pub(crate) fn check_teacher_init(k: usize, student: &StudentBlockConfig) -> Result<()> {
    let StudentBlockConfig::Encoder { heads, head_dim, ffn, init: EncoderInit::Teacher } = *student else {
        return Ok(());
    };
    let size = pipebd_teachers::minilm::layer_config();
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

/// Sentences whose activations rank the teacher's feed-forward neurons and
/// refit the pruned output projection (about 7k real tokens at 32 tokens).
const CALIBRATION_SENTENCES: usize = 256;
/// Ridge of the output projection's refit, relative to the mean diagonal
/// of the Gram matrix.
const REFIT_RIDGE: f64 = 1e-3;

/// Replaces the `encoder` students with `init = "teacher"` by the first
/// teacher layer of their block, pruned to their size: the heads with the
/// largest weights and the feed-forward neurons that move the residual
/// stream most on the first training sentences are kept
/// ([`crate::init`]'s loop over [`EncoderLayer`]s).
pub(crate) fn init_from_teacher(
    config: &RunConfig,
    students: &[StudentBlockConfig],
    blocks: &mut [StudentBlock<Cpu>],
) -> Result<()> {
    let wanted =
        |c: &StudentBlockConfig| matches!(c, StudentBlockConfig::Encoder { init: EncoderInit::Teacher, .. });
    let needed = blocks_from_teacher(config, students, wanted);
    if needed.is_empty() {
        return Ok(());
    }
    let device = Default::default();
    let (embeddings, layers) = MiniLm::<Cpu>::load(&config.teacher.weights, &device).lift()?.into_parts();
    let groups = layers_per_block(config)?;
    let first_layer = |k: usize| groups[..k.min(groups.len())].iter().sum::<usize>();
    // The calibration batch entering the first teacher layer.
    let tokenizer = MiniLmTokenizer::load(&tokenizer_path(config)?).lift()?;
    let (sentences, _) = brown_splits(&config.data.dir, Some(CALIBRATION_SENTENCES), Some(0))?;
    let max_tokens = max_tokens(config)?;
    let ids = tokenize(&tokenizer, &sentences, max_tokens)?;
    let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
    let (hidden, mask) = crate::text::embed_batch(&embeddings, &refs, max_tokens, &device).into_tokens(0)?;
    let teacher = Calibrated { layers: &layers, hidden, mask, teacher: "MiniLM" };
    init_from_layers(teacher, &needed, &first_layer, students, blocks)
}

/// MiniLM's layers prune to `encoder` students: the calibration ranks the
/// feed-forward neurons and keeps their mean activations (to compensate
/// the pruned ones); a student smaller than the layer gets its output
/// projection refitted by least squares (kept as compensated if the system
/// is singular).
impl PrunedFrom for EncoderLayer<Cpu> {
    type Calibration = NeuronStatistics;
    type Student = EncoderLayer<Cpu>;

    fn calibrate(&self, hidden: &Tensor<Cpu, 3>, mask: &Tensor<Cpu, 2>) -> NeuronStatistics {
        self.neuron_statistics(hidden.clone(), mask.clone())
    }

    fn prune(
        &self,
        k: usize,
        config: &StudentBlockConfig,
        statistics: &NeuronStatistics,
        hidden: &Tensor<Cpu, 3>,
        mask: &Tensor<Cpu, 2>,
    ) -> Result<Option<Self>> {
        let StudentBlockConfig::Encoder { heads, ffn, init: EncoderInit::Teacher, .. } = *config else {
            return Ok(None);
        };
        check_teacher_init(k, config)?;
        let size = self.config();
        let kept_heads = top_indices(&self.head_importance(), heads);
        let kept_neurons = top_indices(&statistics.importance, ffn);
        let mut pruned = self.pruned_compensated(&kept_heads, &kept_neurons, &statistics.mean_activation);
        // Nothing pruned: the teacher layer itself.
        if heads < size.heads || ffn < size.ffn {
            pruned.refit_ffn_out(self, hidden.clone(), mask.clone(), REFIT_RIDGE);
        }
        Ok(Some(pruned))
    }

    fn next(
        &self,
        _: Option<NeuronStatistics>,
        hidden: Tensor<Cpu, 3>,
        mask: &Tensor<Cpu, 2>,
    ) -> Tensor<Cpu, 3> {
        self.forward(hidden, mask.clone())
    }

    fn block(student: Self) -> StudentBlock<Cpu> {
        StudentBlock::Encoder(student)
    }

    fn candidate(student: Self) -> Candidate<Cpu> {
        Candidate::Encoder(student)
    }
}

/// MiniLM's files: the Brown corpus' file list, the probe's folder,
/// MiniLM's safetensors header and its tokenizer.
pub(crate) fn check_inputs(config: &RunConfig) -> Result<()> {
    crate::text::brown_files(&config.data.dir)?;
    if let Some(probe) = &DataOptions::of(config)?.probe {
        if !probe.dir.is_dir() {
            return Err(pipe_bd::data::data_error(
                &probe.dir,
                "folder not found (run scripts/setup-data.sh, or fix `data.probe.dir` in the config)",
            ));
        }
    }
    check_safetensors_header(&config.teacher.weights)?;
    MiniLmTokenizer::load(&tokenizer_path(config)?).lift()?;
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
