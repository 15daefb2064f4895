//! Target features for drafter training: the target's tapped hidden states for every token of
//! an example, as the drafter sees them at serving time (`TargetHead::hidden_state` of the
//! engine's taps, concatenated in `target_layer_ids` order), `[tokens, taps·hidden]` f32.
//!
//! Two sources, chosen by the trainer's `--features` flag:
//! - **online**: the target runs over each example whenever the trainer needs it (no disk,
//!   one target prefill per example per epoch);
//! - **offline**: one pass writes every example's features to an f16 file once
//!   ([`FeatureCache`]), and every epoch reads them back (disk instead of target time).

use crate::kv::KvDtype;
use crate::model::{ForwardBatch, LogitsRows, Transformer};
use crate::speculative::dflash::TargetHead;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Runs the target over `tokens` (one prefill, no logits, its K/V cache in `kv`: f16 is what
/// serving uses) and returns the features of every row, `[tokens, layer_ids.len() · hidden]` f32.
pub fn target_features(target: &Transformer, layer_ids: &[usize], tokens: &[u32], kv: KvDtype) -> Result<Tensor> {
    if tokens.is_empty() {
        bail!("no tokens to compute features for");
    }
    let head = TargetHead::of(target);
    let pool = target.new_kv_pool_typed(tokens.len().next_multiple_of(16), kv);
    let mut cache = pool.new_sequence();
    let mut batch = ForwardBatch::new();
    batch.tap_layers = layer_ids.to_vec();
    batch.push(tokens, &mut cache, LogitsRows::None);
    let out = target.forward(&mut batch)?;
    let taps: Vec<Tensor> =
        out.taps.iter().zip(layer_ids).map(|(t, &layer)| head.hidden_state(layer, t)).collect::<Result<_>>()?;
    Ok(Tensor::cat(&taps, 1)?)
}

/// What a feature file was made for; a cache made for anything else is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FeatureKey {
    /// The target's file name (as in the data directory's `meta.json`).
    pub target: String,
    /// SHA-256 of the target's weights ([`model_sha256`]): another file of the same name is
    /// another model.
    #[serde(default)]
    pub target_sha256: String,
    pub layer_ids: Vec<usize>,
    pub hidden: usize,
    /// Examples are cut to at most this many tokens before their features are taken.
    pub max_tokens: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct IndexEntry {
    /// Row offset in the file (rows of `width` f16 values).
    row: u64,
    rows: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Index {
    key: FeatureKey,
    /// `set/id` → where its rows are.
    examples: HashMap<String, IndexEntry>,
    rows: u64,
}

/// Features of many examples in one f16 file (`features.f16`, rows appended in the order
/// they were computed) with an index (`features.json`: example → first row and row count).
/// Appending resumes after an interrupted pass: rows past the index's end are overwritten.
pub struct FeatureCache {
    dir: PathBuf,
    index: Index,
    file: File,
    width: usize,
}

impl FeatureCache {
    /// Bytes the features of `tokens` rows take on disk.
    pub fn bytes_for(tokens: u64, key: &FeatureKey) -> u64 {
        tokens * (key.layer_ids.len() * key.hidden) as u64 * 2
    }

    /// Opens (or creates) the cache in `dir`; a cache made for another key is refused.
    pub fn open(dir: &Path, key: FeatureKey) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let index_path = dir.join("features.json");
        let index = if index_path.exists() {
            let index: Index = serde_json::from_str(&std::fs::read_to_string(&index_path)?)
                .with_context(|| format!("{} is not a feature index", index_path.display()))?;
            if index.key != key {
                bail!(
                    "{} holds features for {:?}, not {:?}: use another --features-dir or delete it",
                    dir.display(),
                    index.key,
                    key
                );
            }
            index
        } else {
            Index { key: key.clone(), examples: HashMap::new(), rows: 0 }
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(dir.join("features.f16"))
            .with_context(|| format!("cannot open {}", dir.join("features.f16").display()))?;
        let width = key.layer_ids.len() * key.hidden;
        Ok(Self { dir: dir.to_path_buf(), index, file, width })
    }

    /// Examples are cut to this many tokens before their features are taken.
    pub fn max_tokens(&self) -> usize {
        self.index.key.max_tokens
    }

    pub fn contains(&self, example: &str) -> bool {
        self.index.examples.contains_key(example)
    }

    pub fn len(&self) -> usize {
        self.index.examples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.examples.is_empty()
    }

    /// Appends one example's features `[rows, width]`; call [`Self::flush_index`] to make
    /// appended examples durable.
    pub fn append(&mut self, example: &str, features: &Tensor) -> Result<()> {
        let (rows, width) = features.dims2()?;
        if width != self.width {
            bail!("features of width {width}, the cache holds {}", self.width);
        }
        let values: Vec<half::f16> = features.to_dtype(DType::F16)?.flatten_all()?.to_vec1()?;
        let mut bytes = Vec::with_capacity(values.len() * 2);
        for v in values {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        let row = self.index.rows;
        self.file.seek(SeekFrom::Start(row * self.width as u64 * 2))?;
        self.file.write_all(&bytes)?;
        self.index.examples.insert(example.to_string(), IndexEntry { row, rows });
        self.index.rows += rows as u64;
        Ok(())
    }

    /// Writes the index (atomically: a temporary file renamed over the old one).
    pub fn flush_index(&mut self) -> Result<()> {
        self.file.flush()?;
        let tmp = self.dir.join("features.json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(&self.index)?)?;
        std::fs::rename(&tmp, self.dir.join("features.json"))?;
        Ok(())
    }

    /// One example's features `[rows, width]` f32.
    pub fn read(&mut self, example: &str, device: &Device) -> Result<Tensor> {
        let e = self.index.examples.get(example).with_context(|| format!("no cached features for {example}"))?.clone();
        let mut bytes = vec![0u8; e.rows * self.width * 2];
        self.file.seek(SeekFrom::Start(e.row * self.width as u64 * 2))?;
        self.file.read_exact(&mut bytes).with_context(|| format!("reading cached features of {example}"))?;
        let values: Vec<half::f16> = bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]])).collect();
        Ok(Tensor::from_vec(values, (e.rows, self.width), device)?.to_dtype(DType::F32)?)
    }
}

/// Where a trainer's features come from.
pub enum Features<'a> {
    Online {
        target: &'a Transformer,
        layer_ids: Vec<usize>,
    },
    /// One cache per data directory, by the examples' `source`.
    Offline(Vec<FeatureCache>),
}

/// What features are asked for: an example's key, its tokens and the data directory it came
/// from (training examples are one).
pub trait FeatureRequest {
    fn key(&self) -> &str;
    fn tokens(&self) -> &[u32];
    fn source(&self) -> usize;
}

impl Features<'_> {
    pub fn get(&mut self, e: &impl FeatureRequest, device: &Device) -> Result<Tensor> {
        match self {
            Features::Online { target, layer_ids } => target_features(target, layer_ids, e.tokens(), KvDtype::F16),
            Features::Offline(caches) => {
                let n = caches.len();
                caches
                    .get_mut(e.source())
                    .with_context(|| format!("{} comes from data directory {} of {n}", e.key(), e.source()))?
                    .read(e.key(), device)
            }
        }
    }
}

/// Fills an offline cache with the features of every example not yet in it, printing the disk
/// size first. `progress(done, total)` is called as it goes. Returns the seconds spent.
pub fn fill_feature_cache(
    cache: &mut FeatureCache,
    key: &FeatureKey,
    target: &Transformer,
    examples: &[&impl FeatureRequest],
    mut progress: impl FnMut(usize, usize),
) -> Result<f64> {
    let t0 = Instant::now();
    let todo: Vec<_> = examples.iter().filter(|e| !cache.contains(e.key())).collect();
    let tokens: u64 = examples.iter().map(|e| e.tokens().len() as u64).sum();
    eprintln!(
        "target features: {} tokens of {} examples take {:.2} GB on disk as f16 ({} to compute)",
        tokens,
        examples.len(),
        FeatureCache::bytes_for(tokens, key) as f64 / 1e9,
        todo.len()
    );
    let mut last_flush = Instant::now();
    progress(0, todo.len());
    for (i, e) in todo.iter().enumerate() {
        let f = target_features(target, &key.layer_ids, e.tokens(), KvDtype::F16)?;
        cache.append(e.key(), &f)?;
        if last_flush.elapsed().as_secs() >= 30 {
            cache.flush_index()?;
            last_flush = Instant::now();
        }
        progress(i + 1, todo.len());
    }
    cache.flush_index()?;
    Ok(t0.elapsed().as_secs_f64())
}

/// SHA-256 (hex) of a model: its file, or every file of a model directory in name order.
pub fn model_sha256(path: &Path) -> Result<String> {
    use sha2::Digest;
    let mut files = if path.is_dir() {
        let mut f: Vec<PathBuf> = std::fs::read_dir(path)
            .with_context(|| format!("reading {}", path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .collect();
        f.sort();
        f
    } else {
        vec![path.to_path_buf()]
    };
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for f in files.drain(..) {
        let mut file = File::open(&f).with_context(|| format!("opening {}", f.display()))?;
        loop {
            let n = file.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
        }
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// A proposer that never drafts and records the target's tapped hidden states of every row
/// that enters its cache, as the trainer's features: `train data` writes an example's
/// features from the same target pass that generates its answer. Rows the engine runs again
/// replace the earlier ones.
pub struct FeatureRecorder {
    layers: Vec<usize>,
    head: TargetHead,
    /// Chunks of consecutive rows `(first row, [rows, width])`, shared with the caller.
    rows: std::sync::Arc<std::sync::Mutex<Vec<(usize, Tensor)>>>,
}

impl FeatureRecorder {
    /// A recorder of `layers` and the handle its rows are read from.
    pub fn new(target: &Transformer, layers: Vec<usize>) -> (Self, FeatureRows) {
        let rows = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        (Self { layers, head: TargetHead::of(target), rows: rows.clone() }, FeatureRows(rows))
    }
}

/// The rows a [`FeatureRecorder`] recorded.
pub struct FeatureRows(std::sync::Arc<std::sync::Mutex<Vec<(usize, Tensor)>>>);

impl FeatureRows {
    /// Features of the rows of an example of `n` tokens: all but the last at least (the
    /// engine does not show a finished request's last step, and no trainer reads the last
    /// token's features); None when fewer were recorded (or not from row 0).
    pub fn take(&self, n: usize) -> Result<Option<Tensor>> {
        let chunks = std::mem::take(&mut *self.0.lock().expect("not poisoned"));
        let mut expect = 0;
        let mut parts = Vec::new();
        for (start, t) in chunks {
            if start != expect {
                return Ok(None);
            }
            expect += t.dim(0)?;
            parts.push(t);
        }
        if n < 2 || expect + 1 < n {
            return Ok(None);
        }
        Ok(Some(Tensor::cat(&parts, 0)?.narrow(0, 0, expect.min(n))?))
    }
}

impl crate::speculative::Proposer for FeatureRecorder {
    fn name(&self) -> &str {
        "features"
    }

    fn tap_layers(&self) -> &[usize] {
        &self.layers
    }

    fn begin(&mut self, _prompt: &[u32]) -> Result<()> {
        // Nothing to reset: the engine may call this after the prompt's rows were observed,
        // and a restarted sequence runs its rows again from 0, which replaces them.
        Ok(())
    }

    fn observe(&mut self, _tokens: &[u32], cached: std::ops::Range<usize>, taps: &[Tensor]) -> Result<()> {
        if cached.is_empty() {
            return Ok(());
        }
        let mut rows = self.rows.lock().expect("not poisoned");
        // Rows from `cached.start` on are run again: drop what was recorded for them.
        while let Some((start, t)) = rows.last_mut() {
            if *start >= cached.start {
                rows.pop();
            } else {
                let keep = cached.start - *start;
                if t.dim(0)? > keep {
                    *t = t.narrow(0, 0, keep)?;
                }
                break;
            }
        }
        let states: Vec<Tensor> =
            taps.iter().zip(&self.layers).map(|(t, &layer)| self.head.hidden_state(layer, t)).collect::<Result<_>>()?;
        rows.push((cached.start, Tensor::cat(&states, 1)?));
        Ok(())
    }

    fn propose(&mut self, _tokens: &[u32], _max_len: usize) -> Result<crate::speculative::Draft> {
        Ok(crate::speculative::Draft::deterministic(Vec::new()))
    }
}

/// The cache folder of the features of data directory `data` under `key`, in `parent`
/// (default: `features/` in the specula cache): every run on that directory with the same
/// target, taps and length reads the same file, `train data --features` included.
pub fn default_dir(key: &FeatureKey, data: &Path, parent: Option<&Path>) -> Result<PathBuf> {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(serde_json::to_vec(key)?);
    let canonical = data.canonicalize().unwrap_or_else(|_| data.to_path_buf());
    h.update(canonical.to_string_lossy().as_bytes());
    let name: String = h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();
    let parent = parent.map_or_else(|| crate::fetch::specula_home().join("features"), Path::to_path_buf);
    Ok(parent.join(name))
}
