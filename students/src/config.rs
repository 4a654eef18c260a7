//! The configuration schema of a student block: [`StudentBlockConfig`] (one
//! entry of the `[[students]]` list of a run config, serde) with its option
//! enums and defaults, and the checks of its sizes ([`MAX_SIZE`],
//! [`MAX_PRODUCT`]) made before anything is allocated.

use pipebd_kernels::decoder::{DecoderLayerConfig, SMOLLM2_135M_LAYER};
use pipebd_kernels::encoder::MINILM_L6_LAYER;
use serde::{Deserialize, Serialize};

/// Configuration of one student block, as written in `[[students]]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum StudentBlockConfig {
    /// `conv 3x3 (c_in -> width) -> ReLU -> conv 1x1 (width -> out) -> ReLU [-> max-pool 2]`.
    Conv {
        /// Channels of the hidden 3x3 convolution.
        width: usize,
        /// Output channels (must equal the teacher block's).
        out_channels: usize,
        /// How height and width are halved: `pool` (2x2 max-pool at the end,
        /// default), `stride` (the 3x3 convolution has stride 2: about 4x
        /// cheaper) or `none` (keep the resolution).
        #[serde(default)]
        downsample: Downsample,
    },
    /// `depthwise 3x3 -> [ReLU] -> pointwise 1x1 (c_in -> out) -> ReLU [-> max-pool 2]`.
    Separable {
        /// Output channels (must equal the teacher block's).
        out_channels: usize,
        /// Channel multiplier of the depthwise convolution (default 1).
        #[serde(default = "default_one")]
        depth_multiplier: usize,
        /// ReLU between the depthwise and the pointwise convolution (default false:
        /// the pair is then a factorisation of one 3x3 convolution).
        #[serde(default)]
        inner_relu: bool,
        /// How height and width are halved: `pool` (2x2 max-pool at the end,
        /// default), `stride` (the 3x3 convolution has stride 2: about 4x
        /// cheaper) or `none` (keep the resolution).
        #[serde(default)]
        downsample: Downsample,
    },
    /// A Tucker-style bottleneck: `1x1 (c_in -> rank) -> 3x3 (rank -> rank) ->
    /// 1x1 (rank -> out) -> ReLU [-> max-pool 2]`, with optional ReLUs inside.
    Bottleneck {
        /// Channels of the inner 3x3 convolution.
        rank: usize,
        /// Output channels (must equal the teacher block's).
        out_channels: usize,
        /// ReLU after each inner convolution (default false: the three
        /// convolutions then factorise one 3x3 convolution).
        #[serde(default)]
        inner_relu: bool,
        /// How height and width are halved: `pool` (2x2 max-pool at the end,
        /// default), `stride` (the 3x3 convolution has stride 2: about 4x
        /// cheaper) or `none` (keep the resolution).
        #[serde(default)]
        downsample: Downsample,
    },
    /// MobileNetV2's inverted residual: `1x1 (c_in -> c_in * expansion) ->
    /// ReLU6 -> depthwise k x k -> ReLU6 -> 1x1 (-> out)` with no activation
    /// after the projection [-> max-pool 2], plus the input when no
    /// downsampling and `c_in == out`.
    Inverted {
        /// Width of the hidden layer as a multiple of the input channels
        /// (MobileNetV2: 6; 3 is cheaper).
        expansion: usize,
        /// Side of the depthwise kernel: 3 (default) or 5.
        #[serde(default = "default_kernel")]
        kernel: usize,
        /// Output channels (must equal the teacher block's).
        out_channels: usize,
        /// How height and width are halved: `pool` (2x2 max-pool at the end,
        /// default), `stride` (the depthwise convolution has stride 2) or
        /// `none` (keep the resolution).
        #[serde(default)]
        downsample: Downsample,
    },
    /// `flatten -> linear (in -> hidden) -> ReLU -> linear (hidden -> classes)`.
    Head {
        /// Width of the hidden layer.
        hidden: usize,
        /// Number of output logits (must equal the teacher's).
        classes: usize,
    },
    /// The identity: no parameters, no FLOPs (only where the teacher block
    /// keeps its input's shape, e.g. a transformer layer). As a candidate it
    /// asks whether the teacher block can be dropped.
    Skip,
    /// Several candidate students for this teacher block, trained at once on
    /// every batch (blockwise architecture search, the `all` mode): each
    /// candidate's own loss against the teacher block, summed for one
    /// backward pass, so every candidate gets exactly its own gradient and
    /// its own optimizer state. The block's output (stitching, evaluation) is
    /// its first candidate's; `pipebd search` picks one afterwards.
    Candidates {
        /// The candidates, in order: ordinary student tables (not `candidates`).
        candidates: Vec<StudentBlockConfig>,
    },
    /// A pre-norm Llama decoder layer: grouped-query causal attention with
    /// rotary positions (or a per-token linear map, or nothing), then a
    /// SwiGLU feed-forward (or nothing), each with a residual. Input and
    /// output are `[tokens, hidden]`. Defaults are SmolLM2-135M's layer.
    Decoder {
        /// What mixes the tokens: `attention` (default), `linear` (a
        /// `[hidden, hidden]` map of each token, no mixing) or `none`.
        #[serde(default)]
        mixer: DecoderMixer,
        /// Query heads (default 9).
        #[serde(default = "default_decoder_heads")]
        heads: usize,
        /// Key/value heads (default 3); `heads` must be a multiple.
        #[serde(default = "default_kv_heads")]
        kv_heads: usize,
        /// Width of each head (default 64).
        #[serde(default = "default_decoder_head_dim")]
        head_dim: usize,
        /// Feed-forward width (default 1536; 0 removes the feed-forward).
        #[serde(default = "default_decoder_ffn")]
        ffn: usize,
        /// Base of the rotary angles (default 100000).
        #[serde(default = "default_rope_base")]
        rope_base: f64,
        /// RMSNorm epsilon (default 1e-5).
        #[serde(default = "default_rms_eps")]
        eps: f64,
        /// Initial weights: `teacher` (default): the first teacher layer of
        /// the block, pruned to the student's size (the strongest key/value
        /// groups and query heads, the feed-forward neurons that move the
        /// residual stream most; a linear mixer starts at zero); or `random`.
        #[serde(default)]
        init: EncoderInit,
    },
    /// A post-LN transformer encoder layer: multi-head attention over the
    /// real tokens, then `GELU` feed-forward, each with a residual and a
    /// layer norm. Input and output are `[tokens, hidden]`.
    Encoder {
        /// Attention heads (default 12, as MiniLM).
        #[serde(default = "default_heads")]
        heads: usize,
        /// Width of each head (default 32, as MiniLM: fewer heads then mean
        /// a narrower, cheaper attention).
        #[serde(default = "default_head_dim")]
        head_dim: usize,
        /// Width of the feed-forward layer (MiniLM's is 1536).
        ffn: usize,
        /// Initial weights: `random`, or `teacher` (default): the first
        /// teacher layer this block replaces, pruned to the student's size by
        /// keeping its most important heads and feed-forward neurons.
        #[serde(default)]
        init: EncoderInit,
    },
}

/// How an `encoder` student block gets its initial weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EncoderInit {
    /// Pruned from the teacher layer it replaces (the first, if several).
    #[default]
    Teacher,
    /// burn's default random initialisation.
    Random,
}

/// The token mixer of a `decoder` student block: the decoder layer's own
/// [`MixerKind`](pipebd_kernels::decoder::MixerKind) (one enum for the layer
/// and its config).
pub use pipebd_kernels::decoder::MixerKind as DecoderMixer;

// A student keeps its teacher's layer sizes unless told otherwise (the
// layers' sizes have one owner, pipebd-kernels).
fn default_decoder_heads() -> usize {
    SMOLLM2_135M_LAYER.heads
}

fn default_kv_heads() -> usize {
    SMOLLM2_135M_LAYER.kv_heads
}

fn default_decoder_head_dim() -> usize {
    SMOLLM2_135M_LAYER.head_dim
}

fn default_decoder_ffn() -> usize {
    SMOLLM2_135M_LAYER.ffn
}

fn default_rope_base() -> f64 {
    SMOLLM2_135M_LAYER.rope_base
}

fn default_rms_eps() -> f64 {
    SMOLLM2_135M_LAYER.eps
}

fn default_heads() -> usize {
    MINILM_L6_LAYER[1]
}

fn default_head_dim() -> usize {
    MINILM_L6_LAYER[2]
}

/// How a conv student halves its input's height and width.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Downsample {
    /// A 2x2 max-pool after the block, like the teacher's stages.
    #[default]
    Pool,
    /// Stride 2 in the block's 3x3 convolution (output `floor(h/2) x floor(w/2)`).
    Stride,
    /// Keep the resolution.
    None,
}

impl Downsample {
    /// Output height and width for an `h x w` input.
    pub fn output(self, h: usize, w: usize) -> (usize, usize) {
        match self {
            Downsample::Pool | Downsample::Stride => (h / 2, w / 2),
            Downsample::None => (h, w),
        }
    }
}

fn default_one() -> usize {
    1
}

fn default_kernel() -> usize {
    3
}

impl StudentBlockConfig {
    /// The kind name as written in TOML.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Conv { .. } => "conv",
            Self::Separable { .. } => "separable",
            Self::Bottleneck { .. } => "bottleneck",
            Self::Inverted { .. } => "inverted",
            Self::Head { .. } => "head",
            Self::Encoder { .. } => "encoder",
            Self::Decoder { .. } => "decoder",
            Self::Skip => "skip",
            Self::Candidates { .. } => "candidates",
        }
    }

    /// The candidates of a `candidates` block; empty for any other kind.
    pub fn candidates(&self) -> &[StudentBlockConfig] {
        match self {
            Self::Candidates { candidates } => candidates,
            _ => &[],
        }
    }

    /// The layer sizes of a `decoder` block on a residual stream of width
    /// `hidden`; `None` for any other kind.
    pub fn decoder_config(&self, hidden: usize) -> Option<DecoderLayerConfig> {
        let Self::Decoder { mixer, heads, kv_heads, head_dim, ffn, rope_base, eps, .. } = *self else {
            return None;
        };
        let attention = mixer == DecoderMixer::Attention;
        Some(DecoderLayerConfig {
            hidden,
            mixer,
            heads: if attention { heads } else { 0 },
            kv_heads: if attention { kv_heads } else { 0 },
            head_dim,
            ffn,
            rope_base,
            eps,
        })
    }

    /// Checks that every size of the block is at least 1 and at most
    /// [`MAX_SIZE`], that no two of them multiply past [`MAX_PRODUCT`] (a
    /// typo must be refused, not allocated), and that the kernel side is one
    /// the zoo has.
    pub(crate) fn check_sizes(&self) -> Result<(), String> {
        if let Self::Decoder { rope_base, eps, heads, kv_heads, head_dim, ffn, .. } = *self {
            if !(rope_base > 0.0 && eps > 0.0) {
                return Err(format!("`rope_base` and `eps` must be positive, got {rope_base} and {eps}"));
            }
            let sizes = [("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim), ("ffn", ffn)];
            check_bounds(&sizes)?;
            // The width does not matter to these checks.
            return self.decoder_config(1).map_or(Ok(()), |config| config.validate());
        }
        let sizes: &[(&str, usize)] = match *self {
            Self::Conv { width, out_channels, .. } => &[("width", width), ("out_channels", out_channels)],
            Self::Separable { out_channels, depth_multiplier, .. } => {
                &[("out_channels", out_channels), ("depth_multiplier", depth_multiplier)]
            }
            Self::Bottleneck { rank, out_channels, .. } => &[("rank", rank), ("out_channels", out_channels)],
            Self::Inverted { expansion, kernel, out_channels, .. } => {
                if kernel != 3 && kernel != 5 {
                    return Err(format!("`kernel` must be 3 or 5, got {kernel}"));
                }
                &[("expansion", expansion), ("out_channels", out_channels)]
            }
            Self::Head { hidden, classes } => &[("hidden", hidden), ("classes", classes)],
            Self::Encoder { heads, head_dim, ffn, .. } => {
                &[("heads", heads), ("head_dim", head_dim), ("ffn", ffn)]
            }
            Self::Decoder { .. } | Self::Skip | Self::Candidates { .. } => &[],
        };
        match sizes.iter().find(|(_, value)| *value == 0) {
            Some((name, _)) => Err(format!("`{name}` must be at least 1")),
            None => check_bounds(sizes),
        }
    }
}

/// The largest size a student block's field may have (channels, neurons,
/// heads, classes, ...): far above any block here, far below what would
/// not fit in memory.
pub const MAX_SIZE: usize = 1 << 16;

/// The largest product of two of a block's sizes (e.g. `width` x
/// `out_channels`, `heads` x `head_dim`): bounds each weight tensor to a
/// few hundred MB whatever the input's channels.
pub const MAX_PRODUCT: usize = 1 << 24;

/// Refuses sizes past [`MAX_SIZE`] and pairs past [`MAX_PRODUCT`].
fn check_bounds(sizes: &[(&str, usize)]) -> Result<(), String> {
    if let Some((name, value)) = sizes.iter().find(|(_, v)| *v > MAX_SIZE) {
        return Err(format!("`{name}` = {value} is larger than {MAX_SIZE}, the most a block may have"));
    }
    for (i, (a, x)) in sizes.iter().enumerate() {
        for (b, y) in &sizes[i + 1..] {
            if x * y > MAX_PRODUCT {
                return Err(format!(
                    "`{a}` x `{b}` = {x} x {y} is larger than {MAX_PRODUCT}: a block this size would not fit in memory"
                ));
            }
        }
    }
    Ok(())
}
