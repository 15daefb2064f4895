//! Structured mutation fuzzing of every loader: GGUF files (headers of the real models, and
//! tiny whole models that also run a forward), Hugging Face model directories (`config.json`,
//! `model.safetensors`, `tokenizer.json`), DFlash and EAGLE-3 drafter directories, chat
//! templates and prompt-set files.
//!
//! Each input is a real file with one to three mutations: bit flips, bytes and integers set to
//! extreme values, truncations, deleted and repeated ranges, and format-aware ones (GGUF
//! header fields, safetensors and JSON values, template syntax). Every input must end in `Ok`
//! or an error: a panic is recorded with its input under `target/fuzz-findings/` and fails the
//! test; an allocation above [`MAX_ALLOCATION`] is refused (the code under test must treat
//! that as an error, else the process aborts with the size) and fails the test; an input
//! that runs longer than [`MAX_INPUT_SECONDS`] aborts the process.
//!
//! The test runs a short, fixed-seed round (`FUZZ_INPUTS` inputs). The long run:
//!
//! ```sh
//! SPECULA_FUZZ_INPUTS=1000000 SPECULA_FUZZ_SEED=1 cargo test --release --test fuzz_loaders -- --nocapture
//! ```

mod common;

use common::fuzz::{interesting_int, mutate_bytes, mutate_json_bytes, Rng};

use anyhow::{Context, Result};
use candle_core::Device;
use specula::engine::{generate, GenerateOptions};
use specula::kv::KvDtype;
use specula::model::{GgufFile, KernelSettings, ModelConfig, Transformer};
use specula::sample::SamplingParams;
use specula::tokenize::{ChatTemplate, Tokenizer};
use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Inputs in the test's own round (the long run sets `SPECULA_FUZZ_INPUTS`).
const FUZZ_INPUTS: usize = 3000;
/// No single allocation may exceed this: a larger one is refused, as an allocation sized by an
/// unchecked field would be.
const MAX_ALLOCATION: usize = 512 << 20;
/// Wall time one input may take before the run is declared hung.
const MAX_INPUT_SECONDS: u64 = 120;

// ---------------------------------------------------------------------------------------------
// An allocator that refuses oversized allocations and records the peak heap.

struct LimitedAlloc;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static REFUSED: AtomicUsize = AtomicUsize::new(0);
static REFUSED_SIZE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// The input this thread is running (`usize::MAX`: none), named when an allocation is refused.
    static CURRENT_INPUT: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

/// Says which input asked for an oversized allocation: the process may abort right after
/// (code that does not expect allocation failure), and the input can be rerun alone with
/// `SPECULA_FUZZ_ONLY`. Formatting integers to stderr does not allocate.
fn report_refusal(size: usize) {
    REFUSED.fetch_add(1, Ordering::SeqCst);
    REFUSED_SIZE.store(size, Ordering::SeqCst);
    let input = CURRENT_INPUT.with(|c| c.get());
    if input != usize::MAX {
        eprintln!("input {input} asked for an allocation of {size} bytes");
    }
}

unsafe impl GlobalAlloc for LimitedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > MAX_ALLOCATION {
            report_refusal(layout.size());
            return std::ptr::null_mut();
        }
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > MAX_ALLOCATION {
            report_refusal(new_size);
            return std::ptr::null_mut();
        }
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                let live = LIVE.fetch_add(new_size - layout.size(), Ordering::Relaxed) + new_size - layout.size();
                PEAK.fetch_max(live, Ordering::Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

#[global_allocator]
static GLOBAL: LimitedAlloc = LimitedAlloc;

// ---------------------------------------------------------------------------------------------
// Format-aware mutations (the generic ones are in `common::fuzz`).

/// Mutates a safetensors file: its JSON header's values (shapes, offsets, dtypes) with the
/// length prefix kept consistent, the length prefix itself, or its bytes.
fn mutate_safetensors(rng: &mut Rng, data: &[u8]) -> Vec<u8> {
    let header_len = data.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize);
    match (rng.below(10), header_len) {
        (0..=5, Some(n)) if 8 + n <= data.len() => {
            let header = mutate_json_bytes(rng, &data[8..8 + n]);
            let mut out = (header.len() as u64).to_le_bytes().to_vec();
            out.extend_from_slice(&header);
            out.extend_from_slice(&data[8 + n..]);
            out
        }
        (6, _) => {
            let mut out = data.to_vec();
            let v = interesting_int(rng, header_len.unwrap_or(0) as u64, 8);
            if out.len() >= 8 {
                out[..8].copy_from_slice(&v.to_le_bytes());
            }
            out
        }
        _ => {
            // Bytes, mostly inside the header where the structure is.
            let n = header_len.unwrap_or(data.len()).min(data.len().saturating_sub(8));
            let mut head = data[..(8 + n).min(data.len())].to_vec();
            mutate_bytes(rng, &mut head);
            head.extend_from_slice(&data[(8 + n).min(data.len())..]);
            head
        }
    }
}

/// Where one integer field of a GGUF header lies, and its width in bytes.
#[derive(Clone, Copy)]
struct Field {
    at: usize,
    width: usize,
    /// Tensor-info fields (dimensions, types, offsets): mutated more often.
    tensor: bool,
}

/// Walks a GGUF header (v2/v3) and lists its integer fields: counts, string and array
/// lengths, value types and scalar values, tensor dimensions, types and offsets. Stops
/// quietly at anything it does not understand (the seed files are well formed).
fn gguf_fields(data: &[u8]) -> Vec<Field> {
    struct Walk<'a> {
        data: &'a [u8],
        at: usize,
        fields: Vec<Field>,
    }
    impl Walk<'_> {
        fn int(&mut self, width: usize, tensor: bool) -> Option<u64> {
            let bytes = self.data.get(self.at..self.at + width)?;
            let mut b = [0u8; 8];
            b[..width].copy_from_slice(bytes);
            self.fields.push(Field { at: self.at, width, tensor });
            self.at += width;
            Some(u64::from_le_bytes(b))
        }
        fn string(&mut self, tensor: bool) -> Option<()> {
            let n = self.int(8, tensor)? as usize;
            self.at = self.at.checked_add(n).filter(|&e| e <= self.data.len())?;
            Some(())
        }
        fn value(&mut self, ty: u64, record: bool) -> Option<()> {
            let widths = [1, 1, 2, 2, 4, 4, 4, 1];
            match ty {
                0..=7 if record => drop(self.int(widths[ty as usize], false)?),
                0..=7 => self.at += widths[ty as usize],
                8 if record => self.string(false)?,
                8 => {
                    let n = u64::from_le_bytes(self.data.get(self.at..self.at + 8)?.try_into().ok()?) as usize;
                    self.at = (self.at + 8).checked_add(n)?;
                }
                9 => {
                    let elem = self.int(4, false)?;
                    let n = self.int(8, false)?;
                    for i in 0..n {
                        // The first few elements of long arrays as fields; the rest skipped.
                        self.value(elem, record && i < 8)?;
                    }
                }
                10..=12 if record => drop(self.int(8, false)?),
                10..=12 => self.at += 8,
                _ => return None,
            }
            (self.at <= self.data.len()).then_some(())
        }
    }
    let mut w = Walk { data, at: 4, fields: Vec::new() };
    let _ = (|| {
        w.int(4, false)?;
        let tensors = w.int(8, true)?;
        let kvs = w.int(8, false)?;
        for _ in 0..kvs {
            w.string(false)?;
            let ty = w.int(4, false)?;
            w.value(ty, true)?;
        }
        for _ in 0..tensors {
            w.string(true)?;
            let dims = w.int(4, true)?;
            for _ in 0..dims {
                w.int(8, true)?;
            }
            w.int(4, true)?;
            w.int(8, true)?;
        }
        Some(())
    })();
    w.fields
}

/// Mutates a GGUF header: one to three of its fields set to extreme values (tensor fields
/// half the time), or its bytes.
fn mutate_gguf(rng: &mut Rng, data: &[u8], fields: &[Field]) -> Vec<u8> {
    let mut out = data.to_vec();
    let tensor_fields: Vec<&Field> = fields.iter().filter(|f| f.tensor).collect();
    for _ in 0..1 + rng.below(3) {
        if fields.is_empty() || rng.chance(0.25) {
            mutate_bytes(rng, &mut out);
            continue;
        }
        let f =
            if !tensor_fields.is_empty() && rng.chance(0.5) { **rng.pick(&tensor_fields) } else { *rng.pick(fields) };
        if f.at + f.width > out.len() {
            continue;
        }
        let mut old = [0u8; 8];
        old[..f.width].copy_from_slice(&out[f.at..f.at + f.width]);
        let v = interesting_int(rng, u64::from_le_bytes(old), f.width);
        out[f.at..f.at + f.width].copy_from_slice(&v.to_le_bytes()[..f.width]);
    }
    out
}

/// Template text with syntax spliced in: loops, recursion, huge ranges and repetitions,
/// unclosed blocks, filters on the wrong types.
fn mutate_template(rng: &mut Rng, data: &[u8]) -> Vec<u8> {
    const PIECES: &[&str] = &[
        "{{",
        "}}",
        "{%",
        "%}",
        "{#",
        "{% endfor %}",
        "{% endif %}",
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        "{% for i in range(1000000000) %}x{% endfor %}",
        "{{ 'x' * 1000000000 }}",
        "{{ messages * 100000000 }}",
        // Doubling a string is bounded here: see docs/reliability.md for why it is not
        // bounded in general.
        "{% set ns = namespace(a='') %}{% for i in range(12) %}{% set ns.a = ns.a ~ ns.a ~ 'ab' %}{% endfor %}{{ ns.a }}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
        "{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}",
        "{{ messages[1000000] }}",
        "{{ messages[-1]['content'] | tojson }}",
        "{{ raise_exception('boom') }}",
        "{{ tools | length }}",
        "{{ (messages | first).content.split('a') }}",
        "{{ 1 / 0 }}",
        "{{ 10 ** 100000 }}",
        "{{ '%s' % messages }}",
        "{{ messages | map(attribute='role') | join(', ') }}",
        "{% if x is defined %}",
        "{{ loop.index }}",
        "{{ x.y.z }}",
        "\u{0}",
        "\u{FFFF}",
    ];
    let mut out = data.to_vec();
    for _ in 0..1 + rng.below(3) {
        if rng.chance(0.6) {
            let piece = rng.pick(PIECES).as_bytes();
            let mut at = rng.below(out.len() + 1);
            while at < out.len() && (out[at] & 0xC0) == 0x80 {
                at += 1;
            }
            out.splice(at..at, piece.iter().copied());
        } else {
            mutate_bytes(rng, &mut out);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Targets: a seed file and what loads it.

/// What a mutated input is written as: the whole file, or a header followed by `total_len`
/// bytes of zeros (the real models' tensor data, which the header checks are against).
enum Seed {
    /// A whole file (`fields`: its GGUF header fields, for GGUF files).
    File { name: &'static str, bytes: Vec<u8>, kind: Kind, fields: Vec<Field> },
    /// A GGUF header (`bytes`, its fields) and the length of the real file it came from.
    GgufHeader { bytes: Vec<u8>, fields: Vec<Field>, file_len: u64 },
}

#[derive(Clone, Copy)]
enum Kind {
    Gguf,
    Json,
    Safetensors,
    Template,
    Lines,
}

struct Target {
    name: String,
    /// Inputs per round, relative.
    weight: usize,
    /// The directory the input's file is written into, with the seed's sibling files linked.
    siblings: Vec<PathBuf>,
    seed: Seed,
    run: Box<dyn Fn(&Path) -> Result<()> + Send + Sync>,
}

fn mutate(rng: &mut Rng, seed: &Seed) -> (Vec<u8>, Option<u64>) {
    match seed {
        Seed::File { bytes, kind, fields, .. } => {
            let out = match kind {
                Kind::Gguf => mutate_gguf(rng, bytes, fields),
                Kind::Json => mutate_json_bytes(rng, bytes),
                Kind::Safetensors => mutate_safetensors(rng, bytes),
                Kind::Template => mutate_template(rng, bytes),
                Kind::Lines => {
                    // One line mutated as JSON, or the bytes.
                    let text = String::from_utf8_lossy(bytes);
                    let lines: Vec<&str> = text.lines().collect();
                    if rng.chance(0.6) && !lines.is_empty() {
                        let i = rng.below(lines.len());
                        let mut out = Vec::new();
                        for (j, line) in lines.iter().enumerate() {
                            if j == i {
                                out.extend(mutate_json_bytes(rng, line.as_bytes()));
                            } else {
                                out.extend_from_slice(line.as_bytes());
                            }
                            out.push(b'\n');
                        }
                        out
                    } else {
                        let mut out = bytes.to_vec();
                        mutate_bytes(rng, &mut out);
                        out
                    }
                }
            };
            (out, None)
        }
        Seed::GgufHeader { bytes, fields, file_len } => {
            let out = mutate_gguf(rng, bytes, fields);
            // The data keeps its place after the header; sometimes the file is cut short.
            let len = if rng.chance(0.1) {
                rng.below(*file_len as usize) as u64
            } else {
                (*file_len + out.len() as u64).saturating_sub(bytes.len() as u64)
            };
            (out, Some(len))
        }
    }
}

fn file_name(seed: &Seed) -> &'static str {
    match seed {
        Seed::File { name, .. } => name,
        Seed::GgufHeader { .. } => "model.gguf",
    }
}

/// Writes one input into `dir` (emptied first) with the target's sibling files linked in.
fn write_input(dir: &Path, target: &Target, bytes: &[u8], len: Option<u64>) -> Result<PathBuf> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let name = file_name(&target.seed);
    for sibling in &target.siblings {
        let file = sibling.file_name().context("sibling without a name")?;
        if file != name {
            std::os::unix::fs::symlink(sibling, dir.join(file))?;
        }
    }
    let path = dir.join(name);
    std::fs::write(&path, bytes)?;
    if let Some(len) = len {
        std::fs::OpenOptions::new().write(true).open(&path)?.set_len(len)?;
    }
    Ok(path)
}

/// A couple of greedy tokens from a loaded model: shapes that load but do not fit fail here.
fn decode_a_little(model: &Transformer) -> Result<()> {
    let vocab = model.config.vocab.max(1);
    let prompt: Vec<u32> = (0..5).map(|i| (i * 7 % vocab) as u32).collect();
    let pool = model.new_kv_pool_typed(64, KvDtype::F32);
    let params = SamplingParams { max_tokens: Some(2), ..SamplingParams::greedy() };
    generate(model.into(), &pool, &prompt, params, None, &GenerateOptions::default(), &mut |_| {})?;
    Ok(())
}

fn tokenizer_round_trip(tok: &Tokenizer) -> Result<()> {
    let ids = tok.encode("Hello, world! <|im_start|>user\n  ünïcødé 12345 \u{1F600}", true)?;
    let _ = tok.decode(&ids, false);
    Ok(())
}

fn render_template(t: &ChatTemplate) -> Result<()> {
    let simple = serde_json::json!([
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Thanks"}
    ]);
    t.render_json(&simple, None, true, &Default::default())?;
    let messages = serde_json::json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
        {"role": "tool", "content": "4"},
        {"role": "user", "content": "Thanks"}
    ]);
    let tools =
        serde_json::json!([{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]);
    // Templates may refuse this one (Gemma 3's wants strictly alternating roles).
    let _ = t.render_json(&messages, Some(&tools), true, &Default::default());
    Ok(())
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn file_seed(path: &Path, name: &'static str, kind: Kind) -> Seed {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let fields = if matches!(kind, Kind::Gguf) { gguf_fields(&bytes) } else { Vec::new() };
    Seed::File { name, bytes, kind, fields }
}

fn dir_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    files
}

fn cpu_f32() -> KernelSettings {
    KernelSettings::default().with_weights(Some(specula::model::WeightFormat::F32))
}

/// Every target, with the models and files it needs.
fn targets(scratch: &Path) -> Vec<Target> {
    let mut targets = Vec::new();
    let device = Device::Cpu;

    // GGUF headers of the real models: the header checks, the configuration, tokenizer and
    // chat template, all against the real file's length. SmolLM2 is always there (fetched);
    // the others when they are in the cache.
    let mut ggufs = vec![("smollm2-135m".to_string(), common::smollm2_path())];
    for key in ["gemma3-270m", "qwen2.5-coder-0.5b"] {
        if let Some(asset) = specula::fetch::find_asset(key) {
            if asset.path().is_file() {
                ggufs.push((key.to_string(), asset.path()));
            }
        }
    }
    for (key, path) in ggufs {
        let header_len = specula::tokenize::read_gguf_header(&path).unwrap().tensor_data_offset as usize;
        let mut bytes = vec![0u8; header_len];
        use std::io::Read;
        std::fs::File::open(&path).unwrap().read_exact(&mut bytes).unwrap();
        let fields = gguf_fields(&bytes);
        let file_len = std::fs::metadata(&path).unwrap().len();
        targets.push(Target {
            name: format!("gguf header: {key}"),
            // The large vocabularies take 0.2 s an input: fewer of those.
            weight: if key == "smollm2-135m" { 4 } else { 1 },
            siblings: vec![],
            seed: Seed::GgufHeader { bytes, fields, file_len },
            run: Box::new(|path| {
                let file = GgufFile::open(path)?;
                let config = ModelConfig::from_gguf(&file.content);
                let tok = Tokenizer::from_gguf(&file.content);
                if let Ok(tok) = &tok {
                    tokenizer_round_trip(tok)?;
                }
                // Some real files carry no template (Gemma 3's): then only the error matters.
                if let Ok(template) = ChatTemplate::from_gguf(&file.content) {
                    render_template(&template)?;
                }
                config?;
                tok?;
                Ok(())
            }),
        });
    }

    // Whole tiny GGUF models (written by candle's GGUF writer from the llama and Qwen3
    // fixtures, in the types our kernels and candle's run): load and decode.
    for (arch, hf, dtype) in [
        ("llama", fixtures().join("llama3-rope"), candle_core::quantized::GgmlDType::Q4_1),
        ("llama", fixtures().join("llama3-rope"), candle_core::quantized::GgmlDType::Q8_0),
        ("qwen3", fixtures().join("dflash/random/target"), candle_core::quantized::GgmlDType::Q5_0),
        ("qwen3", fixtures().join("dflash/random/target"), candle_core::quantized::GgmlDType::F32),
    ] {
        let out = scratch.join(format!("seed-{arch}-{dtype:?}.gguf"));
        common::write_gguf_from_hf(&hf, arch, dtype, &out);
        targets.push(Target {
            name: format!("gguf model: tiny {arch} {dtype:?}"),
            weight: 24,
            siblings: vec![],
            seed: file_seed(&out, "model.gguf", Kind::Gguf),
            run: Box::new(|path| {
                let model = Transformer::from_path_with(path, &KernelSettings::default(), &Device::Cpu)?;
                decode_a_little(&model)
            }),
        });
    }

    // Hugging Face model directories: each of their files mutated in turn.
    for (dir, kind_of) in
        [(fixtures().join("llama3-rope"), "llama"), (fixtures().join("dflash/random/target"), "qwen3")]
    {
        for file in dir_files(&dir) {
            let (name, kind): (&'static str, Kind) = match file.file_name().unwrap().to_str().unwrap() {
                "config.json" => ("config.json", Kind::Json),
                "model.safetensors" => ("model.safetensors", Kind::Safetensors),
                "tokenizer.json" => ("tokenizer.json", Kind::Json),
                _ => continue,
            };
            targets.push(Target {
                name: format!("hf dir: {kind_of} {name}"),
                weight: if name == "model.safetensors" { 16 } else { 12 },
                siblings: dir_files(&dir),
                seed: file_seed(&file, name, kind),
                run: Box::new(|path| {
                    let dir = path.parent().unwrap();
                    let model = Transformer::from_path_with(dir, &cpu_f32(), &Device::Cpu)?;
                    decode_a_little(&model)?;
                    if dir.join("tokenizer.json").exists() {
                        let loaded = specula::engine::LoadedModel::load_with(dir, &cpu_f32(), &Device::Cpu)?;
                        tokenizer_round_trip(&loaded.tokenizer)?;
                    }
                    Ok(())
                }),
            });
        }
    }

    // DFlash drafters against their targets: the fixture's tiny one, the ones speculators and
    // SpecForge wrote for it, and the shipped SmolLM2 drafter against the real SmolLM2.
    let tiny_target =
        Arc::new(Transformer::from_path_with(&fixtures().join("dflash/random/target"), &cpu_f32(), &device).unwrap());
    let smollm2 =
        Arc::new(Transformer::from_path_with(&common::smollm2_path(), &KernelSettings::default(), &device).unwrap());
    let drafters = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("drafters");
    for (label, dir, target, weight) in [
        ("tiny", fixtures().join("dflash/random/drafter"), tiny_target.clone(), 16),
        ("speculators", fixtures().join("interop/speculators-dflash/drafter"), tiny_target.clone(), 8),
        ("specforge", fixtures().join("interop/specforge-dflash/drafter"), tiny_target.clone(), 4),
        ("smollm2-135m", drafters.join("smollm2-135m-dflash"), smollm2.clone(), 4),
    ] {
        for (name, kind) in [("config.json", Kind::Json), ("model.safetensors", Kind::Safetensors)] {
            let target = target.clone();
            targets.push(Target {
                name: format!("dflash drafter: {label} {name}"),
                weight,
                siblings: dir_files(&dir),
                seed: file_seed(&dir.join(name), name, kind),
                run: Box::new(move |path| {
                    let drafter =
                        specula::speculative::dflash::load_for_target(path.parent().unwrap(), &target, &Device::Cpu)?;
                    let _ = drafter;
                    Ok(())
                }),
            });
        }
    }

    // EAGLE-3 drafters: the published-format fixture alone, speculators' against the tiny
    // target, and the shipped SmolLM2 one against its target.
    for (label, dir, target, weight) in [
        ("fixture", fixtures().join("eagle3/drafter"), None, 16),
        ("speculators", fixtures().join("interop/speculators-eagle3/drafter"), Some(tiny_target.clone()), 8),
        ("smollm2-135m", drafters.join("smollm2-135m-eagle3"), Some(smollm2.clone()), 4),
    ] {
        for (name, kind) in [("config.json", Kind::Json), ("model.safetensors", Kind::Safetensors)] {
            let target = target.clone();
            targets.push(Target {
                name: format!("eagle3 drafter: {label} {name}"),
                weight,
                siblings: dir_files(&dir),
                seed: file_seed(&dir.join(name), name, kind),
                run: Box::new(move |path| {
                    let dir = path.parent().unwrap();
                    match &target {
                        Some(t) => drop(specula::speculative::eagle3::load_for_target(dir, t)?),
                        None => drop(specula::speculative::eagle3::Eagle3Drafter::load(dir, &Device::Cpu)?),
                    }
                    Ok(())
                }),
            });
        }
    }

    // Chat templates: the real ones of the supported families, compiled and rendered with a
    // conversation that has a system prompt, tools and tool calls.
    for file in dir_files(&fixtures().join("chat-templates")) {
        if file.extension().is_some_and(|e| e == "jinja") {
            targets.push(Target {
                name: format!("chat template: {}", file.file_name().unwrap().to_string_lossy()),
                weight: 12,
                siblings: vec![],
                seed: file_seed(&file, "template.jinja", Kind::Template),
                run: Box::new(|path| {
                    let source = String::from_utf8(std::fs::read(path)?)?;
                    render_template(&ChatTemplate::from_source(&source, "<s>", "</s>")?)
                }),
            });
        }
    }

    // Prompt sets: the first rows of each cached set's file, parsed as the set.
    for key in ["gsm8k-100", "humaneval", "mt-bench", "math500", "sharegpt"] {
        let Some(asset) = specula::fetch::find_asset(key) else { continue };
        if !asset.path().is_file() {
            continue;
        }
        let text = std::fs::read_to_string(asset.path()).unwrap();
        if !text.starts_with('{') {
            continue; // Not JSON lines.
        }
        let head: String = text.lines().take(20).map(|l| format!("{l}\n")).collect();
        targets.push(Target {
            name: format!("prompt set: {key}"),
            weight: 8,
            siblings: vec![],
            seed: Seed::File { name: "prompts.jsonl", bytes: head.into_bytes(), kind: Kind::Lines, fields: Vec::new() },
            run: Box::new(move |path| {
                specula::datasets::load_from_path(key, path, None)?;
                Ok(())
            }),
        });
    }
    targets
}

// ---------------------------------------------------------------------------------------------
// The run.

#[derive(Default, Clone)]
struct Tally {
    inputs: usize,
    ok: usize,
    errors: usize,
    panics: Vec<String>,
    slowest: Duration,
    total: Duration,
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic".into())
}

#[test]
fn every_loader_survives_mutated_files() {
    let inputs: usize = std::env::var("SPECULA_FUZZ_INPUTS").ok().and_then(|v| v.parse().ok()).unwrap_or(FUZZ_INPUTS);
    let seed: u64 = std::env::var("SPECULA_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let verbose = std::env::var_os("SPECULA_FUZZ_VERBOSE").is_some();
    // One input alone (its number from a failed run), saved under target/fuzz-findings/.
    let only: Option<usize> = std::env::var("SPECULA_FUZZ_ONLY").ok().and_then(|v| v.parse().ok());
    let shm = Path::new("/dev/shm");
    let scratch = tempfile::tempdir_in(if shm.is_dir() { shm } else { Path::new("/tmp") }).unwrap();
    let findings = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/fuzz-findings");
    let targets = targets(scratch.path());
    // Every seed, unmutated, loads: the mutations start from working files.
    for t in &targets {
        let bytes = match &t.seed {
            Seed::File { bytes, .. } | Seed::GgufHeader { bytes, .. } => bytes.clone(),
        };
        let len = match &t.seed {
            Seed::GgufHeader { file_len, .. } => Some(*file_len),
            Seed::File { .. } => None,
        };
        let path = write_input(&scratch.path().join("seed-check"), t, &bytes, len).unwrap();
        if let Err(e) = (t.run)(&path) {
            panic!("the seed of `{}` does not load: {e:#}", t.name);
        }
    }
    let total_weight: usize = targets.iter().map(|t| t.weight).sum();
    // The schedule: target i gets inputs in proportion to its weight, interleaved.
    let schedule: Vec<usize> = (0..inputs)
        .map(|i| {
            let mut w = (i * 7919) % total_weight;
            targets
                .iter()
                .position(|t| {
                    if w < t.weight {
                        true
                    } else {
                        w -= t.weight;
                        false
                    }
                })
                .unwrap()
        })
        .collect();

    // Panics are caught and recorded; keep the default hook's output out of the log.
    std::panic::set_hook(Box::new(|_| {}));
    let tallies = Mutex::new(vec![Tally::default(); targets.len()]);
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    let done = AtomicBool::new(false);
    let in_flight: Vec<AtomicU64> = (0..2).map(|_| AtomicU64::new(0)).collect();
    PEAK.store(LIVE.load(Ordering::SeqCst), Ordering::SeqCst);
    let baseline = LIVE.load(Ordering::SeqCst);
    std::thread::scope(|s| {
        // Watchdog: an input that runs too long is a hang.
        s.spawn(|| {
            while !done.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(500));
                for slot in &in_flight {
                    let since = slot.load(Ordering::SeqCst);
                    if since != 0 && started.elapsed().as_secs().saturating_sub(since) > MAX_INPUT_SECONDS {
                        eprintln!("an input ran for over {MAX_INPUT_SECONDS} s: see the last `trying` line");
                        std::process::abort();
                    }
                }
            }
        });
        let mut workers = Vec::new();
        for (worker, slot) in in_flight.iter().enumerate() {
            let (targets, schedule, tallies, next, findings, only) =
                (&targets, &schedule, &tallies, &next, &findings, only);
            let dir = scratch.path().join(format!("worker-{worker}"));
            workers.push(s.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= inputs {
                    break;
                }
                if only.is_some_and(|only| only != i) {
                    continue;
                }
                let t = &targets[schedule[i]];
                let mut rng = Rng(seed.wrapping_mul(0x100_0000_01B3) ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                let (bytes, len) = mutate(&mut rng, &t.seed);
                let path = write_input(&dir, t, &bytes, len).expect("writing a fuzz input");
                slot.store(started.elapsed().as_secs().max(1), Ordering::SeqCst);
                let t0 = Instant::now();
                let refused_before = REFUSED.load(Ordering::SeqCst);
                if only.is_some() {
                    let _ = std::fs::create_dir_all(findings);
                    let saved = findings.join(format!("input-{seed}-{i}-{}", file_name(&t.seed)));
                    eprintln!("input {i}: {}, saved as {}", t.name, saved.display());
                    let _ = std::fs::write(&saved, &bytes);
                }
                CURRENT_INPUT.with(|c| c.set(i));
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (t.run)(&path)));
                CURRENT_INPUT.with(|c| c.set(usize::MAX));
                let elapsed = t0.elapsed();
                slot.store(0, Ordering::SeqCst);
                let refused = REFUSED.load(Ordering::SeqCst) > refused_before;
                let mut tallies = tallies.lock().unwrap();
                let tally = &mut tallies[schedule[i]];
                tally.inputs += 1;
                tally.slowest = tally.slowest.max(elapsed);
                tally.total += elapsed;
                let failure = match result {
                    Ok(Ok(())) => {
                        tally.ok += 1;
                        None
                    }
                    Ok(Err(e)) => {
                        if verbose && tally.errors < 3 {
                            eprintln!("{}: {e:#}", t.name);
                        }
                        tally.errors += 1;
                        None
                    }
                    Err(payload) => Some(format!("panic: {}", panic_message(&*payload))),
                };
                let failure = failure.or_else(|| {
                    refused.then(|| {
                        format!("an allocation of {} bytes was asked for", REFUSED_SIZE.load(Ordering::SeqCst))
                    })
                });
                if let Some(failure) = failure {
                    let _ = std::fs::create_dir_all(findings);
                    let saved = findings.join(format!("input-{seed}-{i}-{}", file_name(&t.seed)));
                    let _ = std::fs::write(&saved, &bytes);
                    tally.panics.push(format!("input {i}: {failure} (saved as {})", saved.display()));
                }
                if (i + 1) % 10_000 == 0 {
                    eprintln!("{} inputs, {:.0} s", i + 1, started.elapsed().as_secs_f64());
                }
            }));
        }
        for w in workers {
            w.join().unwrap();
        }
        done.store(true, Ordering::SeqCst);
    });
    let _ = std::panic::take_hook();

    let tallies = tallies.into_inner().unwrap();
    let peak = PEAK.load(Ordering::SeqCst).saturating_sub(baseline);
    eprintln!(
        "{inputs} inputs (seed {seed}) in {:.0} s; peak heap above the loaded models {} MiB; largest allocation allowed {} MiB",
        started.elapsed().as_secs_f64(),
        peak >> 20,
        MAX_ALLOCATION >> 20
    );
    eprintln!(
        "{:<48} {:>8} {:>8} {:>8} {:>7} {:>9} {:>9}",
        "target", "inputs", "ok", "errors", "panics", "mean", "slowest"
    );
    let mut failures = Vec::new();
    for (t, tally) in targets.iter().zip(&tallies) {
        eprintln!(
            "{:<48} {:>8} {:>8} {:>8} {:>7} {:>7.1}ms {:>8.2}s",
            t.name,
            tally.inputs,
            tally.ok,
            tally.errors,
            tally.panics.len(),
            tally.total.as_secs_f64() * 1e3 / tally.inputs.max(1) as f64,
            tally.slowest.as_secs_f64()
        );
        failures.extend(tally.panics.iter().map(|p| format!("{}: {p}", t.name)));
    }
    assert!(failures.is_empty(), "{} inputs failed:\n{}", failures.len(), failures.join("\n"));
}
