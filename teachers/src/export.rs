//! Decoder models out of pipe-bd: a student's (or the teacher's own) decoder
//! layers written as a GGUF file of llama.cpp's `deci` architecture (the
//! one llama.cpp added for Puzzle's Llama-3_1-Nemotron-51B), beside the
//! teacher file's embeddings, final norm and tokenizer.
//!
//! `deci` holds our whole variant library: per-layer query and key/value
//! heads and SwiGLU width; a layer with no query heads has no attention; one
//! with query heads but no key/value heads has the linear mixer
//! `x + W RMSNorm(x)`. Two defects of llama.cpp's `deci` graph
//! (src/models/deci.cpp) and loader shape what is written:
//! - a layer with attention and no SwiGLU loses its attention output, and
//!   a last layer without SwiGLU breaks the output rows: such layers get a
//!   zero SwiGLU of [`ZERO_FFN`] neurons (its down projection is zero, so
//!   the layer computes exactly what it did);
//! - the head size is read only when layer 0 has heads: a first layer
//!   without attention is written as the linear mixer with `W = 0`, exact too.
//!
//! Tensor names, orientation (`[outputs, inputs]`, stored innermost first)
//! and the rotary row order of Q and K are the teacher file's: the loader
//! ([`crate::smollm2`]) keeps that order, so the weights go back as they came.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use burn::nn::{Linear, RmsNorm};
use pipebd_kernels::decoder::{DecoderLayer, Mixer};
use pipebd_kernels::FusedBackend;

use crate::gguf::{Gguf, MetaValue, TensorType};
use crate::gguf_write::{fits_rows, quantize, GgufWriter, OutTensor};
use crate::TeacherError;

/// SwiGLU width of the zero feed-forward that stands in for a removed one
/// where llama.cpp needs one (one block of 32).
pub const ZERO_FFN: usize = 32;

/// How an export stores the linear layers' weights (norms are always F32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExportType {
    /// Each tensor in the type its teacher tensor has (SmolLM2's file: Q4_1
    /// linear layers, Q8_0 embeddings).
    #[default]
    Teacher,
    /// 32-bit floats: the student exactly.
    F32,
    /// 16-bit floats.
    F16,
    /// ggml's 8-bit blocks.
    Q8_0,
    /// ggml's 4-bit blocks with a minimum.
    Q4_1,
}

impl ExportType {
    /// Every type's name, as `--type` takes it.
    pub const NAMES: [&'static str; 5] = ["teacher", "f32", "f16", "q8_0", "q4_1"];

    /// The fixed tensor type, or `None` for [`ExportType::Teacher`].
    fn fixed(self) -> Option<TensorType> {
        match self {
            Self::Teacher => None,
            Self::F32 => Some(TensorType::F32),
            Self::F16 => Some(TensorType::F16),
            Self::Q8_0 => Some(TensorType::Q8_0),
            Self::Q4_1 => Some(TensorType::Q4_1),
        }
    }

    /// ggml's `general.file_type` of a file mostly of this type.
    fn file_type(self) -> Option<u32> {
        match self {
            Self::Teacher => None,
            Self::F32 => Some(0),
            Self::F16 => Some(1),
            Self::Q4_1 => Some(3),
            Self::Q8_0 => Some(7),
        }
    }
}

impl FromStr for ExportType {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        match name.to_ascii_lowercase().as_str() {
            "teacher" => Ok(Self::Teacher),
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            "q8_0" => Ok(Self::Q8_0),
            "q4_1" => Ok(Self::Q4_1),
            _ => Err(format!("unknown export type `{name}`: expected one of {}", Self::NAMES.join(", "))),
        }
    }
}

/// One decoder layer to export and the teacher layer whose tensor types it
/// takes under [`ExportType::Teacher`] (the first of those it replaces).
pub struct ExportLayer<'a, B: FusedBackend> {
    /// The layer.
    pub layer: &'a DecoderLayer<B>,
    /// Its teacher layer's number (from 0).
    pub teacher_layer: usize,
}

/// What an export wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportSummary {
    /// The file written.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// Decoder layers in it.
    pub layers: usize,
    /// Multiply-adds of the weights per token (every linear layer and the
    /// LM head; not the attention scores, which grow with the context).
    pub weight_macs_per_token: u64,
    /// The same for the teacher file.
    pub teacher_weight_macs_per_token: u64,
    /// What was written differently from what was asked, and why (a zero
    /// SwiGLU for llama.cpp, a type that rows do not fit).
    pub notes: Vec<String>,
}

/// Writes `layers` as a `deci` GGUF file at `out`, with the embeddings,
/// final norm (and untied output) and tokenizer of `teacher`, a `llama` or
/// `deci` GGUF file. `name` becomes `general.name` (the teacher's is kept
/// when `None`).
pub fn write_deci<B: FusedBackend>(
    teacher: &Gguf,
    layers: &[ExportLayer<'_, B>],
    kind: ExportType,
    name: Option<&str>,
    out: &Path,
) -> Result<ExportSummary, TeacherError> {
    let refuse = |message: String| TeacherError::Export { path: out.to_path_buf(), message };
    if layers.is_empty() {
        return Err(refuse("no decoder layer to export".into()));
    }
    let sizes = crate::smollm2::LlamaSizes::of(teacher)?;
    let mut file = GgufWriter::new();
    let mut notes = Vec::new();
    metadata(&mut file, teacher, layers, kind, name, &sizes).map_err(refuse)?;
    let teacher_macs = teacher_weight_macs(teacher);
    let mut macs = 0u64;
    for frozen in teacher_frozen_tensors(teacher) {
        let tensor = copy_tensor(teacher, &frozen, kind, &mut notes)?;
        if frozen != "token_embd.weight" || teacher.info("output.weight").is_none() {
            macs += head_macs(&frozen, &tensor.shape);
        }
        file.add_tensor(tensor).map_err(refuse)?;
    }
    for (n, export) in layers.iter().enumerate() {
        let tensors = layer_tensors(export, n, n + 1 == layers.len(), &sizes, &mut notes).map_err(refuse)?;
        for (role, shape, values) in tensors {
            let stored = stored_type(teacher, kind, &role, export.teacher_layer, &shape, &mut notes);
            let bytes = quantize(stored, &values).map_err(|e| refuse(format!("blk.{n}.{role}: {e}")))?;
            if role != "attn_norm" && role != "ffn_norm" {
                macs += values.len() as u64;
            }
            let tensor = OutTensor { name: format!("blk.{n}.{role}.weight"), shape, kind: stored, bytes };
            file.add_tensor(tensor).map_err(refuse)?;
        }
    }
    let bytes = file.write(out)?;
    Ok(ExportSummary {
        path: out.to_path_buf(),
        bytes,
        layers: layers.len(),
        weight_macs_per_token: macs,
        teacher_weight_macs_per_token: teacher_macs,
        notes,
    })
}

/// The LM head's multiply-adds per token of a frozen tensor (the tied
/// embeddings, or `output.weight`); 0 for the norm.
fn head_macs(name: &str, shape: &[usize]) -> u64 {
    match name {
        "token_embd.weight" | "output.weight" => shape.iter().product::<usize>() as u64,
        _ => 0,
    }
}

/// Multiply-adds per token of the weights of a GGUF decoder: its layers'
/// linear weights and the LM head.
pub fn teacher_weight_macs(file: &Gguf) -> u64 {
    let linear = |t: &&crate::gguf::TensorInfo| {
        (t.name.starts_with("blk.") && t.shape.len() == 2) || t.name == "output.weight"
    };
    let mut macs: u64 = file.tensors.iter().filter(linear).map(|t| t.len() as u64).sum();
    if file.info("output.weight").is_none() {
        macs += file.info("token_embd.weight").map_or(0, |t| t.len() as u64);
    }
    macs
}

/// The tensors taken from the teacher as they are: embeddings, final
/// norm, and the output matrix when it is not tied to the embeddings.
fn teacher_frozen_tensors(teacher: &Gguf) -> Vec<String> {
    let mut names = vec!["token_embd.weight".to_string(), "output_norm.weight".to_string()];
    if teacher.info("output.weight").is_some() {
        names.push("output.weight".into());
    }
    names
}

/// A teacher tensor, its bytes kept where its type stays, requantized otherwise.
fn copy_tensor(
    teacher: &Gguf,
    name: &str,
    kind: ExportType,
    notes: &mut Vec<String>,
) -> Result<OutTensor, TeacherError> {
    let (info, bytes) = teacher.raw_tensor(name)?;
    let is_norm = info.shape.len() == 1;
    let wanted = if is_norm { TensorType::F32 } else { kind.fixed().unwrap_or(info.kind) };
    let wanted = fitting(wanted, name, *info.shape.last().unwrap_or(&1), notes);
    let bytes = if wanted == info.kind {
        bytes
    } else {
        let values = crate::gguf::dequantize(info.kind, &bytes)
            .map_err(|e| TeacherError::BadWeights { path: teacher.path().to_path_buf(), message: e })?;
        quantize(wanted, &values)
            .map_err(|e| TeacherError::Export { path: PathBuf::new(), message: format!("{name}: {e}") })?
    };
    Ok(OutTensor { name: name.to_string(), shape: info.shape, kind: wanted, bytes })
}

/// `wanted`, or F16 when rows of `row_len` are not whole blocks of it.
fn fitting(wanted: TensorType, name: &str, row_len: usize, notes: &mut Vec<String>) -> TensorType {
    if fits_rows(wanted, row_len) {
        return wanted;
    }
    notes.push(format!("{name}: rows of {row_len} are not whole {wanted:?} blocks of 32; written as F16"));
    TensorType::F16
}

/// The type a layer tensor is stored as.
fn stored_type(
    teacher: &Gguf,
    kind: ExportType,
    role: &str,
    teacher_layer: usize,
    shape: &[usize],
    notes: &mut Vec<String>,
) -> TensorType {
    if shape.len() == 1 {
        return TensorType::F32;
    }
    let wanted = kind.fixed().unwrap_or_else(|| {
        let own = teacher.info(&format!("blk.{teacher_layer}.{role}.weight"));
        let first = || teacher.info(&format!("blk.0.{role}.weight"));
        // A linear mixer has only `attn_output`; a role the teacher lacks
        // takes its query projection's type.
        let any = || teacher.info(&format!("blk.{teacher_layer}.attn_q.weight"));
        own.or_else(first).or_else(any).map_or(TensorType::F32, |t| t.kind)
    });
    fitting(wanted, role, shape[1], notes)
}

/// The metadata: `deci` sizes per layer, the teacher's other model keys,
/// its `general.*` and tokenizer keys.
fn metadata<B: FusedBackend>(
    file: &mut GgufWriter,
    teacher: &Gguf,
    layers: &[ExportLayer<'_, B>],
    kind: ExportType,
    name: Option<&str>,
    sizes: &crate::smollm2::LlamaSizes,
) -> Result<(), String> {
    let source = teacher.get_str("general.architecture").map_err(|e| e.to_string())?.to_string();
    file.set("general.architecture", MetaValue::String("deci".into()));
    for (key, value) in &teacher.metadata {
        if key.starts_with("general.") && key != "general.architecture" && key != "general.alignment" {
            file.set(key, value.clone());
        }
    }
    if let Some(name) = name {
        file.set("general.name", MetaValue::String(name.into()));
    }
    if let Some(file_type) = kind.file_type() {
        file.set("general.file_type", MetaValue::U32(file_type));
    }
    let prefix = format!("{source}.");
    for (key, value) in &teacher.metadata {
        if let Some(rest) = key.strip_prefix(&prefix) {
            file.set(&format!("deci.{rest}"), value.clone());
        }
    }
    let shapes: Vec<(usize, usize, usize)> = layers
        .iter()
        .enumerate()
        .map(|(n, l)| layer_counts(l.layer, n, n + 1 == layers.len(), sizes))
        .collect();
    let array = |pick: fn(&(usize, usize, usize)) -> usize| {
        MetaValue::Array(shapes.iter().map(|s| MetaValue::I32(pick(s) as i32)).collect())
    };
    let head_dim = sizes.layer.head_dim as u32;
    file.set("deci.block_count", MetaValue::U32(layers.len() as u32));
    file.set("deci.embedding_length", MetaValue::U32(sizes.layer.hidden as u32));
    file.set("deci.attention.layer_norm_rms_epsilon", MetaValue::F32(sizes.layer.eps as f32));
    file.set("deci.attention.head_count", array(|s| s.0));
    file.set("deci.attention.head_count_kv", array(|s| s.1));
    file.set("deci.feed_forward_length", array(|s| s.2));
    file.set("deci.attention.key_length", MetaValue::U32(head_dim));
    file.set("deci.attention.value_length", MetaValue::U32(head_dim));
    file.set("deci.rope.dimension_count", MetaValue::U32(head_dim));
    file.set("deci.rope.freq_base", MetaValue::F32(sizes.layer.rope_base as f32));
    if let Some(context) = teacher.get(&format!("{source}.context_length")).and_then(MetaValue::as_u64) {
        file.set("deci.context_length", MetaValue::U32(context as u32));
    }
    file.set("deci.vocab_size", MetaValue::U32(sizes.vocab as u32));
    for (key, value) in &teacher.metadata {
        if key.starts_with("tokenizer.") {
            file.set(key, value.clone());
        }
    }
    if let Some(version) = teacher.get("general.quantization_version") {
        file.set("general.quantization_version", version.clone());
    } else if kind != ExportType::F32 {
        file.set("general.quantization_version", MetaValue::U32(2));
    }
    Ok(())
}

/// Query heads, key/value heads and SwiGLU width of layer `n` as written
/// (with the stand-ins the module's docs explain).
fn layer_counts<B: FusedBackend>(
    layer: &DecoderLayer<B>,
    n: usize,
    last: bool,
    sizes: &crate::smollm2::LlamaSizes,
) -> (usize, usize, usize) {
    let (heads, kv_heads) = match layer.attention.as_ref().map(|a| &a.mixer) {
        Some(Mixer::Attention(attention)) => (attention.heads, attention.kv_heads),
        Some(Mixer::Linear(_)) => (sizes.layer.heads, 0),
        None if n == 0 => (sizes.layer.heads, 0),
        None => (0, 0),
    };
    let ffn = match &layer.ffn {
        Some(ffn) => ffn.gate.weight.dims()[1],
        None if heads > 0 || last => ZERO_FFN,
        None => 0,
    };
    (heads, kv_heads, ffn)
}

/// One layer tensor: its role (`attn_q`...), shape `[outputs, inputs]`
/// (or `[width]` for a norm) and values, row-major.
type LayerTensor = (String, Vec<usize>, Vec<f32>);

/// The tensors of layer `n`, in llama.cpp's orientation.
fn layer_tensors<B: FusedBackend>(
    export: &ExportLayer<'_, B>,
    n: usize,
    last: bool,
    sizes: &crate::smollm2::LlamaSizes,
    notes: &mut Vec<String>,
) -> Result<Vec<LayerTensor>, String> {
    let layer = export.layer;
    let hidden = sizes.layer.hidden;
    let mut out: Vec<LayerTensor> = Vec::new();
    match &layer.attention {
        Some(sub) => {
            out.push(("attn_norm".into(), vec![hidden], norm_values(&sub.norm)));
            match &sub.mixer {
                Mixer::Attention(a) => {
                    out.push((
                        "attn_q".into(),
                        a.query.weight.dims().into_iter().rev().collect(),
                        rows(&a.query, n)?,
                    ));
                    out.push((
                        "attn_k".into(),
                        a.key.weight.dims().into_iter().rev().collect(),
                        rows(&a.key, n)?,
                    ));
                    out.push((
                        "attn_v".into(),
                        a.value.weight.dims().into_iter().rev().collect(),
                        rows(&a.value, n)?,
                    ));
                    let output = rows(&a.output, n)?;
                    out.push((
                        "attn_output".into(),
                        a.output.weight.dims().into_iter().rev().collect(),
                        output,
                    ));
                }
                Mixer::Linear(map) => {
                    out.push(("attn_output".into(), vec![hidden, hidden], rows(map, n)?));
                }
            }
        }
        None if n == 0 => {
            notes.push(
                "blk.0: no attention; written as a zero linear mixer (llama.cpp reads the head size from layer 0's heads)"
                    .to_string(),
            );
            out.push(("attn_norm".into(), vec![hidden], vec![1.0; hidden]));
            out.push(("attn_output".into(), vec![hidden, hidden], vec![0.0; hidden * hidden]));
        }
        None => {}
    }
    match &layer.ffn {
        Some(ffn) => {
            let width = ffn.gate.weight.dims()[1];
            out.push(("ffn_norm".into(), vec![hidden], norm_values(&ffn.norm)));
            out.push(("ffn_gate".into(), vec![width, hidden], rows(&ffn.gate, n)?));
            out.push(("ffn_up".into(), vec![width, hidden], rows(&ffn.up, n)?));
            out.push(("ffn_down".into(), vec![hidden, width], rows(&ffn.down, n)?));
        }
        None if out.is_empty() && !last => {}
        None => {
            notes.push(format!(
                "blk.{n}: no SwiGLU; written as a zero SwiGLU of {ZERO_FFN} neurons (llama.cpp's deci graph drops \
                 the attention output of a layer without one)"
            ));
            out.push(("ffn_norm".into(), vec![hidden], vec![1.0; hidden]));
            out.push(("ffn_gate".into(), vec![ZERO_FFN, hidden], vec![0.0; ZERO_FFN * hidden]));
            out.push(("ffn_up".into(), vec![ZERO_FFN, hidden], vec![0.0; ZERO_FFN * hidden]));
            out.push(("ffn_down".into(), vec![hidden, ZERO_FFN], vec![0.0; ZERO_FFN * hidden]));
        }
    }
    Ok(out)
}

/// A norm's scale.
fn norm_values<B: FusedBackend>(norm: &RmsNorm<B>) -> Vec<f32> {
    norm.gamma.val().into_data().convert::<f32>().to_vec().expect("f32 data")
}

/// A linear layer's weight as llama.cpp stores it: `[outputs, inputs]`
/// rows (burn's is `[inputs, outputs]`). `Err` for a bias, which the
/// `deci` graph has no place for.
fn rows<B: FusedBackend>(linear: &Linear<B>, n: usize) -> Result<Vec<f32>, String> {
    if linear.bias.is_some() {
        return Err(format!(
            "layer {n} has a linear layer with a bias, which llama.cpp's deci layers do not have"
        ));
    }
    let [inputs, outputs] = linear.weight.dims();
    let values: Vec<f32> = linear.weight.val().into_data().convert::<f32>().to_vec().expect("f32 data");
    let mut transposed = vec![0f32; values.len()];
    for (i, row) in values.chunks_exact(outputs).enumerate() {
        for (o, &v) in row.iter().enumerate() {
            transposed[o * inputs + i] = v;
        }
    }
    Ok(transposed)
}
