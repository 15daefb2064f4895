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
    Online { target: &'a Transformer, layer_ids: Vec<usize> },
    Offline(FeatureCache),
}

impl Features<'_> {
    pub fn get(&mut self, e: &super::examples::TrainExample, device: &Device) -> Result<Tensor> {
        match self {
            Features::Online { target, layer_ids } => target_features(target, layer_ids, &e.tokens, KvDtype::F16),
            Features::Offline(cache) => cache.read(&e.key, device),
        }
    }
}

/// Fills an offline cache with the features of every example not yet in it, printing the disk
/// size first. `progress(done, total)` is called as it goes. Returns the seconds spent.
pub fn fill_feature_cache(
    cache: &mut FeatureCache,
    key: &FeatureKey,
    target: &Transformer,
    examples: &[&super::examples::TrainExample],
    mut progress: impl FnMut(usize, usize),
) -> Result<f64> {
    let t0 = Instant::now();
    let todo: Vec<&&super::examples::TrainExample> = examples.iter().filter(|e| !cache.contains(&e.key)).collect();
    let tokens: u64 = examples.iter().map(|e| e.tokens.len() as u64).sum();
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
        let f = target_features(target, &key.layer_ids, &e.tokens, KvDtype::F16)?;
        cache.append(&e.key, &f)?;
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
