//! The built-in zoo's `pipebd export` and `pipebd eval-gguf`: decoder
//! students (and SmolLM2 itself) written as GGUF files of llama.cpp's
//! `deci` architecture ([`pipebd_teachers::export`]), and any Llama or
//! `deci` GGUF file scored with llama.cpp's perplexity protocol.
//!
//! Generic over the zoo that reads the configs and rebuilds a run's
//! students (the built-in one passes itself in): this module knows SmolLM2
//! and the decoder students, not the built-in zoo's other teachers.

use std::path::Path;
use std::str::FromStr;
use std::time::Instant;

use burn::tensor::{Int, Tensor, TensorData};
use pipe_bd::{Error, Result};
use pipebd_cli::config::{Overrides, RunConfig};
use pipebd_cli::jobs::export::{ExportRequest, ExportSource, Exported, TextScore, TextScoreRequest};
use pipebd_cli::report::RunReport;
use pipebd_cli::zoo::Zoo;
use pipebd_students::StudentBlock;
use pipebd_teachers::export::{write_deci, ExportLayer, ExportSummary, ExportType};
use pipebd_teachers::gguf::{Gguf, MetaValue};
use pipebd_teachers::smollm2::SmolLm2;

use crate::smollm2::{is_decoder, layers_per_block};
use crate::Lift;

/// The CPU inference backend exports and scores run on.
type Cpu = burn::backend::Flex;

/// The CPU training backend a finished run's students are rebuilt on
/// ([`pipebd_cli::jobs::eval::load_students`]).
type CpuTrain = burn::backend::Autodiff<Cpu>;

/// `pipebd export` with the built-in zoo: `zoo` (the built-in zoo, or one
/// with its students) reads the configs and rebuilds a run's students.
pub fn export<Z>(zoo: &Z, request: &ExportRequest) -> Result<Exported>
where
    Z: Zoo<Student<CpuTrain> = StudentBlock<CpuTrain>>,
{
    if request.format != "gguf" {
        return Err(Error::Zoo {
            path: None,
            message: format!(
                "export format `{}`: the built-in zoo writes `gguf` (llama.cpp's)",
                request.format
            ),
        });
    }
    let kind = ExportType::from_str(&request.kind).map_err(|message| Error::Zoo { path: None, message })?;
    let summary = match &request.source {
        ExportSource::Teacher(config_path) => {
            let config = zoo.load_config(config_path, Overrides::default())?;
            let config_name = config_path.display().to_string();
            require_decoder(&config, &config_name)?;
            export_teacher(&config, kind, request.first_layers, &request.out)?
        }
        ExportSource::Run(run_dir) => {
            if request.first_layers.is_some() {
                return Err(Error::Zoo {
                    path: Some(run_dir.clone()),
                    message: "first layers: a teacher export's option (a student keeps its own layers)"
                        .into(),
                });
            }
            export_run(zoo, run_dir, kind, &request.out)?
        }
    };
    Ok(describe(summary))
}

/// Fails unless `config`'s teacher is a decoder LLM.
fn require_decoder(config: &RunConfig, source: &str) -> Result<()> {
    if is_decoder(config) {
        return Ok(());
    }
    Err(Error::Zoo {
        path: None,
        message: format!(
            "{source}: teacher `{}` is not a decoder LLM; only decoder (`smollm2-135m`) students export to GGUF",
            config.teacher.kind
        ),
    })
}

/// The teacher of `config` written back: whole, or its first `first_layers`
/// decoder layers.
fn export_teacher(
    config: &RunConfig,
    kind: ExportType,
    first_layers: Option<usize>,
    out: &Path,
) -> Result<ExportSummary> {
    let file = Gguf::open(&config.teacher.weights).lift()?;
    let model = SmolLm2::<Cpu>::load(&config.teacher.weights, &Default::default()).lift()?;
    let count = model.layers.len();
    let keep = first_layers.unwrap_or(count);
    if keep == 0 || keep > count {
        return Err(Error::Zoo {
            path: Some(config.teacher.weights.clone()),
            message: format!("first layers: expected 1 to the teacher's {count} layers, got {keep}"),
        });
    }
    let layers: Vec<_> = model.layers[..keep]
        .iter()
        .enumerate()
        .map(|(n, layer)| ExportLayer { layer, teacher_layer: n })
        .collect();
    let name = first_layers.map(|n| {
        let teacher = file.get_str("general.name").unwrap_or("decoder");
        format!("{teacher} (its first {n} of {count} layers)")
    });
    write_deci(&file, &layers, kind, name.as_deref(), out).lift()
}

/// The student saved in `run_dir`.
fn export_run<Z>(zoo: &Z, run_dir: &Path, kind: ExportType, out: &Path) -> Result<ExportSummary>
where
    Z: Zoo<Student<CpuTrain> = StudentBlock<CpuTrain>>,
{
    let report = RunReport::read(run_dir)?;
    let config = &report.config;
    require_decoder(config, &format!("run folder {}", run_dir.display()))?;
    zoo.check(config)?;
    let student_dir = run_dir.join("student");
    if !student_dir.is_dir() {
        return Err(Error::Zoo {
            path: Some(student_dir),
            message: "no student here: was the run finished (`pipebd run --out` writes it at the end)?"
                .into(),
        });
    }
    let teacher_specs = zoo.teacher_specs(config)?;
    let (blocks, _) = pipebd_cli::jobs::eval::load_students(zoo, run_dir, config, &teacher_specs)?;
    let groups = layers_per_block(config)?;
    let layers = decoder_layers(&blocks, &groups)?;
    let file = Gguf::open(&config.teacher.weights).lift()?;
    let teacher_name = file.get_str("general.name").unwrap_or("decoder").to_string();
    let name = format!("{teacher_name} (pipe-bd student of run {})", report.name);
    write_deci(&file, &layers, kind, Some(&name), out).lift()
}

/// The student's decoder layers with the teacher layer each starts from
/// (skipped blocks are left out: the identity needs no layer).
fn decoder_layers<'a>(
    blocks: &'a [StudentBlock<Cpu>],
    groups: &[usize],
) -> Result<Vec<ExportLayer<'a, Cpu>>> {
    let mut layers = Vec::new();
    let mut teacher_layer = 0;
    for (k, (block, group)) in blocks.iter().zip(groups).enumerate() {
        match block {
            StudentBlock::Decoder(layer) => layers.push(ExportLayer { layer, teacher_layer }),
            StudentBlock::Skip(_) => {}
            StudentBlock::Candidates(_) => {
                return Err(Error::Zoo {
                    path: None,
                    message: format!(
                        "block {} is a candidate set: pick one per block (`pipebd search <run> --budget ...` \
                         writes chosen.toml), run that student, and export its run",
                        k + 1
                    ),
                })
            }
            other => {
                return Err(Error::Zoo {
                    path: None,
                    message: format!("block {} is a `{}` block, not a decoder layer", k + 1, other.kind()),
                })
            }
        }
        teacher_layer += group;
    }
    if layers.is_empty() {
        return Err(Error::Zoo { path: None, message: "every block is skipped: nothing to export".into() });
    }
    Ok(layers)
}

/// The export's lines for the user.
fn describe(summary: ExportSummary) -> Exported {
    let ratio = summary.weight_macs_per_token as f64 / summary.teacher_weight_macs_per_token as f64;
    let mut details = vec![format!(
        "{} decoder layers; weight multiply-adds per token {:.1} M, {:.3}x the teacher's {:.1} M (with the LM head)",
        summary.layers,
        summary.weight_macs_per_token as f64 / 1e6,
        ratio,
        summary.teacher_weight_macs_per_token as f64 / 1e6,
    )];
    details.extend(summary.notes.iter().cloned());
    details.push(format!(
        "run it: llama-completion -m {} -p \"...\" -n 64   score it: pipebd eval-gguf {} --text <file> --context 512",
        summary.path.display(),
        summary.path.display()
    ));
    Exported { path: summary.path, bytes: summary.bytes, details }
}

/// Tokens per forward pass of the scoring (windows are batched up to it).
const SCORE_BATCH_TOKENS: usize = 2048;

/// `pipebd eval-gguf` with the built-in zoo: llama.cpp's `llama-perplexity`
/// protocol (tools/perplexity/perplexity.cpp): the whole text tokenized
/// (with BOS when the file asks for one), cut into windows of `context`
/// tokens (the first replaced by BOS when the file adds one), and in each
/// window the tokens after the first half predicted from all before them.
pub fn score_model_file(request: &TextScoreRequest) -> Result<TextScore> {
    let started = Instant::now();
    let context = request.context;
    if context < 4 {
        return Err(Error::Zoo { path: None, message: format!("--context {context}: at least 4 tokens") });
    }
    if !request.model.is_file() {
        return Err(Error::Zoo { path: Some(request.model.clone()), message: "no such model file".into() });
    }
    let text = read_text(&request.text)?;
    if let Some(path) = &request.save_text {
        std::fs::write(path, &text).map_err(|e| Error::io("writing", path, e))?;
    }
    let device = Default::default();
    let model = SmolLm2::<Cpu>::load(&request.model, &device).lift()?;
    let file = Gguf::open(&request.model).lift()?;
    let bos = match file.get("tokenizer.ggml.add_bos_token") {
        Some(MetaValue::Bool(true)) => Some(file.get_usize("tokenizer.ggml.bos_token_id").lift()? as u32),
        _ => None,
    };
    let mut tokens = model.tokenizer.encode(&text, usize::MAX).lift()?;
    if let Some(bos) = bos {
        tokens.insert(0, bos);
    }
    if tokens.len() < 2 * context {
        return Err(Error::Zoo {
            path: Some(request.text.clone()),
            message: format!(
                "tokenizes to {} tokens; a context of {context} needs at least {} (llama-perplexity's rule)",
                tokens.len(),
                2 * context
            ),
        });
    }
    let windows = (tokens.len() / context).min(request.max_windows.unwrap_or(usize::MAX));
    let first = context / 2;
    let per_batch = (SCORE_BATCH_TOKENS / context).max(1);
    let (mut nll, mut scored) = (0f64, 0usize);
    let mut throttle = pipebd_cli::reporter::Throttle::every(std::time::Duration::from_secs(10));
    for batch_start in (0..windows).step_by(per_batch) {
        let batch = per_batch.min(windows - batch_start);
        let mut ids = tokens[batch_start * context..(batch_start + batch) * context].to_vec();
        if let Some(bos) = bos {
            ids.chunks_mut(context).for_each(|window| window[0] = bos);
        }
        nll += window_nll(&model, &ids, batch, context, first, &device);
        scored += batch * (context - 1 - first);
        pipebd_cli::reporter::reporter().periodic(&mut throttle, "eval-gguf", || {
            format!(
                "{}/{windows} windows, perplexity so far {:.4}",
                batch_start + batch,
                (nll / scored as f64).exp()
            )
        });
    }
    Ok(TextScore {
        perplexity: (nll / scored as f64).exp(),
        text_tokens: tokens.len(),
        windows,
        scored_tokens: scored,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The text of `path`: a file as it is, or a Brown folder's held-out
/// sentences (the split every run uses), one per line.
fn read_text(path: &Path) -> Result<String> {
    if path.is_dir() {
        let (_, heldout) = crate::text::brown_splits(path, None, None)?;
        return Ok(heldout.join("\n") + "\n");
    }
    std::fs::read_to_string(path).map_err(|e| Error::io("reading", path, e))
}

/// Summed negative log-likelihood of `batch` windows of `ids` (the real
/// tokens, not the BOS a window may start with): positions `first ..
/// context - 1` predicting the token after them.
fn window_nll<B: pipebd_kernels::FusedBackend>(
    model: &SmolLm2<B>,
    ids: &[u32],
    batch: usize,
    context: usize,
    first: usize,
    device: &B::Device,
) -> f64 {
    let as_int: Vec<i64> = ids.iter().map(|&id| id as i64).collect();
    let input = Tensor::<B, 2, Int>::from_data(TensorData::new(as_int, [batch, context]), device);
    let mask = Tensor::<B, 2>::ones([batch, context], device);
    let mut hidden = model.embeddings.forward(input);
    for layer in &model.layers {
        hidden = layer.forward(hidden, mask.clone());
    }
    let scored = context - 1 - first;
    let width = hidden.dims()[2];
    let rows = hidden.narrow(1, first, scored).reshape([batch * scored, width]);
    let logits: Vec<f32> =
        model.head.forward(rows).into_data().convert::<f32>().to_vec().expect("f32 logits");
    let vocab = logits.len() / (batch * scored);
    let mut nll = 0f64;
    for (row, values) in logits.chunks_exact(vocab).enumerate() {
        let (window, position) = (row / scored, first + row % scored);
        let target = ids[window * context + position + 1] as usize;
        let max = values.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        let sum: f64 = values.iter().map(|&v| (v as f64 - max).exp()).sum();
        nll += max + sum.ln() - values[target] as f64;
    }
    nll
}
