//! The fuzz targets: one per reader, each calling the function `pipebd`
//! calls on that file, with the valid inputs its mutations start from.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use pipebd_zoo::teachers::gguf::{MetaValue, TensorType};
use pipebd_zoo::teachers::gguf_write::{quantize, GgufWriter, OutTensor};

/// What one input did.
#[derive(Debug)]
pub enum Outcome {
    /// Read without complaint.
    Accepted,
    /// Refused with this message.
    Refused(String),
    /// Read, but what was read is wrong (a damaged file taken as valid).
    Wrong(String),
}

impl<T> From<pipe_bd::Result<T>> for Outcome {
    fn from(result: pipe_bd::Result<T>) -> Self {
        match result {
            Ok(_) => Outcome::Accepted,
            Err(e) => Outcome::Refused(e.to_string()),
        }
    }
}

/// A config's outcome: a refusal must be the user's error (`pipebd` exits
/// with 2), not a runtime failure (exit code 1).
fn user_refusal(result: pipe_bd::Result<()>) -> Outcome {
    match result {
        Ok(()) => Outcome::Accepted,
        Err(e) if e.is_user_error() => Outcome::Refused(e.to_string()),
        Err(e) => Outcome::Wrong(format!("refused as a runtime failure (exit code 1, not 2): {e}")),
    }
}

/// One reader under fuzz.
pub struct Target {
    /// Its name on the command line and in the summary.
    pub name: &'static str,
    /// What it reads, for the summary.
    pub what: &'static str,
    /// A text format (token-level mutations apply).
    pub text: bool,
    /// Builds models (configs, sweeps): a checked config may build every
    /// student block to count its sizes, so it gets 4 GiB more than the
    /// other targets' allowance and 5 times the hang limit.
    pub heavy: bool,
    /// The file name the input is written to inside the work folder.
    pub file: &'static str,
    /// Prepares the work folder and returns the valid inputs (`None`: the
    /// committed seed of the same name, `fuzz/seeds/<file>`).
    pub seeds: Option<fn(&Path) -> Result<Vec<Vec<u8>>, String>>,
    /// Reads the input at `path` (inside `work`) as `pipebd` would.
    pub run: fn(&Path, &Path) -> Outcome,
}

impl Target {
    /// Prepares the work folder and returns the valid inputs.
    pub fn valid_inputs(&self, work: &Path) -> Result<Vec<Vec<u8>>, String> {
        match self.seeds {
            Some(seeds) => seeds(work),
            None => seed_files(&[self.file]),
        }
    }

    /// The name of the file the input is written to.
    pub fn file_name(&self) -> String {
        Path::new(self.file).file_name().unwrap_or_default().to_string_lossy().into_owned()
    }
}

/// A target of a text file a run writes, whose valid input is the committed
/// seed of that name.
fn committed(
    name: &'static str,
    what: &'static str,
    file: &'static str,
    run: fn(&Path, &Path) -> Outcome,
) -> Target {
    Target { name, what, text: true, heavy: false, file, seeds: None, run }
}

/// Every target, in the order the summary lists them.
pub fn all() -> Vec<Target> {
    let mut all = input_targets();
    all.extend(run_folder_targets());
    all
}

/// The readers of what a run starts from: configs, sweeps, models, data.
fn input_targets() -> Vec<Target> {
    vec![
        Target {
            name: "config",
            what: "run configs (pipebd check)",
            text: true,
            heavy: true,
            file: "run.toml",
            seeds: Some(config_seeds),
            run: |p, _| user_refusal(pipebd_zoo::fuzzing::check_config(p)),
        },
        Target {
            name: "sweep",
            what: "sweep files and their grids",
            text: true,
            heavy: true,
            file: "sweep.toml",
            seeds: Some(sweep_seeds),
            run: |p, _| user_refusal(pipebd_zoo::fuzzing::check_sweep(p)),
        },
        Target {
            name: "gguf",
            what: "GGUF models (SmolLM2 load + tokenizer)",
            text: false,
            heavy: false,
            file: "model.gguf",
            seeds: Some(gguf_seeds),
            run: |p, _| pipebd_zoo::fuzzing::load_gguf_model(p).into(),
        },
        Target {
            name: "idx-images",
            what: "MNIST IDX image files",
            text: false,
            heavy: false,
            file: "images-idx3-ubyte",
            seeds: Some(idx_image_seeds),
            run: |p, _| pipebd_zoo::fuzzing::read_idx_images(p).into(),
        },
        Target {
            name: "idx-labels",
            what: "MNIST IDX label files",
            text: false,
            heavy: false,
            file: "labels-idx1-ubyte",
            seeds: Some(idx_label_seeds),
            run: |p, _| pipebd_zoo::fuzzing::read_idx_labels(p).into(),
        },
    ]
}

/// The readers of what a run writes and reads back, and of rank frames.
fn run_folder_targets() -> Vec<Target> {
    vec![
        committed("metrics", "metrics.csv", "metrics.csv", |p, _| {
            pipebd_cli::metrics::read_metrics(p).into()
        }),
        committed(
            "sweep-csv",
            "sweep.csv (the finished points a sweep resumes from)",
            "sweep.csv",
            |p, _| {
                let keys = ["schedule".to_string(), "train.batch_size".to_string()];
                pipebd_cli::jobs::sweep::read_rows(p, &keys).into()
            },
        ),
        committed("report", "report.json", "report.json", |_, w| {
            pipebd_cli::report::RunReport::read(w).into()
        }),
        committed("search", "search.json", "search.json", |p, _| {
            pipebd_cli::jobs::search::SearchScores::read(p).into()
        }),
        committed("trace", "trace.json (pipebd plot's timeline)", "trace.json", |p, _| {
            pipebd_cli::jobs::plot::timeline::Timeline::read(p).into()
        }),
        committed("profile", "profile caches (pipebd profile)", "profile.json", |p, _| {
            pipebd_cli::jobs::profile::Profile::read(p).into()
        }),
        Target {
            name: "plot",
            what: "run folders drawn by pipebd plot (metrics.csv)",
            text: true,
            heavy: false,
            file: "metrics.csv",
            seeds: Some(plot_seeds),
            run: |_, w| pipebd_cli::jobs::plot::plot_run(w).into(),
        },
        Target {
            name: "manifest",
            what: "checkpoint manifests",
            text: true,
            heavy: false,
            file: "checkpoints/block-01/step-00000041/manifest.json",
            seeds: Some(manifest_seeds),
            run: read_checkpoint,
        },
        Target {
            name: "checkpoint-data",
            what: "checkpoint weight files (checksums)",
            text: false,
            heavy: false,
            file: "checkpoints/block-01/step-00000041/weights.mpk",
            seeds: Some(weights_seeds),
            run: read_checkpoint_weights,
        },
        Target {
            name: "frames",
            what: "frames between ranks (progress, phase end, state, activation, plan)",
            text: false,
            heavy: false,
            file: "frame.bin",
            seeds: Some(frame_seeds),
            run: decode_frame,
        },
    ]
}

/// The committed valid inputs (`fuzz/seeds/`) and regression inputs
/// (`tests/data/fuzz/<name>/`) of a target, by file name.
fn seed_files(names: &[&str]) -> Result<Vec<Vec<u8>>, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    for name in names {
        let path = root.join("seeds").join(name);
        out.push(std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?);
    }
    Ok(out)
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("fuzz/ has a parent").to_path_buf()
}

fn experiments() -> Result<Vec<(String, Vec<u8>)>, String> {
    let dir = workspace().join("experiments");
    let mut out = Vec::new();
    let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "toml") {
            let name = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
            out.push((name, std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?));
        }
    }
    out.sort();
    Ok(out)
}

fn config_seeds(_: &Path) -> Result<Vec<Vec<u8>>, String> {
    let configs: Vec<Vec<u8>> = experiments()?
        .into_iter()
        .filter(|(name, text)| !name.contains("sweep") && !String::from_utf8_lossy(text).contains("[grid]"))
        .map(|(_, text)| text)
        .collect();
    Ok(configs)
}

/// The sweeps of `experiments/`, with every experiment beside them in the
/// work folder (their `base` is relative to the sweep file).
fn sweep_seeds(work: &Path) -> Result<Vec<Vec<u8>>, String> {
    let mut sweeps = Vec::new();
    for (name, text) in experiments()? {
        std::fs::write(work.join(&name), &text).map_err(|e| e.to_string())?;
        if String::from_utf8_lossy(&text).contains("[grid]") {
            sweeps.push(text);
        }
    }
    Ok(sweeps)
}

/// GPT-2's byte-level alphabet: the character each byte becomes.
fn byte_level_alphabet() -> Vec<String> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                extra += 1;
                255 + extra
            };
            char::from_u32(c).unwrap_or('?').to_string()
        })
        .collect()
}

/// A two-layer SmolLM2-shaped model (hidden 64, 2 heads over 1 key/value
/// head, SwiGLU 64) with every tensor type the reader knows, and a
/// byte-level BPE vocabulary of 256 bytes and 8 merges.
fn gguf_seeds(_: &Path) -> Result<Vec<Vec<u8>>, String> {
    let mut tokens = byte_level_alphabet();
    let merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ w"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    let (hidden, kv, ffn, vocab) = (64usize, 32usize, 64usize, tokens.len());
    let mut w = GgufWriter::new();
    let u32v = |v: usize| MetaValue::U32(v as u32);
    w.set("general.architecture", MetaValue::String("llama".into()));
    w.set("llama.block_count", u32v(2));
    w.set("llama.embedding_length", u32v(hidden));
    w.set("llama.feed_forward_length", u32v(ffn));
    w.set("llama.attention.head_count", u32v(2));
    w.set("llama.attention.head_count_kv", u32v(1));
    w.set("llama.attention.layer_norm_rms_epsilon", MetaValue::F32(1e-5));
    w.set("llama.rope.freq_base", MetaValue::F32(10_000.0));
    w.set("tokenizer.ggml.model", MetaValue::String("gpt2".into()));
    w.set("tokenizer.ggml.tokens", MetaValue::Array(tokens.into_iter().map(MetaValue::String).collect()));
    w.set(
        "tokenizer.ggml.merges",
        MetaValue::Array(merges.iter().map(|m| MetaValue::String(m.to_string())).collect()),
    );
    w.set("tokenizer.ggml.eos_token_id", u32v(0));
    let mut k = 0u32;
    let mut add =
        |w: &mut GgufWriter, name: &str, shape: Vec<usize>, kind: TensorType| -> Result<(), String> {
            let n: usize = shape.iter().product();
            let values: Vec<f32> = (0..n)
                .map(|i| {
                    k = k.wrapping_mul(1_103_515_245).wrapping_add(12_345 + i as u32);
                    (k >> 16) as f32 / 65_536.0 - 0.5
                })
                .collect();
            let bytes = quantize(kind, &values)?;
            w.add_tensor(OutTensor { name: name.into(), shape, kind, bytes })
        };
    add(&mut w, "token_embd.weight", vec![vocab, hidden], TensorType::Q8_0)?;
    add(&mut w, "output_norm.weight", vec![hidden], TensorType::F32)?;
    add(&mut w, "output.weight", vec![vocab, hidden], TensorType::Q4_1)?;
    for n in 0..2 {
        let name = |part: &str| format!("blk.{n}.{part}.weight");
        add(&mut w, &name("attn_norm"), vec![hidden], TensorType::F32)?;
        add(&mut w, &name("attn_q"), vec![hidden, hidden], TensorType::Q4_0)?;
        add(&mut w, &name("attn_k"), vec![kv, hidden], TensorType::F16)?;
        add(&mut w, &name("attn_v"), vec![kv, hidden], TensorType::F32)?;
        add(&mut w, &name("attn_output"), vec![hidden, hidden], TensorType::Q8_0)?;
        add(&mut w, &name("ffn_norm"), vec![hidden], TensorType::F32)?;
        add(&mut w, &name("ffn_gate"), vec![ffn, hidden], TensorType::Q4_1)?;
        add(&mut w, &name("ffn_up"), vec![ffn, hidden], TensorType::F16)?;
        add(&mut w, &name("ffn_down"), vec![hidden, ffn], TensorType::Q8_0)?;
    }
    Ok(vec![w.to_bytes()])
}

/// IDX3 images: a 28 x 28 file of 3 images and a 2 x 5 one of 2.
fn idx_image_seeds(_: &Path) -> Result<Vec<Vec<u8>>, String> {
    let file = |count: u32, rows: u32, cols: u32| {
        let mut bytes = vec![0, 0, 8, 3];
        for d in [count, rows, cols] {
            bytes.extend_from_slice(&d.to_be_bytes());
        }
        bytes.extend((0..count * rows * cols).map(|i| (i * 37 % 256) as u8));
        bytes
    };
    Ok(vec![file(3, 28, 28), file(2, 2, 5)])
}

/// IDX1 labels: 12 labels below 10.
fn idx_label_seeds(_: &Path) -> Result<Vec<Vec<u8>>, String> {
    let mut bytes = vec![0, 0, 8, 1];
    bytes.extend_from_slice(&12u32.to_be_bytes());
    bytes.extend((0..12u8).map(|i| i % 10));
    Ok(vec![bytes])
}

/// A run folder for `pipebd plot`: report.json and trace.json from the
/// seeds beside the mutated metrics.csv.
fn plot_seeds(work: &Path) -> Result<Vec<Vec<u8>>, String> {
    for name in ["report.json", "trace.json"] {
        let bytes = seed_files(&[name])?.remove(0);
        std::fs::write(work.join(name), bytes).map_err(|e| e.to_string())?;
    }
    seed_files(&["metrics.csv"])
}

/// The identity the checkpoint of the seeds was written with.
fn identity() -> BTreeMap<String, serde_json::Value> {
    [("config".to_string(), serde_json::json!("fuzz")), ("block".to_string(), serde_json::json!(1))]
        .into_iter()
        .collect()
}

/// The trainer state the checkpoint seeds hold.
fn state() -> pipe_bd::train::TrainerState {
    pipe_bd::train::TrainerState {
        weights: (0..300u32).map(|i| (i * 7 % 256) as u8).collect(),
        optimizer: vec![3; 64],
        arch_optimizer: None,
        step: 41,
        recent_losses: vec![0.5, 0.25],
    }
}

/// A checkpoint written by `pipebd`'s own writer into `work/checkpoints`.
fn write_checkpoint(work: &Path) -> Result<PathBuf, String> {
    let policy = pipe_bd::train::checkpoint::CheckpointPolicy {
        dir: work.join("checkpoints"),
        every_steps: 1,
        every_seconds: 0.0,
        keep: 1,
        identity: identity(),
    };
    pipe_bd::train::checkpoint::write(&policy, 1, &state(), "{1}", identity(), BTreeMap::new(), None)
        .map_err(|e| e.to_string())
}

fn manifest_seeds(work: &Path) -> Result<Vec<Vec<u8>>, String> {
    let folder = write_checkpoint(work)?;
    Ok(vec![std::fs::read(folder.join("manifest.json")).map_err(|e| e.to_string())?])
}

fn weights_seeds(work: &Path) -> Result<Vec<Vec<u8>>, String> {
    let folder = write_checkpoint(work)?;
    Ok(vec![std::fs::read(folder.join("weights.mpk")).map_err(|e| e.to_string())?])
}

fn checkpoint_outcome(folder: &Path) -> Result<pipe_bd::train::TrainerState, String> {
    match pipe_bd::train::checkpoint::read(folder, &identity()) {
        Ok((_, state)) => Ok(state),
        Err(
            pipe_bd::train::checkpoint::Refusal::Damaged(e)
            | pipe_bd::train::checkpoint::Refusal::Mismatch(e),
        ) => Err(e.to_string()),
    }
}

fn read_checkpoint(path: &Path, _: &Path) -> Outcome {
    let folder = path.parent().expect("the manifest is in a folder");
    match checkpoint_outcome(folder) {
        Ok(state) if state.weights != self::state().weights || state.optimizer != self::state().optimizer => {
            Outcome::Wrong("a checkpoint with other weights than its files' was loaded".into())
        }
        Ok(_) => Outcome::Accepted,
        Err(e) => Outcome::Refused(e),
    }
}

fn read_checkpoint_weights(path: &Path, _: &Path) -> Outcome {
    let folder = path.parent().expect("the weights are in a folder");
    match checkpoint_outcome(folder) {
        Ok(state) if state.weights != self::state().weights => {
            Outcome::Wrong("damaged weights passed the checksum and were loaded".into())
        }
        Ok(_) => Outcome::Accepted,
        Err(e) => Outcome::Refused(e),
    }
}

/// Frames: one byte naming the kind, then the frame.
fn frame_seeds(_: &Path) -> Result<Vec<Vec<u8>>, String> {
    let kinds = pipe_bd::runtime::frames::FrameKind::ALL;
    let samples = pipe_bd::runtime::frames::samples().map_err(|e| e.to_string())?;
    Ok(samples
        .into_iter()
        .map(|(kind, bytes)| {
            let tag = kinds.iter().position(|k| *k == kind).unwrap_or(0) as u8;
            std::iter::once(tag).chain(bytes).collect()
        })
        .collect())
}

fn decode_frame(path: &Path, _: &Path) -> Outcome {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) => return Outcome::Refused(e.to_string()),
    };
    let kinds = pipe_bd::runtime::frames::FrameKind::ALL;
    let Some((&tag, frame)) = bytes.split_first() else {
        return Outcome::Refused("empty".into());
    };
    let kind = kinds[tag as usize % kinds.len()];
    pipe_bd::runtime::frames::decode(kind, frame).into()
}
