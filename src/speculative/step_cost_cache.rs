//! The measured step-cost curve kept on disk between starts, so that a server that already
//! measured it on this machine starts without timing anything.
//!
//! One JSON file per [`StepCostKey`] under the cache directory (`<specula home>/step-cost`):
//! the key names everything the curve depends on (the model's contents, the CPU, the matmul
//! threads, the weight format and kernels, the KV dtype, how it was measured). Files are written
//! atomically and read like any untrusted input: anything malformed, foreign or implausible is
//! an error for the caller to report before measuring again.

use super::step_cost::{StepCost, StepCostSettings};
use crate::cpu_identity::{matmul_threads, CpuIdentity};
use crate::kv::KvDtype;
use crate::model::{KernelSettings, Transformer};
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

/// Bump when the kernels or the measuring change, so that curves measured before are not
/// reused.
pub const MEASUREMENT_VERSION: u32 = 2;

/// Cache files larger than this are not read (a curve is a few hundred bytes).
const MAX_FILE_BYTES: u64 = 64 * 1024;

/// No forward of up to a few hundred rows takes this long: a larger value is not a timing.
const MAX_PLAUSIBLE_SECS: f64 = 60.0;

/// The default cache directory: `step-cost` in the specula home.
pub fn default_dir() -> PathBuf {
    crate::fetch::specula_home().join("step-cost")
}

/// Everything a measured curve depends on; a file is reused only for an equal key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepCostKey {
    pub version: u32,
    /// sha256 of the model file (of its files' hashes for a model directory).
    pub model_sha256: String,
    pub cpu_model: Option<String>,
    pub cpu_flags: Vec<String>,
    /// Threads of the matmul pool (`CANDLE_NUM_THREADS`).
    pub threads: usize,
    /// The weight format the model was loaded in, and the kernel switches of this process.
    pub weight_format: String,
    pub kernels: String,
    pub kv_dtype: String,
    pub depth: usize,
    pub sizes: Vec<usize>,
    pub rounds: usize,
}

impl StepCostKey {
    /// The key for `model` (loaded from `model_path`) on this machine and process, measured
    /// with `settings` on a `kv_dtype` cache. Hashes the model file unless a fetch already
    /// verified it or `dir` remembers its hash.
    pub fn new(
        model: &Transformer,
        model_path: &Path,
        kv_dtype: KvDtype,
        settings: &StepCostSettings,
        dir: &Path,
    ) -> Result<Self> {
        let cpu = CpuIdentity::current();
        let kernels = KernelSettings { weights: None, ..KernelSettings::from_env() };
        Ok(Self {
            version: MEASUREMENT_VERSION,
            model_sha256: model_sha256(model_path, dir)?,
            cpu_model: cpu.model,
            cpu_flags: cpu.kernel_flags,
            threads: matmul_threads(),
            weight_format: format!("{:?}", model.weight_format),
            kernels: format!("{kernels:?}"),
            kv_dtype: format!("{kv_dtype:?}"),
            depth: settings.depth,
            sizes: settings.sizes.clone(),
            rounds: settings.rounds,
        })
    }

    /// The cache file's name: a digest of the whole key.
    pub fn file_name(&self) -> String {
        let json = serde_json::to_vec(self).unwrap_or_default();
        format!("{}.json", &hex(&Sha256::digest(json))[..24])
    }

    pub fn path_in(&self, dir: &Path) -> PathBuf {
        dir.join(self.file_name())
    }
}

/// What a cache file holds.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CacheFile {
    key: StepCostKey,
    /// The median seconds of each size, as measured (one per `key.sizes`).
    measured: Vec<(usize, f64)>,
    /// Seconds the measurement took.
    measure_secs: f64,
}

/// The curve cached for `key` in `dir`: Ok(None) when there is no file, an error when the file
/// is unreadable, malformed, someone else's or implausible (the caller measures again).
pub fn load(dir: &Path, key: &StepCostKey) -> Result<Option<StepCost>> {
    let path = key.path_in(dir);
    let text = match read_bounded(&path) {
        Ok(text) => text,
        Err(e) if e.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::NotFound) => {
            return Ok(None)
        }
        Err(e) => return Err(e),
    };
    let file: CacheFile =
        serde_json::from_str(&text).with_context(|| format!("{}: not a step-cost file", path.display()))?;
    ensure!(&file.key == key, "{}: measured for another model, machine or setting", path.display());
    validate(&file.measured, &key.sizes).with_context(|| format!("{}", path.display()))?;
    Ok(Some(StepCost::from_measured(file.measured)))
}

/// Writes `cost` for `key` into `dir` atomically (a temporary file renamed over the old one);
/// returns the file's path.
pub fn save(dir: &Path, key: &StepCostKey, cost: &StepCost, measure_secs: f64) -> Result<PathBuf> {
    validate(cost.measured(), &key.sizes).context("not writing an implausible step-cost curve")?;
    let file = CacheFile { key: key.clone(), measured: cost.measured().to_vec(), measure_secs };
    let path = key.path_in(dir);
    write_atomically(&path, &serde_json::to_vec_pretty(&file)?)?;
    Ok(path)
}

/// One timing per size, in order, each a plausible number of seconds.
fn validate(measured: &[(usize, f64)], sizes: &[usize]) -> Result<()> {
    let rows: Vec<usize> = measured.iter().map(|p| p.0).collect();
    ensure!(rows == sizes, "the curve's sizes {rows:?} are not the expected {sizes:?}");
    for &(m, secs) in measured {
        ensure!(secs.is_finite() && secs > 0.0 && secs < MAX_PLAUSIBLE_SECS, "{m} rows: {secs} s is not a timing");
    }
    // Medians wobble by noise, but a block never costs less than half a smaller one, nor more
    // per row than single rows by far: beyond that the numbers were not measured.
    for w in measured.windows(2) {
        let ((m0, s0), (m1, s1)) = (w[0], w[1]);
        ensure!(s1 >= 0.5 * s0, "{m1} rows cost {s1} s, far below {m0} rows' {s0} s");
        ensure!(s1 / m1 as f64 <= 2.0 * s0 / m0 as f64, "{m1} rows cost {s1} s, far above {m0} rows' {s0} s per row");
    }
    Ok(())
}

/// The sha256 of a model file, or of a model directory's files (name and hash of each):
/// from the fetcher's verified marker where there is one, else remembered in
/// `dir/sha256/` by canonical path, size and mtime, else computed (and remembered).
pub fn model_sha256(path: &Path, dir: &Path) -> Result<String> {
    if path.is_dir() {
        let mut names: Vec<PathBuf> = fs::read_dir(path)
            .with_context(|| format!("listing {}", path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')))
            .collect();
        names.sort();
        let mut digest = Sha256::new();
        for file in names {
            digest.update(file.file_name().unwrap_or_default().as_encoded_bytes());
            digest.update(file_sha256(&file, dir)?.as_bytes());
        }
        return Ok(hex(&digest.finalize()));
    }
    file_sha256(path, dir)
}

/// A remembered hash: valid while the file at `path` keeps its size and mtime.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RememberedHash {
    path: PathBuf,
    size: u64,
    mtime_ns: u128,
    sha256: String,
}

fn file_sha256(path: &Path, dir: &Path) -> Result<String> {
    if let Some(sha) = crate::fetch::verified_sha256(path) {
        return Ok(sha);
    }
    let path = fs::canonicalize(path).with_context(|| format!("reading {}", path.display()))?;
    let meta = fs::metadata(&path).with_context(|| format!("reading {}", path.display()))?;
    let (size, mtime_ns) = (meta.len(), mtime_nanos(&meta));
    let memo =
        dir.join("sha256").join(format!("{}.json", &hex(&Sha256::digest(path.as_os_str().as_encoded_bytes()))[..24]));
    let remembered = read_bounded(&memo).ok().and_then(|t| serde_json::from_str::<RememberedHash>(&t).ok());
    if let Some(r) = remembered {
        let valid = r.sha256.len() == 64 && r.sha256.bytes().all(|b| b.is_ascii_hexdigit());
        if valid && r.path == path && r.size == size && r.mtime_ns == mtime_ns {
            return Ok(r.sha256);
        }
    }
    let mut file = fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let mut digest = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        digest.update(&buf[..n]);
    }
    let sha256 = hex(&digest.finalize());
    // Failing to remember only costs hashing again next time.
    let record = RememberedHash { path: path.clone(), size, mtime_ns, sha256: sha256.clone() };
    if let Err(e) = serde_json::to_vec(&record).map_err(anyhow::Error::from).and_then(|b| write_atomically(&memo, &b)) {
        eprintln!("specula: warning: cannot remember the hash of {}: {e:#}", path.display());
    }
    Ok(sha256)
}

/// The file's text if it is a regular file of at most [`MAX_FILE_BYTES`].
fn read_bounded(path: &Path) -> Result<String> {
    let file = fs::File::open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() || meta.len() > MAX_FILE_BYTES {
        bail!("{}: not a small regular file", path.display());
    }
    let mut text = String::new();
    file.take(MAX_FILE_BYTES).read_to_string(&mut text).with_context(|| format!("reading {}", path.display()))?;
    Ok(text)
}

/// Writes a temporary file beside `path` and renames it over `path`: readers see the old file
/// or the new one, never a part.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let parent = path.parent().context("the cache file has no folder")?;
    fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    // Unique per process and call: two servers starting at once each write their own.
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{}.{n}.tmp", std::process::id()));
    let tmp = path.with_file_name(name);
    let written = (|| -> Result<()> {
        let mut file = fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        fs::rename(&tmp, path)?;
        Ok(())
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written.with_context(|| format!("writing {}", path.display()))
}

fn mtime_nanos(meta: &fs::Metadata) -> u128 {
    meta.modified().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> StepCostKey {
        StepCostKey {
            version: MEASUREMENT_VERSION,
            model_sha256: "ab".repeat(32),
            cpu_model: Some("Some CPU".into()),
            cpu_flags: vec!["avx2".into()],
            threads: 2,
            weight_format: "Native".into(),
            kernels: "k".into(),
            kv_dtype: "F16".into(),
            depth: 64,
            sizes: vec![1, 2, 4],
            rounds: 9,
        }
    }

    #[test]
    fn round_trips_and_rejects_what_it_did_not_write() {
        let dir = tempfile::tempdir().unwrap();
        let k = key();
        assert!(load(dir.path(), &k).unwrap().is_none());
        let cost = StepCost::from_measured(vec![(1, 0.010), (2, 0.011), (4, 0.013)]);
        let path = save(dir.path(), &k, &cost, 1.5).unwrap();
        assert_eq!(load(dir.path(), &k).unwrap().unwrap(), cost);
        // Another thread count: another file, not this one.
        let other = StepCostKey { threads: 4, ..k.clone() };
        assert_ne!(other.file_name(), k.file_name());
        assert!(load(dir.path(), &other).unwrap().is_none());
        // A foreign key in the right place, bad values, garbage, a huge file: errors.
        let text = fs::read_to_string(&path).unwrap();
        for bad in [
            text.replace("\"threads\": 2", "\"threads\": 3"),
            text.replace("0.013", "NaN"),
            text.replace("0.013", "-0.013"),
            text.replace("0.013", "0.001"),
            text.replace("0.013", "1e9"),
            text[..text.len() / 2].to_string(),
            "{}".into(),
            "\u{0}\u{1}".into(),
            " ".repeat(MAX_FILE_BYTES as usize + 1),
        ] {
            fs::write(&path, &bad).unwrap();
            assert!(load(dir.path(), &k).is_err(), "accepted {:.80}", bad);
        }
        // Wrong sizes are refused on writing too.
        assert!(save(dir.path(), &k, &StepCost::from_measured(vec![(1, 0.01), (2, 0.011)]), 1.0).is_err());
    }

    #[test]
    fn hashes_are_remembered_by_path_size_and_mtime() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m.gguf");
        fs::write(&model, b"abc").unwrap();
        let cache = dir.path().join("cache");
        let sha = model_sha256(&model, &cache).unwrap();
        assert_eq!(sha, hex(&Sha256::digest(b"abc")));
        assert_eq!(fs::read_dir(cache.join("sha256")).unwrap().count(), 1);
        assert_eq!(model_sha256(&model, &cache).unwrap(), sha);
        fs::write(&model, b"abcd").unwrap();
        assert_eq!(model_sha256(&model, &cache).unwrap(), hex(&Sha256::digest(b"abcd")));
    }
}
