//! `specula train data`: the target answers training prompts on the batching engine, and each
//! prompt + response becomes one training example. With [`ResponseSource::Dataset`] the
//! examples hold the prompt set's own answers instead (no generation).
//!
//! Output directory:
//! - `shard-00000.jsonl`, `shard-00001.jsonl`, …: one [`Example`] per line, `shard_size` lines
//!   per shard; each line is written whole with one write and flushed.
//! - `meta.json`: [`Meta`], the target, the settings and the counts.
//!
//! Resuming: a rerun reads the shards, skips the examples already there (by set + id) and
//! appends the rest. A trailing line of the last shard that is cut off or does not parse (a
//! run killed mid-write) is dropped first. A directory written for another target, or with
//! other generation settings, is refused.
//!
//! Evaluation sets ([`EVAL_SETS`]) never enter training data: they are refused as prompt sets,
//! and [`check_no_eval_prompts`] checks a finished directory against every evaluation set that
//! is available offline.

use crate::datasets::{self, Prompt, PromptKind};
use crate::engine::{EngineConfig, EngineCore, EngineEvent, EngineModel, EngineRequest, EventSink, LoadedModel};
use crate::sample::SamplingParams;
use crate::speculative::DraftLen;
use crate::tokenize::ChatMessage;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Instant;

/// Prompt sets that measure quality and speed: never training data. The one list, shared with
/// [`datasets::is_evaluation_set`].
pub const EVAL_SETS: &[&str] = datasets::EVALUATION_SETS;

/// Version of the on-disk format in `meta.json`.
pub const FORMAT_VERSION: u32 = 1;

/// Where a set's prompts come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptSource {
    /// A known set, fetched on first use ([`datasets::load`]).
    Set(String),
    /// A local file in the format of set `key` ([`datasets::load_from_path`]).
    File { key: String, path: PathBuf },
}

impl PromptSource {
    pub fn key(&self) -> &str {
        match self {
            Self::Set(k) | Self::File { key: k, .. } => k,
        }
    }

    /// `KEY=PATH` (the `--prompts-file` form).
    pub fn parse_file(spec: &str) -> Result<Self> {
        let (key, path) =
            spec.split_once('=').with_context(|| format!("--prompts-file `{spec}`: expected KEY=PATH"))?;
        if key.is_empty() || path.is_empty() {
            bail!("--prompts-file `{spec}`: expected KEY=PATH");
        }
        Ok(Self::File { key: key.to_string(), path: PathBuf::from(path) })
    }
}

/// One training example: a line of a shard.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Example {
    /// The prompt set (`sharegpt`, `fastchat-dummy`, …).
    pub set: String,
    /// The prompt's id in its set.
    pub id: String,
    /// The prompt text as given to the chat template (or raw, for completion prompts).
    pub prompt: String,
    /// Prompt tokens at the front of `tokens` (chat template and BOS included).
    pub prompt_tokens: usize,
    /// Prompt token ids followed by the target's response (the stop token is not included).
    pub tokens: Vec<u32>,
    /// One per token: 1 for response tokens (the ones to learn), 0 for the prompt.
    pub loss_mask: Vec<u8>,
    /// Why the response ended: `stop` (end of sequence), `length` (`max_new_tokens`),
    /// `context_full`.
    pub finish: String,
}

impl Example {
    pub fn response(&self) -> &[u32] {
        &self.tokens[self.prompt_tokens.min(self.tokens.len())..]
    }
}

/// The target a data directory was made for; resuming with another is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetId {
    /// The model file (or directory) as given.
    pub path: String,
    /// Its file name, compared on resume (the cache may move).
    pub file_name: String,
    /// Tokens in the target's tokenizer.
    pub vocab_size: usize,
    pub n_layers: usize,
    pub hidden: usize,
}

impl TargetId {
    pub fn of(target: &LoadedModel) -> Self {
        Self {
            path: target.path.display().to_string(),
            file_name: target.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            vocab_size: target.tokenizer.vocab_size(),
            n_layers: target.model.config.n_layers,
            hidden: target.model.config.hidden,
        }
    }

    pub fn same_model(&self, other: &Self) -> bool {
        self.file_name == other.file_name
            && self.vocab_size == other.vocab_size
            && self.n_layers == other.n_layers
            && self.hidden == other.hidden
    }
}

/// Who answers the prompts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResponseSource {
    /// The target, decoding on the batching engine: the text a drafter will be asked to predict.
    #[default]
    Target,
    /// The prompt set's own answers (ShareGPT's first model turn, CodeI/O's code), tokenized
    /// as they are, cut at `max_new_tokens`: no generation, so fast, but not the target's words.
    Dataset,
}

impl ResponseSource {
    pub fn parse(text: &str) -> Result<Self> {
        match text {
            "target" => Ok(Self::Target),
            "dataset" => Ok(Self::Dataset),
            other => bail!("--responses `{other}`: expected `target` or `dataset`"),
        }
    }

    fn is_target(&self) -> bool {
        *self == Self::Target
    }
}

/// Generation settings that must stay the same across resumed runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenSettings {
    pub max_new_tokens: usize,
    /// 0 = greedy.
    pub temperature: f32,
    /// Each example samples with its own seed derived from this and its set + id.
    pub seed: u64,
    /// Chat template variables for chat prompts (`{"enable_thinking": false}`: the published
    /// Qwen3 DFlash drafters were trained on answers without thinking).
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub chat_template_kwargs: crate::tokenize::TemplateKwargs,
    /// Whose answers the examples hold.
    #[serde(default, skip_serializing_if = "ResponseSource::is_target")]
    pub responses: ResponseSource,
}

/// Throughput of one run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunStats {
    pub examples: usize,
    pub prompt_tokens: u64,
    pub response_tokens: u64,
    pub secs: f64,
    /// Response tokens per second of generation (all requests together).
    pub tokens_per_sec: f64,
    pub batch: usize,
}

/// `meta.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    pub format: u32,
    pub target: TargetId,
    pub settings: GenSettings,
    pub shard_size: usize,
    /// Prompt sets that have contributed examples, in first-use order.
    pub prompt_sets: Vec<String>,
    /// Examples in the shards, per set and in all.
    pub examples_per_set: HashMap<String, usize>,
    pub examples: usize,
    pub prompt_tokens: u64,
    pub response_tokens: u64,
    pub shards: Vec<String>,
    /// Prompts left out because they do not fit the context or the KV cache (set/id).
    pub skipped: Vec<String>,
    /// The latest run.
    pub last_run: RunStats,
}

/// What `specula train data` does.
#[derive(Debug, Clone)]
pub struct DataSettings {
    pub sources: Vec<PromptSource>,
    /// Prompts skipped at the start of each set, before `limit` counts.
    pub skip: usize,
    /// Prompts per set at most.
    pub limit: Option<usize>,
    pub gen: GenSettings,
    pub out: PathBuf,
    /// Requests decoding together.
    pub batch: usize,
    /// Examples per shard file.
    pub shard_size: usize,
    /// KV cache capacity in tokens, shared by the batch.
    pub kv_tokens: usize,
    /// Prompts longer than this (in tokens, template included) are skipped: long prompts cost
    /// prefill time and teach a drafter little that short ones do not. None: no limit.
    pub max_prompt_tokens: Option<usize>,
    /// Also write the target's features of every example, from the same pass that generates
    /// it, into the feature cache a trainer on this directory reads.
    pub features: Option<DataFeatures>,
}

/// Which features `train data` writes while it generates, and where.
#[derive(Debug, Clone)]
pub struct DataFeatures {
    pub key: super::features::FeatureKey,
    /// The folder the caches are in (the trainers' `--features-dir`); None: the default
    /// ([`super::features::default_dir`]).
    pub dir: Option<PathBuf>,
}

impl DataSettings {
    pub fn validate(&self) -> Result<()> {
        if self.sources.is_empty() {
            bail!("no prompt sets given (--prompts or --prompts-file)");
        }
        if self.batch == 0 {
            bail!("--batch must be at least 1");
        }
        if self.gen.max_new_tokens == 0 {
            bail!("--max-new-tokens must be at least 1");
        }
        if self.shard_size == 0 {
            bail!("--shard-size must be at least 1");
        }
        if !self.gen.temperature.is_finite() || self.gen.temperature < 0.0 {
            bail!("--temperature must be a number >= 0 (0 = greedy)");
        }
        Ok(())
    }
}

/// Progress after each finished example.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Examples in the directory (earlier runs included).
    pub done: usize,
    /// Examples the directory will hold at the end (skipped prompts excluded).
    pub total: usize,
    /// Response tokens per second so far in this run.
    pub tokens_per_sec: f64,
    pub secs: f64,
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct DataSummary {
    /// Prompts selected (all sets, after `limit`).
    pub prompts: usize,
    /// Already in the directory before this run.
    pub already: usize,
    /// Written by this run.
    pub written: usize,
    /// A cut-off trailing line was dropped on resume.
    pub dropped_partial_line: bool,
    pub skipped: Vec<String>,
    pub run: RunStats,
    pub meta: Meta,
}

/// Refuses evaluation sets and sets that are not prompt sets, with a clear message.
pub fn check_training_set(key: &str) -> Result<()> {
    if EVAL_SETS.contains(&key) {
        bail!(
            "`{key}` is an evaluation set: evaluation prompts never enter training data (evaluation sets: {})",
            EVAL_SETS.join(", ")
        );
    }
    if !datasets::PROMPT_SETS.contains(&key) {
        bail!("unknown prompt set `{key}`; training sets: {}", datasets::TRAINING_SETS.join(", "));
    }
    Ok(())
}

/// The prompts of every source, the first `skip` of each left out and `limit` per set after
/// them, each with its set key. Evaluation sets, unknown sets and empty selections are errors;
/// a repeated id within a set keeps its first prompt.
pub fn load_prompts(sources: &[PromptSource], skip: usize, limit: Option<usize>) -> Result<Vec<(String, Prompt)>> {
    let read = limit.map(|l| l.saturating_add(skip));
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    for source in sources {
        let key = source.key();
        check_training_set(key)?;
        let prompts = match source {
            PromptSource::Set(k) => datasets::load(k, read).with_context(|| format!("loading prompt set `{k}`"))?,
            PromptSource::File { key, path } => datasets::load_from_path(key, path, read)?,
        };
        let total = prompts.len();
        if total == 0 {
            bail!("prompt set `{key}` has no prompts");
        }
        if total <= skip {
            bail!("prompt set `{key}` has {total} prompts, none left after skipping {skip}");
        }
        for p in prompts.into_iter().skip(skip) {
            if seen.insert((key.to_string(), p.id.clone())) {
                out.push((key.to_string(), p));
            }
        }
    }
    Ok(out)
}

/// Name of shard `i`.
pub fn shard_name(i: usize) -> String {
    format!("shard-{i:05}.jsonl")
}

/// The shard files of `dir`, in order.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut shards: Vec<(usize, PathBuf)> = Vec::new();
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if let Some(n) = name.strip_prefix("shard-").and_then(|s| s.strip_suffix(".jsonl")) {
            if let Ok(i) = n.parse::<usize>() {
                shards.push((i, path));
            }
        }
    }
    shards.sort();
    for (expected, (i, path)) in shards.iter().enumerate() {
        if *i != expected {
            bail!("{}: shard {expected} is missing", path.display());
        }
    }
    Ok(shards.into_iter().map(|(_, p)| p).collect())
}

/// The shards of a data directory, read.
#[derive(Debug, Clone, Default)]
pub struct ShardScan {
    pub examples: Vec<Example>,
    /// Each shard file and the examples it holds.
    pub counts: Vec<(PathBuf, usize)>,
    /// The last shard ended in a cut-off or unparsable line.
    pub dropped_partial_line: bool,
}

/// Reads every example of a data directory. With `repair`, a cut-off or unparsable trailing
/// line of the last shard is cut from the file; without, it is ignored. Any other line that
/// does not parse is an error.
pub fn read_examples(dir: &Path, repair: bool) -> Result<ShardScan> {
    let shards = shard_files(dir)?;
    let mut examples = Vec::new();
    let mut counts = Vec::new();
    let mut dropped = false;
    for (si, path) in shards.iter().enumerate() {
        let last_shard = si + 1 == shards.len();
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let mut n = 0;
        let mut pos = 0;
        while pos < bytes.len() {
            let end = bytes[pos..].iter().position(|&b| b == b'\n').map(|i| pos + i);
            let line = &bytes[pos..end.unwrap_or(bytes.len())];
            let next = end.map_or(bytes.len(), |e| e + 1);
            let is_last_line = next >= bytes.len();
            if line.iter().all(u8::is_ascii_whitespace) {
                pos = next;
                continue;
            }
            let parsed = if end.is_some() { serde_json::from_slice::<Example>(line).ok() } else { None };
            match parsed {
                Some(ex) => {
                    if ex.tokens.len() != ex.loss_mask.len() || ex.prompt_tokens > ex.tokens.len() {
                        bail!("{}: line {}: tokens and loss mask disagree", path.display(), n + 1);
                    }
                    examples.push(ex);
                    n += 1;
                }
                None if last_shard && is_last_line => {
                    dropped = true;
                    if repair {
                        let f = std::fs::OpenOptions::new()
                            .write(true)
                            .open(path)
                            .with_context(|| format!("opening {}", path.display()))?;
                        f.set_len(pos as u64).with_context(|| format!("truncating {}", path.display()))?;
                    }
                }
                None => bail!(
                    "{}: line {} is not a training example (a damaged shard; remove it to regenerate)",
                    path.display(),
                    n + 1
                ),
            }
            pos = next;
        }
        counts.push((path.clone(), n));
    }
    Ok(ShardScan { examples, counts, dropped_partial_line: dropped })
}

fn read_meta(dir: &Path) -> Result<Option<Meta>> {
    let path = dir.join("meta.json");
    if !path.exists() {
        return Ok(None);
    }
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let meta = serde_json::from_slice(&bytes)
        .with_context(|| format!("{}: not a specula training-data meta file", path.display()))?;
    Ok(Some(meta))
}

fn write_meta(dir: &Path, meta: &Meta) -> Result<()> {
    let path = dir.join("meta.json");
    let tmp = dir.join("meta.json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(meta)?).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Appends examples to the shards, `shard_size` per file.
struct ShardWriter {
    dir: PathBuf,
    shard_size: usize,
    index: usize,
    lines: usize,
    file: Option<std::fs::File>,
}

impl ShardWriter {
    fn new(dir: &Path, shard_size: usize, counts: &[(PathBuf, usize)]) -> Self {
        let (index, lines) = match counts.last() {
            Some((_, n)) => (counts.len() - 1, *n),
            None => (0, 0),
        };
        Self { dir: dir.to_path_buf(), shard_size, index, lines, file: None }
    }

    fn write(&mut self, ex: &Example) -> Result<()> {
        if self.lines >= self.shard_size {
            self.index += 1;
            self.lines = 0;
            self.file = None;
        }
        let path = self.dir.join(shard_name(self.index));
        if self.file.is_none() {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .with_context(|| format!("opening {}", path.display()))?;
            self.file = Some(f);
        }
        let mut line = serde_json::to_string(ex)?;
        line.push('\n');
        let f = self.file.as_mut().expect("opened above");
        f.write_all(line.as_bytes()).with_context(|| format!("writing {}", path.display()))?;
        f.flush()?;
        self.lines += 1;
        Ok(())
    }

    fn shard_names(&self) -> Vec<String> {
        let n = if self.lines == 0 && self.file.is_none() && self.index == 0 { 0 } else { self.index + 1 };
        (0..n).map(shard_name).collect()
    }
}

/// A seed per example, independent of the order examples run in (stable across resumes).
fn example_seed(seed: u64, set: &str, id: &str) -> u64 {
    // FNV-1a over "set/id", mixed with the run's seed.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in set.bytes().chain([b'/']).chain(id.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The prompt's token ids: chat prompts through the target's chat template (with `kwargs`),
/// completion prompts as raw text.
pub fn encode(target: &LoadedModel, prompt: &Prompt, kwargs: &crate::tokenize::TemplateKwargs) -> Result<Vec<u32>> {
    match prompt.kind {
        PromptKind::Chat => target.encode_chat_with(&[ChatMessage::user(prompt.text.clone())], kwargs),
        PromptKind::Completion => target.encode_prompt(&prompt.text),
    }
}

/// The sampling settings of one example.
pub fn example_params(gen: &GenSettings, set: &str, id: &str) -> SamplingParams {
    let greedy = gen.temperature <= 0.0;
    SamplingParams {
        temperature: if greedy { 0.0 } else { gen.temperature },
        seed: Some(example_seed(gen.seed, set, id)),
        max_tokens: Some(gen.max_new_tokens),
        ..SamplingParams::default()
    }
}

fn finish_name(f: crate::engine::FinishReason) -> String {
    serde_json::to_value(f).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
}

/// One request's events.
#[derive(Default)]
struct Outcome {
    tokens: Vec<u32>,
    end: Option<Result<String, String>>,
}

struct Sink(Rc<RefCell<Outcome>>);

impl EventSink for Sink {
    fn send(&mut self, event: EngineEvent) -> bool {
        let mut o = self.0.borrow_mut();
        match event {
            EngineEvent::Tokens(chunk) => o.tokens.extend_from_slice(&chunk.ids),
            EngineEvent::Done(c) => o.end = Some(Ok(finish_name(c.finish))),
            EngineEvent::Failed(e) => o.end = Some(Err(e)),
        }
        true
    }
    fn is_closed(&self) -> bool {
        false
    }
}

/// One example: the prompt's ids, then the response, learned from (loss mask 1).
fn example(set: &str, p: &Prompt, ids: &[u32], response: &[u32], finish: String) -> Example {
    let mut tokens = ids.to_vec();
    tokens.extend_from_slice(response);
    let mut loss_mask = vec![0u8; ids.len()];
    loss_mask.resize(tokens.len(), 1);
    Example {
        set: set.to_string(),
        id: p.id.clone(),
        prompt: p.text.clone(),
        prompt_tokens: ids.len(),
        tokens,
        loss_mask,
        finish,
    }
}

/// Writes one example and counts it.
fn record(ex: Example, writer: &mut ShardWriter, meta: &mut Meta, run: &mut RunStats) -> Result<()> {
    writer.write(&ex)?;
    let response = ex.response().len() as u64;
    run.examples += 1;
    run.prompt_tokens += ex.prompt_tokens as u64;
    run.response_tokens += response;
    meta.examples += 1;
    meta.prompt_tokens += ex.prompt_tokens as u64;
    meta.response_tokens += response;
    *meta.examples_per_set.entry(ex.set.clone()).or_default() += 1;
    if !meta.prompt_sets.contains(&ex.set) {
        meta.prompt_sets.push(ex.set);
    }
    Ok(())
}

/// Runs `specula train data` with a loaded target. `on_progress` is called after every
/// example written.
/// `specula train data`: opens (or resumes) the directory, picks the prompts left to answer,
/// and has the target answer them (or stores the set's own answers), writing each example as
/// it finishes.
pub fn generate_data(
    target: &LoadedModel,
    settings: &DataSettings,
    on_progress: &mut dyn FnMut(&Progress),
) -> Result<DataSummary> {
    settings.validate()?;
    let prompts = load_prompts(&settings.sources, settings.skip, settings.limit)?;
    let dir = &settings.out;
    let Opened { mut meta, done, counts, dropped_partial_line } = open_directory(target, settings)?;
    let (todo, skipped) = prompts_to_answer(target, settings, &prompts, &done)?;
    let already = prompts.len() - todo.len() - skipped.len();
    for s in &skipped {
        if !meta.skipped.contains(s) {
            meta.skipped.push(s.clone());
        }
    }
    // A resumed directory keeps the shard size it was started with.
    let mut writer = ShardWriter::new(dir, meta.shard_size.max(1), &counts);
    meta.shards = writer.shard_names();
    write_meta(dir, &meta)?;

    let total = meta.examples + todo.len();
    let mut run = RunStats { batch: settings.batch, ..RunStats::default() };
    let started = Instant::now();
    // Writes an example, counts it and reports progress.
    let mut keep_example = |ex: Example| -> Result<()> {
        record(ex, &mut writer, &mut meta, &mut run)?;
        let secs = started.elapsed().as_secs_f64();
        on_progress(&Progress {
            done: meta.examples,
            total,
            tokens_per_sec: run.response_tokens as f64 / secs.max(1e-9),
            secs,
        });
        Ok(())
    };
    if settings.gen.responses == ResponseSource::Dataset {
        store_dataset_answers(target, settings, &todo, &mut keep_example)?;
    } else if !todo.is_empty() {
        answer_with_target(target, settings, &todo, &mut keep_example)?;
    }
    run.secs = started.elapsed().as_secs_f64();
    run.tokens_per_sec = if run.examples > 0 { run.response_tokens as f64 / run.secs.max(1e-9) } else { 0.0 };
    meta.shards = writer.shard_names();
    meta.last_run = run.clone();
    write_meta(dir, &meta)?;
    Ok(DataSummary { prompts: prompts.len(), already, written: run.examples, dropped_partial_line, skipped, run, meta })
}

/// A data directory opened for writing: its record (counts recomputed from the shards), the
/// examples it holds, and each shard's line count.
struct Opened {
    meta: Meta,
    done: HashSet<(String, String)>,
    counts: Vec<(PathBuf, usize)>,
    dropped_partial_line: bool,
}

/// Opens `settings.out`, new or to resume: refuses another format, target or generation
/// settings, and repairs a cut-off last line.
fn open_directory(target: &LoadedModel, settings: &DataSettings) -> Result<Opened> {
    let dir = &settings.out;
    if dir.exists() && !dir.is_dir() {
        bail!("--out {} is not a directory", dir.display());
    }
    let target_id = TargetId::of(target);
    let old_meta = read_meta(dir)?;
    if let Some(m) = &old_meta {
        if m.format != FORMAT_VERSION {
            bail!("{} holds training data of format {} (this build writes {FORMAT_VERSION})", dir.display(), m.format);
        }
        if !m.target.same_model(&target_id) {
            bail!(
                "{} holds training data of another target ({}, vocab {}); this target is {} (vocab {}): use another --out",
                dir.display(),
                m.target.path,
                m.target.vocab_size,
                target_id.path,
                target_id.vocab_size
            );
        }
        if m.settings != settings.gen {
            bail!(
                "{} was made with other settings (max new tokens {}, temperature {}, seed {}, chat template kwargs {}, responses {:?}): resume with the same ones or use another --out",
                dir.display(),
                m.settings.max_new_tokens,
                m.settings.temperature,
                m.settings.seed,
                serde_json::Value::Object(m.settings.chat_template_kwargs.clone()),
                m.settings.responses
            );
        }
    }
    let ShardScan { examples: existing, counts, dropped_partial_line } = read_examples(dir, true)?;
    if old_meta.is_none() && !existing.is_empty() {
        bail!("{} holds shards but no meta.json: not resuming data of an unknown target", dir.display());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let done: HashSet<(String, String)> = existing.iter().map(|e| (e.set.clone(), e.id.clone())).collect();
    let mut meta = old_meta.unwrap_or_else(|| Meta {
        format: FORMAT_VERSION,
        target: target_id.clone(),
        settings: settings.gen.clone(),
        shard_size: settings.shard_size,
        prompt_sets: Vec::new(),
        examples_per_set: HashMap::new(),
        examples: 0,
        prompt_tokens: 0,
        response_tokens: 0,
        shards: Vec::new(),
        skipped: Vec::new(),
        last_run: RunStats::default(),
    });
    // Counts come from the shards themselves (a killed run leaves meta.json behind them).
    meta.examples = existing.len();
    meta.prompt_tokens = existing.iter().map(|e| e.prompt_tokens as u64).sum();
    meta.response_tokens = existing.iter().map(|e| e.response().len() as u64).sum();
    meta.examples_per_set.clear();
    for e in &existing {
        *meta.examples_per_set.entry(e.set.clone()).or_default() += 1;
        if !meta.prompt_sets.contains(&e.set) {
            meta.prompt_sets.push(e.set.clone());
        }
    }
    Ok(Opened { meta, done, counts, dropped_partial_line })
}

/// A prompt to answer: its set, the prompt and its token ids.
type Todo = (String, Prompt, Vec<u32>);

/// The prompts not yet in the directory, encoded; those that cannot fit (or, for the set's
/// own answers, have none) are skipped and listed as `set/id`.
fn prompts_to_answer(
    target: &LoadedModel,
    settings: &DataSettings,
    prompts: &[(String, Prompt)],
    done: &HashSet<(String, String)>,
) -> Result<(Vec<Todo>, Vec<String>)> {
    let ctx = target.model.config.context_len;
    let mut todo = Vec::new();
    let mut skipped = Vec::new();
    for (set, p) in prompts.iter().filter(|(s, p)| !done.contains(&(s.clone(), p.id.clone()))) {
        let ids = encode(target, p, &settings.gen.chat_template_kwargs)
            .with_context(|| format!("encoding {set} {}", p.id))?;
        let no_answer = settings.gen.responses == ResponseSource::Dataset
            && p.response.as_deref().is_none_or(|r| r.trim().is_empty());
        if no_answer
            || ids.is_empty()
            || ids.len() + 1 >= ctx
            || ids.len() + 1 > settings.kv_tokens
            || settings.max_prompt_tokens.is_some_and(|m| ids.len() > m)
        {
            skipped.push(format!("{set}/{}", p.id));
            continue;
        }
        todo.push((set.clone(), p.clone(), ids));
    }
    Ok((todo, skipped))
}

/// `--responses dataset`: each prompt set's own answer, tokenized and cut where generation
/// would have stopped.
fn store_dataset_answers(
    target: &LoadedModel,
    settings: &DataSettings,
    todo: &[Todo],
    keep_example: &mut dyn FnMut(Example) -> Result<()>,
) -> Result<()> {
    let ctx = target.model.config.context_len;
    for (set, p, ids) in todo {
        let answer = p.response.as_deref().unwrap_or_default();
        let mut response =
            target.tokenizer.encode(answer, false).with_context(|| format!("encoding {set} {}", p.id))?;
        // Cut where generation would have stopped: at the limit, or where the context ends.
        let max_new = settings.gen.max_new_tokens;
        let keep = max_new.min(ctx.saturating_sub(ids.len()));
        let finish = match response.len() {
            n if n <= keep => "stop",
            _ if keep < max_new => "context_full",
            _ => "length",
        };
        response.truncate(keep);
        keep_example(example(set, p, ids, &response, finish.to_string()))?;
    }
    Ok(())
}

/// The target answers the prompts on the serving engine's batched step loop (with
/// `settings.features`, a [`super::features::FeatureRecorder`] per request keeps the tapped
/// hidden states of the same pass).
fn answer_with_target(
    target: &LoadedModel,
    settings: &DataSettings,
    todo: &[Todo],
    keep_example: &mut dyn FnMut(Example) -> Result<()>,
) -> Result<()> {
    let mut features = match &settings.features {
        Some(f) => {
            let dir = super::features::default_dir(&f.key, &settings.out, f.dir.as_deref())?;
            eprintln!("writing target features as it generates to {}", dir.display());
            Some((super::features::FeatureCache::open(&dir, f.key.clone())?, f.key.layer_ids.clone()))
        }
        None => None,
    };
    let pool = target.model.new_kv_pool(settings.kv_tokens);
    let config = EngineConfig {
        kv_tokens: settings.kv_tokens,
        max_running: settings.batch,
        max_waiting: usize::MAX,
        drafter: None,
        draft_len: DraftLen::Fixed(0),
        prefix_caching: true,
        ..EngineConfig::default()
    };
    let model = EngineModel { model: &target.model, tokenizer: None };
    let mut core = EngineCore::new(model, target.stop_ids(), pool, &config, None, Arc::new(AtomicUsize::new(0)));
    let mut next = 0;
    let mut in_flight: Vec<(usize, Rc<RefCell<Outcome>>, Option<super::features::FeatureRows>)> = Vec::new();
    let max_new = settings.gen.max_new_tokens;
    // Enough queued that a finished request is replaced in the next step.
    let window = settings.batch * 2;
    loop {
        while next < todo.len() && in_flight.len() < window {
            let (set, p, ids) = &todo[next];
            let outcome = Rc::new(RefCell::new(Outcome::default()));
            let mut params = example_params(&settings.gen, set, &p.id);
            let (recorder, rows) = match &features {
                Some((_, layers)) => {
                    // One token more than kept, so the last kept one runs through the
                    // target too and has features; the answer is cut back below.
                    params.max_tokens = Some(max_new + 1);
                    let (r, rows) = super::features::FeatureRecorder::new(&target.model, layers.clone());
                    (Some(Box::new(r) as Box<dyn crate::speculative::Proposer>), Some(rows))
                }
                None => (None, None),
            };
            let request = EngineRequest { speculate: false, ..EngineRequest::new(ids.clone(), params) };
            core.add(request, recorder, Box::new(Sink(outcome.clone())));
            in_flight.push((next, outcome, rows));
            next += 1;
        }
        if in_flight.is_empty() {
            break;
        }
        core.step();
        let mut i = 0;
        while i < in_flight.len() {
            if in_flight[i].1.borrow().end.is_none() {
                i += 1;
                continue;
            }
            let (index, outcome, rows) = in_flight.remove(i);
            let o = Rc::try_unwrap(outcome).map_err(|_| anyhow::anyhow!("engine still holds a finished request"))?;
            let mut o = o.into_inner();
            let (set, p, ids) = &todo[index];
            let mut finish = match o.end {
                Some(Ok(f)) => f,
                Some(Err(e)) => bail!("{set} {}: generation failed: {e}", p.id),
                None => unreachable!("checked above"),
            };
            if rows.is_some() && o.tokens.len() >= max_new && finish != "context_full" {
                // What a run without features gives: cut at the limit.
                o.tokens.truncate(max_new);
                finish = "length".into();
            }
            let ex = example(set, p, ids, &o.tokens, finish);
            if let (Some((cache, _)), Some(rows)) = (features.as_mut(), rows) {
                // Examples without every row (a full context) get theirs when a trainer
                // fills the cache.
                let n = ex.tokens.len().min(cache.max_tokens());
                if let Some(f) = rows.take(n)? {
                    cache.append(&format!("{}/{}", ex.set, ex.id), &f)?;
                }
            }
            keep_example(ex)?;
        }
    }
    if let Some((cache, _)) = features.as_mut() {
        cache.flush_index()?;
    }
    Ok(())
}

/// What [`check_no_eval_prompts`] compared.
#[derive(Debug, Clone, Default)]
pub struct EvalCheck {
    pub examples: usize,
    /// Evaluation sets compared against.
    pub sets_checked: Vec<String>,
    /// Evaluation sets not available offline (not fetched), so not compared.
    pub sets_unavailable: Vec<String>,
}

/// Checks a data directory against every evaluation set whose file is already on this machine
/// (nothing is downloaded): no example may come from an evaluation set, carry an evaluation
/// prompt's id, or have an evaluation prompt's text.
pub fn check_no_eval_prompts(dir: &Path) -> Result<EvalCheck> {
    let mut eval = Vec::new();
    let mut unavailable = Vec::new();
    for &key in EVAL_SETS {
        if !datasets::PROMPT_SETS.contains(&key) {
            continue; // gsm8k-fewshot: few-shot examples, not prompts; checked by set name.
        }
        let file_key = if key == "humaneval-edit" { "humaneval" } else { key };
        match crate::fetch::find_asset(file_key).map(|a| a.path()) {
            Some(path) if path.is_file() => eval.push((key.to_string(), datasets::load_from_path(key, &path, None)?)),
            _ => unavailable.push(key.to_string()),
        }
    }
    let mut check = check_no_eval_prompts_against(dir, &eval)?;
    check.sets_unavailable = unavailable;
    Ok(check)
}

/// [`check_no_eval_prompts`] against the given evaluation prompts.
pub fn check_no_eval_prompts_against(dir: &Path, eval: &[(String, Vec<Prompt>)]) -> Result<EvalCheck> {
    let examples = read_examples(dir, false)?.examples;
    let norm = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut texts: HashMap<String, String> = HashMap::new();
    let mut ids: HashMap<&str, &str> = HashMap::new();
    for (key, prompts) in eval {
        for p in prompts {
            texts.entry(norm(&p.text)).or_insert_with(|| format!("{key} {}", p.id));
            ids.insert(p.id.as_str(), key.as_str());
        }
    }
    let mut leaks = Vec::new();
    for ex in &examples {
        if EVAL_SETS.contains(&ex.set.as_str()) {
            leaks.push(format!("{} {}: from evaluation set `{}`", ex.set, ex.id, ex.set));
        } else if let Some(key) = ids.get(ex.id.as_str()) {
            leaks.push(format!("{} {}: the id of a `{key}` prompt", ex.set, ex.id));
        } else if let Some(which) = texts.get(&norm(&ex.prompt)) {
            leaks.push(format!("{} {}: the text of evaluation prompt {which}", ex.set, ex.id));
        }
    }
    if !leaks.is_empty() {
        bail!(
            "{}: {} example(s) come from evaluation sets: {}",
            dir.display(),
            leaks.len(),
            leaks.iter().take(5).cloned().collect::<Vec<_>>().join("; ")
        );
    }
    Ok(EvalCheck {
        examples: examples.len(),
        sets_checked: eval.iter().map(|(k, _)| k.clone()).collect(),
        sets_unavailable: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(set: &str, id: &str, prompt: &str) -> Example {
        Example {
            set: set.into(),
            id: id.into(),
            prompt: prompt.into(),
            prompt_tokens: 2,
            tokens: vec![1, 2, 3],
            loss_mask: vec![0, 0, 1],
            finish: "length".into(),
        }
    }

    fn tempdir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("specula-train-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn eval_sets_are_refused_and_unknown_sets_named() {
        for key in
            ["gsm8k-100", "gsm8k-fewshot", "humaneval", "humaneval-edit", "humaneval-rust", "mt-bench", "math500"]
        {
            let err = check_training_set(key).unwrap_err().to_string();
            assert!(err.contains("evaluation set"), "{key}: {err}");
        }
        assert!(check_training_set("sharegpt").is_ok());
        assert!(check_training_set("fastchat-dummy").is_ok());
        let err = check_training_set("nope").unwrap_err().to_string();
        assert!(err.contains("unknown prompt set") && err.contains("sharegpt"), "{err}");
        let err = load_prompts(&[PromptSource::Set("mt-bench".into())], 0, Some(1)).unwrap_err().to_string();
        assert!(err.contains("evaluation set"), "{err}");
    }

    #[test]
    fn prompts_file_spec_parses() {
        let s = PromptSource::parse_file("fastchat-dummy=prompts/x.json").unwrap();
        assert_eq!(s, PromptSource::File { key: "fastchat-dummy".into(), path: "prompts/x.json".into() });
        assert!(PromptSource::parse_file("nokey").is_err());
        assert!(PromptSource::parse_file("=x").is_err());
    }

    #[test]
    fn trailing_partial_line_is_dropped_and_middle_damage_is_an_error() {
        let dir = tempdir("partial");
        let a = serde_json::to_string(&example("sharegpt", "a", "hi")).unwrap();
        let b = serde_json::to_string(&example("sharegpt", "b", "ho")).unwrap();
        let shard = dir.join(shard_name(0));
        std::fs::write(&shard, format!("{a}\n{}", &b[..b.len() / 2])).unwrap();
        let scan = read_examples(&dir, false).unwrap();
        assert_eq!((scan.examples.len(), scan.counts[0].1, scan.dropped_partial_line), (1, 1, true));
        assert_eq!(std::fs::read_to_string(&shard).unwrap().len(), a.len() + 1 + b.len() / 2, "no repair asked");
        let scan = read_examples(&dir, true).unwrap();
        assert_eq!((scan.examples.len(), scan.dropped_partial_line), (1, true));
        assert_eq!(std::fs::read_to_string(&shard).unwrap(), format!("{a}\n"));
        std::fs::write(&shard, format!("{a}\nnot json\n{b}\n")).unwrap();
        assert!(read_examples(&dir, true).unwrap_err().to_string().contains("line 2"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn eval_check_finds_ids_texts_and_sets() {
        let dir = tempdir("evalcheck");
        let eval = vec![(
            "mt-bench".to_string(),
            vec![Prompt {
                id: "mt-bench/81".into(),
                text: "Write a  poem.".into(),
                kind: PromptKind::Chat,
                reference: None,
                response: None,
            }],
        )];
        let write = |exs: &[Example]| {
            let lines: String = exs.iter().map(|e| serde_json::to_string(e).unwrap() + "\n").collect();
            std::fs::write(dir.join(shard_name(0)), lines).unwrap();
        };
        write(&[example("sharegpt", "sharegpt/1", "Hello")]);
        assert_eq!(check_no_eval_prompts_against(&dir, &eval).unwrap().examples, 1);
        write(&[example("sharegpt", "sharegpt/1", "Hello"), example("sharegpt", "sharegpt/2", " Write a poem.\n")]);
        let err = check_no_eval_prompts_against(&dir, &eval).unwrap_err().to_string();
        assert!(err.contains("sharegpt/2") && err.contains("mt-bench/81"), "{err}");
        write(&[example("math500", "math500/3", "x")]);
        assert!(check_no_eval_prompts_against(&dir, &eval).is_err());
        write(&[example("fastchat-dummy", "mt-bench/81", "x")]);
        assert!(check_no_eval_prompts_against(&dir, &eval).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn example_seeds_depend_on_set_id_and_seed_only() {
        assert_eq!(example_seed(1, "a", "x"), example_seed(1, "a", "x"));
        assert_ne!(example_seed(1, "a", "x"), example_seed(2, "a", "x"));
        assert_ne!(example_seed(1, "a", "x"), example_seed(1, "a", "y"));
    }
}
