//! A GGUF file: metadata accessors and tensor loading through candle's quantized tensors.

use anyhow::{anyhow, bail, ensure, Context, Result};
use candle_core::quantized::{gguf_file, QTensor};
use candle_core::Device;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

pub struct GgufFile {
    pub path: PathBuf,
    pub content: gguf_file::Content,
    reader: BufReader<File>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let len = file.metadata()?.len();
        let mut reader = BufReader::new(file);
        let bad = |e: String| anyhow!("{} is not a readable GGUF file: {e}", path.display());
        if zero_alignment(&mut reader)? {
            return Err(bad("`general.alignment` is 0".into()));
        }
        // Should candle's reader still panic on a malformed header: an error here.
        let content = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            gguf_file::Content::read(&mut reader)
        }))
        .map_err(|_| bad("its header makes the reader fail".into()))?
        .map_err(|e| bad(readable(e.to_string())))?;
        check_layout(&content, len).map_err(|e| bad(format!("{e:#}")))?;
        Ok(Self {
            path: path.to_path_buf(),
            content,
            reader,
        })
    }

    pub fn get(&self, key: &str) -> Option<&gguf_file::Value> {
        self.content.metadata.get(key)
    }

    pub fn string(&self, key: &str) -> Result<String> {
        self.get(key)
            .ok_or_else(|| anyhow!("GGUF metadata `{key}` is missing"))?
            .to_string()
            .cloned()
            .map_err(|e| anyhow!("GGUF metadata `{key}`: {e}"))
    }

    pub fn opt_string(&self, key: &str) -> Option<String> {
        self.get(key).and_then(|v| v.to_string().ok().cloned())
    }

    /// Any integer type, as GGUF writers differ in which one they use.
    pub fn opt_u64(&self, key: &str) -> Option<u64> {
        use gguf_file::Value::*;
        Some(match self.get(key)? {
            U8(v) => *v as u64,
            I8(v) => *v as u64,
            U16(v) => *v as u64,
            I16(v) => *v as u64,
            U32(v) => *v as u64,
            I32(v) => *v as u64,
            U64(v) => *v,
            I64(v) => *v as u64,
            _ => return None,
        })
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_u64(key)
            .map(|v| v as usize)
            .ok_or_else(|| anyhow!("GGUF metadata `{key}` is missing or not an integer"))
    }

    pub fn opt_f32(&self, key: &str) -> Option<f32> {
        use gguf_file::Value::*;
        match self.get(key)? {
            F32(v) => Some(*v),
            F64(v) => Some(*v as f32),
            _ => None,
        }
    }

    pub fn opt_bool(&self, key: &str) -> Option<bool> {
        self.get(key).and_then(|v| v.to_bool().ok())
    }

    pub fn string_array(&self, key: &str) -> Result<Vec<String>> {
        let arr = self
            .get(key)
            .ok_or_else(|| anyhow!("GGUF metadata `{key}` is missing"))?
            .to_vec()
            .map_err(|e| anyhow!("GGUF metadata `{key}`: {e}"))?;
        arr.iter()
            .map(|v| v.to_string().cloned().map_err(|e| anyhow!("`{key}`: {e}")))
            .collect()
    }

    pub fn f32_array(&self, key: &str) -> Option<Vec<f32>> {
        let arr = self.get(key)?.to_vec().ok()?;
        arr.iter().map(|v| v.to_f32().ok()).collect()
    }

    pub fn u64_array(&self, key: &str) -> Option<Vec<u64>> {
        use gguf_file::Value::*;
        let arr = self.get(key)?.to_vec().ok()?;
        arr.iter()
            .map(|v| match v {
                I32(x) => Some(*x as u64),
                U32(x) => Some(*x as u64),
                I64(x) => Some(*x as u64),
                U64(x) => Some(*x),
                U8(x) => Some(*x as u64),
                I8(x) => Some(*x as u64),
                _ => None,
            })
            .collect()
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    pub fn tensor(&mut self, name: &str, device: &Device) -> Result<QTensor> {
        if !self.has_tensor(name) {
            bail!("{}: tensor `{name}` is missing", self.path.display());
        }
        self.content
            .tensor(&mut self.reader, name, device)
            .map_err(|e| anyhow!("{}: cannot read `{name}`: {e}", self.path.display()))
    }

    /// Weights in all tensors (what `WeightFormat::Auto` sizes a model by).
    pub fn param_count(&self) -> usize {
        self.content
            .tensor_infos
            .values()
            .map(|t| t.shape.elem_count())
            .sum()
    }

    /// Bytes of all tensor data as stored.
    pub fn tensor_bytes(&self) -> usize {
        self.content
            .tensor_infos
            .values()
            .map(|t| t.shape.elem_count() / t.ggml_dtype.block_size() * t.ggml_dtype.type_size())
            .sum()
    }
}

/// candle names a tensor type it cannot read by its number: llama.cpp's name for it, and
/// the types that load.
fn readable(e: String) -> String {
    let Some(t) = e
        .strip_prefix("unknown dtype for tensor ")
        .and_then(|t| t.split_whitespace().next()?.parse::<u32>().ok())
    else {
        return e;
    };
    let name = match super::supported::ggml_type_name(t) {
        Some(n) => format!("{n} (type {t})"),
        None => format!("of type {t}"),
    };
    format!(
        "a tensor is {name}, a GGUF tensor type this build cannot load; it loads {}",
        super::supported::GGUF_TYPES
    )
}

/// Whether the header sets `general.alignment` to 0, which candle's reader divides by: the
/// key, as GGUF stores it, looked for in the first 16 MiB (where the metadata is).
fn zero_alignment(reader: &mut BufReader<File>) -> Result<bool> {
    use std::io::{Read, Seek};
    let mut head = Vec::new();
    reader.by_ref().take(16 << 20).read_to_end(&mut head)?;
    reader.rewind()?;
    let mut key = 17u64.to_le_bytes().to_vec();
    key.extend(b"general.alignment");
    let Some(at) = head.windows(key.len()).position(|w| w == key.as_slice()) else {
        return Ok(false);
    };
    let rest = &head[at + key.len()..];
    // The integer types candle reads the alignment from: u8, i8, u16, i16, u32, i32.
    let width = match rest
        .get(..4)
        .map(|t| u32::from_le_bytes(t.try_into().unwrap()))
    {
        Some(0 | 1) => 1,
        Some(2 | 3) => 2,
        Some(4 | 5) => 4,
        _ => return Ok(false),
    };
    Ok(rest
        .get(4..4 + width)
        .is_some_and(|v| v.iter().all(|&b| b == 0)))
}

/// Every tensor's bytes lie inside the file, aligned and packed one after the other as GGUF
/// writers lay them out: a changed type or shape, a moved offset or a truncated file is an
/// error naming the tensor, never weights read from the wrong bytes.
fn check_layout(c: &gguf_file::Content, file_len: u64) -> Result<()> {
    use gguf_file::Value;
    let alignment = match c.metadata.get("general.alignment") {
        None => 32,
        Some(Value::U8(v)) => *v as u64,
        Some(Value::U16(v)) => *v as u64,
        Some(Value::U32(v)) => *v as u64,
        Some(Value::I8(v)) => *v as u64,
        Some(Value::I16(v)) => *v as u64,
        Some(Value::I32(v)) => *v as u64,
        Some(v) => bail!(
            "`general.alignment` is a {:?}, not an integer: the file is malformed",
            v.value_type()
        ),
    };
    ensure!(
        alignment.is_power_of_two(),
        "`general.alignment` is {alignment}, not a power of two"
    );
    let data = file_len
        .checked_sub(c.tensor_data_offset)
        .context("the file ends inside its header")?;
    let mut spans = Vec::with_capacity(c.tensor_infos.len());
    for (name, t) in &c.tensor_infos {
        let elems = t
            .shape
            .dims()
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
            .with_context(|| format!("tensor `{name}`: its shape {:?} overflows", t.shape))?;
        let block = t.ggml_dtype.block_size() as u64;
        ensure!(
            elems % block == 0,
            "tensor `{name}`: {elems} values are not whole {:?} blocks of {block}",
            t.ggml_dtype
        );
        spans.push((
            t.offset,
            elems / block * t.ggml_dtype.type_size() as u64,
            name,
        ));
    }
    spans.sort();
    let mut next = 0u64;
    for (at, bytes, name) in spans {
        ensure!(
            at == next,
            "tensor `{name}` starts at byte {at} of the data, where {next} was expected after \
             the tensor before it: its offset, type or shape does not match the data"
        );
        let end = at
            .checked_add(bytes)
            .filter(|&e| e <= data)
            .with_context(|| {
                format!("tensor `{name}` ({bytes} bytes at {at}) runs past the end of the file")
            })?;
        next = end.div_ceil(alignment) * alignment;
    }
    Ok(())
}

impl ferrite_tokenizer::Metadata for GgufFile {
    fn path(&self) -> &Path {
        &self.path
    }
    fn string(&self, key: &str) -> Result<String> {
        GgufFile::string(self, key)
    }
    fn opt_string(&self, key: &str) -> Option<String> {
        GgufFile::opt_string(self, key)
    }
    fn opt_u64(&self, key: &str) -> Option<u64> {
        GgufFile::opt_u64(self, key)
    }
    fn opt_bool(&self, key: &str) -> Option<bool> {
        GgufFile::opt_bool(self, key)
    }
    fn string_array(&self, key: &str) -> Result<Vec<String>> {
        GgufFile::string_array(self, key)
    }
    fn f32_array(&self, key: &str) -> Option<Vec<f32>> {
        GgufFile::f32_array(self, key)
    }
    fn u64_array(&self, key: &str) -> Option<Vec<u64>> {
        GgufFile::u64_array(self, key)
    }
}
