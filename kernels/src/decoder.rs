//! A Llama-style (pre-norm) decoder layer: RMSNorm, rotary positions,
//! grouped-query causal attention and a SwiGLU feed-forward.
//!
//! The teacher (SmolLM2-135M's 30 layers) and its students (fewer heads, a
//! narrower feed-forward, attention replaced by a linear map or removed, the
//! feed-forward removed) share this module, so it lives at the bottom of the
//! dependency graph like [`crate::encoder`]. Projections run through
//! [`linear`] (the fused matmul of each backend); the norms, the attention
//! and SwiGLU's gated product through the decoder ops of [`crate::llama`]
//! (one pass each, forward and backward, on the CPU).
//!
//! ```text
//! h   = x + Wo · CausalAttention(RoPE(Wq·n1(x)), RoPE(Wk·n1(x)), Wv·n1(x), mask)
//! out = h + Wdown · (SiLU(Wgate·n2(h)) * Wup·n2(h))          n = RMSNorm
//! ```
//!
//! Rotary positions rotate adjacent pairs `(x[2i], x[2i+1])` by
//! `pos * base^(-2i/head_dim)`: llama.cpp's layout, in which GGUF files store
//! the query and key rows (its converter permutes Hugging Face's halves into
//! pairs), so GGUF weights load unchanged.

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig, RmsNorm, RmsNormConfig};
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorData};

use crate::encoder::{ridge_shift, ridge_solve};
use crate::llama::{causal_attention, rms_norm, swiglu, CausalHeads};
use crate::{linear, Epilogue, FusedBackend};

/// The `[n, m]` weights `W` that minimise `|F W - T|^2 + s |W - prior|^2`
/// for features `F` (`[rows, n]`) and targets `T` (`[rows, m]`), with `s`
/// `ridge` times the mean diagonal of `F^T F` (in f64 on the host). `None`
/// if the system is singular even so.
fn least_squares<B: FusedBackend>(
    features: Tensor<B, 2>,
    target: Tensor<B, 2>,
    prior: Tensor<B, 2>,
    ridge: f64,
) -> Option<Tensor<B, 2>> {
    let [_, n] = features.dims();
    let [_, m] = target.dims();
    let to_f64 = |t: Tensor<B, 2>| t.into_data().iter::<f32>().map(f64::from).collect::<Vec<_>>();
    let gram = to_f64(features.clone().transpose().matmul(features.clone()));
    let shift = ridge_shift(&gram, n, ridge);
    let rhs: Vec<f64> = to_f64(features.transpose().matmul(target))
        .into_iter()
        .zip(to_f64(prior.clone()))
        .map(|(r, p)| r + shift * p)
        .collect();
    let solution = ridge_solve(&gram, &rhs, n, m, ridge)?;
    let values: Vec<f32> = solution.iter().map(|&v| v as f32).collect();
    if values.iter().any(|v| !v.is_finite()) {
        return None;
    }
    Some(Tensor::from_data(TensorData::new(values, [n, m]), &prior.device()))
}

/// Refits `projection`'s weight by [`least_squares`] (toward the current
/// one) so that `features` (`[rows, in]`) map to `target` (`[rows, out]`);
/// a bias stays as it is and is taken off the target. Whether the weight
/// was refitted.
fn refit_projection<B: FusedBackend>(
    projection: &mut Linear<B>,
    features: Tensor<B, 2>,
    target: Tensor<B, 2>,
    ridge: f64,
) -> bool {
    let target = match &projection.bias {
        Some(bias) => target - bias.val().unsqueeze_dim::<2>(0),
        None => target,
    };
    match least_squares(features, target, projection.weight.val(), ridge) {
        Some(weight) => {
            projection.weight = Param::from_tensor(weight);
            true
        }
        None => false,
    }
}

/// A teacher layer's states on the real tokens of a calibration batch, the
/// targets of [`DecoderLayer::refit`] (from [`DecoderLayer::refit_targets`]).
#[derive(Debug, Clone)]
pub struct RefitTargets<B: FusedBackend> {
    /// The residual stream after the attention half, `[real tokens, hidden]`.
    pub middle: Tensor<B, 2>,
    /// The layer's output, `[real tokens, hidden]`.
    pub output: Tensor<B, 2>,
    /// The layer's output as [`DecoderLayer::forward`] gives it, `[batch,
    /// tokens, hidden]`: the next layer's input.
    pub next: Tensor<B, 3>,
}

/// SmolLM2-135M's decoder layer (what its GGUF file says): the built-in
/// teacher's layers, and the sizes a `decoder` student keeps unless its
/// config says otherwise. One owner for both.
pub const SMOLLM2_135M_LAYER: DecoderLayerConfig = DecoderLayerConfig {
    hidden: 576,
    mixer: MixerKind::Attention,
    heads: 9,
    kv_heads: 3,
    head_dim: 64,
    ffn: 1536,
    rope_base: 100_000.0,
    // Stored as an f32 in the file.
    eps: 1e-5_f32 as f64,
};

/// Sizes of one decoder layer. A removed attention or feed-forward has 0
/// heads or 0 width.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecoderLayerConfig {
    /// Width of the residual stream (576 for SmolLM2-135M).
    pub hidden: usize,
    /// What mixes the tokens.
    pub mixer: MixerKind,
    /// Query heads (attention only).
    pub heads: usize,
    /// Key/value heads, each shared by `heads / kv_heads` query heads.
    pub kv_heads: usize,
    /// Width of each head.
    pub head_dim: usize,
    /// Feed-forward width (0: no feed-forward).
    pub ffn: usize,
    /// Base of the rotary position angles.
    pub rope_base: f64,
    /// RMSNorm epsilon.
    pub eps: f64,
}

/// The token mixer of a decoder layer; in a config (a `decoder` student's
/// `mixer`), `"attention"`, `"linear"` or `"none"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, burn::serde::Serialize, burn::serde::Deserialize)]
#[serde(crate = "burn::serde", rename_all = "kebab-case")]
pub enum MixerKind {
    /// Grouped-query causal self-attention.
    #[default]
    Attention,
    /// A linear map of each token's normalised state (Puzzle's "linear
    /// replacement" of attention: no mixing across tokens).
    Linear,
    /// No attention sublayer at all.
    None,
}

impl DecoderLayerConfig {
    /// Builds a randomly initialised layer (burn's default initialisers).
    pub fn init<B: FusedBackend>(&self, device: &B::Device) -> DecoderLayer<B> {
        let norm = || RmsNormConfig::new(self.hidden).with_epsilon(self.eps).init(device);
        let plain = |inputs, outputs| LinearConfig::new(inputs, outputs).with_bias(false).init(device);
        let inner = self.heads * self.head_dim;
        let kv_inner = self.kv_heads * self.head_dim;
        let mixer = match self.mixer {
            MixerKind::None => None,
            MixerKind::Linear => Some(Mixer::Linear(plain(self.hidden, self.hidden))),
            MixerKind::Attention => Some(Mixer::Attention(CausalAttention {
                query: plain(self.hidden, inner),
                key: plain(self.hidden, kv_inner),
                value: plain(self.hidden, kv_inner),
                output: plain(inner, self.hidden),
                heads: self.heads,
                kv_heads: self.kv_heads,
                head_dim: self.head_dim,
                rope_base: self.rope_base,
            })),
        };
        DecoderLayer {
            attention: mixer.map(|mixer| AttentionSublayer { norm: norm(), mixer }),
            ffn: (self.ffn > 0).then(|| SwiGlu {
                norm: norm(),
                gate: plain(self.hidden, self.ffn),
                up: plain(self.hidden, self.ffn),
                down: plain(self.ffn, self.hidden),
            }),
        }
    }

    /// Whether the sizes make a layer: heads a multiple of the key/value
    /// heads, widths positive, something left of the layer. `Err` says what
    /// is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if self.hidden == 0 {
            return Err("hidden must be positive".into());
        }
        if self.mixer == MixerKind::Attention {
            if self.heads == 0 || self.kv_heads == 0 || self.head_dim == 0 {
                return Err(format!(
                    "attention needs heads, kv_heads and head_dim >= 1, got {}, {}, {}",
                    self.heads, self.kv_heads, self.head_dim
                ));
            }
            if self.heads % self.kv_heads != 0 {
                return Err(format!(
                    "heads ({}) must be a multiple of kv_heads ({}): each key/value head serves a group",
                    self.heads, self.kv_heads
                ));
            }
            if self.head_dim % 2 != 0 {
                return Err(format!("head_dim must be even for rotary positions, got {}", self.head_dim));
            }
        }
        if self.mixer == MixerKind::None && self.ffn == 0 {
            return Err("a layer without attention and feed-forward is the identity: use `skip`".into());
        }
        Ok(())
    }

    /// Forward FLOPs of one layer for one sequence of `tokens` tokens (two
    /// per multiply-accumulate; every query scored against every key, as a
    /// dense causal kernel computes it; norms, softmax and SiLU not counted).
    pub fn flops(&self, tokens: usize) -> u64 {
        let (t, h) = (tokens as u64, self.hidden as u64);
        let mixer = match self.mixer {
            MixerKind::None => 0,
            MixerKind::Linear => 2 * t * h * h,
            MixerKind::Attention => {
                let (q, kv) = ((self.heads * self.head_dim) as u64, (self.kv_heads * self.head_dim) as u64);
                2 * t * (h * q + 2 * h * kv + q * h) + 2 * 2 * t * t * q
            }
        };
        mixer + 2 * t * 3 * h * self.ffn as u64
    }

    /// Trainable parameters of one layer.
    pub fn params(&self) -> usize {
        let h = self.hidden;
        let mixer = match self.mixer {
            MixerKind::None => 0,
            MixerKind::Linear => h * h + h,
            MixerKind::Attention => {
                let (q, kv) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
                2 * h * q + 2 * h * kv + h
            }
        };
        let ffn = if self.ffn > 0 { 3 * h * self.ffn + h } else { 0 };
        mixer + ffn
    }
}

/// Grouped-query causal self-attention with rotary positions (no biases).
#[derive(Module, Debug)]
pub struct CausalAttention<B: FusedBackend> {
    /// Query projection `[hidden, heads * head_dim]`.
    pub query: Linear<B>,
    /// Key projection `[hidden, kv_heads * head_dim]`.
    pub key: Linear<B>,
    /// Value projection `[hidden, kv_heads * head_dim]`.
    pub value: Linear<B>,
    /// Output projection `[heads * head_dim, hidden]`.
    pub output: Linear<B>,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of each head.
    pub head_dim: usize,
    /// Base of the rotary angles.
    pub rope_base: f64,
}

/// The token mixer of a decoder layer.
#[derive(Module, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Mixer<B: FusedBackend> {
    /// Causal self-attention.
    Attention(CausalAttention<B>),
    /// A per-token linear map `[hidden, hidden]`.
    Linear(Linear<B>),
}

/// The attention half of a layer: its norm and its mixer.
#[derive(Module, Debug)]
pub struct AttentionSublayer<B: FusedBackend> {
    /// RMSNorm before the mixer.
    pub norm: RmsNorm<B>,
    /// The mixer.
    pub mixer: Mixer<B>,
}

/// The feed-forward half of a layer: RMSNorm, then SwiGLU.
#[derive(Module, Debug)]
pub struct SwiGlu<B: FusedBackend> {
    /// RMSNorm before the feed-forward.
    pub norm: RmsNorm<B>,
    /// Gate projection `[hidden, ffn]` (SiLU after it).
    pub gate: Linear<B>,
    /// Up projection `[hidden, ffn]`.
    pub up: Linear<B>,
    /// Down projection `[ffn, hidden]`.
    pub down: Linear<B>,
}

/// One pre-norm decoder layer; either half may be absent (a pruned student).
#[derive(Module, Debug)]
pub struct DecoderLayer<B: FusedBackend> {
    /// The attention half (`None`: removed).
    pub attention: Option<AttentionSublayer<B>>,
    /// The feed-forward half (`None`: removed).
    pub ffn: Option<SwiGlu<B>>,
}

fn project<B: FusedBackend>(layer: &Linear<B>, x: Tensor<B, 2>) -> Tensor<B, 2> {
    linear(x, layer.weight.val(), layer.bias.as_ref().map(|b| b.val()), Epilogue::Identity)
}

/// Where the rows a layer computes sit in the `[batch, tokens]` grid of
/// its input: every position, or the real tokens only. A padding token's
/// state reaches no real token (causal attention never reads it) and no
/// loss (they count real tokens only), so the token-wise products (the
/// projections, norms and SwiGLU: nearly all the work) may leave the
/// padding out; only the attention needs the grid.
struct TokenGrid<B: FusedBackend> {
    batch: usize,
    tokens: usize,
    /// `[batch, tokens]`, 1 for real tokens.
    mask: Tensor<B, 2>,
    /// The real tokens' rows of `[batch * tokens]`, in order, when only
    /// they are computed.
    real: Option<Tensor<B, 1, Int>>,
}

impl<B: FusedBackend> TokenGrid<B> {
    /// Every position is computed.
    fn dense(mask: Tensor<B, 2>) -> Self {
        let [batch, tokens] = mask.dims();
        Self { batch, tokens, mask, real: None }
    }

    /// The real tokens only, where that saves work: on a device that runs
    /// behind the host, reading the mask back would stall it, and a batch
    /// without padding (or without real tokens) gains nothing.
    fn real_tokens(mask: Tensor<B, 2>) -> Self {
        match B::ASYNC_DEVICE {
            true => Self::dense(mask),
            false => Self::gathered(mask),
        }
    }

    /// The real tokens only, on any device (every position when there is
    /// no padding, or no real token).
    fn gathered(mask: Tensor<B, 2>) -> Self {
        let dense = Self::dense(mask);
        let real: Vec<i64> = dense
            .mask
            .to_data()
            .iter::<f32>()
            .enumerate()
            .filter(|(_, m)| *m > 0.5)
            .map(|(row, _)| row as i64)
            .collect();
        let all = dense.batch * dense.tokens;
        if real.is_empty() || real.len() == all {
            return dense;
        }
        let count = real.len();
        let index = Tensor::from_data(TensorData::new(real, [count]), &dense.mask.device());
        Self { real: Some(index), ..dense }
    }

    /// The computed rows of `all` (`[batch * tokens, width]`).
    fn gather(&self, all: Tensor<B, 2>) -> Tensor<B, 2> {
        match &self.real {
            Some(index) => all.select(0, index.clone()),
            None => all,
        }
    }

    /// `all` (`[batch * tokens, width]`) with its computed rows, `before`,
    /// replaced by `after` (the other rows as they were).
    fn update(&self, all: Tensor<B, 2>, before: Tensor<B, 2>, after: Tensor<B, 2>) -> Tensor<B, 2> {
        match &self.real {
            Some(index) => all.select_assign(0, index.clone(), after - before, IndexingUpdateOp::Add),
            None => after,
        }
    }

    /// Computed rows back in the grid, `[batch, tokens, width]` (zeros
    /// where a row was left out).
    fn to_grid(&self, rows: Tensor<B, 2>) -> Tensor<B, 3> {
        let [_, width] = rows.dims();
        let all =
            match &self.real {
                Some(index) => Tensor::zeros([self.batch * self.tokens, width], &rows.device())
                    .select_assign(0, index.clone(), rows, IndexingUpdateOp::Add),
                None => rows,
            };
        all.reshape([self.batch, self.tokens, width])
    }
}

impl<B: FusedBackend> DecoderLayer<B> {
    /// `[batch, tokens, hidden]` with a `[batch, tokens]` mask (1 for real
    /// tokens, 0 for padding) to `[batch, tokens, hidden]`. Each token
    /// attends to the real tokens up to itself. Only the real tokens are
    /// computed (on a device that runs with the host): a padding position
    /// leaves the layer as it entered.
    pub fn forward(&self, x: Tensor<B, 3>, mask: Tensor<B, 2>) -> Tensor<B, 3> {
        let [batch, tokens, hidden] = x.dims();
        let grid = TokenGrid::real_tokens(mask);
        let all = x.reshape([batch * tokens, hidden]);
        let rows = grid.gather(all.clone());
        let out = self.rows_after_feed_forward(self.rows_after_attention(rows.clone(), &grid));
        grid.update(all, rows, out).reshape([batch, tokens, hidden])
    }

    /// The feed-forward's hidden activations `SiLU(gate) * up` on the real
    /// tokens of `x` (`[real tokens, ffn]`): what ranks its neurons. `None`
    /// without a feed-forward.
    pub fn ffn_activations(&self, x: Tensor<B, 3>, mask: Tensor<B, 2>) -> Option<Tensor<B, 2>> {
        let ffn = self.ffn.as_ref()?;
        Some(ffn.activations(self.after_attention(x, &TokenGrid::gathered(mask))))
    }

    /// What this (teacher) layer makes of the real tokens of the
    /// calibration batch `x`, in one forward pass: the targets of
    /// [`Self::refit`].
    pub fn refit_targets(&self, x: Tensor<B, 3>, mask: Tensor<B, 2>) -> RefitTargets<B> {
        let [batch, tokens, hidden] = x.dims();
        let grid = TokenGrid::gathered(mask);
        let all = x.reshape([batch * tokens, hidden]);
        let rows = grid.gather(all.clone());
        let middle = self.rows_after_attention(rows.clone(), &grid);
        let output = self.rows_after_feed_forward(middle.clone());
        let next = grid.update(all, rows, output.clone()).reshape([batch, tokens, hidden]);
        RefitTargets { middle, output, next }
    }

    /// Refits this (pruned) layer to its teacher layer by ridge least
    /// squares on the real tokens of the calibration batch `x` (the teacher
    /// layer's input; `teacher` its [`Self::refit_targets`] on `x`): first
    /// the mixer's output projection (attention's `Wo`, or a linear mixer's
    /// map) to what the teacher's attention adds to the residual stream (to
    /// all the teacher layer adds, if this layer has no feed-forward), then
    /// the feed-forward's down projection to what the teacher layer's
    /// output still lacks after this layer's own mixer. The ridge (`ridge`
    /// times the mean diagonal of each Gram matrix) pulls toward the
    /// current weights, not toward zero. Returns how many projections were
    /// refitted (a singular system leaves one as it was).
    pub fn refit(
        &mut self,
        teacher: &RefitTargets<B>,
        x: Tensor<B, 3>,
        mask: Tensor<B, 2>,
        ridge: f64,
    ) -> usize {
        let [batch, tokens, hidden] = x.dims();
        let grid = TokenGrid::gathered(mask);
        let x = grid.gather(x.reshape([batch * tokens, hidden]));
        let mut refitted = 0;
        if let Some(AttentionSublayer { norm, mixer }) = self.attention.as_mut() {
            let n = rms_norm(x.clone(), norm);
            let (features, projection) = match mixer {
                Mixer::Linear(map) => (n, map),
                Mixer::Attention(attention) => (attention.context(n, &grid), &mut attention.output),
            };
            let goal = if self.ffn.is_some() { &teacher.middle } else { &teacher.output };
            refitted += usize::from(refit_projection(projection, features, goal.clone() - x.clone(), ridge));
        }
        let h = self.rows_after_attention(x, &grid);
        if let Some(ffn) = self.ffn.as_mut() {
            let target = teacher.output.clone() - h.clone();
            let features = ffn.activations(h);
            refitted += usize::from(refit_projection(&mut ffn.down, features, target, ridge));
        }
        refitted
    }

    /// The residual stream after the attention half of the rows of `grid`.
    fn after_attention(&self, x: Tensor<B, 3>, grid: &TokenGrid<B>) -> Tensor<B, 2> {
        let [batch, tokens, hidden] = x.dims();
        self.rows_after_attention(grid.gather(x.reshape([batch * tokens, hidden])), grid)
    }

    /// The residual stream `h` (rows) after the feed-forward half (`h`
    /// without one).
    fn rows_after_feed_forward(&self, h: Tensor<B, 2>) -> Tensor<B, 2> {
        match &self.ffn {
            Some(ffn) => h.clone() + ffn.forward(h),
            None => h,
        }
    }

    /// The residual stream (the rows of `grid`) after the attention half
    /// (`x` without one).
    fn rows_after_attention(&self, x: Tensor<B, 2>, grid: &TokenGrid<B>) -> Tensor<B, 2> {
        match &self.attention {
            Some(sublayer) => x.clone() + sublayer.forward(x, grid),
            None => x,
        }
    }
}

impl<B: FusedBackend> AttentionSublayer<B> {
    fn forward(&self, x: Tensor<B, 2>, grid: &TokenGrid<B>) -> Tensor<B, 2> {
        let n = rms_norm(x, &self.norm);
        match &self.mixer {
            Mixer::Linear(map) => project(map, n),
            Mixer::Attention(attention) => project(&attention.output, attention.context(n, grid)),
        }
    }
}

impl<B: FusedBackend> SwiGlu<B> {
    fn forward(&self, h: Tensor<B, 2>) -> Tensor<B, 2> {
        project(&self.down, self.activations(h))
    }

    /// `SiLU(gate · n2(h)) * up · n2(h)` of `[rows, hidden]` states, `[rows, ffn]`.
    fn activations(&self, h: Tensor<B, 2>) -> Tensor<B, 2> {
        let n = rms_norm(h, &self.norm);
        swiglu(project(&self.gate, n.clone()), project(&self.up, n))
    }
}

impl<B: FusedBackend> CausalAttention<B> {
    /// What enters the output projection for the normalised states `n` (the
    /// rows of `grid`): the heads' weighted values, `[rows, heads * head_dim]`.
    fn context(&self, n: Tensor<B, 2>, grid: &TokenGrid<B>) -> Tensor<B, 2> {
        let layout = CausalHeads { heads: self.heads, kv_heads: self.kv_heads, rope_base: self.rope_base };
        let heads_of = |layer: &Linear<B>| grid.to_grid(project(layer, n.clone()));
        let qkv = [heads_of(&self.query), heads_of(&self.key), heads_of(&self.value)];
        let context = causal_attention(qkv, grid.mask.clone(), layout);
        grid.gather(context.reshape([grid.batch * grid.tokens, self.heads * self.head_dim]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::Distribution;

    fn config(mixer: MixerKind, heads: usize, kv_heads: usize, ffn: usize) -> DecoderLayerConfig {
        DecoderLayerConfig {
            hidden: 16,
            mixer,
            heads,
            kv_heads,
            head_dim: 4,
            ffn,
            rope_base: 10000.0,
            eps: 1e-5,
        }
    }

    #[test]
    fn tokens_see_only_the_past() {
        let device = Default::default();
        let layer = config(MixerKind::Attention, 4, 2, 24).init::<Flex>(&device);
        let x = Tensor::<Flex, 3>::random([2, 6, 16], Distribution::Normal(0.0, 1.0), &device);
        let mask = Tensor::<Flex, 2>::ones([2, 6], &device);
        let full = layer.forward(x.clone(), mask.clone());
        // Changing the last token changes no earlier output.
        let changed = Tensor::cat(
            vec![
                x.clone().narrow(1, 0, 5),
                Tensor::random([2, 1, 16], Distribution::Normal(0.0, 1.0), &device),
            ],
            1,
        );
        let again = layer.forward(changed, mask.clone());
        let before: f32 =
            (full.clone().narrow(1, 0, 5) - again.clone().narrow(1, 0, 5)).abs().max().into_scalar();
        let after: f32 = (full.narrow(1, 5, 1) - again.narrow(1, 5, 1)).abs().max().into_scalar();
        assert!(before < 1e-5, "an earlier token moved by {before}");
        assert!(after > 1e-3, "the changed token did not move ({after})");
        // A prefix run alone gives the same states as inside a padded batch.
        let short = layer.forward(x.clone().narrow(1, 0, 3), Tensor::ones([2, 3], &device));
        let padded_mask = Tensor::<Flex, 2>::from_floats([[1.0, 1.0, 1.0, 0.0, 0.0, 0.0]; 2], &device);
        let padded = layer.forward(x, padded_mask).narrow(1, 0, 3);
        let gap: f32 = (short - padded).abs().max().into_scalar();
        assert!(gap < 1e-5, "padding changed real tokens by {gap}");
    }

    #[test]
    fn leaving_the_padding_out_changes_no_real_token_nor_any_gradient() {
        type Ad = burn::backend::Autodiff<Flex>;
        let device = Default::default();
        let layer = config(MixerKind::Attention, 4, 2, 24).init::<Ad>(&device);
        let x = Tensor::<Ad, 3>::random([3, 6, 16], Distribution::Normal(0.0, 1.0), &device).require_grad();
        // Right padding, a hole, and no padding at all.
        let mask = Tensor::<Ad, 2>::from_floats(
            [[1.0, 1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0, 1.0, 0.0], [1.0; 6]],
            &device,
        );
        let packed = layer.forward(x.clone(), mask.clone());
        assert!(TokenGrid::real_tokens(mask.clone()).real.is_some(), "this batch has padding to leave out");
        let dense = layer
            .rows_after_feed_forward(layer.after_attention(x.clone(), &TokenGrid::dense(mask.clone())))
            .reshape([3, 6, 16]);
        let real = mask.clone().unsqueeze_dim::<3>(2);
        let gap: f32 = ((packed.clone() - dense.clone()) * real.clone()).abs().max().into_scalar();
        assert!(gap < 1e-5, "a real token moved by {gap}");
        // Padding positions leave the layer as they entered.
        let kept: f32 = ((packed.clone() - x.clone()) * (real.clone().neg() + 1.0)).abs().max().into_scalar();
        assert_eq!(kept, 0.0);
        // The gradients of a loss over the real tokens are the same.
        let weights = Tensor::<Ad, 3>::random([3, 6, 16], Distribution::Normal(0.0, 1.0), &device) * real;
        let grads_of = |out: Tensor<Ad, 3>| (out * weights.clone()).sum().backward();
        let (a, b) = (grads_of(packed), grads_of(dense));
        let attention = layer.attention.as_ref().unwrap();
        let Mixer::Attention(mixer) = &attention.mixer else { unreachable!() };
        let ffn = layer.ffn.as_ref().unwrap();
        let params = [
            ("query", mixer.query.weight.val()),
            ("key", mixer.key.weight.val()),
            ("output", mixer.output.weight.val()),
            ("gate", ffn.gate.weight.val()),
            ("down", ffn.down.weight.val()),
        ];
        for (name, param) in params {
            let (ga, gb) = (param.grad(&a).unwrap(), param.grad(&b).unwrap());
            let gap: f32 = (ga.clone() - gb).abs().max().into_scalar();
            let scale: f32 = ga.abs().max().into_scalar();
            assert!(gap <= 1e-5 * scale.max(1.0), "{name}: gradient gap {gap} (scale {scale})");
        }
        let gamma = attention.norm.gamma.val();
        let norm_gap: f32 = (gamma.grad(&a).unwrap() - gamma.grad(&b).unwrap()).abs().max().into_scalar();
        assert!(norm_gap < 1e-4, "attention norm: gradient gap {norm_gap}");
        let input_gap: f32 = (x.grad(&a).unwrap() - x.grad(&b).unwrap()).abs().max().into_scalar();
        assert!(input_gap < 1e-5, "input gradient gap {input_gap}");
    }

    #[test]
    fn sizes_match_the_modules() {
        let device = Default::default();
        for config in [
            config(MixerKind::Attention, 4, 2, 24),
            config(MixerKind::Attention, 2, 1, 0),
            config(MixerKind::Linear, 0, 0, 8),
            config(MixerKind::None, 0, 0, 8),
        ] {
            config.validate().unwrap();
            let layer = config.init::<Flex>(&device);
            assert_eq!(layer.num_params(), config.params(), "{config:?}");
            let out = layer.forward(Tensor::ones([2, 3, 16], &device), Tensor::ones([2, 3], &device));
            assert_eq!(out.dims(), [2, 3, 16]);
        }
        assert!(config(MixerKind::Attention, 3, 2, 8).validate().is_err());
        assert!(config(MixerKind::None, 0, 0, 0).validate().is_err());
        // Dropping the feed-forward removes exactly its multiply-accumulates.
        let full = config(MixerKind::Attention, 4, 2, 24);
        let no_ffn = config(MixerKind::Attention, 4, 2, 0);
        assert_eq!(full.flops(10) - no_ffn.flops(10), 2 * 10 * 3 * 16 * 24);
    }

    /// A batch of 4 x 8 tokens, the last two of the second sequence padding.
    fn calibration<B: FusedBackend>(device: &B::Device) -> (Tensor<B, 3>, Tensor<B, 2>) {
        let x = Tensor::random([4, 8, 16], Distribution::Normal(0.0, 1.0), device);
        let mut mask = vec![1.0f32; 32];
        mask[14] = 0.0;
        mask[15] = 0.0;
        (x, Tensor::from_data(TensorData::new(mask, [4, 8]), device))
    }

    /// An attention layer with a feed-forward of `ffn` neurons, its
    /// parameters drawn: burn initialises parameters lazily, on first use,
    /// and the clones of a layer not yet used would draw different weights.
    /// (On the default device.)
    fn drawn_layer(ffn: usize) -> DecoderLayer<Flex> {
        let device = Default::default();
        let layer = config(MixerKind::Attention, 4, 2, ffn).init::<Flex>(&device);
        let _ = layer.forward(Tensor::zeros([1, 1, 16], &device), Tensor::ones([1, 1], &device));
        layer
    }

    /// Mean squared gap between two layers' outputs over the real tokens.
    fn real_gap(
        a: &DecoderLayer<Flex>,
        b: &DecoderLayer<Flex>,
        x: &Tensor<Flex, 3>,
        mask: &Tensor<Flex, 2>,
    ) -> f32 {
        let gap = a.forward(x.clone(), mask.clone()) - b.forward(x.clone(), mask.clone());
        let real = mask.clone().unsqueeze_dim::<3>(2);
        ((gap.square() * real.clone()).sum() / real.sum()).into_scalar()
    }

    #[test]
    fn refit_recovers_a_scrambled_down_projection() {
        let device = Default::default();
        let teacher = drawn_layer(12);
        let mut student = teacher.clone();
        let ffn = student.ffn.as_mut().unwrap();
        ffn.down.weight =
            Param::from_tensor(Tensor::random([12, 16], Distribution::Normal(0.0, 1.0), &device));
        let (x, mask) = calibration::<Flex>(&device);
        let before = real_gap(&student, &teacher, &x, &mask);
        // The attention's output projection is refitted too (to itself).
        assert_eq!(
            student.refit(&teacher.refit_targets(x.clone(), mask.clone()), x.clone(), mask.clone(), 1e-9),
            2
        );
        let after = real_gap(&student, &teacher, &x, &mask);
        assert!(after < 1e-8 * before.max(1.0), "gap {before} -> {after}: the exact down projection exists");
    }

    #[test]
    fn refit_fits_a_linear_mixer_and_a_narrow_feed_forward() {
        let device = Default::default();
        let teacher = drawn_layer(12);
        let narrow = |layer: &Linear<Flex>, dim: usize| Linear {
            weight: Param::from_tensor(layer.weight.val().narrow(dim, 0, 6)),
            bias: None,
        };
        let (attention, ffn) = (teacher.attention.as_ref().unwrap(), teacher.ffn.as_ref().unwrap());
        let mut student = DecoderLayer {
            attention: Some(AttentionSublayer {
                norm: attention.norm.clone(),
                mixer: Mixer::Linear(Linear {
                    weight: Param::from_tensor(Tensor::zeros([16, 16], &device)),
                    bias: None,
                }),
            }),
            ffn: Some(SwiGlu {
                norm: ffn.norm.clone(),
                gate: narrow(&ffn.gate, 1),
                up: narrow(&ffn.up, 1),
                down: narrow(&ffn.down, 0),
            }),
        };
        let (x, mask) = calibration::<Flex>(&device);
        let before = real_gap(&student, &teacher, &x, &mask);
        let untouched = student.clone();
        assert_eq!(
            student.refit(&teacher.refit_targets(x.clone(), mask.clone()), x.clone(), mask.clone(), 1e-6),
            2
        );
        let after = real_gap(&student, &teacher, &x, &mask);
        assert!(after < 0.9 * before, "the refit should fit the teacher better: {before} -> {after}");
        // The gate and up projections stay as they were.
        let (old, new) = (untouched.ffn.unwrap(), student.ffn.unwrap());
        let same = (old.gate.weight.val() - new.gate.weight.val()).abs().max().into_scalar();
        assert_eq!(same, 0.0);
    }

    #[test]
    fn refit_lets_an_attention_only_layer_stand_in_for_the_whole_layer() {
        let device = Default::default();
        let teacher = drawn_layer(12);
        let mut student = DecoderLayer { attention: teacher.attention.clone(), ffn: None };
        let (x, mask) = calibration::<Flex>(&device);
        let before = real_gap(&student, &teacher, &x, &mask);
        assert_eq!(
            student.refit(&teacher.refit_targets(x.clone(), mask.clone()), x.clone(), mask.clone(), 1e-6),
            1
        );
        let after = real_gap(&student, &teacher, &x, &mask);
        assert!(
            after < before,
            "the output projection should absorb part of the feed-forward: {before} -> {after}"
        );
    }
}
