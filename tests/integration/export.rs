//! `pipebd export --format gguf` and `pipebd eval-gguf`: the teacher written
//! back is the original file's tensors; a student of every layer kind
//! (pruned SwiGLU, fewer heads, the linear mixer, no attention, no SwiGLU,
//! a skipped layer) written at F32 and read back computes its own logits;
//! at Q8_0 every weight comes back within the quantizer's step; eval-gguf
//! follows llama-perplexity's windows; bad requests get clear errors.

use burn::backend::Flex;
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::{Int, Tensor, TensorData};
use pipebd_kernels::decoder::{DecoderLayer, DecoderLayerConfig, Mixer, MixerKind};
use pipebd_teachers::export::{write_deci, ExportLayer, ExportType, ZERO_FFN};
use pipebd_teachers::gguf::{dequantize, Gguf, MetaValue, TensorType};
use pipebd_teachers::smollm2::{SmolLm2, SMOLLM2_135M};

use crate::common;
use crate::smollm2::model_path;

type Model = SmolLm2<Flex>;

/// `pipebd export --teacher` of the SmolLM2 config at `kind` into `dir`:
/// the file and what the command printed.
fn export_teacher(dir: &std::path::Path, kind: &str) -> (std::path::PathBuf, String) {
    let out = dir.join(format!("teacher-{kind}.gguf"));
    let config = "experiments/smollm2-chosen.toml";
    let (code, stdout, stderr) =
        common::pipebd(&["export", "--teacher", config, "--type", kind, "--out", out.to_str().unwrap()]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    (out, stdout)
}

#[test]
fn the_teacher_exported_at_its_own_types_is_the_original_files_tensors() {
    let _disk = common::writes_large_files();
    let dir = common::large_tempdir();
    let (out, stdout) = export_teacher(dir.path(), "teacher");
    assert!(stdout.contains("1.000x the teacher's"), "{stdout}");
    let (original, exported) = (Gguf::open(&model_path()).unwrap(), Gguf::open(&out).unwrap());
    assert_eq!(exported.get_str("general.architecture").unwrap(), "deci");
    assert_eq!(exported.tensors.len(), original.tensors.len(), "no tensor added or lost");
    for tensor in &original.tensors {
        let (info, bytes) = exported.raw_tensor(&tensor.name).unwrap();
        assert_eq!((info.kind, &info.shape), (tensor.kind, &tensor.shape), "{}", tensor.name);
        assert!(bytes == original.raw_tensor(&tensor.name).unwrap().1, "{}: other bytes", tensor.name);
    }
    for (key, value) in original.metadata.iter().filter(|(k, _)| k.starts_with("tokenizer.")) {
        assert_eq!(exported.get(key), Some(value), "{key}");
    }
    let per_layer = |v: i32| MetaValue::Array(vec![MetaValue::I32(v); 30]);
    assert_eq!(exported.get("deci.attention.head_count"), Some(&per_layer(9)));
    assert_eq!(exported.get("deci.attention.head_count_kv"), Some(&per_layer(3)));
    assert_eq!(exported.get("deci.feed_forward_length"), Some(&per_layer(1536)));
    assert_eq!(exported.get_usize("deci.rope.dimension_count").unwrap(), 64);
    assert_eq!(exported.get_usize("deci.attention.key_length").unwrap(), 64);
    drop(exported);
    std::fs::remove_file(&out).unwrap();
    // At F32 every tensor holds exactly the values the teacher computes with.
    let exported = Gguf::open(&export_teacher(dir.path(), "f32").0).unwrap();
    for tensor in &original.tensors {
        assert_eq!(exported.info(&tensor.name).unwrap().kind, TensorType::F32, "{}", tensor.name);
        assert!(
            exported.tensor(&tensor.name).unwrap() == original.tensor(&tensor.name).unwrap(),
            "{}",
            tensor.name
        );
    }
}

/// `pipebd export --teacher ... --first-layers 2`: the file holds the
/// original's embeddings, head and first two layers byte for byte and
/// nothing of the others, and a run takes it as its teacher (two blocks).
#[test]
fn a_teacher_cut_to_its_first_layers_is_a_teacher_of_those_layers() {
    let _disk = common::writes_large_files();
    let dir = common::large_tempdir();
    let out = dir.path().join("first-2.gguf");
    let config = "experiments/smollm2-chosen.toml";
    let (code, stdout, stderr) = common::pipebd(&[
        "export",
        "--teacher",
        config,
        "--first-layers",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("2 decoder layers"), "{stdout}");
    let (original, cut) = (Gguf::open(&model_path()).unwrap(), Gguf::open(&out).unwrap());
    assert_eq!(cut.get_usize("deci.block_count").unwrap(), 2);
    assert!(cut.get_str("general.name").unwrap().contains("first 2 of 30 layers"));
    let kept =
        |name: &str| !name.starts_with("blk.") || name.starts_with("blk.0.") || name.starts_with("blk.1.");
    let expected: Vec<_> = original.tensors.iter().filter(|t| kept(&t.name)).collect();
    assert_eq!(cut.tensors.len(), expected.len(), "the first two layers' tensors and the shared ones");
    for tensor in expected {
        let (info, bytes) = cut.raw_tensor(&tensor.name).unwrap();
        assert_eq!((info.kind, &info.shape), (tensor.kind, &tensor.shape), "{}", tensor.name);
        assert!(bytes == original.raw_tensor(&tensor.name).unwrap().1, "{}: other bytes", tensor.name);
    }
    // As a teacher: one block per layer by default, so two students.
    let run_config = crate::smollm2::tiny_config(
        dir.path(),
        "\n[[students]]\nkind = \"decoder\"\n\n[[students]]\nkind = \"decoder\"\nffn = 512\n",
    );
    let text = std::fs::read_to_string(&run_config)
        .unwrap()
        .replace(model_path().to_str().unwrap(), out.to_str().unwrap())
        .replace("layers_per_block = [10, 10, 10]\n", "");
    assert!(text.contains("first-2.gguf"), "{text}");
    std::fs::write(&run_config, text).unwrap();
    let run = dir.path().join("run");
    let (code, stdout, stderr) =
        common::pipebd(&["run", run_config.to_str().unwrap(), "--out", run.to_str().unwrap(), "--quiet"]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["blocks"].as_array().unwrap().len(), 2, "{}", report["blocks"]);
    let teacher = report["language"]["teacher_perplexity"].as_f64().unwrap();
    assert!(teacher.is_finite() && teacher > 1.0, "{teacher}");
    // Cut past its end, or to nothing: refused.
    for n in ["0", "31"] {
        let (code, _, stderr) = common::pipebd(&[
            "export",
            "--teacher",
            config,
            "--first-layers",
            n,
            "--out",
            dir.path().join("x.gguf").to_str().unwrap(),
        ]);
        assert_ne!(code, 0);
        assert!(stderr.contains("expected 1 to the teacher's 30 layers"), "{stderr}");
    }
}

/// A layer of `config`'s sizes with burn's random weights, scaled down so
/// that it nudges the residual stream instead of swamping it.
fn random_layer(config: DecoderLayerConfig) -> DecoderLayer<Flex> {
    let layer = config.init::<Flex>(&Default::default());
    layer.map(&mut Scale(0.05))
}

struct Scale(f32);

impl burn::module::ModuleMapper<Flex> for Scale {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<Flex, D>>) -> Param<Tensor<Flex, D>> {
        let (id, tensor, mapper) = param.consume();
        let scaled = if D == 1 { tensor } else { tensor.mul_scalar(self.0) };
        Param::from_mapped_value(id, scaled, mapper)
    }
}

/// The first `len` inputs (`dim` 0) or outputs (`dim` 1) of `linear`.
fn narrowed(linear: &Linear<Flex>, dim: usize, len: usize) -> Linear<Flex> {
    let mut out = linear.clone();
    out.weight = Param::from_tensor(linear.weight.val().narrow(dim, 0, len));
    out
}

/// Query heads, key/value heads and SwiGLU width of a layer as written.
type LayerCounts = (usize, usize, usize);

/// Layers of the student of every kind: its first layers one of each kind,
/// the rest the teacher's, the teacher's later layers skipped (a shorter
/// file, and a student that drops layers is a kind of its own).
const EVERY_KIND_LAYERS: usize = 8;

/// The teacher's first layers, one replaced by each kind, and the (heads,
/// kv heads, SwiGLU width) each layer must have in the file.
fn student_of_every_kind(teacher: &Model) -> (Vec<DecoderLayer<Flex>>, Vec<LayerCounts>) {
    let base = SMOLLM2_135M.layer;
    let mut layers = teacher.layers[..EVERY_KIND_LAYERS].to_vec();
    let mut expected = vec![(9, 3, 1536); layers.len()];
    // No attention in layer 0: written as a zero linear mixer.
    layers[0].attention = None;
    expected[0] = (9, 0, 1536);
    // A SwiGLU pruned to 64 neurons.
    let ffn = layers[1].ffn.as_mut().unwrap();
    (ffn.gate, ffn.up, ffn.down) =
        (narrowed(&ffn.gate, 1, 64), narrowed(&ffn.up, 1, 64), narrowed(&ffn.down, 0, 64));
    expected[1] = (9, 3, 64);
    // The linear mixer.
    layers[2].attention = random_layer(DecoderLayerConfig { mixer: MixerKind::Linear, ..base }).attention;
    expected[2] = (9, 0, 1536);
    // 6 query heads over 2 key/value heads, and no SwiGLU: a zero one stands in.
    let Some(Mixer::Attention(attention)) = layers[3].attention.as_mut().map(|a| &mut a.mixer) else {
        panic!()
    };
    attention.query = narrowed(&attention.query, 1, 6 * 64);
    attention.key = narrowed(&attention.key, 1, 2 * 64);
    attention.value = narrowed(&attention.value, 1, 2 * 64);
    attention.output = narrowed(&attention.output, 0, 6 * 64);
    (attention.heads, attention.kv_heads) = (6, 2);
    layers[3].ffn = None;
    expected[3] = (6, 2, ZERO_FFN);
    // Attention removed.
    layers[4].attention = None;
    expected[4] = (0, 0, 1536);
    // The last layer without SwiGLU.
    layers.last_mut().unwrap().ffn = None;
    *expected.last_mut().unwrap() = (9, 3, ZERO_FFN);
    (layers, expected)
}

/// Logits `[sentences * tokens, vocab]` of embeddings -> `layers` -> the
/// head of `model`, for the sentences padded to one batch.
fn logits(model: &Model, layers: &[DecoderLayer<Flex>], sentences: &[Vec<u32>]) -> (Vec<f32>, usize) {
    let device = Default::default();
    let tokens = sentences.iter().map(Vec::len).max().unwrap();
    let padded = pipebd_teachers::minilm::PaddedIds::new(sentences.iter().map(Vec::as_slice), tokens);
    let (ids, mask) = padded.tensors::<Flex>(&device);
    let mut hidden = model.embeddings.forward(ids);
    for layer in layers {
        hidden = layer.forward(hidden, mask.clone());
    }
    let [b, t, h] = hidden.dims();
    let values = model.head.forward(hidden.reshape([b * t, h])).into_data().to_vec::<f32>().unwrap();
    (values, tokens)
}

fn probe_sentences(model: &Model) -> Vec<Vec<u32>> {
    [
        "It's late, and they'll say we'd've known.",
        "In 1984, 3.5 million people paid $12,000 each.",
        "The café served a naïve crème brûlée.",
        "The quick brown fox jumps over the lazy dog while the sun sets slowly.",
        "Good morning",
        "def f(x): return x**2",
        "Wait... what?!? No -- really?! (Yes!!!)",
        "  Two  spaces  here, and a leading one.",
    ]
    .iter()
    .map(|s| model.tokenizer.encode(s, 64).unwrap())
    .collect()
}

/// The teacher, the student of every kind, the counts its layers must have
/// in the file, and what writing it at `kind` to `out` reported.
struct EveryKind {
    teacher: Model,
    layers: Vec<DecoderLayer<Flex>>,
    expected: Vec<LayerCounts>,
    summary: pipebd_teachers::export::ExportSummary,
}

fn export_every_kind(kind: ExportType, out: &std::path::Path) -> EveryKind {
    let teacher = Model::load(&model_path(), &Default::default()).unwrap();
    let (layers, expected) = student_of_every_kind(&teacher);
    let file = Gguf::open(&model_path()).unwrap();
    let export: Vec<_> =
        layers.iter().enumerate().map(|(n, layer)| ExportLayer { layer, teacher_layer: n }).collect();
    let summary = write_deci(&file, &export, kind, Some("every kind"), out).unwrap();
    EveryKind { teacher, layers, expected, summary }
}

#[test]
fn a_student_of_every_layer_kind_exported_at_f32_computes_its_own_logits() {
    let device = Default::default();
    let _disk = common::writes_large_files();
    let dir = common::large_tempdir();
    let keep = std::env::var_os("PIPEBD_KEEP_EXPORT").map(std::path::PathBuf::from);
    let out = keep.clone().unwrap_or_else(|| dir.path().to_path_buf()).join("every-kind-f32.gguf");
    let EveryKind { teacher, layers, expected, summary } = export_every_kind(ExportType::F32, &out);
    assert_eq!(summary.notes.len(), 3, "layer 0's linear stand-in and two zero SwiGLUs: {:?}", summary.notes);
    let back = Model::load(&out, &device).unwrap();
    let sizes: Vec<_> = back.layer_sizes.iter().map(|l| (l.heads, l.kv_heads, l.ffn)).collect();
    assert_eq!(sizes, expected);
    assert_eq!(back.layer_sizes[2].mixer, MixerKind::Linear);
    assert_eq!(back.layer_sizes[4].mixer, MixerKind::None);
    let sentences = probe_sentences(&teacher);
    let (want, tokens) = logits(&teacher, &layers, &sentences);
    let (got, _) = logits(&back, &back.layers, &sentences);
    let vocab = SMOLLM2_135M.vocab;
    let mut worst = 0f32;
    let mut scale = 1f32;
    for (s, sentence) in sentences.iter().enumerate() {
        // Real tokens only: padding rows are not defined to agree.
        for i in 0..sentence.len() {
            let row = (s * tokens + i) * vocab..(s * tokens + i + 1) * vocab;
            for (a, b) in want[row.clone()].iter().zip(&got[row]) {
                worst = worst.max((a - b).abs());
                scale = scale.max(a.abs());
            }
        }
    }
    assert!(worst <= 1e-4 * scale, "exported logits off by {worst} (scale {scale})");
    if let Some(keep) = keep {
        // For llama.cpp by hand (its random linear mixer drawn again).
        export_every_kind(ExportType::Teacher, &keep.join("every-kind-q4_1.gguf"));
    }
}

#[test]
fn a_q8_0_export_keeps_every_weight_within_the_quantizers_step() {
    let _disk = common::writes_large_files();
    let dir = common::large_tempdir();
    let (f32_path, q8_path) = (dir.path().join("f32.gguf"), dir.path().join("q8.gguf"));
    let EveryKind { layers, .. } = export_every_kind(ExportType::F32, &f32_path);
    let export: Vec<_> =
        layers.iter().enumerate().map(|(n, layer)| ExportLayer { layer, teacher_layer: n }).collect();
    write_deci(&Gguf::open(&model_path()).unwrap(), &export, ExportType::Q8_0, None, &q8_path).unwrap();
    let (exact, quantized) = (Gguf::open(&f32_path).unwrap(), Gguf::open(&q8_path).unwrap());
    for tensor in &exact.tensors {
        let (_, want) = exact.tensor(&tensor.name).unwrap();
        let (info, bytes) = quantized.raw_tensor(&tensor.name).unwrap();
        let expected = if tensor.shape.len() == 1 { TensorType::F32 } else { TensorType::Q8_0 };
        assert_eq!(info.kind, expected, "{}", tensor.name);
        let got = dequantize(info.kind, &bytes).unwrap();
        for (block, back) in want.chunks(32).zip(got.chunks(32)) {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            // Half a step of amax / 127, plus 127 times the f16 scale's
            // rounding (relative 2^-11; absolute 2^-25 below f16's normals).
            let scale_error = (amax / 127.0 * 2f32.powi(-11)).max(2f32.powi(-25));
            let bound = amax / 254.0 + 127.0 * scale_error + 1e-9;
            for (a, b) in block.iter().zip(back) {
                assert!((a - b).abs() <= bound, "{}: {a} came back as {b} (bound {bound})", tensor.name);
            }
        }
    }
}

#[test]
fn eval_gguf_scores_the_second_half_of_each_window_as_llama_perplexity_does() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("text.txt");
    let sentences = "The jury said it did find that many of Georgia's registration and election laws are \
                     outmoded or inadequate and often ambiguous. It recommended that Fulton legislators act \
                     to have these laws studied and revised to the end of modernizing and improving them.";
    std::fs::write(&text, sentences).unwrap();
    let context = 16;
    let model_file = model_path();
    let args =
        ["eval-gguf", model_file.to_str().unwrap(), "--text", text.to_str().unwrap(), "--context", "16"];
    let (code, stdout, stderr) = common::pipebd(&args);
    assert_eq!(code, 0, "{stdout}{stderr}");
    let printed: f64 = stdout.split_whitespace().nth(1).unwrap().parse().unwrap();
    // The same windows by hand: whole logits, log-softmax, second halves.
    let device = Default::default();
    let model = Model::load(&model_path(), &device).unwrap();
    let ids = model.tokenizer.encode(sentences, usize::MAX).unwrap();
    let windows = ids.len() / context;
    let mut nll = 0f64;
    for w in 0..windows {
        let window: Vec<i64> = ids[w * context..(w + 1) * context].iter().map(|&i| i64::from(i)).collect();
        let input = Tensor::<Flex, 2, Int>::from_data(TensorData::new(window.clone(), [1, context]), &device);
        let logits = model.logits(input, Tensor::ones([1, context], &device));
        let log_probs = burn::tensor::activation::log_softmax(logits, 1).into_data().to_vec::<f32>().unwrap();
        let vocab = log_probs.len() / context;
        for i in context / 2..context - 1 {
            nll -= f64::from(log_probs[i * vocab + window[i + 1] as usize]);
        }
    }
    let expected = (nll / (windows * (context - 1 - context / 2)) as f64).exp();
    assert!((printed - expected).abs() <= 1e-3 * expected, "eval-gguf printed {printed}, by hand {expected}");
    assert!(stdout.contains(&format!("{windows} windows")), "{stdout}");
    // Too short a text for the context: llama-perplexity's rule, said plainly.
    let args =
        ["eval-gguf", model_file.to_str().unwrap(), "--text", text.to_str().unwrap(), "--context", "512"];
    let (code, _, stderr) = common::pipebd(&args);
    assert_ne!(code, 0);
    assert!(stderr.contains("needs at least 1024"), "{stderr}");
}

#[test]
fn bad_export_requests_say_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.gguf");
    let out = out.to_str().unwrap();
    let config = "experiments/smollm2-chosen.toml";
    let cases: [(&[&str], &str); 5] = [
        (&["export", "--teacher", config, "--type", "q5_k", "--out", out], "unknown export type `q5_k`"),
        (&["export", "--teacher", config, "--format", "onnx", "--out", out], "writes `gguf`"),
        (&["export", "--teacher", "experiments/mnist-cnn.toml", "--out", out], "not a decoder LLM"),
        (&["export", dir.path().to_str().unwrap(), "--out", out], "report.json"),
        (&["eval-gguf", "no/such/model.gguf", "--text", config], "no/such/model.gguf"),
    ];
    for (args, expected) in cases {
        let (code, stdout, stderr) = common::pipebd(args);
        assert_ne!(code, 0, "{args:?} succeeded: {stdout}");
        assert!(stderr.contains(expected), "{args:?}: expected {expected:?} in: {stderr}");
    }
    assert!(!std::path::Path::new(out).exists(), "a refused export writes no file");
}

#[derive(serde::Deserialize)]
struct Probes {
    probe_vocab_ids: Vec<usize>,
    layers: Vec<LayerCounts>,
    sentences: Vec<Probe>,
}

#[derive(serde::Deserialize)]
struct Probe {
    text: String,
    ids: Vec<u32>,
    logits_at_probe_ids: Vec<Vec<f64>>,
    logsumexp: Vec<f64>,
}

/// The Python of `scripts/setup-python.sh` (llama.cpp's `gguf` reader, numpy).
fn reference_python() -> std::path::PathBuf {
    let python = common::repo().join("data/venv-gguf/bin/python");
    assert!(python.exists(), "{} is missing: run scripts/setup-python.sh", python.display());
    python
}

#[test]
fn llama_cpps_reader_and_a_numpy_decoder_compute_the_exported_students_logits() {
    let _disk = common::writes_large_files();
    let dir = common::large_tempdir();
    let (out, probes) = (dir.path().join("student.gguf"), dir.path().join("probes.json"));
    let EveryKind { teacher, layers, expected, .. } = export_every_kind(ExportType::F32, &out);
    let script = common::repo().join("bench/peers/smollm2_reference.py");
    let done = std::process::Command::new(reference_python())
        .args([script.as_os_str(), "--probe".as_ref(), out.as_os_str(), probes.as_os_str()])
        .output()
        .unwrap();
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    let probes: Probes = serde_json::from_str(&std::fs::read_to_string(&probes).unwrap()).unwrap();
    assert_eq!(probes.layers, expected, "the per-layer sizes gguf reads");
    let ids: Vec<Vec<u32>> = probes.sentences.iter().map(|s| s.ids.clone()).collect();
    let (ours, tokens) = logits(&teacher, &layers, &ids);
    let vocab = SMOLLM2_135M.vocab;
    for (s, sentence) in probes.sentences.iter().enumerate() {
        assert_eq!(
            teacher.tokenizer.encode(&sentence.text, 512).unwrap(),
            sentence.ids,
            "{:?}",
            sentence.text
        );
        let scale = sentence.logits_at_probe_ids.iter().flatten().fold(1f64, |m, v| m.max(v.abs()));
        let mut worst = 0f64;
        for i in 0..sentence.ids.len() {
            let row = &ours[(s * tokens + i) * vocab..(s * tokens + i + 1) * vocab];
            for (p, &id) in probes.probe_vocab_ids.iter().enumerate() {
                worst = worst.max((f64::from(row[id]) - sentence.logits_at_probe_ids[i][p]).abs());
            }
            let max = row.iter().fold(f32::MIN, |m, &v| m.max(v)) as f64;
            let lse = max + row.iter().map(|&v| (f64::from(v) - max).exp()).sum::<f64>().ln();
            worst = worst.max((lse - sentence.logsumexp[i]).abs());
        }
        eprintln!("{:?}: largest logit gap {worst:.2e} (scale {scale:.1})", sentence.text);
        assert!(worst <= 1e-4 * scale, "{:?}: logits off by {worst} (scale {scale})", sentence.text);
    }
}
