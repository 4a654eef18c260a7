//! GGUF files (llama.cpp's model format, version 2 and 3): the header, the
//! metadata (architecture, sizes, the tokenizer's vocabulary and merges),
//! the tensor table, and each tensor read to `f32`, dequantized from the
//! types a published small LLM uses: `F32`, `F16`, `Q8_0`, `Q4_0` and `Q4_1`.
//!
//! A quantized model is a fine teacher: the student learns the function the
//! file computes, which is the dequantized one.
//!
//! No crate fits here: the Rust GGUF parsers read the header and metadata but
//! do not dequantize, and the ones that do come with a whole inference
//! engine. The format is small (the spec is ggml's `docs/gguf.md`).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::TeacherError;

/// The file's first four bytes.
const MAGIC: &[u8; 4] = b"GGUF";
/// Where tensor data is aligned when the file does not say
/// (`general.alignment`).
const DEFAULT_ALIGNMENT: u64 = 32;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `float32`.
    F32(f32),
    /// `bool`.
    Bool(bool),
    /// `string` (UTF-8).
    String(String),
    /// `array` of values of one type.
    Array(Vec<MetaValue>),
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float64`.
    F64(f64),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// The value as text, if it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }
}

/// How a tensor's elements are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorType {
    /// 32-bit floats.
    F32,
    /// 16-bit floats.
    F16,
    /// Blocks of 32: an f16 scale `d` and 32 4-bit values `q`, `x = (q - 8) d`.
    Q4_0,
    /// Blocks of 32: f16 `d` and `m` and 32 4-bit values, `x = q d + m`.
    Q4_1,
    /// Blocks of 32: an f16 scale `d` and 32 signed bytes, `x = q d`.
    Q8_0,
    /// A ggml type this reader does not dequantize (its number).
    Other(u32),
}

impl TensorType {
    fn from_id(id: u32) -> Self {
        match id {
            0 => TensorType::F32,
            1 => TensorType::F16,
            2 => TensorType::Q4_0,
            3 => TensorType::Q4_1,
            8 => TensorType::Q8_0,
            other => TensorType::Other(other),
        }
    }

    /// Elements per block and bytes per block, for the types read here.
    pub(crate) fn layout(self) -> Option<(usize, usize)> {
        match self {
            TensorType::F32 => Some((1, 4)),
            TensorType::F16 => Some((1, 2)),
            TensorType::Q4_0 => Some((32, 18)),
            TensorType::Q4_1 => Some((32, 20)),
            TensorType::Q8_0 => Some((32, 34)),
            TensorType::Other(_) => None,
        }
    }
}

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Its name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Its shape, outermost dimension first (PyTorch's order: a linear
    /// layer's weight is `[out, in]`); GGUF stores the reverse.
    pub shape: Vec<usize>,
    /// How its elements are stored.
    pub kind: TensorType,
    /// Where its data starts, from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Its number of elements (`usize::MAX` for a shape whose product
    /// overflows: no file can hold it, and the reader refuses it).
    pub fn len(&self) -> usize {
        self.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).unwrap_or(usize::MAX)
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A GGUF file's header, metadata and tensor table; tensors are read on
/// demand ([`Gguf::tensor`]).
#[derive(Debug, Clone)]
pub struct Gguf {
    path: PathBuf,
    /// The format version (2 or 3).
    pub version: u32,
    /// Every metadata key and value.
    pub metadata: BTreeMap<String, MetaValue>,
    /// The tensor table, in file order.
    pub tensors: Vec<TensorInfo>,
    /// Where the data section starts in the file.
    data_start: u64,
    /// The file's length in bytes.
    file_len: u64,
}

impl Gguf {
    /// Reads the header, metadata and tensor table of the GGUF file at `path`.
    pub fn open(path: &Path) -> Result<Self, TeacherError> {
        if !path.exists() {
            return Err(TeacherError::MissingWeights { path: path.to_path_buf() });
        }
        let bad = |message: String| TeacherError::BadWeights { path: path.to_path_buf(), message };
        let file = File::open(path).map_err(|e| bad(e.to_string()))?;
        let file_len = file.metadata().map_err(|e| bad(e.to_string()))?.len();
        let mut reader = Reader { inner: BufReader::new(file), position: 0, file_len };
        let header = reader.header().map_err(bad)?;
        let data_start = header.data_start;
        let tensors = header.tensors;
        for tensor in &tensors {
            let Some((per_block, bytes)) = tensor.kind.layout() else { continue };
            let size = (tensor.len() / per_block).checked_mul(bytes).map(|n| n as u64);
            let end = size.and_then(|n| data_start.checked_add(tensor.offset)?.checked_add(n));
            if end.is_none_or(|end| end > file_len) {
                let end = end.map_or_else(|| "beyond 2^64".to_string(), |e| e.to_string());
                return Err(bad(format!(
                    "tensor `{}` ends at byte {end}, past the end of the file ({file_len} bytes): truncated?",
                    tensor.name
                )));
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            version: header.version,
            metadata: header.metadata,
            tensors,
            data_start,
            file_len,
        })
    }

    /// The file this was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The metadata value under `key`, if any.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// The whole-number metadata value under `key`; the error names the key.
    pub fn get_usize(&self, key: &str) -> Result<usize, TeacherError> {
        let value = self.get(key).and_then(MetaValue::as_u64);
        value.map(|v| v as usize).ok_or_else(|| self.missing(key, "a whole number"))
    }

    /// The numeric metadata value under `key`; the error names the key.
    pub fn get_f64(&self, key: &str) -> Result<f64, TeacherError> {
        self.get(key).and_then(MetaValue::as_f64).ok_or_else(|| self.missing(key, "a number"))
    }

    /// The string metadata value under `key`; the error names the key.
    pub fn get_str(&self, key: &str) -> Result<&str, TeacherError> {
        self.get(key).and_then(MetaValue::as_str).ok_or_else(|| self.missing(key, "a string"))
    }

    /// The array of strings under `key` (a vocabulary, the merges).
    pub fn get_strings(&self, key: &str) -> Result<Vec<&str>, TeacherError> {
        match self.get(key) {
            Some(MetaValue::Array(items)) => items
                .iter()
                .map(|v| v.as_str().ok_or_else(|| self.missing(key, "an array of strings")))
                .collect(),
            _ => Err(self.missing(key, "an array of strings")),
        }
    }

    fn missing(&self, key: &str, what: &str) -> TeacherError {
        TeacherError::BadWeights {
            path: self.path.clone(),
            message: format!("metadata `{key}` is missing or not {what}"),
        }
    }

    /// The entry of tensor `name`, if the file has one.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Tensor `name` as `f32` (dequantized) with its shape, outermost first.
    pub fn tensor(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), TeacherError> {
        let (info, bytes) = self.raw_tensor(name)?;
        let values = dequantize(info.kind, &bytes).map_err(|e| self.bad(format!("tensor `{name}`: {e}")))?;
        Ok((info.shape, values))
    }

    /// Tensor `name` as stored (its entry and its bytes, in its type's layout).
    pub fn raw_tensor(&self, name: &str) -> Result<(TensorInfo, Vec<u8>), TeacherError> {
        let bad = |message: String| self.bad(message);
        let info = self.info(name).ok_or_else(|| bad(format!("no tensor `{name}`")))?;
        let (per_block, block_bytes) = info.kind.layout().ok_or_else(|| {
            bad(format!("tensor `{name}` has ggml type {:?}, which is not read here", info.kind))
        })?;
        if info.len() % per_block != 0 {
            return Err(bad(format!(
                "tensor `{name}` has {} elements, not whole blocks of {per_block}",
                info.len()
            )));
        }
        let start = self.data_start + info.offset;
        let mut bytes = vec![0u8; info.len() / per_block * block_bytes];
        debug_assert!(start + bytes.len() as u64 <= self.file_len, "checked when the file was opened");
        let mut file = File::open(&self.path).map_err(|e| bad(e.to_string()))?;
        file.seek(SeekFrom::Start(start)).map_err(|e| bad(e.to_string()))?;
        file.read_exact(&mut bytes).map_err(|e| bad(format!("reading tensor `{name}`: {e}")))?;
        Ok((info.clone(), bytes))
    }

    fn bad(&self, message: String) -> TeacherError {
        TeacherError::BadWeights { path: self.path.clone(), message }
    }
}

/// The values of `bytes` stored as `kind`, as `f32`.
pub fn dequantize(kind: TensorType, bytes: &[u8]) -> Result<Vec<f32>, String> {
    let (per_block, block_bytes) =
        kind.layout().ok_or_else(|| format!("ggml type {kind:?} is not read here"))?;
    if bytes.len() % block_bytes != 0 {
        return Err(format!("{} bytes are not whole {kind:?} blocks of {block_bytes}", bytes.len()));
    }
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    let mut out = Vec::with_capacity(bytes.len() / block_bytes * per_block);
    for block in bytes.chunks_exact(block_bytes) {
        match kind {
            TensorType::F32 => out.push(f32::from_le_bytes([block[0], block[1], block[2], block[3]])),
            TensorType::F16 => out.push(f16(block)),
            TensorType::Q8_0 => {
                let d = f16(block);
                out.extend(block[2..].iter().map(|&q| f32::from(q as i8) * d));
            }
            TensorType::Q4_0 => {
                let d = f16(block);
                let qs = &block[2..];
                out.extend(qs.iter().map(|&q| (f32::from(q & 0x0f) - 8.0) * d));
                out.extend(qs.iter().map(|&q| (f32::from(q >> 4) - 8.0) * d));
            }
            TensorType::Q4_1 => {
                let (d, m) = (f16(block), f16(&block[2..]));
                let qs = &block[4..];
                out.extend(qs.iter().map(|&q| f32::from(q & 0x0f) * d + m));
                out.extend(qs.iter().map(|&q| f32::from(q >> 4) * d + m));
            }
            TensorType::Other(_) => unreachable!("no layout"),
        }
    }
    Ok(out)
}

/// What the header holds.
struct Header {
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
    data_start: u64,
}

/// Little-endian reads that know where they are and refuse lengths past
/// the end of the file (a damaged file must not ask for terabytes).
struct Reader<R> {
    inner: R,
    position: u64,
    file_len: u64,
}

impl<R: Read> Reader<R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut buf = [0u8; N];
        self.inner
            .read_exact(&mut buf)
            .map_err(|e| format!("at byte {}: {e} (truncated?)", self.position))?;
        self.position += N as u64;
        Ok(buf)
    }

    fn u32(&mut self) -> Result<u32, String> {
        self.bytes().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, String> {
        self.bytes().map(u64::from_le_bytes)
    }

    /// A count of items of at least `min_bytes` each, checked against what
    /// is left of the file.
    fn count(&mut self, min_bytes: u64, what: &str) -> Result<usize, String> {
        let at = self.position;
        let n = self.u64()?;
        if n.saturating_mul(min_bytes) > self.file_len.saturating_sub(self.position) {
            return Err(format!("at byte {at}: {n} {what} cannot fit in the rest of the file"));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String, String> {
        let at = self.position;
        let len = self.count(1, "string bytes")?;
        let mut buf = vec![0u8; len];
        self.inner.read_exact(&mut buf).map_err(|e| format!("at byte {at}: {e}"))?;
        self.position += len as u64;
        String::from_utf8(buf).map_err(|_| format!("at byte {at}: a string that is not UTF-8"))
    }

    fn value(&mut self, type_id: u32) -> Result<MetaValue, String> {
        Ok(match type_id {
            0 => MetaValue::U8(self.bytes::<1>()?[0]),
            1 => MetaValue::I8(self.bytes::<1>()?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.bytes()?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.bytes()?)),
            4 => MetaValue::U32(self.u32()?),
            5 => MetaValue::I32(i32::from_le_bytes(self.bytes()?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.bytes()?)),
            7 => MetaValue::Bool(self.bytes::<1>()?[0] != 0),
            8 => MetaValue::String(self.string()?),
            9 => {
                let at = self.position;
                let item_type = self.u32()?;
                if item_type == 9 {
                    // GGUF writers (ggml's, gguf-py) write no arrays of
                    // arrays; reading them would recurse once per 12 bytes.
                    return Err(format!("at byte {at}: an array of arrays (not read here)"));
                }
                let n = self.count(1, "array items")?;
                let items = (0..n).map(|_| self.value(item_type)).collect::<Result<Vec<_>, _>>()?;
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(i64::from_le_bytes(self.bytes()?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.bytes()?)),
            other => return Err(format!("at byte {}: unknown metadata type {other}", self.position - 4)),
        })
    }

    fn header(&mut self) -> Result<Header, String> {
        let magic: [u8; 4] = self.bytes()?;
        if &magic != MAGIC {
            return Err(format!("not a GGUF file (starts with {magic:02x?}, not \"GGUF\")"));
        }
        let version = self.u32()?;
        if !(2..=3).contains(&version) {
            return Err(format!("GGUF version {version}: only versions 2 and 3 are read"));
        }
        let tensor_count = self.count(24, "tensors")?;
        let metadata_count = self.count(12, "metadata entries")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..metadata_count {
            let key = self.string()?;
            let type_id = self.u32()?;
            let value = self.value(type_id).map_err(|e| format!("metadata `{key}`: {e}"))?;
            metadata.insert(key, value);
        }
        let mut tensors = Vec::with_capacity(tensor_count);
        for _ in 0..tensor_count {
            let name = self.string()?;
            let dims = self.u32()?;
            if dims > 4 {
                return Err(format!("tensor `{name}` has {dims} dimensions (at most 4)"));
            }
            // Stored innermost first; kept outermost first.
            let mut shape =
                (0..dims).map(|_| self.u64().map(|d| d as usize)).collect::<Result<Vec<_>, _>>()?;
            shape.reverse();
            let kind = TensorType::from_id(self.u32()?);
            let offset = self.u64()?;
            tensors.push(TensorInfo { name, shape, kind, offset });
        }
        let alignment =
            metadata.get("general.alignment").and_then(MetaValue::as_u64).unwrap_or(DEFAULT_ALIGNMENT);
        if alignment == 0 {
            return Err("`general.alignment` is 0".into());
        }
        // Cannot overflow: the result is at most max(alignment, 2 x position).
        let data_start = self.position.div_ceil(alignment) * alignment;
        Ok(Header { version, metadata, tensors, data_start })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF file written by hand: the test's own writer, independent of
    /// the reader.
    #[derive(Default)]
    struct Writer {
        header: Vec<u8>,
        data: Vec<u8>,
        metadata: Vec<u8>,
        tensors: Vec<u8>,
        metadata_count: u64,
        tensor_count: u64,
    }

    impl Writer {
        fn string(out: &mut Vec<u8>, s: &str) {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        }

        fn meta(&mut self, key: &str, type_id: u32, value: &[u8]) {
            Self::string(&mut self.metadata, key);
            self.metadata.extend(type_id.to_le_bytes());
            self.metadata.extend(value);
            self.metadata_count += 1;
        }

        /// A tensor of GGUF dimensions `dims` (innermost first), type `kind`.
        fn tensor(&mut self, name: &str, dims: &[u64], kind: u32, bytes: &[u8]) {
            Self::string(&mut self.tensors, name);
            self.tensors.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                self.tensors.extend(d.to_le_bytes());
            }
            self.tensors.extend(kind.to_le_bytes());
            // Each tensor's data aligned to 32 bytes.
            while self.data.len() % 32 != 0 {
                self.data.push(0);
            }
            self.tensors.extend((self.data.len() as u64).to_le_bytes());
            self.data.extend(bytes);
            self.tensor_count += 1;
        }

        fn finish(mut self) -> Vec<u8> {
            self.header.extend(b"GGUF");
            self.header.extend(3u32.to_le_bytes());
            self.header.extend(self.tensor_count.to_le_bytes());
            self.header.extend(self.metadata_count.to_le_bytes());
            let mut file = self.header;
            file.extend(self.metadata);
            file.extend(self.tensors);
            while file.len() % 32 != 0 {
                file.push(0);
            }
            file.extend(self.data);
            file
        }
    }

    fn f16_bytes(v: f32) -> [u8; 2] {
        half::f16::from_f32(v).to_le_bytes()
    }

    /// A Q4_1 block: d = 0.5, m = -1, nibbles 0..15 low and 15..0 high.
    fn q4_1_block() -> (Vec<u8>, Vec<f32>) {
        let mut block = Vec::new();
        block.extend(f16_bytes(0.5));
        block.extend(f16_bytes(-1.0));
        block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let low = (0..16).map(|j| j as f32 * 0.5 - 1.0);
        let high = (0..16).map(|j| (15 - j) as f32 * 0.5 - 1.0);
        (block, low.chain(high).collect())
    }

    /// A Q8_0 block: d = 0.25, bytes -16..16.
    fn q8_0_block() -> (Vec<u8>, Vec<f32>) {
        let mut block = Vec::new();
        block.extend(f16_bytes(0.25));
        block.extend((-16i8..16).map(|q| q as u8));
        (block, (-16..16).map(|q| q as f32 * 0.25).collect())
    }

    fn write(bytes: &[u8]) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut file, bytes).unwrap();
        file
    }

    fn sample_file() -> (Vec<u8>, Vec<f32>, Vec<f32>) {
        let mut w = Writer::default();
        w.meta("general.architecture", 8, &{
            let mut v = Vec::new();
            Writer::string(&mut v, "llama");
            v
        });
        w.meta("llama.block_count", 4, &30u32.to_le_bytes());
        w.meta("llama.rope.freq_base", 6, &100000f32.to_le_bytes());
        let mut tokens = Vec::new();
        tokens.extend(8u32.to_le_bytes());
        tokens.extend(2u64.to_le_bytes());
        Writer::string(&mut tokens, "<s>");
        Writer::string(&mut tokens, "Ġthe");
        w.meta("tokenizer.ggml.tokens", 9, &tokens);
        // A type not read here, first: the check for truncation skips it.
        w.tensor("odd.weight", &[32], 12, &[0u8; 144]);
        let (q4, q4_values) = q4_1_block();
        let (q8, q8_values) = q8_0_block();
        // A [2, 32] linear weight in two Q4_1 blocks, stored as ne = [32, 2].
        w.tensor("blk.0.ffn_up.weight", &[32, 2], 3, &[q4.clone(), q4].concat());
        w.tensor("token_embd.weight", &[32, 1], 8, &q8);
        let norm: Vec<u8> = [1.5f32, -2.0, 0.25].iter().flat_map(|v| v.to_le_bytes()).collect();
        w.tensor("blk.0.attn_norm.weight", &[3], 0, &norm);
        (w.finish(), [q4_values.clone(), q4_values].concat(), q8_values)
    }

    #[test]
    fn metadata_and_tensors_read_back_as_written() {
        let (bytes, q4_values, q8_values) = sample_file();
        let file = write(&bytes);
        let gguf = Gguf::open(file.path()).unwrap();
        assert_eq!(gguf.version, 3);
        assert_eq!(gguf.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(gguf.get_usize("llama.block_count").unwrap(), 30);
        assert_eq!(gguf.get_f64("llama.rope.freq_base").unwrap(), 100000.0);
        assert_eq!(gguf.get_strings("tokenizer.ggml.tokens").unwrap(), ["<s>", "Ġthe"]);
        let (shape, values) = gguf.tensor("blk.0.ffn_up.weight").unwrap();
        assert_eq!((shape, values), (vec![2, 32], q4_values), "Q4_1, shape outermost first");
        assert_eq!(gguf.tensor("token_embd.weight").unwrap(), (vec![1, 32], q8_values));
        assert_eq!(gguf.tensor("blk.0.attn_norm.weight").unwrap(), (vec![3], vec![1.5, -2.0, 0.25]));
        // A type not read here, and a missing key, are named.
        let error = gguf.tensor("odd.weight").unwrap_err().to_string();
        assert!(error.contains("odd.weight") && error.contains("Other(12)"), "{error}");
        let error = gguf.get_usize("llama.embedding_length").unwrap_err().to_string();
        assert!(error.contains("llama.embedding_length"), "{error}");
    }

    #[test]
    fn every_dequantizer_follows_ggml_formulas() {
        // Q4_0: d = 2, nibbles j (low) and 15 - j (high), minus 8.
        let mut q4_0 = f16_bytes(2.0).to_vec();
        q4_0.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let expected: Vec<f32> =
            (0..16).map(|j| (j as f32 - 8.0) * 2.0).chain((0..16).map(|j| (7 - j) as f32 * 2.0)).collect();
        assert_eq!(dequantize(TensorType::Q4_0, &q4_0).unwrap(), expected);
        let f16s: Vec<u8> = [0.5f32, -3.0].iter().flat_map(|&v| f16_bytes(v)).collect();
        assert_eq!(dequantize(TensorType::F16, &f16s).unwrap(), [0.5, -3.0]);
        assert_eq!(dequantize(TensorType::Q8_0, &q8_0_block().0).unwrap(), q8_0_block().1);
        assert!(dequantize(TensorType::Q8_0, &[0u8; 33]).unwrap_err().contains("whole"));
    }

    #[test]
    fn damaged_files_are_refused_with_a_reason() {
        let (bytes, _, _) = sample_file();
        let cut = write(&bytes[..bytes.len() - 10]);
        let error = Gguf::open(cut.path()).unwrap_err().to_string();
        assert!(error.contains("past the end of the file"), "{error}");
        let mut wrong = bytes.clone();
        wrong[0] = b'X';
        let error = Gguf::open(write(&wrong).path()).unwrap_err().to_string();
        assert!(error.contains("not a GGUF file"), "{error}");
        // A string length far past the end of the file is not allocated.
        let mut huge = b"GGUF".to_vec();
        huge.extend(3u32.to_le_bytes());
        huge.extend(0u64.to_le_bytes());
        huge.extend(1u64.to_le_bytes());
        huge.extend(u64::MAX.to_le_bytes());
        huge.extend([0u8; 16]);
        let error = Gguf::open(write(&huge).path()).unwrap_err().to_string();
        assert!(error.contains("cannot fit"), "{error}");
        let missing = Gguf::open(Path::new("/no/such/model.gguf")).unwrap_err();
        assert!(matches!(missing, TeacherError::MissingWeights { .. }));
    }

    /// Fuzzing's findings (issue 55): a header that nests arrays 200,000
    /// deep (the reader recursed once per 12 bytes and overflowed its
    /// stack), an alignment that puts the data past 2^64 bytes, and a
    /// tensor whose shape's product overflows are refused with the reason.
    #[test]
    fn refuses_nested_arrays_overflowing_alignments_and_shapes() {
        let mut nested = Vec::new();
        for _ in 0..200_000 {
            nested.extend(9u32.to_le_bytes());
            nested.extend(1u64.to_le_bytes());
        }
        nested.extend(4u32.to_le_bytes());
        nested.extend(1u64.to_le_bytes());
        nested.extend(7u32.to_le_bytes());
        let mut w = Writer::default();
        w.meta("deep", 9, &nested);
        let file = write(&w.finish());
        let error = Gguf::open(file.path()).unwrap_err().to_string();
        assert!(error.contains("array of arrays"), "{error}");

        let mut w = Writer::default();
        w.meta("general.alignment", 10, &(u64::MAX - 3).to_le_bytes());
        w.tensor("t", &[4], 0, &[0; 16]);
        let file = write(&w.finish());
        let error = Gguf::open(file.path()).unwrap_err().to_string();
        assert!(error.contains("`t` ends at byte beyond 2^64"), "{error}");

        let mut w = Writer::default();
        w.tensor("huge", &[1 << 32, 1 << 32, 1 << 2], 0, &[0; 16]);
        let file = write(&w.finish());
        let error = Gguf::open(file.path()).unwrap_err().to_string();
        assert!(error.contains("`huge`") && error.contains("past the end of the file"), "{error}");
    }
}
