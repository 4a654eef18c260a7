//! The built-in zoo's decoder LLM on text: SmolLM2's tokens through its
//! frozen token embeddings in front of the first decoder block, and the
//! language-model evaluation of a stitched student (held-out perplexity,
//! next-token top-1 agreement and KL to the teacher, through the teacher's
//! frozen final norm and LM head).

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};
use pipebd_core::{Activation, BlockSpec, HeadScores, OutputHead};
use pipebd_kernels::decoder::{
    AttentionSublayer, CausalAttention, DecoderLayer, DecoderLayerConfig, Mixer, MixerKind, SwiGlu,
};
use pipebd_kernels::encoder::top_indices;
use pipebd_kernels::FusedBackend;
use pipebd_teachers::smollm2::{LmHead, SmolTokenizer, TokenEmbeddings};

use crate::text_scores::LanguageReport;
use pipe_bd::eval::{Evaluate, Network, Score};
use pipe_bd::{Error, Result};

use crate::text::embed_batch;

/// Sequences scored at once (the logits of a chunk, `chunk * tokens *
/// vocab` floats, dominate the memory: 100 MB at 8 x 64 x 49,152).
const EVAL_CHUNK: usize = 8;

/// Next-token figures summed over the scored positions of some batches.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Tally {
    /// Positions scored: each real token but a sequence's first, predicted
    /// from the tokens before it.
    pub predicted: usize,
    /// Summed negative log-likelihood of the true next token, teacher.
    pub teacher_nll: f64,
    /// The same for the student.
    pub student_nll: f64,
    /// Positions where the student's most likely token is the teacher's.
    pub agree: usize,
    /// Summed `KL(teacher || student)` of the next-token distributions.
    pub kl: f64,
}

impl Tally {
    /// Adds another tally.
    pub fn add(&mut self, other: Tally) {
        self.predicted += other.predicted;
        self.teacher_nll += other.teacher_nll;
        self.student_nll += other.student_nll;
        self.agree += other.agree;
        self.kl += other.kl;
    }

    /// `exp` of the teacher's mean next-token negative log-likelihood.
    pub fn teacher_perplexity(&self) -> f64 {
        (self.teacher_nll / self.predicted.max(1) as f64).exp()
    }

    /// The student's perplexity.
    pub fn student_perplexity(&self) -> f64 {
        (self.student_nll / self.predicted.max(1) as f64).exp()
    }
}

/// The frozen final norm and LM head as the stitched pass's output head
/// (`stitched_output_loss = "head-kl"`): every real token's next-token
/// logits but the last's (which would predict past the sentence), as the
/// evaluation scores them.
#[derive(Debug)]
pub struct NextTokenHead<B: FusedBackend> {
    head: LmHead<B>,
}

impl<B: FusedBackend> NextTokenHead<B> {
    /// `head` with its parameters frozen: gradients flow through it to the
    /// states, never into it.
    pub fn new(head: LmHead<B>) -> Self {
        Self { head: head.no_grad() }
    }
}

impl<B: FusedBackend> OutputHead<B> for NextTokenHead<B> {
    /// The logits of the positions that count (those whose next token is
    /// real) only, each weighted 1: the rows that would be weighted 0 are
    /// left out before the norm and the LM head, which saves their share of
    /// the head's `[rows, 49,152]` products forward and backward (about a
    /// third at 32 tokens on Brown). A batch without such a position keeps
    /// every row, weighted 0.
    fn scores(&self, output: Activation<B>) -> pipebd_core::Result<HeadScores<B>> {
        let (hidden, mask) = output.into_tokens(0)?;
        let [batch, tokens, width] = hidden.dims();
        let hidden = hidden.reshape([batch * tokens, width]);
        let real: Vec<f32> = mask.to_data().iter::<f32>().collect();
        // Position i counts when token i + 1 is real: it has a next token.
        let counted: Vec<i64> = (0..batch * tokens)
            .filter(|&row| row % tokens + 1 < tokens && real[row + 1] > 0.5)
            .map(|row| row as i64)
            .collect();
        if counted.is_empty() {
            let scores = self.head.forward(hidden);
            return Ok(HeadScores { scores, weights: Tensor::zeros([batch * tokens], &mask.device()) });
        }
        let rows = counted.len();
        let index = Tensor::<B, 1, Int>::from_data(TensorData::new(counted, [rows]), &mask.device());
        let scores = self.head.forward(hidden.select(0, index));
        Ok(HeadScores { scores, weights: Tensor::ones([rows], &mask.device()) })
    }
}

/// Per-row log-probabilities `[rows, vocab]` of the final states `hidden`
/// `[batch, tokens, width]` through `head`.
fn log_probs<B: FusedBackend>(head: &LmHead<B>, hidden: Tensor<B, 3>) -> Tensor<B, 2> {
    let [batch, tokens, width] = hidden.dims();
    log_softmax(head.forward(hidden.reshape([batch * tokens, width])), 1)
}

fn host_f32<B: FusedBackend>(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

fn host_ids<B: FusedBackend>(t: Tensor<B, 2, Int>) -> Vec<i64> {
    t.into_data().iter::<i64>().collect()
}

/// Scores the final states of the teacher (and of a student, if given) on
/// `sequences`: position `i` of sequence `b` predicts token `i + 1`.
pub fn tally<B: FusedBackend>(
    head: &LmHead<B>,
    sequences: &[&[u32]],
    teacher: Tensor<B, 3>,
    student: Option<Tensor<B, 3>>,
) -> Tally {
    let [batch, tokens, _] = teacher.dims();
    let device = teacher.device();
    let mut targets = vec![0i64; batch * tokens];
    let mut scored = vec![false; batch * tokens];
    for (b, sequence) in sequences.iter().enumerate() {
        for i in 0..sequence.len().min(tokens).saturating_sub(1) {
            targets[b * tokens + i] = i64::from(sequence[i + 1]);
            scored[b * tokens + i] = true;
        }
    }
    let targets = Tensor::<B, 2, Int>::from_data(TensorData::new(targets, [batch * tokens, 1]), &device);
    let teacher = log_probs(head, teacher);
    let teacher_nll = host_f32(teacher.clone().gather(1, targets.clone()));
    let mut tally = Tally { predicted: scored.iter().filter(|&&s| s).count(), ..Tally::default() };
    tally.teacher_nll = sum_scored(&teacher_nll, &scored, |v| -f64::from(v));
    let Some(student) = student else { return tally };
    let student = log_probs(head, student);
    let student_nll = host_f32(student.clone().gather(1, targets));
    tally.student_nll = sum_scored(&student_nll, &scored, |v| -f64::from(v));
    let teacher_top = host_ids(teacher.clone().argmax(1));
    let student_top = host_ids(student.clone().argmax(1));
    tally.agree = (0..scored.len()).filter(|&r| scored[r] && teacher_top[r] == student_top[r]).count();
    let kl = host_f32(pipebd_kernels::loss::kl_rows(student, teacher).unsqueeze_dim(1));
    tally.kl = sum_scored(&kl, &scored, f64::from);
    tally
}

fn sum_scored(values: &[f32], scored: &[bool], f: impl Fn(f32) -> f64) -> f64 {
    values.iter().zip(scored).filter(|(_, &s)| s).map(|(&v, _)| f(v)).sum()
}

/// The final token states of `network` on `sequences` (an error naming the
/// last block if it gives something else).
fn final_states<B: FusedBackend>(network: &Network<'_, B>, input: Activation<B>) -> Result<Tensor<B, 3>> {
    match network.forward(input)? {
        Activation::Tokens { hidden, .. } => Ok(hidden),
        other => Err(Error::block(
            network.blocks(),
            format!("the last block must produce token states, got {:?}", other.dims()),
        )),
    }
}

/// The evaluation of a decoder LLM student: the teacher's and the stitched
/// student's next-token predictions on held-out sentences, through the
/// teacher's frozen embeddings and LM head.
pub struct NextTokenScores<B: FusedBackend> {
    /// The teacher's token embeddings (input preparation).
    pub embeddings: TokenEmbeddings<B>,
    /// The teacher's final norm and LM head.
    pub head: LmHead<B>,
    /// Held-out sentences, tokenised.
    pub heldout: Vec<Vec<u32>>,
    /// Tokens per sequence.
    pub max_tokens: usize,
}

impl<B: FusedBackend> NextTokenScores<B> {
    /// Tallies `teacher` (and `student`) over the held-out sentences.
    pub fn run(
        &self,
        teacher: &Network<'_, B>,
        student: Option<&Network<'_, B>>,
        device: &B::Device,
    ) -> Result<Tally> {
        let mut total = Tally::default();
        for part in self.heldout.chunks(EVAL_CHUNK) {
            let refs: Vec<&[u32]> = part.iter().map(Vec::as_slice).collect();
            let input = embed_batch(&self.embeddings, &refs, self.max_tokens, device);
            let student = match student {
                Some(student) => Some(final_states(student, input.clone())?),
                None => None,
            };
            let teacher = final_states(teacher, input)?;
            total.add(tally(&self.head, &refs, teacher, student));
        }
        Ok(total)
    }
}

impl<B: FusedBackend> Evaluate<B> for NextTokenScores<B> {
    /// The accuracies are next-token top-1 accuracies (the true next token);
    /// the figures that matter are in the report's `language`.
    fn score(&self, teacher: &Network<'_, B>, student: &Network<'_, B>, device: &B::Device) -> Result<Score> {
        let tally = self.run(teacher, Some(student), device)?;
        let sum = |specs: &[BlockSpec], f: fn(&BlockSpec) -> f64| specs.iter().map(f).sum::<f64>();
        let ratio = |f: fn(&BlockSpec) -> f64| sum(student.specs, f) / sum(teacher.specs, f);
        let predicted = tally.predicted.max(1) as f64;
        // The head's multiply-adds for a sequence: [hidden, vocab] per token.
        let head = 2.0 * self.max_tokens as f64 * self.head.weight.dims().iter().product::<usize>() as f64;
        let flops = |specs: &[BlockSpec]| sum(specs, |s| s.flops as f64) + head;
        Ok(Score {
            teacher_accuracy: 0.0,
            student_accuracy: tally.agree as f64 / predicted,
            test_samples: tally.predicted,
            sections: vec![LanguageReport {
                heldout_sequences: self.heldout.len(),
                predicted_tokens: tally.predicted,
                max_tokens: self.max_tokens,
                teacher_perplexity: tally.teacher_perplexity(),
                student_perplexity: tally.student_perplexity(),
                top1_agreement: tally.agree as f64 / predicted,
                mean_kl: tally.kl / predicted,
                params_ratio: ratio(|s| s.params as f64),
                flops_ratio: ratio(|s| s.flops as f64),
                whole_model_flops_ratio: flops(student.specs) / flops(teacher.specs),
            }
            .section()],
        })
    }

    /// The teacher's perplexity is not an accuracy: this gives 0 and the
    /// positions scored; `pipebd run` and `eval` report the perplexity.
    fn score_teacher(&self, teacher: &Network<'_, B>, device: &B::Device) -> Result<(f64, usize)> {
        let tally = self.run(teacher, None, device)?;
        Ok((0.0, tally.predicted))
    }
}

/// Token ids of `texts` by SmolLM2's tokenizer, each truncated to
/// `max_tokens`; texts of fewer than two tokens (nothing to predict) are
/// left out.
pub fn tokenize_lm(tokenizer: &SmolTokenizer, texts: &[String], max_tokens: usize) -> Result<Vec<Vec<u32>>> {
    let mut out = Vec::with_capacity(texts.len());
    for text in texts {
        let ids = tokenizer.encode(text, max_tokens).map_err(Error::teacher)?;
        if ids.len() >= 2 {
            out.push(ids);
        }
    }
    Ok(out)
}

/// A linear layer's weight `[inputs, outputs]` on the host, row-major.
fn weight_of<B: FusedBackend>(layer: &Linear<B>) -> (Vec<f32>, [usize; 2]) {
    let weight = layer.weight.val();
    let dims = weight.dims();
    (weight.into_data().iter::<f32>().collect(), dims)
}

/// `layer` with the weight `values` `[inputs, outputs]`.
fn with_weight<B: FusedBackend>(
    mut layer: Linear<B>,
    values: Vec<f32>,
    shape: [usize; 2],
    device: &B::Device,
) -> Linear<B> {
    layer.weight = Param::from_tensor(Tensor::from_data(TensorData::new(values, shape), device));
    layer
}

/// The columns `columns` of a row-major `[rows, width]` matrix.
fn take_columns(values: &[f32], width: usize, columns: &[usize]) -> Vec<f32> {
    values.chunks_exact(width).flat_map(|row| columns.iter().map(move |&c| row[c])).collect()
}

/// The rows `rows` of a row-major `[_, width]` matrix.
fn take_rows(values: &[f32], width: usize, rows: &[usize]) -> Vec<f32> {
    rows.iter().flat_map(|&r| values[r * width..(r + 1) * width].iter().copied()).collect()
}

/// The columns of heads `heads` (each `head_dim` wide).
fn head_columns(heads: &[usize], head_dim: usize) -> Vec<usize> {
    heads.iter().flat_map(|&h| h * head_dim..(h + 1) * head_dim).collect()
}

/// Euclidean norm of column block `head` of a row-major `[_, width]` matrix.
fn head_norm(values: &[f32], width: usize, columns: std::ops::Range<usize>) -> f32 {
    values
        .chunks_exact(width)
        .map(|row| row[columns.clone()].iter().map(|v| v * v).sum::<f32>())
        .sum::<f32>()
        .sqrt()
}

/// The query heads a pruned attention keeps, grouped by the key/value head
/// they use, and those key/value heads: the `kv_heads` groups with the
/// largest summed head importance, and in each the `heads / kv_heads`
/// strongest query heads (importance: the norm of a head's query columns
/// times that of its output rows).
fn kept_heads(
    teacher: &CausalAttention<impl FusedBackend>,
    heads: usize,
    kv_heads: usize,
) -> (Vec<usize>, Vec<usize>) {
    let d = teacher.head_dim;
    let group = teacher.heads / teacher.kv_heads;
    let (query, [_, q_width]) = weight_of(&teacher.query);
    let (output, [_, hidden]) = weight_of(&teacher.output);
    let importance: Vec<f32> = (0..teacher.heads)
        .map(|h| {
            let out_rows: f32 =
                output[h * d * hidden..(h + 1) * d * hidden].iter().map(|v| v * v).sum::<f32>().sqrt();
            head_norm(&query, q_width, h * d..(h + 1) * d) * out_rows
        })
        .collect();
    let group_importance: Vec<f32> =
        (0..teacher.kv_heads).map(|g| importance[g * group..(g + 1) * group].iter().sum()).collect();
    let groups = top_indices(&group_importance, kv_heads);
    let per_group = heads / kv_heads;
    let queries = groups
        .iter()
        .flat_map(|&g| {
            top_indices(&importance[g * group..(g + 1) * group], per_group)
                .into_iter()
                .map(move |h| g * group + h)
        })
        .collect();
    (queries, groups)
}

/// The teacher's attention cut to the query heads `queries` and key/value
/// heads `groups` ([`kept_heads`]).
fn prune_attention<B: FusedBackend>(
    teacher: &CausalAttention<B>,
    queries: &[usize],
    groups: &[usize],
    device: &B::Device,
) -> CausalAttention<B> {
    let d = teacher.head_dim;
    let (q_cols, kv_cols) = (head_columns(queries, d), head_columns(groups, d));
    let cut_columns = |layer: &Linear<B>, columns: &[usize]| {
        let (values, [inputs, width]) = weight_of(layer);
        with_weight(layer.clone(), take_columns(&values, width, columns), [inputs, columns.len()], device)
    };
    let (output, [_, hidden]) = weight_of(&teacher.output);
    CausalAttention {
        query: cut_columns(&teacher.query, &q_cols),
        key: cut_columns(&teacher.key, &kv_cols),
        value: cut_columns(&teacher.value, &kv_cols),
        output: with_weight(
            teacher.output.clone(),
            take_rows(&output, hidden, &q_cols),
            [q_cols.len(), hidden],
            device,
        ),
        heads: queries.len(),
        kv_heads: groups.len(),
        head_dim: d,
        rope_base: teacher.rope_base,
    }
}

/// The teacher's feed-forward cut to the neurons `kept`.
fn prune_ffn<B: FusedBackend>(teacher: &SwiGlu<B>, kept: &[usize], device: &B::Device) -> SwiGlu<B> {
    let cut = |layer: &Linear<B>| {
        let (values, [inputs, width]) = weight_of(layer);
        with_weight(layer.clone(), take_columns(&values, width, kept), [inputs, kept.len()], device)
    };
    let (down, [_, hidden]) = weight_of(&teacher.down);
    SwiGlu {
        norm: teacher.norm.clone(),
        gate: cut(&teacher.gate),
        up: cut(&teacher.up),
        down: with_weight(teacher.down.clone(), take_rows(&down, hidden, kept), [kept.len(), hidden], device),
    }
}

/// How much each feed-forward neuron of `layer` moves the residual stream
/// on the calibration batch `x`: the root mean square of `SiLU(gate) * up`
/// over the real tokens times the norm of the neuron's down-projection row.
/// (A square mean, not `|x|`'s: the few neurons that write an LLM's massive
/// activations fire on a handful of tokens, and must not be pruned.)
pub fn ffn_importance<B: FusedBackend>(
    layer: &DecoderLayer<B>,
    x: Tensor<B, 3>,
    mask: Tensor<B, 2>,
) -> Option<Vec<f32>> {
    let ffn = layer.ffn.as_ref()?;
    // The activations of the real tokens only (every position if none is).
    let activations = layer.ffn_activations(x, mask)?;
    let count = activations.dims()[0].max(1) as f64;
    let sums: Vec<f32> = activations.square().sum_dim(0).into_data().iter::<f32>().collect();
    let (down, [_, hidden]) = weight_of(&ffn.down);
    Some(
        sums.iter()
            .enumerate()
            .map(|(j, &s)| {
                let rms = (f64::from(s) / count).sqrt() as f32;
                rms * down[j * hidden..(j + 1) * hidden].iter().map(|v| v * v).sum::<f32>().sqrt()
            })
            .collect(),
    )
}

/// The teacher decoder layer `teacher` pruned to the student sizes `size`
/// (checked to fit it): the strongest key/value groups and query heads,
/// the feed-forward neurons ranked by `neurons` (from [`ffn_importance`]);
/// a linear mixer starts at zero (the layer then starts without its
/// attention), a removed half is dropped.
pub fn prune_decoder<B: FusedBackend>(
    teacher: &DecoderLayer<B>,
    size: &DecoderLayerConfig,
    neurons: Option<&[f32]>,
    device: &B::Device,
) -> DecoderLayer<B> {
    let attention = teacher.attention.as_ref().and_then(|sublayer| {
        let mixer = match (&sublayer.mixer, size.mixer) {
            (_, MixerKind::None) => return None,
            (Mixer::Attention(attention), MixerKind::Attention) => {
                let (queries, groups) = kept_heads(attention, size.heads, size.kv_heads);
                Mixer::Attention(prune_attention(attention, &queries, &groups, device))
            }
            _ => {
                let zero = Tensor::zeros([size.hidden, size.hidden], device);
                let mut map = LinearConfig::new(size.hidden, size.hidden).with_bias(false).init(device);
                map.weight = Param::from_tensor(zero);
                Mixer::Linear(map)
            }
        };
        Some(AttentionSublayer { norm: sublayer.norm.clone(), mixer })
    });
    let ffn = teacher.ffn.as_ref().filter(|_| size.ffn > 0).map(|ffn| {
        let kept = match neurons {
            Some(scores) => top_indices(scores, size.ffn),
            None => (0..size.ffn).collect(),
        };
        prune_ffn(ffn, &kept, device)
    });
    DecoderLayer { attention, ffn }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::module::Module;
    use burn::tensor::Distribution;

    fn teacher_size() -> DecoderLayerConfig {
        DecoderLayerConfig {
            hidden: 16,
            mixer: MixerKind::Attention,
            heads: 6,
            kv_heads: 2,
            head_dim: 4,
            ffn: 12,
            rope_base: 10_000.0,
            eps: 1e-5,
        }
    }

    fn max_gap(a: Tensor<Flex, 3>, b: Tensor<Flex, 3>) -> f32 {
        (a - b).abs().max().into_scalar()
    }

    #[test]
    fn pruning_to_the_full_size_keeps_the_layer() {
        let device = Default::default();
        let size = teacher_size();
        let teacher = size.init::<Flex>(&device);
        let x = Tensor::<Flex, 3>::random([2, 5, 16], Distribution::Normal(0.0, 1.0), &device);
        let mask = Tensor::<Flex, 2>::ones([2, 5], &device);
        let neurons = ffn_importance(&teacher, x.clone(), mask.clone()).unwrap();
        let copy = prune_decoder(&teacher, &size, Some(&neurons), &device);
        let gap = max_gap(teacher.forward(x.clone(), mask.clone()), copy.forward(x, mask));
        assert!(gap < 1e-5, "the full-size pruned layer differs by {gap}");
    }

    #[test]
    fn pruned_heads_stay_in_their_key_value_groups() {
        let device = Default::default();
        let teacher = teacher_size().init::<Flex>(&device);
        let Some(Mixer::Attention(attention)) = teacher.attention.as_ref().map(|s| &s.mixer) else {
            panic!("an attention layer")
        };
        let (queries, groups) = kept_heads(attention, 2, 1);
        assert_eq!(groups.len(), 1);
        // Both kept query heads read the one kept key/value head (3 per group).
        assert!(queries.iter().all(|&q| q / 3 == groups[0]), "{queries:?} vs {groups:?}");
        let size = DecoderLayerConfig { heads: 2, kv_heads: 1, ffn: 5, ..teacher_size() };
        let pruned = prune_decoder(&teacher, &size, None, &device);
        assert_eq!(pruned.num_params(), size.params());
        let out = pruned.forward(Tensor::ones([1, 3, 16], &device), Tensor::ones([1, 3], &device));
        assert_eq!(out.dims(), [1, 3, 16]);
    }

    #[test]
    fn a_linear_mixer_starts_as_no_attention() {
        let device = Default::default();
        let teacher = teacher_size().init::<Flex>(&device);
        let linear = prune_decoder(
            &teacher,
            &DecoderLayerConfig { mixer: MixerKind::Linear, ..teacher_size() },
            None,
            &device,
        );
        let none = prune_decoder(
            &teacher,
            &DecoderLayerConfig { mixer: MixerKind::None, ..teacher_size() },
            None,
            &device,
        );
        let x = Tensor::<Flex, 3>::random([1, 4, 16], Distribution::Normal(0.0, 1.0), &device);
        let mask = Tensor::<Flex, 2>::ones([1, 4], &device);
        assert!(none.attention.is_none());
        assert!(max_gap(linear.forward(x.clone(), mask.clone()), none.forward(x, mask)) < 1e-6);
    }

    #[test]
    fn tally_scores_every_real_token_but_the_first() {
        let device = Default::default();
        let head = LmHead::<Flex> {
            norm: burn::nn::RmsNormConfig::new(4).init(&device),
            weight: Param::from_tensor(Tensor::random([4, 7], Distribution::Normal(0.0, 1.0), &device)),
        };
        let hidden = Tensor::<Flex, 3>::random([2, 3, 4], Distribution::Normal(0.0, 1.0), &device);
        let sequences: [&[u32]; 2] = [&[1, 2, 3], &[4, 5]];
        let same = tally(&head, &sequences, hidden.clone(), Some(hidden.clone()));
        assert_eq!(same.predicted, 3);
        assert_eq!(same.agree, 3);
        assert!(same.kl.abs() < 1e-5 && (same.teacher_nll - same.student_nll).abs() < 1e-9);
        // Sequence 2's one prediction (token 5 after 4), by hand.
        let position: Tensor<Flex, 2> = hidden.clone().narrow(0, 1, 1).narrow(1, 0, 1).reshape([1, 4]);
        let logits: Vec<f64> = head.forward(position).into_data().iter::<f32>().map(f64::from).collect();
        let expected = logits.iter().map(|v| v.exp()).sum::<f64>().ln() - logits[5];
        let alone = tally(&head, &[&[4, 5]], hidden.narrow(0, 1, 1), None);
        assert_eq!(alone.predicted, 1);
        assert!((alone.teacher_nll - expected).abs() < 1e-4, "{} vs {expected}", alone.teacher_nll);
        assert!((alone.teacher_perplexity() - expected.exp()).abs() < 1e-3 * expected.exp());
    }

    #[test]
    fn the_next_token_head_weights_positions_with_a_real_next_token_and_stays_frozen() {
        type Ad = burn::backend::Autodiff<Flex>;
        let device = Default::default();
        let head = LmHead::<Ad> {
            norm: burn::nn::RmsNormConfig::new(4).init(&device),
            weight: Param::from_tensor(Tensor::random([4, 5], Distribution::Normal(0.0, 1.0), &device)),
        };
        let head = NextTokenHead::new(head);
        let hidden =
            Tensor::<Ad, 3>::random([2, 4, 4], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let mask = Tensor::<Ad, 2>::from_floats([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]], &device);
        let out = head.scores(Activation::Tokens { hidden: hidden.clone(), mask }).unwrap();
        // Positions (0, 0), (0, 1) and (1, 0) have a real next token: their
        // rows only, in order, each the head's logits of that position.
        assert_eq!(out.scores.dims(), [3, 5]);
        let weights: Vec<f32> = out.weights.into_data().iter::<f32>().collect();
        assert_eq!(weights, [1.0, 1.0, 1.0]);
        let all = head.head.forward(hidden.clone().reshape([8, 4]));
        let expected = Tensor::cat(vec![all.clone().narrow(0, 0, 2), all.narrow(0, 4, 1)], 0);
        let gap: f32 = (out.scores.clone() - expected).abs().max().into_scalar();
        assert!(gap < 1e-6, "the kept rows are not the counted positions' logits ({gap})");
        // A batch where nothing counts keeps every row at weight 0.
        let lone = head
            .scores(Activation::Tokens {
                hidden: hidden.clone().narrow(1, 0, 1),
                mask: Tensor::ones([2, 1], &device),
            })
            .unwrap();
        assert_eq!(lone.scores.dims(), [2, 5]);
        assert_eq!(lone.weights.into_data().iter::<f32>().collect::<Vec<_>>(), [0.0, 0.0]);
        // Gradients reach the states, never the head's parameters.
        let grads = out.scores.sum().backward();
        assert!(hidden.grad(&grads).is_some());
        assert!(head.head.weight.val().grad(&grads).is_none());
        assert!(head.head.norm.gamma.val().grad(&grads).is_none());
    }
}
