//! Speculative decoding against plain decoding over prompt suites: per data set and
//! temperature, every prompt is decoded plainly and then by each drafter (batch 1, same
//! `max_tokens`, fresh KV cache and drafter per prompt). Reports tokens/s, speedup, τ,
//! acceptance, draft vs verify time, and the speedup bound implied by the target's
//! verify-cost curve; at temperature 0 it also checks that speculative output equals plain
//! output token for token.

use crate::datasets::{self, Prompt, PromptKind};
use crate::engine::{generate, FleetAcceptance, GenerateOptions, LoadedModel};
use crate::kv::KvDtype;
use crate::sample::SamplingParams;
use crate::speculative::step_cost_cache::{self, StepCostKey};
use crate::speculative::suffix::cache::SuffixCache;
use crate::speculative::{build_proposer, Caller, DrafterSpec};
use crate::speculative::{DraftLen, DraftTree, SpecMetrics, StepCost, StepCostSettings};
use crate::tokenize::ChatMessage;
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// `4` or `auto`, as a report label.
pub fn draft_len_label(k: DraftLen) -> String {
    match k {
        DraftLen::Fixed(n) => n.to_string(),
        DraftLen::Auto => "auto".to_string(),
    }
}

/// One way of decoding: plain (no drafter) or a drafter at a draft length.
#[derive(Debug, Clone, PartialEq)]
pub struct Mode {
    /// The `--drafter` string; None = plain decoding.
    pub drafter: Option<String>,
    pub draft_len: Option<DraftLen>,
    /// Draft trees (drafters that can draft them); `Off` for plain decoding.
    pub draft_tree: DraftTree,
    /// Adaptive modes: each prompt starts from the acceptance the drafter had on the earlier
    /// prompts of its data set (as on a running server) instead of from nothing.
    pub warm: bool,
}

impl Mode {
    pub fn plain() -> Self {
        Self { drafter: None, draft_len: None, draft_tree: DraftTree::Off, warm: false }
    }

    pub fn spec(drafter: &str, draft_len: DraftLen) -> Self {
        Self { drafter: Some(drafter.to_string()), draft_len: Some(draft_len), draft_tree: DraftTree::Off, warm: false }
    }

    pub fn is_plain(&self) -> bool {
        self.drafter.is_none()
    }

    /// `plain`, `ngram k=4`, `draft-model:qwen2.5-coder-0.5b k=auto`, `dflash:DIR k=auto warm`,
    /// `dflash:DIR k=auto tree=auto`.
    pub fn label(&self) -> String {
        let warm = if self.warm { " warm" } else { "" };
        let tree = match self.draft_tree {
            DraftTree::Off => String::new(),
            DraftTree::Auto => " tree=auto".to_string(),
            DraftTree::Max(n) => format!(" tree={n}"),
        };
        match (&self.drafter, &self.draft_len) {
            (None, _) => "plain".to_string(),
            (Some(d), Some(k)) => format!("{d} k={}{tree}{warm}", draft_len_label(*k)),
            (Some(d), None) => d.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct SpecBenchSettings {
    /// Target models (keys or paths).
    pub models: Vec<String>,
    pub weights: Option<String>,
    /// `--drafter` strings (see [`DrafterSpec::parse`]).
    pub drafters: Vec<String>,
    pub draft_lens: Vec<DraftLen>,
    /// Draft-tree settings; each is its own mode.
    pub draft_trees: Vec<DraftTree>,
    /// Starts of the adaptive modes: cold (false: each prompt knows nothing of the drafter) and/or
    /// warm (true: each prompt starts from the earlier prompts' acceptance); each is its own mode.
    pub starts: Vec<bool>,
    /// Upper limit of the adaptive policy's draft length.
    pub max_auto_draft_len: usize,
    pub datasets: Vec<String>,
    /// Prompts left out at the start of each set (to measure on prompts a drafter was not
    /// trained on, from a set it was trained on).
    pub skip: usize,
    pub limit: Option<usize>,
    pub max_tokens: usize,
    pub temperatures: Vec<f32>,
    /// Prompt i at temperature > 0 samples with seed `seed + i` in every mode.
    pub seed: u64,
    /// The verify-cost curve is measured for m = 1..=curve_max_m.
    pub curve_max_m: usize,
    /// Take the curve from the step-cost cache `serve` uses (measuring and caching it when
    /// absent) instead of measuring it for this run.
    pub cached_curve: bool,
    /// Chat template variables for chat prompts (`{"enable_thinking": false}`).
    pub chat_template_kwargs: crate::tokenize::TemplateKwargs,
}

impl SpecBenchSettings {
    /// Plain first, then every drafter × draft length.
    pub fn modes(&self) -> Vec<Mode> {
        let mut modes = vec![Mode::plain()];
        for d in &self.drafters {
            // The canonical form names defaults (`ngram` → `ngram:3`); parse errors surface in validate.
            let name = DrafterSpec::parse(d).map_or_else(|_| d.clone(), |spec| spec.label());
            for k in &self.draft_lens {
                for &draft_tree in &self.draft_trees {
                    let mode = Mode { draft_tree, ..Mode::spec(&name, *k) };
                    match k {
                        DraftLen::Auto => {
                            for &warm in &self.starts {
                                modes.push(Mode { warm, ..mode.clone() });
                            }
                        }
                        DraftLen::Fixed(_) => modes.push(mode),
                    }
                }
            }
        }
        modes
    }

    pub fn validate(&self) -> Result<()> {
        if self.models.is_empty() {
            bail!("no target model: give --model KEY|PATH");
        }
        if self.drafters.is_empty() {
            bail!("no drafter: give --drafter ngram and/or --drafter draft-model:KEY");
        }
        if self.draft_lens.is_empty() {
            bail!("no draft length: give --draft-len N|auto");
        }
        if self.draft_trees.is_empty() {
            bail!("no draft-tree setting: give --draft-tree off|auto|N");
        }
        if self.starts.is_empty() {
            bail!("no start for the adaptive modes: give --acceptance-history cold and/or warm");
        }
        if self.datasets.is_empty() {
            bail!("no data set: give --dataset KEY (e.g. humaneval, gsm8k-100)");
        }
        if self.temperatures.is_empty() {
            bail!("no temperature: give --temperatures 0,1");
        }
        if self.max_tokens == 0 {
            bail!("--max-tokens must be at least 1");
        }
        for t in &self.temperatures {
            if !t.is_finite() || *t < 0.0 {
                bail!("temperature {t} is not a finite number >= 0");
            }
        }
        for d in &self.drafters {
            DrafterSpec::parse(d).with_context(|| format!("--drafter {d}"))?;
        }
        for key in &self.datasets {
            if !datasets::PROMPT_SETS.contains(&key.as_str()) {
                bail!("unknown data set `{key}` (available: {})", datasets::PROMPT_SETS.join(", "));
            }
        }
        Ok(())
    }
}

/// One prompt decoded in one mode.
#[derive(Debug, Clone, Serialize)]
pub struct PromptRun {
    pub dataset: String,
    pub temperature: f32,
    pub mode: String,
    pub prompt_id: String,
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub tokens: usize,
    pub finish: String,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    /// Generated tokens / (prefill + decode) seconds.
    pub tokens_per_s: f64,
    /// Tokens after the first / decode seconds.
    pub decode_tokens_per_s: f64,
    pub tau: f64,
    pub acceptance_rate: f64,
    pub metrics: SpecMetrics,
    /// Greedy runs of speculative modes: whether the output equals the plain output.
    pub matches_plain: Option<bool>,
    /// Index of the first differing generated token (or the shorter length).
    pub first_mismatch: Option<usize>,
}

/// Aggregate of one model × data set × temperature × mode.
#[derive(Debug, Clone, Serialize)]
pub struct CellSummary {
    pub dataset: String,
    pub temperature: f32,
    pub mode: String,
    pub drafter: Option<String>,
    pub draft_len: Option<String>,
    pub prompts: usize,
    pub tokens: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    /// Σ tokens / Σ (prefill + decode).
    pub tokens_per_s: f64,
    /// Σ (tokens − 1) / Σ decode.
    pub decode_tokens_per_s: f64,
    /// `tokens_per_s` over plain decoding's on the same prompts.
    pub speedup: f64,
    /// 95% interval of `speedup` from a paired bootstrap over the prompts (speculative modes
    /// with at least two prompts): how far the machine's noise alone moves it.
    pub speedup_interval: Option<(f64, f64)>,
    pub decode_speedup: f64,
    pub tau: f64,
    /// 95% interval of `tau` from a bootstrap over the prompts (speculative modes with at least
    /// two prompts): how far another sample of prompts of the set could move it.
    pub tau_interval: Option<(f64, f64)>,
    pub acceptance_rate: f64,
    pub steps: u64,
    pub spec_steps: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// Fraction of drafts reaching position (depth) i that were accepted there.
    pub acceptance_at: Vec<f64>,
    /// Fraction of tries of sibling rank r (0: the drafter's first choice) that were accepted.
    pub acceptance_at_rank: Vec<f64>,
    /// Drafted tokens per verify step.
    pub mean_draft_len: f64,
    pub draft_secs: f64,
    pub verify_secs: f64,
    /// Mean verify cost per step in units of cost(1), from the draft lengths used.
    pub mean_verify_cost: f64,
    /// Ideal decode speedup: τ / mean verify cost (drafting free, acceptance as measured).
    pub bound: f64,
    /// `decode_speedup / bound`.
    pub of_bound: f64,
    /// Greedy speculative modes: prompts whose output differs from plain decoding.
    pub mismatches: Option<usize>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelReport {
    pub model: String,
    pub path: String,
    pub weights: String,
    /// cost(m)/cost(1) for m = 1..; index m−1.
    pub verify_curve: Vec<f64>,
    pub cells: Vec<CellSummary>,
    pub runs: Vec<PromptRun>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SpecBenchReport {
    /// When, on which commit and CPU, with how many threads.
    pub run: super::RunInfo,
    pub threads: String,
    pub datasets: Vec<String>,
    pub temperatures: Vec<f32>,
    pub modes: Vec<String>,
    #[serde(skip_serializing_if = "is_zero")]
    pub skip: usize,
    pub limit: Option<usize>,
    pub max_tokens: usize,
    pub seed: u64,
    pub models: Vec<ModelReport>,
    /// Greedy speculative outputs that differ from plain output, over everything. Must be 0.
    pub greedy_mismatches: usize,
}

/// Steps by draft size: `out[j]` = steps that drafted exactly j tokens (tree nodes).
pub fn draft_len_histogram(m: &SpecMetrics) -> Vec<u64> {
    m.steps_by_nodes.clone()
}

/// Mean verify cost per step, in units of cost(1): a step drafting j tokens runs j + 1 rows.
pub fn mean_verify_cost(m: &SpecMetrics, cost: &StepCost) -> f64 {
    if m.steps == 0 {
        return 1.0;
    }
    let total: f64 = draft_len_histogram(m).iter().enumerate().map(|(j, &n)| n as f64 * cost.relative(j + 1)).sum();
    total / m.steps as f64
}

/// The ideal decode speedup over plain decoding: τ tokens per step at the step's verify cost,
/// against one token per cost(1). Drafting time is taken as free, so real runs stay below it.
pub fn speedup_bound(m: &SpecMetrics, step_cost: &StepCost) -> f64 {
    let cost = mean_verify_cost(m, step_cost);
    if m.steps == 0 || cost <= 0.0 {
        return 1.0;
    }
    m.tau() / cost
}

/// Index of the first differing token of two outputs; None when equal.
pub fn first_mismatch(plain: &[u32], spec: &[u32]) -> Option<usize> {
    match plain.iter().zip(spec).position(|(a, b)| a != b) {
        Some(i) => Some(i),
        None if plain.len() != spec.len() => Some(plain.len().min(spec.len())),
        None => None,
    }
}

fn ratio(num: f64, den: f64) -> f64 {
    if den > 0.0 && num.is_finite() {
        num / den
    } else {
        0.0
    }
}

/// 95% interval of the end-to-end speedup (Σ tokens / Σ seconds, over plain decoding's) from a
/// paired bootstrap ([`crate::stats::bootstrap_95`]): the prompts are drawn with replacement,
/// each keeping its plain and its speculative run together, so prompt-to-prompt differences in
/// length and difficulty cancel and what is left is the run-to-run noise. None with fewer than
/// two pairs.
pub fn speedup_interval(pairs: &[(&PromptRun, &PromptRun)]) -> Option<(f64, f64)> {
    let secs = |r: &PromptRun| r.prefill_secs + r.decode_secs;
    crate::stats::bootstrap_95(pairs.len(), |drawn| {
        let (mut plain_tokens, mut plain_secs, mut spec_tokens, mut spec_secs) = (0.0, 0.0, 0.0, 0.0);
        for &i in drawn {
            let (plain, spec) = pairs[i];
            plain_tokens += plain.tokens as f64;
            plain_secs += secs(plain);
            spec_tokens += spec.tokens as f64;
            spec_secs += secs(spec);
        }
        ratio(ratio(spec_tokens, spec_secs), ratio(plain_tokens, plain_secs))
    })
}

/// 95% interval of τ (tokens committed per verify step, as [`SpecMetrics::tau`]) from a
/// bootstrap over the prompts: how much another sample of prompts of the same kind could move it
/// (prompts differ in difficulty; τ itself does not depend on the machine). None with fewer than
/// two prompts.
pub fn tau_interval(runs: &[&PromptRun]) -> Option<(f64, f64)> {
    let items: Vec<(f64, f64)> =
        runs.iter().map(|r| ((r.metrics.accepted + r.metrics.steps) as f64, r.metrics.steps as f64)).collect();
    crate::stats::ratio_of_sums_95(&items)
}

/// Summarises the runs of one cell. `plain` is the plain-decoding summary of the same prompts
/// (None when summarising plain decoding itself).
pub fn summarize(
    runs: &[&PromptRun],
    mode: &Mode,
    dataset: &str,
    temperature: f32,
    cost: &StepCost,
    plain: Option<&CellSummary>,
) -> CellSummary {
    let mut metrics = SpecMetrics::default();
    let (mut tokens, mut after_first, mut prefill, mut decode) = (0usize, 0usize, 0.0, 0.0);
    let mut compared = 0usize;
    let mut mismatches = 0usize;
    for r in runs {
        metrics.merge(&r.metrics);
        tokens += r.tokens;
        after_first += r.tokens.saturating_sub(1);
        prefill += r.prefill_secs;
        decode += r.decode_secs;
        if let Some(ok) = r.matches_plain {
            compared += 1;
            mismatches += usize::from(!ok);
        }
    }
    let tokens_per_s = ratio(tokens as f64, prefill + decode);
    let decode_tokens_per_s = ratio(after_first as f64, decode);
    let (speedup, decode_speedup) = match plain {
        Some(p) => (ratio(tokens_per_s, p.tokens_per_s), ratio(decode_tokens_per_s, p.decode_tokens_per_s)),
        None => (1.0, 1.0),
    };
    let bound = speedup_bound(&metrics, cost);
    let acceptance_at =
        metrics.drafted_at.iter().zip(&metrics.accepted_at).map(|(&d, &a)| ratio(a as f64, d as f64)).collect();
    CellSummary {
        dataset: dataset.to_string(),
        temperature,
        mode: mode.label(),
        drafter: mode.drafter.clone(),
        draft_len: mode.draft_len.map(draft_len_label),
        prompts: runs.len(),
        tokens,
        prefill_secs: prefill,
        decode_secs: decode,
        tokens_per_s,
        decode_tokens_per_s,
        speedup,
        speedup_interval: None,
        decode_speedup,
        tau: metrics.tau(),
        tau_interval: if mode.is_plain() { None } else { tau_interval(runs) },
        acceptance_rate: metrics.acceptance_rate(),
        steps: metrics.steps,
        spec_steps: metrics.spec_steps,
        drafted: metrics.drafted,
        accepted: metrics.accepted,
        acceptance_at,
        acceptance_at_rank: metrics.per_rank_acceptance(),
        mean_draft_len: ratio(metrics.drafted as f64, metrics.steps as f64),
        draft_secs: metrics.draft_secs,
        verify_secs: metrics.verify_secs,
        mean_verify_cost: mean_verify_cost(&metrics, cost),
        bound,
        of_bound: ratio(decode_speedup, bound),
        mismatches: (compared > 0 || (!mode.is_plain() && temperature <= 0.0)).then_some(mismatches),
    }
}

/// Cells of one model in run order: per data set, per temperature, plain then each mode.
pub fn summarize_all(
    runs: &[PromptRun],
    modes: &[Mode],
    datasets: &[String],
    temperatures: &[f32],
    cost: &StepCost,
) -> Vec<CellSummary> {
    let mut cells = Vec::new();
    for ds in datasets {
        for &t in temperatures {
            // Plain decoding's summary and runs of this set and temperature (plain comes first).
            let mut plain: Option<(CellSummary, Vec<&PromptRun>)> = None;
            for mode in modes {
                let label = mode.label();
                let rows: Vec<&PromptRun> =
                    runs.iter().filter(|r| &r.dataset == ds && r.temperature == t && r.mode == label).collect();
                if rows.is_empty() {
                    continue;
                }
                let mut cell = summarize(&rows, mode, ds, t, cost, plain.as_ref().map(|(c, _)| c));
                if mode.is_plain() {
                    plain = Some((cell.clone(), rows));
                } else if let Some((_, plain_rows)) = &plain {
                    let pairs: Vec<(&PromptRun, &PromptRun)> = rows
                        .iter()
                        .filter_map(|&r| Some((*plain_rows.iter().find(|p| p.prompt_id == r.prompt_id)?, r)))
                        .collect();
                    if pairs.len() == rows.len() {
                        cell.speedup_interval = speedup_interval(&pairs);
                    }
                }
                cells.push(cell);
            }
        }
    }
    cells
}

/// A prompt of a set, as token ids for this model.
struct EncodedPrompt {
    id: String,
    ids: Vec<u32>,
}

fn encode_set(
    loaded: &LoadedModel,
    key: &str,
    prompts: &[Prompt],
    kwargs: &crate::tokenize::TemplateKwargs,
) -> Result<Vec<EncodedPrompt>> {
    prompts
        .iter()
        .map(|p| {
            let ids = match p.kind {
                PromptKind::Chat => loaded.encode_chat_with(&[ChatMessage::user(p.text.clone())], kwargs),
                PromptKind::Completion => loaded.encode_prompt(&p.text),
            }
            .with_context(|| format!("{key}: encoding prompt {}", p.id))?;
            if ids.is_empty() {
                bail!("{key}: prompt {} encodes to no tokens", p.id);
            }
            Ok(EncodedPrompt { id: p.id.clone(), ids })
        })
        .collect()
}

/// The verify-cost curve for m = 1..=`max_m`: measured now, or from the step-cost cache (then
/// measured and cached when the cache has none for this model, machine and size).
fn verify_curve(loaded: &LoadedModel, path: &Path, max_m: usize, cached: bool) -> Result<StepCost> {
    let settings = StepCostSettings::up_to(max_m);
    if !cached {
        return StepCost::measure(&loaded.model, &settings);
    }
    let dir = step_cost_cache::default_dir();
    let key = StepCostKey::new(&loaded.model, path, KvDtype::F16, &settings, &dir)?;
    if let Some(cost) = step_cost_cache::load(&dir, &key)? {
        return Ok(cost);
    }
    let t = std::time::Instant::now();
    let cost = StepCost::measure(&loaded.model, &settings)?;
    step_cost_cache::save(&dir, &key, &cost, t.elapsed().as_secs_f64())?;
    Ok(cost)
}

/// Runs the whole benchmark. `progress` is advanced once per prompt × mode.
pub fn run(settings: &SpecBenchSettings, progress: &indicatif::ProgressBar) -> Result<SpecBenchReport> {
    settings.validate()?;
    let run_info = super::RunInfo::now();
    let modes = settings.modes();
    let drafters: Vec<Option<DrafterSpec>> =
        modes.iter().map(|m| m.drafter.as_deref().map(DrafterSpec::parse).transpose()).collect::<Result<_>>()?;
    let threads =
        std::env::var("CANDLE_NUM_THREADS").or_else(|_| std::env::var("RAYON_NUM_THREADS")).unwrap_or("all".into());
    // All prompts first: a missing or empty set fails before any model loads.
    let mut sets: Vec<(String, Vec<Prompt>)> = Vec::new();
    for key in &settings.datasets {
        let mut prompts = datasets::load(key, settings.limit.map(|l| l.saturating_add(settings.skip)))?;
        prompts.drain(..settings.skip.min(prompts.len()));
        if prompts.is_empty() {
            bail!(
                "data set {key} has no prompts{}",
                if settings.skip > 0 { format!(" after the first {}", settings.skip) } else { String::new() }
            );
        }
        sets.push((key.clone(), prompts));
    }
    let runs_per_model: usize =
        sets.iter().map(|(_, p)| p.len()).sum::<usize>() * settings.temperatures.len() * modes.len();
    progress.set_length((runs_per_model * settings.models.len()) as u64);
    let mut models = Vec::new();
    let mut greedy_mismatches = 0;

    for model_key in &settings.models {
        progress.set_message(format!("{model_key}: loading"));
        let path: PathBuf = crate::fetch::resolve_model(model_key, false)?;
        let weights = settings.weights.as_deref().map(crate::model::WeightFormat::parse).transpose()?;
        let loaded = LoadedModel::load(&path, weights, &candle_core::Device::Cpu)?;
        // A drafter that cannot draft for this target (another vocabulary) fails here, before
        // any time is spent measuring.
        for spec in drafters.iter().flatten() {
            build_proposer(spec, loaded.target(), Caller::default())
                .with_context(|| format!("drafter {} for {model_key}", spec.label()))?;
        }
        let curve_max_m = settings.curve_max_m.max(settings.max_auto_draft_len + 1).max(
            settings.draft_lens.iter().map(|k| if let DraftLen::Fixed(n) = k { n + 1 } else { 1 }).max().unwrap_or(1),
        );
        progress.set_message(format!("{model_key}: measuring the verify-cost curve"));
        let cost = Arc::new(verify_curve(&loaded, &path, curve_max_m, settings.cached_curve)?);
        let curve: Vec<f64> = (1..=curve_max_m).map(|m| cost.relative(m)).collect();
        let stop_ids = loaded.stop_ids();
        let mut runs: Vec<PromptRun> = Vec::new();
        // A suffix drafter remembers this model's earlier requests, as a server's would.
        let suffix_caches: Vec<Option<Arc<SuffixCache>>> = drafters
            .iter()
            .map(|d| d.as_ref().filter(|d| d.uses_suffix()).map(|_| Arc::new(SuffixCache::new(Default::default()))))
            .collect();

        for (ds, raw_prompts) in &sets {
            let prompts = encode_set(&loaded, ds, raw_prompts, &settings.chat_template_kwargs)?;
            let longest = prompts.iter().map(|p| p.ids.len()).max().unwrap_or(0);
            // Room for the prompt, the output, and one verify block past the committed tokens.
            let pool = loaded.model.new_kv_pool(longest + settings.max_tokens + curve_max_m + 64);
            for &temperature in &settings.temperatures {
                // Each warm mode's acceptance history over this set at this temperature.
                let histories: Vec<_> = modes
                    .iter()
                    .map(|m| m.warm.then(|| Arc::new(std::sync::Mutex::new(FleetAcceptance::default()))))
                    .collect();
                for (i, prompt) in prompts.iter().enumerate() {
                    let mut plain_tokens: Option<Vec<u32>> = None;
                    for (m, ((mode, drafter), history)) in modes.iter().zip(&drafters).zip(&histories).enumerate() {
                        progress.set_message(format!("{model_key} · {ds} · T={temperature} · {}", mode.label()));
                        let params = SamplingParams {
                            temperature,
                            seed: Some(settings.seed.wrapping_add(i as u64)),
                            max_tokens: Some(settings.max_tokens),
                            ..SamplingParams::default()
                        };
                        let mut proposer = match drafter {
                            Some(spec) => Some(build_proposer(
                                spec,
                                loaded.target(),
                                Caller { suffix_cache: suffix_caches[m].as_ref(), api_key: None },
                            )?),
                            None => None,
                        };
                        let opts = GenerateOptions {
                            stop_ids: stop_ids.clone(),
                            draft_len: mode.draft_len.unwrap_or(DraftLen::Fixed(0)),
                            draft_tree: mode.draft_tree,
                            max_draft: settings.max_auto_draft_len,
                            step_cost: Some(cost.clone()),
                            history: history.clone(),
                            ..GenerateOptions::default()
                        };
                        let gen = generate(
                            (&loaded.model).into(),
                            &pool,
                            &prompt.ids,
                            params,
                            proposer.as_deref_mut().map(|p| p as &mut dyn crate::speculative::Proposer),
                            &opts,
                            &mut |_| {},
                        )
                        .with_context(|| format!("{ds} prompt {} ({})", prompt.id, mode.label()))?;
                        let (matches_plain, mismatch_at) = match (&plain_tokens, temperature <= 0.0) {
                            (Some(p), true) => {
                                let at = first_mismatch(p, &gen.tokens);
                                (Some(at.is_none()), at)
                            }
                            _ => (None, None),
                        };
                        if matches_plain == Some(false) {
                            greedy_mismatches += 1;
                            progress.println(format!(
                                "MISMATCH: {model_key} {ds} {} ({}): greedy output differs from plain at token {}",
                                prompt.id,
                                mode.label(),
                                mismatch_at.unwrap_or(0)
                            ));
                        }
                        runs.push(PromptRun {
                            dataset: ds.clone(),
                            temperature,
                            mode: mode.label(),
                            prompt_id: prompt.id.clone(),
                            prompt_tokens: prompt.ids.len(),
                            tokens: gen.tokens.len(),
                            finish: gen.finish.openai().to_string(),
                            prefill_secs: gen.prefill_secs,
                            decode_secs: gen.decode_secs,
                            tokens_per_s: ratio(gen.tokens.len() as f64, gen.prefill_secs + gen.decode_secs),
                            decode_tokens_per_s: gen.decode_tps(),
                            tau: gen.metrics.tau(),
                            acceptance_rate: gen.metrics.acceptance_rate(),
                            metrics: gen.metrics.clone(),
                            matches_plain,
                            first_mismatch: mismatch_at,
                        });
                        if mode.is_plain() {
                            plain_tokens = Some(gen.tokens);
                        }
                        progress.inc(1);
                    }
                }
            }
        }
        let cells = summarize_all(&runs, &modes, &settings.datasets, &settings.temperatures, &cost);
        models.push(ModelReport {
            model: model_key.clone(),
            path: path.display().to_string(),
            weights: loaded.model.weight_format.name().to_string(),
            verify_curve: curve,
            cells,
            runs,
        });
    }
    Ok(SpecBenchReport {
        run: run_info,
        threads,
        datasets: settings.datasets.clone(),
        temperatures: settings.temperatures.clone(),
        modes: modes.iter().map(Mode::label).collect(),
        skip: settings.skip,
        limit: settings.limit,
        max_tokens: settings.max_tokens,
        seed: settings.seed,
        models,
        greedy_mismatches,
    })
}

/// Leaves `skip` out of a report's JSON when no prompt was skipped.
fn is_zero(n: &usize) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics_of(steps: &[(usize, usize)]) -> SpecMetrics {
        let mut m = SpecMetrics::default();
        for &(drafted, accepted) in steps {
            m.record(drafted, accepted, accepted + 1);
        }
        m
    }

    fn run_row(
        dataset: &str,
        t: f32,
        mode: &str,
        tokens: usize,
        secs: f64,
        m: SpecMetrics,
        ok: Option<bool>,
    ) -> PromptRun {
        PromptRun {
            dataset: dataset.into(),
            temperature: t,
            mode: mode.into(),
            prompt_id: "p".into(),
            prompt_tokens: 10,
            tokens,
            finish: "length".into(),
            prefill_secs: 0.0,
            decode_secs: secs,
            tokens_per_s: tokens as f64 / secs,
            decode_tokens_per_s: (tokens - 1) as f64 / secs,
            tau: m.tau(),
            acceptance_rate: m.acceptance_rate(),
            metrics: m,
            matches_plain: ok,
            first_mismatch: None,
        }
    }

    #[test]
    fn histogram_counts_steps_by_exact_draft_length() {
        // Two steps drafting 4, one drafting 2, one plain step.
        let m = metrics_of(&[(4, 1), (4, 4), (2, 0), (0, 0)]);
        assert_eq!(draft_len_histogram(&m), vec![1, 0, 1, 0, 2]);
        assert_eq!(draft_len_histogram(&m).iter().sum::<u64>(), m.steps);
    }

    #[test]
    fn bound_is_tau_over_verify_cost_at_fixed_length() {
        // k = 4 every step → verify 5 rows: cost(5) = 2.5; τ = (1+4+2+3)/4 + 1 = 3.5.
        let curve = cost_of(&[1.0, 1.3, 1.7, 2.1, 2.5, 2.9]);
        let m = metrics_of(&[(4, 1), (4, 4), (4, 2), (4, 3)]);
        assert!((m.tau() - 3.5).abs() < 1e-12);
        assert!((speedup_bound(&m, &curve) - 3.5 / 2.5).abs() < 1e-12);
        // Plain decoding: τ = 1 at cost(1) = 1.
        assert!((speedup_bound(&metrics_of(&[(0, 0), (0, 0)]), &curve) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn bound_averages_the_cost_of_mixed_draft_lengths() {
        let curve = cost_of(&[1.0, 2.0, 3.0]);
        // One step with k=2 (cost 3), one plain (cost 1): mean cost 2, τ = (2 + 2) / 2 = 2.
        let m = metrics_of(&[(2, 2), (0, 0)]);
        assert!((mean_verify_cost(&m, &curve) - 2.0).abs() < 1e-12);
        assert!((speedup_bound(&m, &curve) - 1.0).abs() < 1e-12);
    }

    fn cost_of(relative: &[f64]) -> StepCost {
        StepCost::from_points(relative.iter().enumerate().map(|(i, &c)| (i + 1, c)).collect())
    }

    #[test]
    fn first_mismatch_finds_differences_and_length_changes() {
        assert_eq!(first_mismatch(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_mismatch(&[1, 2, 3], &[1, 9, 3]), Some(1));
        assert_eq!(first_mismatch(&[1, 2, 3], &[1, 2]), Some(2));
        assert_eq!(first_mismatch(&[], &[5]), Some(0));
    }

    #[test]
    fn summaries_compute_speedup_against_plain_and_count_mismatches() {
        let modes = vec![Mode::plain(), Mode::spec("ngram", DraftLen::Fixed(2))];
        let ds = vec!["humaneval".to_string()];
        let curve = [1.0, 1.2, 1.4];
        let spec = modes[1].label();
        let runs = vec![
            run_row("humaneval", 0.0, "plain", 11, 10.0, metrics_of(&[(0, 0); 10]), None),
            run_row("humaneval", 0.0, "plain", 11, 10.0, metrics_of(&[(0, 0); 10]), None),
            run_row("humaneval", 0.0, &spec, 11, 5.0, metrics_of(&[(2, 2), (2, 2), (2, 1), (2, 2)]), Some(true)),
            run_row("humaneval", 0.0, &spec, 11, 5.0, metrics_of(&[(2, 2), (2, 2), (2, 1), (2, 2)]), Some(false)),
        ];
        let cells = summarize_all(&runs, &modes, &ds, &[0.0], &cost_of(&curve));
        assert_eq!(cells.len(), 2);
        let (plain, ngram) = (&cells[0], &cells[1]);
        assert_eq!(plain.mismatches, None);
        assert!((plain.speedup - 1.0).abs() < 1e-12);
        assert_eq!(ngram.prompts, 2);
        assert_eq!(ngram.mismatches, Some(1));
        assert!((ngram.decode_speedup - 2.0).abs() < 1e-12);
        assert!((ngram.speedup - 2.0).abs() < 1e-12);
        // τ = (7 + 4) / 4 per prompt; k = 2 → cost(3) = 1.4.
        assert!((ngram.tau - 11.0 / 4.0).abs() < 1e-12);
        assert!((ngram.bound - (11.0 / 4.0) / 1.4).abs() < 1e-12);
        assert!((ngram.of_bound - 2.0 / ngram.bound).abs() < 1e-12);
        assert_eq!(ngram.acceptance_at, vec![1.0, 0.75]);
    }

    #[test]
    fn the_speedup_interval_is_tight_for_steady_pairs_and_wide_for_noisy_ones() {
        let plain = |secs: f64| run_row("gsm8k", 0.0, "plain", 101, secs, metrics_of(&[(0, 0)]), None);
        let spec = |secs: f64| run_row("gsm8k", 0.0, "ngram", 101, secs, metrics_of(&[(0, 0)]), None);
        // Every prompt exactly twice as fast: the interval is the point.
        let steady: Vec<(PromptRun, PromptRun)> = (1..=10).map(|i| (plain(i as f64), spec(i as f64 / 2.0))).collect();
        let pairs: Vec<(&PromptRun, &PromptRun)> = steady.iter().map(|(p, s)| (p, s)).collect();
        let (lo, hi) = speedup_interval(&pairs).unwrap();
        assert!((lo - 2.0).abs() < 1e-9 && (hi - 2.0).abs() < 1e-9, "{lo} {hi}");
        // Same work, ±20% run-to-run noise: the interval straddles 1 and holds the estimate.
        let noisy: Vec<(PromptRun, PromptRun)> =
            (0..20).map(|i| (plain(10.0), spec(if i % 2 == 0 { 8.0 } else { 12.0 }))).collect();
        let pairs: Vec<(&PromptRun, &PromptRun)> = noisy.iter().map(|(p, s)| (p, s)).collect();
        let (lo, hi) = speedup_interval(&pairs).unwrap();
        assert!(lo < 1.0 && hi > 1.0 && hi - lo > 0.1, "{lo} {hi}");
        assert_eq!(speedup_interval(&pairs[..1]), None, "one pair says nothing about noise");
    }

    #[test]
    fn settings_list_plain_then_every_drafter_and_length() {
        let s = SpecBenchSettings {
            models: vec!["m".into()],
            weights: None,
            drafters: vec!["ngram".into(), "draft-model:x".into()],
            draft_lens: vec![DraftLen::Fixed(4), DraftLen::Auto],
            draft_trees: vec![DraftTree::Off],
            starts: vec![false, true],
            max_auto_draft_len: 8,
            datasets: vec!["humaneval".into()],
            skip: 0,
            limit: None,
            max_tokens: 16,
            temperatures: vec![0.0],
            seed: 0,
            curve_max_m: 16,
            cached_curve: false,
            chat_template_kwargs: Default::default(),
        };
        let labels: Vec<String> = s.modes().iter().map(Mode::label).collect();
        assert_eq!(
            labels,
            [
                "plain",
                "ngram:3 k=4",
                "ngram:3 k=auto",
                "ngram:3 k=auto warm",
                "draft-model:x k=4",
                "draft-model:x k=auto",
                "draft-model:x k=auto warm"
            ]
        );
        assert!(s.validate().is_ok());
        let trees = SpecBenchSettings {
            drafters: vec!["dflash:d".into()],
            draft_lens: vec![DraftLen::Fixed(7)],
            draft_trees: vec![DraftTree::Off, DraftTree::Max(15)],
            ..s.clone()
        };
        let labels: Vec<String> = trees.modes().iter().map(Mode::label).collect();
        assert_eq!(labels, ["plain", "dflash:d k=7", "dflash:d k=7 tree=15"]);
        assert!(SpecBenchSettings { drafters: vec!["bogus".into()], ..s.clone() }.validate().is_err());
        assert!(SpecBenchSettings { datasets: vec!["nope".into()], ..s }.validate().is_err());
    }
}
