//! Opening GGUF files: header and bounds validation, tensor reading, and load-time
//! re-quantisation into the weight format chosen for speed on this machine.

use anyhow::{bail, Context, Result};
use candle_core::quantized::{gguf_file::Content, QTensor};
use candle_core::Device;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// An open GGUF file whose header has been read and whose tensors are known to lie inside it.
pub struct GgufFile {
    pub path: PathBuf,
    pub content: Content,
    reader: BufReader<File>,
}

const GGUF_MAGIC: &[u8; 4] = b"GGUF";

/// The integer value of `general.alignment`, found by walking the metadata with every length
/// bounded by the file: candle's reader divides by it unchecked, so a 0 there would panic.
/// `None` when the key is absent or the header does not parse (candle then says why).
fn find_alignment(r: &mut (impl Read + Seek), file_len: u64) -> Option<u64> {
    fn int(r: &mut impl Read, bytes: usize) -> Option<u64> {
        let mut b = [0u8; 8];
        r.read_exact(&mut b[..bytes]).ok()?;
        Some(u64::from_le_bytes(b))
    }
    // Fixed sizes of GGUF value types 0..=12 (8: string, 9: array are variable).
    const SIZES: [u64; 13] = [1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8];
    struct Walk<'a, R> {
        r: &'a mut R,
        wide: bool,
        file_len: u64,
    }
    impl<R: Read + Seek> Walk<'_, R> {
        fn len(&mut self) -> Option<u64> {
            int(self.r, if self.wide { 8 } else { 4 })
        }
        fn skip(&mut self, n: u64) -> Option<()> {
            let at = self.r.stream_position().ok()?;
            let to = at.checked_add(n).filter(|&to| to <= self.file_len)?;
            self.r.seek_relative(to.checked_sub(at)? as i64).ok()
        }
        fn value(&mut self, ty: u64, depth: usize) -> Option<()> {
            match ty {
                8 => {
                    let n = self.len()?;
                    self.skip(n)
                }
                9 if depth < 4 => {
                    let elem = int(self.r, 4)?;
                    let n = self.len()?;
                    match SIZES.get(elem as usize) {
                        Some(&size) if size > 0 => self.skip(n.checked_mul(size)?),
                        _ => (0..n).try_for_each(|_| self.value(elem, depth + 1)),
                    }
                }
                _ => self.skip(*SIZES.get(ty as usize).filter(|&&s| s > 0)?),
            }
        }
    }
    r.seek(SeekFrom::Start(4)).ok()?;
    let version = int(r, 4)?;
    let mut w = Walk { r, wide: version >= 2, file_len };
    let _tensors = w.len()?;
    let kvs = w.len()?;
    for _ in 0..kvs {
        let key_len = w.len()?;
        if key_len == "general.alignment".len() as u64 {
            let mut key = [0u8; 17];
            w.r.read_exact(&mut key).ok()?;
            let ty = int(w.r, 4)?;
            if &key == b"general.alignment" && matches!(ty, 0..=5 | 10 | 11) {
                return int(w.r, SIZES[ty as usize] as usize);
            }
            w.value(ty, 0)?;
        } else {
            w.skip(key_len)?;
            let ty = int(w.r, 4)?;
            w.value(ty, 0)?;
        }
    }
    None
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("cannot open model file {}", path.display()))?;
        let file_len = file.metadata()?.len();
        let mut reader = BufReader::new(file);
        let mut magic = [0u8; 4];
        if reader.read_exact(&mut magic).is_err() || &magic != GGUF_MAGIC {
            bail!("{} is not a GGUF file (bad magic bytes)", path.display());
        }
        if let Some(0) = find_alignment(&mut reader, file_len) {
            bail!("{} has `general.alignment` = 0", path.display());
        }
        reader.seek(SeekFrom::Start(0))?;
        let content = Content::read(&mut reader)
            .map_err(|e| anyhow::anyhow!("{} has a corrupt or truncated GGUF header: {e}", path.display()))?;
        for (name, info) in &content.tensor_infos {
            // Checked: the dimensions are untrusted, and a wrapped product (2^63 × 576 is 0)
            // would pass the bounds check below and size an allocation later.
            let elems = info.shape.dims().iter().try_fold(1usize, |n, &d| n.checked_mul(d));
            let Some(elems) = elems.filter(|&e| e as u64 <= file_len.saturating_mul(8)) else {
                bail!("{}: tensor `{name}` has impossible dimensions {:?}", path.display(), info.shape.dims());
            };
            let block = info.ggml_dtype.block_size();
            if elems % block != 0 {
                bail!("{}: tensor `{name}` has {elems} elements, not a multiple of its block size", path.display());
            }
            let bytes = (elems / block) as u64 * info.ggml_dtype.type_size() as u64;
            let end = content.tensor_data_offset.checked_add(info.offset).and_then(|o| o.checked_add(bytes));
            let Some(end) = end else {
                bail!("{}: tensor `{name}` lies past any file size (offset {})", path.display(), info.offset);
            };
            if end > file_len {
                bail!(
                    "{} is truncated: tensor `{name}` ends at byte {end} but the file has {file_len} bytes",
                    path.display()
                );
            }
        }
        Ok(Self { path: path.to_path_buf(), content, reader })
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Reads one tensor in the file's own type.
    pub fn qtensor(&mut self, name: &str, device: &Device) -> Result<QTensor> {
        if !self.has_tensor(name) {
            bail!("{}: missing tensor `{name}`", self.path.display());
        }
        self.content
            .tensor(&mut self.reader, name, device)
            .with_context(|| format!("{}: cannot read tensor `{name}`", self.path.display()))
    }

    /// Reads a small tensor (norm weights, biases) as dense f32.
    pub fn dense(&mut self, name: &str, device: &Device) -> Result<candle_core::Tensor> {
        Ok(self.qtensor(name, device)?.dequantize(device)?)
    }

    /// Counts tensors per quantisation type, for `inspect`.
    pub fn type_counts(&self) -> Vec<(String, usize)> {
        let mut counts = std::collections::BTreeMap::new();
        for info in self.content.tensor_infos.values() {
            *counts.entry(format!("{:?}", info.ggml_dtype)).or_insert(0) += 1;
        }
        counts.into_iter().collect()
    }
}
