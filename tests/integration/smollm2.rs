//! The SmolLM2 teacher is the real SmolLM2-135M-Instruct: the same token ids,
//! logits and Brown perplexity as an independent implementation
//! (bench/peers/smollm2_reference.py: llama.cpp's `gguf` package to
//! dequantize, a numpy Llama in float64 with Hugging Face's rotary layout,
//! a pure-Python GPT-2 BPE), recorded in `tests/data/smollm2-reference.json`.

use burn::backend::Flex;
use burn::tensor::{Int, Tensor};
use pipebd_teachers::smollm2::{SmolLm2, SmolTokenizer};
use pipebd_zoo::lm::tally;
use pipebd_zoo::text::strip_tags;
use serde::Deserialize;

use crate::common;

#[derive(Deserialize)]
struct Reference {
    probe_vocab_ids: Vec<usize>,
    sentences: Vec<Sentence>,
    perplexity: Perplexity,
}

#[derive(Deserialize)]
struct Sentence {
    text: String,
    ids: Vec<u32>,
    logits_at_probe_ids: Vec<Vec<f64>>,
    logsumexp: Vec<f64>,
    argmax: Vec<i64>,
    last_top20: Vec<(usize, f64)>,
}

#[derive(Deserialize)]
struct Perplexity {
    file: String,
    sentences: usize,
    max_tokens: usize,
    predicted_tokens: usize,
    perplexity: f64,
}

fn reference() -> Reference {
    let path = common::repo().join("tests/data/smollm2-reference.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

pub fn model_path() -> std::path::PathBuf {
    common::repo().join("data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// `[batch, tokens]` ids padded with 0 and their mask.
fn padded(
    sequences: &[&[u32]],
    device: &burn::backend::flex::FlexDevice,
) -> (Tensor<Flex, 2, Int>, Tensor<Flex, 2>, usize) {
    let tokens = sequences.iter().map(|s| s.len()).max().unwrap();
    let padded = pipebd_teachers::minilm::PaddedIds::new(sequences.iter().copied(), tokens);
    let (ids, mask) = padded.tensors::<Flex>(device);
    (ids, mask, tokens)
}

#[test]
fn tokens_and_logits_match_the_reference() {
    let reference = reference();
    let tokenizer = SmolTokenizer::load(&model_path()).unwrap();
    for sentence in &reference.sentences {
        assert_eq!(
            tokenizer.encode(&sentence.text, 512).unwrap(),
            sentence.ids,
            "ids of {:?}",
            sentence.text
        );
        assert_eq!(tokenizer.decode(&sentence.ids).unwrap(), sentence.text);
    }
    let device = Default::default();
    let model = SmolLm2::<Flex>::load(&model_path(), &device).unwrap();
    // All eight in one padded batch: padding must not change a real token.
    let sequences: Vec<&[u32]> = reference.sentences.iter().map(|s| s.ids.as_slice()).collect();
    let (ids, mask, tokens) = padded(&sequences, &device);
    let logits = model.logits(ids, mask);
    let vocab = model.sizes.vocab;
    let lse: Vec<f32> = logits.clone().exp().sum_dim(1).log().into_data().iter::<f32>().collect();
    let top: Vec<i64> = logits.clone().argmax(1).into_data().iter::<i64>().collect();
    let logits: Vec<f32> = logits.into_data().iter::<f32>().collect();
    for (b, sentence) in reference.sentences.iter().enumerate() {
        let row = |i: usize| &logits[(b * tokens + i) * vocab..(b * tokens + i + 1) * vocab];
        let scale = sentence.logits_at_probe_ids.iter().flatten().fold(1.0f64, |m, v| m.max(v.abs()));
        let mut worst = 0f64;
        for i in 0..sentence.ids.len() {
            for (p, &id) in reference.probe_vocab_ids.iter().enumerate() {
                worst = worst.max((f64::from(row(i)[id]) - sentence.logits_at_probe_ids[i][p]).abs());
            }
            worst = worst.max((f64::from(lse[b * tokens + i]) - sentence.logsumexp[i]).abs());
            assert_eq!(top[b * tokens + i], sentence.argmax[i], "top-1 of {:?} at {i}", sentence.text);
        }
        let last = row(sentence.ids.len() - 1);
        for &(id, value) in &sentence.last_top20 {
            worst = worst.max((f64::from(last[id]) - value).abs());
        }
        eprintln!("{:?}: largest logit gap {worst:.2e} (scale {scale:.1})", sentence.text);
        assert!(worst <= 1e-3 * scale, "{:?}: logits off by {worst} (scale {scale})", sentence.text);
    }
}

#[test]
fn brown_perplexity_matches_the_reference() {
    let reference = reference().perplexity;
    let text = std::fs::read_to_string(common::repo().join("data/brown").join(&reference.file)).unwrap();
    let sentences: Vec<String> =
        text.lines().map(strip_tags).filter(|s| !s.is_empty()).take(reference.sentences).collect();
    let tokenizer = SmolTokenizer::load(&model_path()).unwrap();
    let ids: Vec<Vec<u32>> = sentences
        .iter()
        .map(|s| tokenizer.encode(s, reference.max_tokens).unwrap())
        .filter(|ids| ids.len() >= 2)
        .collect();
    let device = Default::default();
    let model = SmolLm2::<Flex>::load(&model_path(), &device).unwrap();
    let mut total = pipebd_zoo::lm::Tally::default();
    for part in ids.chunks(16) {
        let refs: Vec<&[u32]> = part.iter().map(Vec::as_slice).collect();
        let (ids, mask, _) = padded(&refs, &device);
        let mut hidden = model.embeddings.forward(ids);
        for layer in &model.layers {
            hidden = layer.forward(hidden, mask.clone());
        }
        total.add(tally(&model.head, &refs, hidden, None));
    }
    assert_eq!(total.predicted, reference.predicted_tokens);
    let ours = total.teacher_perplexity();
    let gap = (ours / reference.perplexity - 1.0).abs();
    eprintln!(
        "Brown {} perplexity: ours {ours:.3}, the reference's {:.3}",
        reference.file, reference.perplexity
    );
    assert!(gap < 0.01, "perplexity {ours:.3} vs the reference's {:.3}", reference.perplexity);
}

/// A SmolLM2 run config cut into three blocks of ten layers, with
/// `students` (TOML `[[students]]` tables) after it.
pub(crate) fn tiny_config(dir: &std::path::Path, students: &str) -> std::path::PathBuf {
    let root = common::repo().join("data");
    let text = format!(
        r#"name = "smollm2-test"
seed = 5
# Two pipeline stages with teacher relaying and decoupled updates.
devices = ["cpu", "cpu"]
schedule = "tr-dpu"

[data]
dataset = "brown"
dir = "{brown}"
train_limit = 16
test_limit = 8
max_tokens = 8

[teacher]
kind = "smollm2-135m"
weights = "{weights}"
layers_per_block = [10, 10, 10]

[train]
epochs = 1
batch_size = 8
log_every = 1

[optimizer]
kind = "adam"
lr = 0.00005
{students}"#,
        brown = root.join("brown").display(),
        weights = model_path().display(),
    );
    let path = dir.join("smollm2-test.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// [`tiny_config`] with a pruned layer, a skipped block and an FFN-only
/// layer as students, then a stitched pass that also matches the
/// next-token distributions through the frozen LM head.
pub(crate) fn stitched_decoder_config(dir: &std::path::Path) -> std::path::PathBuf {
    let students = r#"
[[students]]
kind = "decoder"
ffn = 512

[[students]]
kind = "skip"

[[students]]
kind = "decoder"
mixer = "none"
"#;
    let config = tiny_config(dir, students);
    let text = std::fs::read_to_string(&config).unwrap().replace(
        "log_every = 1",
        "log_every = 1\nstitched_epochs = 1\nstitched_output_loss = \"head-kl\"\nstitched_output_weight = 10.0",
    );
    std::fs::write(&config, text).unwrap();
    config
}

/// A search run's students over [`tiny_config`]'s three blocks: two
/// candidate sets (a narrower SwiGLU, no attention, the linear mixer, skip)
/// and one decoder, all randomly initialised.
pub(crate) const SEARCH_STUDENTS: &str = r#"
[[students]]
kind = "candidates"
candidates = [
  { kind = "decoder", ffn = 256, init = "random" },
  { kind = "decoder", mixer = "none", ffn = 128, init = "random" },
  { kind = "skip" },
]

[[students]]
kind = "decoder"
ffn = 128
init = "random"

[[students]]
kind = "candidates"
candidates = [
  { kind = "decoder", ffn = 128, init = "random" },
  { kind = "decoder", mixer = "linear", ffn = 128, init = "random" },
]
"#;

#[test]
fn a_decoder_run_reports_perplexity_and_eval_reloads_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = stitched_decoder_config(dir.path());
    let out = dir.path().join("run");
    let (code, stdout, stderr) =
        common::pipebd(&["run", config.to_str().unwrap(), "--out", out.to_str().unwrap(), "--quiet"]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("perplexity: teacher"), "{stdout}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    let language = &report["language"];
    let teacher = language["teacher_perplexity"].as_f64().unwrap();
    let student = language["student_perplexity"].as_f64().unwrap();
    assert!(teacher.is_finite() && teacher > 1.0 && student.is_finite() && student > 1.0, "{language}");
    let kl = language["mean_kl"].as_f64().unwrap();
    let agreement = language["top1_agreement"].as_f64().unwrap();
    assert!(kl > 0.0 && (0.0..1.0).contains(&agreement), "{language}");
    let stitched = &report["stitched"];
    assert_eq!(stitched["output_loss"], "head-kl", "{stitched}");
    let head_kl = stitched["final_output_loss"].as_f64().unwrap();
    assert!(head_kl.is_finite() && head_kl > 0.0, "{stitched}");
    // One layer pruned to FFN 512, nothing, and one FFN-only layer, for 30.
    let layer = pipebd_teachers::smollm2::SMOLLM2_135M.layer;
    let student_flops = pipebd_kernels::decoder::DecoderLayerConfig { ffn: 512, ..layer }.flops(8)
        + pipebd_kernels::decoder::DecoderLayerConfig {
            mixer: pipebd_kernels::decoder::MixerKind::None,
            ..layer
        }
        .flops(8);
    let expected = student_flops as f64 / (30 * layer.flops(8)) as f64;
    assert!((language["flops_ratio"].as_f64().unwrap() - expected).abs() < 1e-9, "{language}");
    // The saved student scores the same when reloaded.
    let (code, stdout, stderr) = common::pipebd(&["eval", out.to_str().unwrap()]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    let printed = format!("student {student:.2}");
    assert!(stdout.contains(&printed), "`{printed}` not in:\n{stdout}");
}

#[test]
fn configs_refuse_students_that_cannot_replace_a_decoder_layer() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("[[students]]\nkind = \"encoder\"\nffn = 64\n", "`encoder` students attend both ways"),
        ("[[students]]\nkind = \"decoder\"\nheads = 6\nkv_heads = 4\n", "multiple of kv_heads"),
        ("[[students]]\nkind = \"decoder\"\nffn = 2048\n", "ffn <= 1536"),
        ("[[students]]\nkind = \"decoder\"\nmixer = \"none\"\nffn = 0\n", "use `skip`"),
    ];
    for (first, expected) in cases {
        let students = format!("{first}\n[[students]]\nkind = \"skip\"\n\n[[students]]\nkind = \"skip\"\n");
        let config = tiny_config(dir.path(), &students);
        let (code, stdout, stderr) = common::pipebd(&["check", config.to_str().unwrap()]);
        assert_ne!(code, 0, "{first} was accepted:\n{stdout}");
        assert!(stderr.contains(expected) && stderr.contains("block 1"), "{first}: {stderr}");
    }
}

/// Pipe-BD on the decoder LLM: a search run's candidates (three per block
/// over SmolLM2's 30 layers cut into three blocks) trained under teacher
/// relaying on two slots, with and without decoupled updates, end at the
/// weights the ideal schedule gives them on one.
#[test]
fn relayed_schedules_train_the_decoder_candidates_to_the_ideal_weights() {
    use burn::backend::Autodiff;
    use pipe_bd::plan::{flops_cost, Plan};
    use pipe_bd::runtime::{Distillation, RuntimeSettings};
    use pipebd_cli::config::RunConfig;
    use pipebd_cli::zoo::Zoo;
    type B = Autodiff<Flex>;

    let dir = tempfile::tempdir().unwrap();
    let path = tiny_config(dir.path(), SEARCH_STUDENTS);
    let config = RunConfig::parse(&std::fs::read_to_string(&path).unwrap(), &path).unwrap();
    let device = Default::default();
    let workload = pipebd_zoo::Builtin.workload::<Flex>(&config, &device, false).unwrap();
    let teacher = &workload.teacher;
    let train = |plan: &Plan, slots: usize| {
        let students = pipebd_zoo::Builtin.students::<B>(&config, &teacher.specs, &device).unwrap();
        let output = Distillation::new(teacher, students, workload.train.as_ref())
            .settings(config.train_settings())
            .devices(vec![device; slots])
            .runtime(RuntimeSettings { threads_per_worker: 1, ..Default::default() })
            .run(plan)
            .unwrap_or_else(|e| panic!("{}: {e}", plan.name));
        assert_eq!(output.log.steps, 2, "{}: 16 sentences in batches of 8", plan.name);
        let weights: Vec<Vec<f32>> =
            output.students.blocks.iter().map(pipe_bd::flat_parameters::<B, _>).collect();
        (weights, output.log.final_losses)
    };
    let (ideal, ideal_losses) = train(&Plan::ideal(3), 1);
    let untrained: Vec<Vec<f32>> = pipebd_zoo::Builtin
        .students::<B>(&config, &teacher.specs, &device)
        .unwrap()
        .blocks
        .iter()
        .map(pipe_bd::flat_parameters::<B, _>)
        .collect();
    assert!(common::max_abs_diff(&ideal, &untrained) > 1e-6, "the ideal schedule trained nothing");
    let specs = pipebd_zoo::Builtin.student_specs(&config, &teacher.specs).unwrap();
    let cost = flops_cost(&teacher.specs, &specs);
    for name in ["tr", "tr-dpu"] {
        let plan = Plan::named(name, 3, 2, &cost, &[]).unwrap();
        let (weights, losses) = train(&plan, 2);
        let diff = common::max_abs_diff(&ideal, &weights);
        assert!(diff <= 1e-5, "{name}: candidates differ from ideal by {diff}");
        for (a, b) in ideal_losses.iter().zip(&losses) {
            assert!(
                (a - b).abs() <= 1e-5 * a.abs().max(1.0),
                "{name}: final losses {losses:?} vs {ideal_losses:?}"
            );
        }
    }
}
