//! A BERT-style (post-LN) transformer encoder layer on the fused ops.
//!
//! Teachers (all-MiniLM-L6-v2's six layers) and students (narrower layers)
//! share this module, so it lives at the bottom of the dependency graph. Its
//! projections run through [`linear`] (one fused matmul + bias + activation
//! on wgpu and cuda), the attention through [`masked_attention`] and each
//! residual add with its layer norm through [`add_layer_norm`] (one pass
//! each, forward and backward, on flex; burn ops elsewhere).
//!
//! ```text
//! h   = LayerNorm(x + Wo · MultiHeadAttention(Wq·x, Wk·x, Wv·x, mask))
//! out = LayerNorm(h + W2 · GELU(W1 · h))
//! ```
//!
//! The field names follow what `burn-store` needs to load a BERT checkpoint
//! after a key remapping (see the `minilm` teacher).

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::{ElementConversion, Int, Tensor};

use crate::transformer::{add_layer_norm, masked_attention};
use crate::{linear, Epilogue, FusedBackend};

/// BERT's layer-norm epsilon, of every encoder layer (teacher and students).
pub const LAYER_NORM_EPS: f64 = 1e-12;

/// all-MiniLM-L6-v2's encoder layer (hidden, heads, head width, feed-forward
/// width): the built-in teacher's layers, and the sizes an `encoder`
/// student keeps unless its config says otherwise. One owner for both.
pub const MINILM_L6_LAYER: [usize; 4] = [384, 12, 32, 1536];

/// Sizes of one encoder layer.
#[derive(Config, Debug, PartialEq)]
pub struct EncoderLayerConfig {
    /// Width of the residual stream (384 for MiniLM).
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Width of each head (`hidden / heads` in BERT; a student with fewer
    /// heads keeps the teacher's head width and so has a narrower attention).
    pub head_dim: usize,
    /// Width of the feed-forward layer (1536 for MiniLM).
    pub ffn: usize,
}

impl EncoderLayerConfig {
    /// Builds a randomly initialised layer (burn's default initialisers).
    pub fn init<B: FusedBackend>(&self, device: &B::Device) -> EncoderLayer<B> {
        let inner = self.heads * self.head_dim;
        let norm = || LayerNormConfig::new(self.hidden).with_epsilon(LAYER_NORM_EPS).init(device);
        EncoderLayer {
            query: LinearConfig::new(self.hidden, inner).init(device),
            key: LinearConfig::new(self.hidden, inner).init(device),
            value: LinearConfig::new(self.hidden, inner).init(device),
            attn_out: LinearConfig::new(inner, self.hidden).init(device),
            attn_norm: norm(),
            ffn_in: LinearConfig::new(self.hidden, self.ffn).init(device),
            ffn_out: LinearConfig::new(self.ffn, self.hidden).init(device),
            ffn_norm: norm(),
            heads: self.heads,
            head_dim: self.head_dim,
        }
    }

    /// Forward FLOPs of one layer for one sequence of `tokens` tokens (two
    /// per multiply-accumulate; layer norms, softmax and GELU not counted).
    pub fn flops(&self, tokens: usize) -> u64 {
        let (t, h, a, f) =
            (tokens as u64, self.hidden as u64, (self.heads * self.head_dim) as u64, self.ffn as u64);
        let projections = 2 * t * (3 * h * a + a * h + 2 * h * f);
        let attention = 2 * 2 * t * t * a;
        projections + attention
    }

    /// Trainable parameters of one layer.
    pub fn params(&self) -> usize {
        let (h, a, f) = (self.hidden, self.heads * self.head_dim, self.ffn);
        3 * (h * a + a) + (a * h + h) + (h * f + f) + (f * h + h) + 4 * h
    }
}

/// One post-LN transformer encoder layer.
#[derive(Module, Debug)]
pub struct EncoderLayer<B: FusedBackend> {
    /// Query projection `[hidden, heads * head_dim]`.
    pub query: Linear<B>,
    /// Key projection.
    pub key: Linear<B>,
    /// Value projection.
    pub value: Linear<B>,
    /// Attention output projection `[heads * head_dim, hidden]`.
    pub attn_out: Linear<B>,
    /// Layer norm after the attention residual.
    pub attn_norm: LayerNorm<B>,
    /// Feed-forward expansion `[hidden, ffn]` (GELU after it).
    pub ffn_in: Linear<B>,
    /// Feed-forward projection back `[ffn, hidden]`.
    pub ffn_out: Linear<B>,
    /// Layer norm after the feed-forward residual.
    pub ffn_norm: LayerNorm<B>,
    /// Attention heads.
    pub heads: usize,
    /// Width of each head.
    pub head_dim: usize,
}

fn fused<B: FusedBackend>(layer: &Linear<B>, x: Tensor<B, 2>, epilogue: Epilogue) -> Tensor<B, 2> {
    linear(x, layer.weight.val(), layer.bias.as_ref().map(|b| b.val()), epilogue)
}

impl<B: FusedBackend> EncoderLayer<B> {
    /// `[batch, tokens, hidden]` with a `[batch, tokens]` mask (1 for real
    /// tokens, 0 for padding) to `[batch, tokens, hidden]`. Padding positions
    /// are computed but attend to real tokens only and are never attended to.
    pub fn forward(&self, x: Tensor<B, 3>, mask: Tensor<B, 2>) -> Tensor<B, 3> {
        let [batch, tokens, hidden] = x.dims();
        let h = self.attention(x, mask);
        let ffn = fused(&self.ffn_out, fused(&self.ffn_in, h.clone(), Epilogue::Gelu), Epilogue::Identity);
        add_layer_norm(ffn, h, &self.ffn_norm, LAYER_NORM_EPS).reshape([batch, tokens, hidden])
    }

    /// The attention half: `[batch, tokens, hidden]` to the normalised
    /// residual stream `[batch * tokens, hidden]` that enters the feed-forward.
    fn attention(&self, x: Tensor<B, 3>, mask: Tensor<B, 2>) -> Tensor<B, 2> {
        let [batch, tokens, hidden] = x.dims();
        let inner = self.heads * self.head_dim;
        let rows = x.reshape([batch * tokens, hidden]);
        let project = |layer| fused(layer, rows.clone(), Epilogue::Identity).reshape([batch, tokens, inner]);
        let context = masked_attention(
            project(&self.query),
            project(&self.key),
            project(&self.value),
            mask,
            self.heads,
        );
        let out = fused(&self.attn_out, context.reshape([batch * tokens, inner]), Epilogue::Identity);
        add_layer_norm(out, rows, &self.attn_norm, LAYER_NORM_EPS)
    }

    /// The sizes of this layer.
    pub fn config(&self) -> EncoderLayerConfig {
        let [hidden, ffn] = self.ffn_in.weight.dims();
        EncoderLayerConfig::new(hidden, self.heads, self.head_dim, ffn)
    }

    /// Importance of each attention head: `||Wv[:, head]|| * ||Wo[head, :]||`
    /// (how much the head can move the residual stream).
    pub fn head_importance(&self) -> Vec<f32> {
        let value = self.value.weight.val().powf_scalar(2.0).sum_dim(0).into_data();
        let out = self.attn_out.weight.val().powf_scalar(2.0).sum_dim(1).into_data();
        let (value, out) = (value.iter::<f32>().collect::<Vec<_>>(), out.iter::<f32>().collect::<Vec<_>>());
        (0..self.heads)
            .map(|h| {
                let span = h * self.head_dim..(h + 1) * self.head_dim;
                (value[span.clone()].iter().sum::<f32>() * out[span].iter().sum::<f32>()).sqrt()
            })
            .collect()
    }

    /// Statistics of each feed-forward neuron on real inputs `x` (with
    /// their mask), over the real tokens.
    pub fn neuron_statistics(&self, x: Tensor<B, 3>, mask: Tensor<B, 2>) -> NeuronStatistics {
        let [batch, tokens, _] = x.dims();
        let h = self.attention(x, mask.clone());
        let activation = fused(&self.ffn_in, h, Epilogue::Gelu);
        let real = mask.reshape([batch * tokens, 1]);
        let count = real.clone().sum().into_scalar().elem::<f32>().max(1.0);
        let mean_abs = (activation.clone().abs() * real.clone()).sum_dim(0).into_data();
        let mean = (activation * real).sum_dim(0).into_data();
        let w_out = self.ffn_out.weight.val().powf_scalar(2.0).sum_dim(1).sqrt().into_data();
        NeuronStatistics {
            importance: mean_abs.iter::<f32>().zip(w_out.iter::<f32>()).map(|(a, w)| a / count * w).collect(),
            mean_activation: mean.iter::<f32>().map(|m| m / count).collect(),
        }
    }

    /// [`Self::pruned`], with the average contribution of the dropped
    /// feed-forward neurons (`mean_activation[j] * W2[j, :]`) folded into
    /// the feed-forward output bias, so that on average the pruned layer
    /// still moves the residual stream as the full one does.
    pub fn pruned_compensated(&self, heads: &[usize], neurons: &[usize], mean_activation: &[f32]) -> Self {
        let mut pruned = self.pruned(heads, neurons);
        let mut dropped = mean_activation.to_vec();
        for &j in neurons {
            dropped[j] = 0.0;
        }
        let device = self.ffn_out.weight.device();
        let dropped = Tensor::<B, 1>::from_floats(dropped.as_slice(), &device).unsqueeze_dim::<2>(0);
        let shift = dropped.matmul(self.ffn_out.weight.val()).squeeze_dim::<1>(0);
        pruned.ffn_out.bias = pruned.ffn_out.bias.map(|b| Param::from_tensor(b.val() + shift));
        pruned
    }

    /// Refits this (pruned) layer's feed-forward output projection by ridge
    /// least squares on real inputs `x`: the weights and bias with which its
    /// kept neurons best reproduce, over the real tokens, what `teacher`
    /// adds to the residual stream before its last layer norm. Returns false
    /// (leaving the layer as it was) if the system is singular.
    pub fn refit_ffn_out(&mut self, teacher: &Self, x: Tensor<B, 3>, mask: Tensor<B, 2>, ridge: f64) -> bool {
        let [batch, tokens, _] = x.dims();
        let real = mask.clone().reshape([batch * tokens, 1]);
        let h_teacher = teacher.attention(x.clone(), mask.clone());
        let ffn_teacher = fused(
            &teacher.ffn_out,
            fused(&teacher.ffn_in, h_teacher.clone(), Epilogue::Gelu),
            Epilogue::Identity,
        );
        let h_student = self.attention(x, mask);
        // Target of the student's feed-forward: teacher's pre-norm sum minus the student's residual.
        let target = (ffn_teacher + h_teacher - h_student.clone()) * real.clone();
        let hidden_units = fused(&self.ffn_in, h_student, Epilogue::Gelu);
        let ones = real.clone();
        let features = Tensor::cat(vec![hidden_units * real, ones], 1);
        let [_, n] = features.dims();
        let [_, m] = target.dims();
        let gram = features.clone().transpose().matmul(features.clone());
        let rhs = features.transpose().matmul(target);
        let to_f64 = |t: Tensor<B, 2>| t.into_data().iter::<f32>().map(f64::from).collect::<Vec<_>>();
        let Some(solution) = ridge_solve(&to_f64(gram), &to_f64(rhs), n, m, ridge) else {
            return false;
        };
        let device = self.ffn_out.weight.device();
        let values: Vec<f32> = solution.iter().map(|&v| v as f32).collect();
        let all = Tensor::<B, 2>::from_data(burn::tensor::TensorData::new(values, [n, m]), &device);
        self.ffn_out.weight = Param::from_tensor(all.clone().narrow(0, 0, n - 1));
        self.ffn_out.bias = Some(Param::from_tensor(all.narrow(0, n - 1, 1).squeeze_dim::<1>(0)));
        true
    }

    /// A narrower copy that keeps attention heads `heads` and feed-forward
    /// neurons `neurons` (indices into this layer, kept in the given order):
    /// the pruning initialisation of a student from its teacher layer.
    pub fn pruned(&self, heads: &[usize], neurons: &[usize]) -> Self {
        let device = self.query.weight.device();
        let head_columns: Vec<i64> = heads
            .iter()
            .flat_map(|&h| (h * self.head_dim..(h + 1) * self.head_dim).map(|c| c as i64))
            .collect();
        let index = |values: Vec<i64>| Tensor::<B, 1, Int>::from_ints(values.as_slice(), &device);
        let heads_index = index(head_columns);
        let neurons_index = index(neurons.iter().map(|&n| n as i64).collect());
        let columns = |layer: &Linear<B>, keep: &Tensor<B, 1, Int>| Linear {
            weight: Param::from_tensor(layer.weight.val().select(1, keep.clone())),
            bias: layer.bias.as_ref().map(|b| Param::from_tensor(b.val().select(0, keep.clone()))),
        };
        let rows = |layer: &Linear<B>, keep: &Tensor<B, 1, Int>| Linear {
            weight: Param::from_tensor(layer.weight.val().select(0, keep.clone())),
            bias: layer.bias.as_ref().map(|b| Param::from_tensor(b.val())),
        };
        Self {
            query: columns(&self.query, &heads_index),
            key: columns(&self.key, &heads_index),
            value: columns(&self.value, &heads_index),
            attn_out: rows(&self.attn_out, &heads_index),
            attn_norm: self.attn_norm.clone(),
            ffn_in: columns(&self.ffn_in, &neurons_index),
            ffn_out: rows(&self.ffn_out, &neurons_index),
            ffn_norm: self.ffn_norm.clone(),
            heads: heads.len(),
            head_dim: self.head_dim,
        }
    }
}

/// Solves `(G + ridge * mean(diag G) * I) X = R` for symmetric positive
/// semi-definite `G` (`n x n`, row-major) and `R` (`n x m`) by Cholesky, in
/// f64. Returns `X` (`n x m`), or `None` if `G` is not positive definite even
/// with the ridge.
pub fn ridge_solve(gram: &[f64], rhs: &[f64], n: usize, m: usize, ridge: f64) -> Option<Vec<f64>> {
    let shift = ridge_shift(gram, n, ridge);
    // Lower-triangular factor L with G + shift I = L L^T.
    let mut l = vec![0.0; n * n];
    for i in 0..n {
        for j in 0..=i {
            let mut sum = gram[i * n + j] + if i == j { shift } else { 0.0 };
            for k in 0..j {
                sum -= l[i * n + k] * l[j * n + k];
            }
            if i == j {
                if sum <= 0.0 {
                    return None;
                }
                l[i * n + i] = sum.sqrt();
            } else {
                l[i * n + j] = sum / l[j * n + j];
            }
        }
    }
    // Forward (L Y = R), then backward (L^T X = Y) substitution, a row of
    // all m right-hand sides at a time: the inner loops run over contiguous
    // rows (the same arithmetic, in the same order, as column by column).
    let mut x = rhs.to_vec();
    for i in 0..n {
        let (solved, rest) = x.split_at_mut(i * m);
        let row = &mut rest[..m];
        for k in 0..i {
            let factor = l[i * n + k];
            for (value, known) in row.iter_mut().zip(&solved[k * m..(k + 1) * m]) {
                *value -= factor * known;
            }
        }
        let pivot = l[i * n + i];
        row.iter_mut().for_each(|value| *value /= pivot);
    }
    for i in (0..n).rev() {
        let (head, solved) = x.split_at_mut((i + 1) * m);
        let row = &mut head[i * m..];
        for k in i + 1..n {
            let factor = l[k * n + i];
            let known = &solved[(k - i - 1) * m..(k - i) * m];
            for (value, known) in row.iter_mut().zip(known) {
                *value -= factor * known;
            }
        }
        let pivot = l[i * n + i];
        row.iter_mut().for_each(|value| *value /= pivot);
    }
    Some(x)
}

/// The ridge [`ridge_solve`] adds to the diagonal of `gram` (`n x n`):
/// `ridge` times the mean of its diagonal.
pub fn ridge_shift(gram: &[f64], n: usize, ridge: f64) -> f64 {
    let mean_diag = (0..n).map(|i| gram[i * n + i]).sum::<f64>() / n.max(1) as f64;
    ridge * mean_diag.max(1e-12)
}

/// Per-neuron statistics of a feed-forward layer on real data.
#[derive(Debug, Clone)]
pub struct NeuronStatistics {
    /// Mean absolute activation times the norm of the output weights.
    pub importance: Vec<f32>,
    /// Mean (signed) activation.
    pub mean_activation: Vec<f32>,
}

/// Indices of the `keep` largest scores, in increasing index order.
pub fn top_indices(scores: &[f32], keep: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut kept: Vec<usize> = order.into_iter().take(keep).collect();
    kept.sort_unstable();
    kept
}

/// Mean of `hidden` over the real tokens of each sequence, L2-normalised:
/// sentence-transformers' pooling for MiniLM. `[batch, tokens, hidden]` and
/// `[batch, tokens]` to `[batch, hidden]`.
pub fn mean_pool_normalized<B: burn::tensor::backend::Backend>(
    hidden: Tensor<B, 3>,
    mask: Tensor<B, 2>,
) -> Tensor<B, 2> {
    let [batch, _, width] = hidden.dims();
    let weights = mask.clone().unsqueeze_dim::<3>(2);
    let summed = (hidden * weights).sum_dim(1).reshape([batch, width]);
    let counts = mask.sum_dim(1).clamp_min(1e-9);
    let mean = summed / counts;
    let norm = mean.clone().powf_scalar(2.0).sum_dim(1).sqrt().clamp_min(1e-12);
    mean / norm
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::Distribution;

    #[test]
    fn padding_does_not_change_the_real_tokens() {
        let device = Default::default();
        let layer = EncoderLayerConfig::new(16, 4, 4, 24).init::<Flex>(&device);
        let x = Tensor::<Flex, 3>::random([1, 5, 16], Distribution::Normal(0.0, 1.0), &device);
        let short = layer.forward(x.clone().narrow(1, 0, 3), Tensor::ones([1, 3], &device));
        let mask = Tensor::<Flex, 2>::from_floats([[1.0, 1.0, 1.0, 0.0, 0.0]], &device);
        let padded = layer.forward(x, mask).narrow(1, 0, 3);
        let diff = (short - padded).abs().max().into_scalar();
        assert!(diff < 1e-5, "padding leaked into real tokens: {diff}");
    }

    #[test]
    fn keeping_every_head_and_neuron_reproduces_the_layer() {
        let device = Default::default();
        let layer = EncoderLayerConfig::new(16, 4, 4, 24).init::<Flex>(&device);
        let x = Tensor::<Flex, 3>::random([2, 5, 16], Distribution::Normal(0.0, 1.0), &device);
        let mask = Tensor::<Flex, 2>::ones([2, 5], &device);
        let all = layer.pruned(&[0, 1, 2, 3], &(0..24).collect::<Vec<_>>());
        let diff =
            (layer.forward(x.clone(), mask.clone()) - all.forward(x.clone(), mask.clone())).abs().max();
        assert!(diff.into_scalar() < 1e-5);
        let narrow = layer.pruned(&[1, 3], &[0, 5, 7]);
        assert_eq!(narrow.config(), EncoderLayerConfig::new(16, 2, 4, 3));
        assert_eq!(narrow.num_params(), narrow.config().params());
        assert_eq!(narrow.forward(x, mask).dims(), [2, 5, 16]);
    }

    #[test]
    fn bias_compensation_preserves_the_mean_output_of_dropped_neurons() {
        let device = Default::default();
        let layer = EncoderLayerConfig::new(8, 2, 4, 12).init::<Flex>(&device);
        let x = Tensor::<Flex, 3>::random([4, 6, 8], Distribution::Normal(0.0, 1.0), &device);
        let mask = Tensor::<Flex, 2>::ones([4, 6], &device);
        let stats = layer.neuron_statistics(x.clone(), mask.clone());
        let keep: Vec<usize> = (0..6).collect();
        let plain = layer.pruned(&[0, 1], &keep);
        let compensated = layer.pruned_compensated(&[0, 1], &keep, &stats.mean_activation);
        // The feed-forward output before the residual, averaged over tokens.
        let ffn_mean = |l: &EncoderLayer<Flex>| {
            let h = l.attention(x.clone(), mask.clone());
            fused(&l.ffn_out, fused(&l.ffn_in, h, Epilogue::Gelu), Epilogue::Identity).mean_dim(0)
        };
        let full = ffn_mean(&layer);
        let err = |l| (ffn_mean(l) - full.clone()).abs().max().into_scalar();
        assert!(err(&compensated) < 1e-4, "{}", err(&compensated));
        assert!(err(&plain) > 10.0 * err(&compensated));
    }

    #[test]
    fn ridge_solve_solves_a_small_system() {
        // [[4, 2], [2, 3]] x = [[2], [1]]  ->  x = [0.5, 0].
        let x = ridge_solve(&[4.0, 2.0, 2.0, 3.0], &[2.0, 1.0], 2, 1, 0.0).unwrap();
        assert!((x[0] - 0.5).abs() < 1e-12 && x[1].abs() < 1e-12, "{x:?}");
        assert!(ridge_solve(&[0.0, 0.0, 0.0, 0.0], &[1.0, 1.0], 2, 1, 0.0).is_none());
    }

    #[test]
    fn ridge_solve_recovers_every_right_hand_side_of_a_larger_system() {
        // G = A^T A + I (symmetric positive definite), R = G X for a known X.
        let (n, m, rows) = (9, 4, 12);
        let mut state = 12345u64;
        let mut draw = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 11) as f64 / (1u64 << 53) as f64 - 0.5
        };
        let a: Vec<f64> = (0..rows * n).map(|_| draw()).collect();
        let expected: Vec<f64> = (0..n * m).map(|_| draw()).collect();
        let mut gram = vec![0.0; n * n];
        for i in 0..n {
            for j in 0..n {
                gram[i * n + j] = (0..rows).map(|r| a[r * n + i] * a[r * n + j]).sum::<f64>();
            }
            gram[i * n + i] += 1.0;
        }
        let mut rhs = vec![0.0; n * m];
        for i in 0..n {
            for c in 0..m {
                rhs[i * m + c] = (0..n).map(|k| gram[i * n + k] * expected[k * m + c]).sum::<f64>();
            }
        }
        let x = ridge_solve(&gram, &rhs, n, m, 0.0).unwrap();
        let worst = x.iter().zip(&expected).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(worst < 1e-10, "largest error {worst}");
    }

    #[test]
    fn refitting_the_output_projection_beats_plain_pruning() {
        let device = Default::default();
        let teacher = EncoderLayerConfig::new(8, 2, 4, 24).init::<Flex>(&device);
        let x = Tensor::<Flex, 3>::random([16, 6, 8], Distribution::Normal(0.0, 1.0), &device);
        let mask = Tensor::<Flex, 2>::ones([16, 6], &device);
        let stats = teacher.neuron_statistics(x.clone(), mask.clone());
        let keep = top_indices(&stats.importance, 12);
        let plain = teacher.pruned_compensated(&[0, 1], &keep, &stats.mean_activation);
        let mut refit = plain.clone();
        assert!(refit.refit_ffn_out(&teacher, x.clone(), mask.clone(), 1e-6));
        let reference = teacher.forward(x.clone(), mask.clone());
        let err = |l: &EncoderLayer<Flex>| {
            (l.forward(x.clone(), mask.clone()) - reference.clone()).powf_scalar(2.0).mean().into_scalar()
        };
        assert!(err(&refit) < err(&plain), "refit {} vs plain {}", err(&refit), err(&plain));
        // Keeping every neuron, the refit recovers the teacher exactly.
        let mut full = teacher.pruned(&[0, 1], &(0..24).collect::<Vec<_>>());
        assert!(full.refit_ffn_out(&teacher, x.clone(), mask.clone(), 1e-9));
        assert!(err(&full) < 1e-6, "{}", err(&full));
    }

    #[test]
    fn top_indices_keeps_the_largest_in_index_order() {
        assert_eq!(top_indices(&[0.1, 3.0, 2.0, 5.0], 2), vec![1, 3]);
        assert_eq!(top_indices(&[1.0, 1.0, 1.0], 2), vec![0, 1]);
    }

    #[test]
    fn pooling_averages_real_tokens_and_normalises() {
        let device = Default::default();
        let hidden = Tensor::<Flex, 3>::from_floats([[[3.0, 0.0], [1.0, 0.0], [0.0, 100.0]]], &device);
        let mask = Tensor::<Flex, 2>::from_floats([[1.0, 1.0, 0.0]], &device);
        let pooled: Vec<f32> = mean_pool_normalized(hidden, mask).into_data().iter::<f32>().collect();
        assert!((pooled[0] - 1.0).abs() < 1e-6 && pooled[1].abs() < 1e-6, "{pooled:?}");
    }
}
