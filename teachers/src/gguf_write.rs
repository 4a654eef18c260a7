//! Writing GGUF files (version 3) and quantizing tensors to ggml's block
//! types, the inverse of [`crate::gguf`]: what `pipebd export` writes for
//! llama.cpp.
//!
//! The quantizers follow ggml's reference formulas (`quantize_row_*_ref` in
//! ggml-quants.c: the scale from the block's extremes, stored as f16, the
//! values rounded against the unrounded scale), so values dequantized from a
//! block quantize back to the same block: a teacher tensor read by
//! [`crate::gguf`] and written here is the original file's bytes.

use std::io::Write;
use std::path::Path;

use crate::gguf::{MetaValue, TensorType};
use crate::TeacherError;

/// Where tensor data is aligned (ggml's default; written as no key).
const ALIGNMENT: usize = 32;

/// One tensor to write: its name, shape (outermost first), type and bytes.
#[derive(Debug, Clone)]
pub struct OutTensor {
    /// Its name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Its shape, outermost first (written innermost first, as GGUF stores it).
    pub shape: Vec<usize>,
    /// How its elements are stored.
    pub kind: TensorType,
    /// Its data, already in `kind`'s layout.
    pub bytes: Vec<u8>,
}

/// A GGUF file being put together: metadata in insertion order, then tensors.
#[derive(Debug, Clone, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<OutTensor>,
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets metadata `key` (replacing an earlier value, keeping its place).
    pub fn set(&mut self, key: &str, value: MetaValue) {
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = value,
            None => self.metadata.push((key.to_string(), value)),
        }
    }

    /// The metadata set so far, in order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    /// The tensors added so far, in order.
    pub fn tensors(&self) -> &[OutTensor] {
        &self.tensors
    }

    /// Adds a tensor; `Err` when its bytes do not fit its shape and type,
    /// or its name is taken.
    pub fn add_tensor(&mut self, tensor: OutTensor) -> Result<(), String> {
        let elements: usize = tensor.shape.iter().product();
        let expected = stored_bytes(tensor.kind, elements)?;
        if tensor.bytes.len() != expected {
            return Err(format!(
                "tensor `{}`: {} bytes for {elements} {:?} elements, expected {expected}",
                tensor.name,
                tensor.bytes.len(),
                tensor.kind
            ));
        }
        if tensor.shape.is_empty() || tensor.shape.len() > 4 {
            return Err(format!("tensor `{}` has {} dimensions (1 to 4)", tensor.name, tensor.shape.len()));
        }
        if self.tensors.iter().any(|t| t.name == tensor.name) {
            return Err(format!("tensor `{}` is added twice", tensor.name));
        }
        self.tensors.push(tensor);
        Ok(())
    }

    /// The whole file as bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(b"GGUF");
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut out, key);
            out.extend(type_id(value).to_le_bytes());
            put_value(&mut out, value);
        }
        let mut offset = 0usize;
        for tensor in &self.tensors {
            put_string(&mut out, &tensor.name);
            out.extend((tensor.shape.len() as u32).to_le_bytes());
            for &d in tensor.shape.iter().rev() {
                out.extend((d as u64).to_le_bytes());
            }
            out.extend(kind_id(tensor.kind).to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = (offset + tensor.bytes.len()).div_ceil(ALIGNMENT) * ALIGNMENT;
        }
        out.resize(out.len().div_ceil(ALIGNMENT) * ALIGNMENT, 0);
        for tensor in &self.tensors {
            out.extend(&tensor.bytes);
            out.resize(out.len().div_ceil(ALIGNMENT) * ALIGNMENT, 0);
        }
        out
    }

    /// Writes the file at `path` (through a temporary file beside it, so
    /// that a failed write leaves no half file); returns its size in bytes.
    pub fn write(&self, path: &Path) -> Result<u64, TeacherError> {
        let failed = |message: String| TeacherError::Export { path: path.to_path_buf(), message };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| failed(format!("cannot create its folder: {e}")))?;
        }
        if path.is_dir() {
            return Err(failed("it is a folder; give a file name, e.g. student.gguf".into()));
        }
        let bytes = self.to_bytes();
        let partial = path.with_extension("gguf.partial");
        let write = || -> std::io::Result<()> {
            let mut file = std::fs::File::create(&partial)?;
            file.write_all(&bytes)?;
            file.sync_all()?;
            std::fs::rename(&partial, path)
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&partial);
            failed(e.to_string())
        })?;
        Ok(bytes.len() as u64)
    }
}

/// Bytes that `elements` values take as `kind`; `Err` for a type not
/// written here or a count that is not whole blocks.
pub fn stored_bytes(kind: TensorType, elements: usize) -> Result<usize, String> {
    let (per_block, block_bytes) = layout(kind)?;
    if !elements.is_multiple_of(per_block) {
        return Err(format!("{elements} values are not whole {kind:?} blocks of {per_block}"));
    }
    Ok(elements / per_block * block_bytes)
}

fn layout(kind: TensorType) -> Result<(usize, usize), String> {
    kind.layout().ok_or_else(|| format!("ggml type {kind:?} is not written here"))
}

/// Whether rows of `row_len` values can be stored as `kind` (block types
/// quantize each row in blocks of 32).
pub fn fits_rows(kind: TensorType, row_len: usize) -> bool {
    layout(kind).map(|(per_block, _)| row_len.is_multiple_of(per_block)).unwrap_or(false)
}

/// `values` stored as `kind` (ggml's reference quantizers for the block
/// types); `Err` for a non-finite value, a type not written here, or a
/// count that is not whole blocks.
pub fn quantize(kind: TensorType, values: &[f32]) -> Result<Vec<u8>, String> {
    let expected = stored_bytes(kind, values.len())?;
    if let Some(at) = values.iter().position(|v| !v.is_finite()) {
        return Err(format!("value {at} is {}, which no GGUF type stores usefully", values[at]));
    }
    let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
    let mut out = Vec::with_capacity(expected);
    match kind {
        TensorType::F32 => values.iter().for_each(|v| out.extend(v.to_le_bytes())),
        TensorType::F16 => values.iter().for_each(|&v| out.extend(f16(v))),
        TensorType::Q8_0 => {
            for block in values.chunks_exact(32) {
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16(d));
                out.extend(block.iter().map(|&v| (v * id).round() as i8 as u8));
            }
        }
        TensorType::Q4_0 => {
            for block in values.chunks_exact(32) {
                // The value of largest magnitude, with its sign, maps to -8.
                let max = block.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16(d));
                let q = |v: f32| ((v * id + 8.5) as i32).min(15) as u8;
                out.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
            }
        }
        TensorType::Q4_1 => {
            for block in values.chunks_exact(32) {
                let min = block.iter().fold(f32::INFINITY, |m, &v| m.min(v));
                let max = block.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16(d));
                out.extend(f16(min));
                let q = |v: f32| (((v - min) * id + 0.5) as i32).min(15) as u8;
                out.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
            }
        }
        TensorType::Other(_) => unreachable!("refused by stored_bytes"),
    }
    debug_assert_eq!(out.len(), expected);
    Ok(out)
}

/// ggml's number of a tensor type.
fn kind_id(kind: TensorType) -> u32 {
    match kind {
        TensorType::F32 => 0,
        TensorType::F16 => 1,
        TensorType::Q4_0 => 2,
        TensorType::Q4_1 => 3,
        TensorType::Q8_0 => 8,
        TensorType::Other(id) => id,
    }
}

/// GGUF's number of a metadata type (an empty array is written as an array
/// of `uint32`: it has no element to say otherwise).
fn type_id(value: &MetaValue) -> u32 {
    match value {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &MetaValue) {
    match value {
        MetaValue::U8(v) => out.push(*v),
        MetaValue::I8(v) => out.push(*v as u8),
        MetaValue::U16(v) => out.extend(v.to_le_bytes()),
        MetaValue::I16(v) => out.extend(v.to_le_bytes()),
        MetaValue::U32(v) => out.extend(v.to_le_bytes()),
        MetaValue::I32(v) => out.extend(v.to_le_bytes()),
        MetaValue::F32(v) => out.extend(v.to_le_bytes()),
        MetaValue::Bool(v) => out.push(u8::from(*v)),
        MetaValue::String(s) => put_string(out, s),
        MetaValue::Array(items) => {
            let item_type = items.first().map_or(4, type_id);
            out.extend(item_type.to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
        MetaValue::U64(v) => out.extend(v.to_le_bytes()),
        MetaValue::I64(v) => out.extend(v.to_le_bytes()),
        MetaValue::F64(v) => out.extend(v.to_le_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{dequantize, Gguf};

    /// Deterministic values with a spread of magnitudes and signs.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                let unit = (state as f32 / u32::MAX as f32) * 2.0 - 1.0;
                unit * (1.0 + (i % 7) as f32) * 0.05
            })
            .collect()
    }

    #[test]
    fn quantized_values_come_back_within_half_a_step() {
        let x = values(32 * 64, 7);
        for kind in [TensorType::Q8_0, TensorType::Q4_0, TensorType::Q4_1] {
            let back = dequantize(kind, &quantize(kind, &x).unwrap()).unwrap();
            for (block, got) in x.chunks(32).zip(back.chunks(32)) {
                let (min, max) = block.iter().fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
                let amax = min.abs().max(max.abs());
                // Half a step of rounding; Q4_0 maps the largest magnitude to
                // -8 steps, so the other sign reaches only +7: a whole step.
                let bound = match kind {
                    TensorType::Q8_0 => 0.5 * amax / 127.0,
                    TensorType::Q4_0 => amax / 8.0,
                    _ => 0.5 * (max - min) / 15.0,
                };
                for (a, b) in block.iter().zip(got) {
                    // Plus the f16 scale's own rounding.
                    assert!((a - b).abs() <= bound + 2e-3 * amax, "{kind:?}: {a} came back as {b}");
                }
            }
        }
    }

    #[test]
    fn dequantized_blocks_quantize_back_to_the_same_bytes() {
        for kind in [TensorType::Q8_0, TensorType::Q4_0, TensorType::Q4_1, TensorType::F16, TensorType::F32] {
            let mut x = values(32 * 200, 11);
            // Blocks whose values are all equal, and all zero.
            x[..32].fill(0.25);
            x[32..64].fill(0.0);
            let bytes = quantize(kind, &x).unwrap();
            let again = quantize(kind, &dequantize(kind, &bytes).unwrap()).unwrap();
            assert!(bytes == again, "{kind:?}: a second quantization changed the blocks");
        }
    }

    #[test]
    fn what_is_written_reads_back_through_the_reader() {
        let mut file = GgufWriter::new();
        file.set("general.architecture", MetaValue::String("deci".into()));
        file.set("deci.block_count", MetaValue::U32(2));
        file.set("deci.attention.head_count", MetaValue::Array(vec![MetaValue::I32(9), MetaValue::I32(0)]));
        file.set("deci.attention.layer_norm_rms_epsilon", MetaValue::F32(1e-5));
        file.set("tokenizer.ggml.tokens", MetaValue::Array(vec![MetaValue::String("a".into())]));
        file.set("deci.block_count", MetaValue::U32(3));
        let weight = values(64 * 3, 3);
        let norm = values(5, 4);
        let q = quantize(TensorType::Q4_1, &weight).unwrap();
        file.add_tensor(OutTensor {
            name: "w".into(),
            shape: vec![3, 64],
            kind: TensorType::Q4_1,
            bytes: q.clone(),
        })
        .unwrap();
        let f = quantize(TensorType::F32, &norm).unwrap();
        file.add_tensor(OutTensor { name: "n".into(), shape: vec![5], kind: TensorType::F32, bytes: f })
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.gguf");
        let size = file.write(&path).unwrap();
        assert_eq!(size, std::fs::metadata(&path).unwrap().len());
        let read = Gguf::open(&path).unwrap();
        assert_eq!(read.version, 3);
        assert_eq!(read.get_usize("deci.block_count").unwrap(), 3, "a second set replaces the value");
        assert_eq!(read.metadata.len(), 5);
        assert_eq!(read.get("deci.attention.head_count"), Some(&file.metadata()[2].1));
        let (shape, back) = read.tensor("w").unwrap();
        assert_eq!(shape, vec![3, 64]);
        assert_eq!(back, dequantize(TensorType::Q4_1, &q).unwrap());
        assert_eq!(read.tensor("n").unwrap().1, norm);
        assert_eq!(read.raw_tensor("w").unwrap().1, q);
        assert!(read.tensors.iter().all(|t| t.offset % ALIGNMENT as u64 == 0));
    }

    #[test]
    fn bad_tensors_are_refused_with_a_reason() {
        let mut file = GgufWriter::new();
        let short =
            OutTensor { name: "w".into(), shape: vec![2, 32], kind: TensorType::Q8_0, bytes: vec![0; 34] };
        assert!(file.add_tensor(short).unwrap_err().contains("expected 68"));
        assert!(quantize(TensorType::Q4_1, &[0.0; 31]).unwrap_err().contains("whole"));
        assert!(quantize(TensorType::F32, &[f32::NAN]).unwrap_err().contains("NaN"));
        assert!(
            !fits_rows(TensorType::Q8_0, 48)
                && fits_rows(TensorType::Q8_0, 64)
                && fits_rows(TensorType::F16, 3)
        );
        let dir = tempfile::tempdir().unwrap();
        let error = GgufWriter::new().write(dir.path()).unwrap_err().to_string();
        assert!(error.contains("folder"), "{error}");
    }
}
