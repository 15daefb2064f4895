//! Structured outputs stay lossless under speculation, on the real SmolLM2-135M: with a JSON
//! schema, any JSON object, a regex and a choice, the constrained greedy output with every
//! drafter (n-gram, SmolLM2 drafting for itself, the shipped DFlash drafter, a random EAGLE-3
//! drafter, and test drafters that propose the answer, random tokens, or the answer with
//! forbidden tokens spliced in) equals constrained greedy decoding without one; sampled
//! outputs always match the grammar.

mod common;

use common::{chi_square, chi_square_critical_001, StochasticDrafter};

use candle_core::Tensor;
use serde_json::{json, Value};
use specula::engine::{generate, EngineModel, GenerateOptions, Generation, LoadedModel};
use specula::grammar::{GrammarCompiler, GrammarSpec};
use specula::model::{ForwardBatch, LogitsRows};
use specula::sample::{SamplerRng, SamplingParams};
use specula::speculative::{build_proposer, Draft, DraftLen, DrafterSpec, Proposer};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::OnceLock;

fn smollm2() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| LoadedModel::load(&common::smollm2_path(), None, &candle_core::Device::Cpu).unwrap())
}

fn compiler() -> &'static GrammarCompiler {
    static C: OnceLock<GrammarCompiler> = OnceLock::new();
    C.get_or_init(|| {
        let m = smollm2();
        GrammarCompiler::new(&m.tokenizer, &m.stop_ids(), m.model.config.vocab).unwrap()
    })
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                       "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
        "required": ["name", "age", "city"],
        "additionalProperties": false,
    })
}

/// (prompt, grammar, a check that the output matches it).
fn cases() -> Vec<(&'static str, GrammarSpec, fn(&str) -> bool)> {
    fn is_person(s: &str) -> bool {
        serde_json::from_str::<Value>(s).is_ok_and(|v| {
            v["name"].is_string()
                && v["age"].is_i64()
                && ["Paris", "London", "Tokyo"].contains(&v["city"].as_str().unwrap_or(""))
                && v.as_object().unwrap().len() == 3
        })
    }
    fn is_object(s: &str) -> bool {
        serde_json::from_str::<Value>(s).is_ok_and(|v| v.is_object())
    }
    fn is_phone(s: &str) -> bool {
        let b = s.as_bytes();
        b.len() == 9 && b[4] == b' ' && b[..4].iter().chain(&b[5..]).all(u8::is_ascii_digit)
    }
    fn is_choice(s: &str) -> bool {
        ["yes", "no", "maybe"].contains(&s)
    }
    vec![
        ("Describe a person who lives in a big city as JSON.", GrammarSpec::JsonSchema(person_schema()), is_person),
        ("List three fruits and their colours as a JSON object.", GrammarSpec::JsonObject, is_object),
        ("Write a made-up phone number.", GrammarSpec::Regex("[0-9]{4} [0-9]{4}".into()), is_phone),
        ("Is the sea salty? Answer yes, no or maybe.", GrammarSpec::Regex("(yes|no|maybe)".into()), is_choice),
    ]
}

fn run(prompt: &[u32], spec: &GrammarSpec, params: SamplingParams, proposer: Option<&mut dyn Proposer>) -> Generation {
    let m = smollm2();
    let pool = m.model.new_kv_pool(2048);
    let opts = GenerateOptions {
        stop_ids: m.stop_ids(),
        draft_len: DraftLen::Fixed(if proposer.is_some() { 4 } else { 0 }),
        constraint: Some(compiler().compile(spec).unwrap()),
        ..GenerateOptions::default()
    };
    let target = EngineModel { model: &m.model, tokenizer: Some(&m.tokenizer) };
    generate(target, &pool, prompt, params, proposer, &opts, &mut |_| {}).unwrap()
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { max_tokens: Some(max_tokens), ..SamplingParams::greedy() }
}

/// Test drafters that know the constrained greedy answer.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// The answer itself: every draft token is accepted.
    Answer,
    /// Uniform random ids: almost all forbidden by the grammar.
    Random,
    /// A right prefix of random length, then a forbidden or wrong token, then the answer.
    Spliced,
}

struct KnowsTheAnswer {
    kind: Kind,
    prompt_len: usize,
    answer: Vec<u32>,
    rng: SamplerRng,
    vocab: u32,
}

impl Proposer for KnowsTheAnswer {
    fn name(&self) -> &str {
        "test"
    }
    fn begin(&mut self, _prompt: &[u32]) -> anyhow::Result<()> {
        Ok(())
    }
    fn observe(&mut self, _tokens: &[u32], _cached: Range<usize>, _taps: &[Tensor]) -> anyhow::Result<()> {
        Ok(())
    }
    fn propose(&mut self, tokens: &[u32], max_len: usize) -> anyhow::Result<Draft> {
        let at = tokens.len() - self.prompt_len;
        let right: Vec<u32> = self.answer.iter().skip(at).take(max_len).copied().collect();
        let mut random = || (self.rng.next_u64() % self.vocab as u64) as u32;
        let draft = match self.kind {
            Kind::Answer => right,
            Kind::Random => (0..max_len).map(|_| random()).collect(),
            Kind::Spliced => {
                let cut = (random() as usize) % (right.len() + 1);
                let mut d = right[..cut].to_vec();
                d.push(random());
                d.extend(self.answer.iter().skip(at + d.len()).take(max_len.saturating_sub(d.len())));
                d.truncate(max_len);
                d
            }
        };
        Ok(Draft::deterministic(draft))
    }
}

/// A finished output matches the grammar whole; one cut by `max_tokens` is a prefix it allows.
fn assert_valid(out: &Generation, spec: &GrammarSpec, matches: fn(&str) -> bool) {
    if out.finish.openai() == "stop" {
        assert!(matches(&out.text), "{spec:?}: {:?} does not match", out.text);
    } else {
        let mut c = compiler().compile(spec).unwrap();
        assert_eq!(c.allowed_prefix(&out.tokens), out.tokens.len(), "{spec:?}: {:?}", out.text);
    }
}

#[test]
fn constrained_greedy_output_is_the_same_with_every_drafter_and_matches_the_grammar() {
    let m = smollm2();
    let eagle_dir = tempfile::tempdir().unwrap();
    let c = &m.model.config;
    common::write_eagle3_drafter(eagle_dir.path(), c.hidden, c.hidden, c.vocab, [1, 14, 26], false, None, 9);
    let shipped_dflash = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("drafters/smollm2-135m-dflash");
    let specs = [
        DrafterSpec::parse("ngram").unwrap(),
        DrafterSpec::DraftModel { model: common::smollm2_path().display().to_string(), settings: Default::default() },
        DrafterSpec::parse(&format!("dflash:{}", shipped_dflash.display())).unwrap(),
        DrafterSpec::parse(&format!("eagle3:{}", eagle_dir.path().display())).unwrap(),
    ];
    let mut accepted = 0;
    for (i, (text, spec, matches)) in cases().into_iter().enumerate() {
        let prompt = m.encode_chat(&[specula::tokenize::ChatMessage::user(text)]).unwrap();
        let plain = run(&prompt, &spec, greedy(48), None);
        assert_valid(&plain, &spec, matches);
        if matches!(spec, GrammarSpec::JsonSchema(_) | GrammarSpec::Regex(_)) {
            assert_eq!(plain.finish.openai(), "stop", "{spec:?}: the grammar should end the output: {:?}", plain.text);
        }
        for drafter in &specs {
            let mut p = build_proposer(drafter, m.target(), specula::speculative::Caller::default()).unwrap();
            let out = run(&prompt, &spec, greedy(48), Some(p.as_mut()));
            assert_eq!(out.tokens, plain.tokens, "{} with {spec:?}", drafter.label());
            accepted += out.metrics.accepted;
        }
        for kind in [Kind::Answer, Kind::Random, Kind::Spliced] {
            let mut p = KnowsTheAnswer {
                kind,
                prompt_len: prompt.len(),
                answer: plain.tokens.clone(),
                rng: SamplerRng::from_seed(i as u64),
                vocab: c.vocab as u32,
            };
            let out = run(&prompt, &spec, greedy(48), Some(&mut p));
            assert_eq!(out.tokens, plain.tokens, "{kind:?} drafter with {spec:?}");
            if matches!(kind, Kind::Answer) && plain.tokens.len() > 2 {
                // Every draft is the answer: one verify step per 4 tokens plus the bonus.
                assert!(out.metrics.accepted > 0, "{spec:?}: the answer's drafts should be accepted");
            }
        }
    }
    assert!(accepted > 0, "the real drafters should get some tokens accepted under the grammars");
}

#[test]
fn sampled_outputs_match_the_grammar_with_and_without_speculation() {
    let m = smollm2();
    for (text, spec, matches) in cases() {
        let prompt = m.encode_chat(&[specula::tokenize::ChatMessage::user(text)]).unwrap();
        for seed in 0..4 {
            let params =
                SamplingParams { temperature: 1.0, seed: Some(seed), max_tokens: Some(64), ..Default::default() };
            let plain = run(&prompt, &spec, params.clone(), None);
            let mut ngram = build_proposer(
                &DrafterSpec::parse("ngram").unwrap(),
                m.target(),
                specula::speculative::Caller::default(),
            )
            .unwrap();
            let spec_out = run(&prompt, &spec, params, Some(ngram.as_mut()));
            assert_valid(&plain, &spec, matches);
            assert_valid(&spec_out, &spec, matches);
        }
    }
}

#[test]
fn bad_grammars_are_refused_with_the_reason() {
    let bad = [
        GrammarSpec::JsonSchema(json!({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})),
        GrammarSpec::Regex("(unclosed".into()),
        GrammarSpec::Lark("start: undefined_rule".into()),
    ];
    for spec in bad {
        let err = compiler().compile(&spec).err().unwrap_or_else(|| panic!("{spec:?} should not compile"));
        assert!(!format!("{err:#}").is_empty());
    }
}

/// The exact distribution of whole constrained outputs (without the stop token that ends
/// them): chains of the masked target rows, one forward per prefix.
fn exact_constrained(prompt: &[u32], spec: &GrammarSpec, params: &SamplingParams) -> HashMap<Vec<u32>, f64> {
    let m = smollm2();
    let stop = m.stop_ids();
    let mut out = HashMap::new();
    let mut stack = vec![(Vec::<u32>::new(), 1.0f64)];
    while let Some((prefix, p)) = stack.pop() {
        if prefix.last().is_some_and(|t| stop.contains(t)) {
            // Outputs leave their stop token out, whichever stop token it was.
            *out.entry(prefix[..prefix.len() - 1].to_vec()).or_default() += p;
            continue;
        }
        if prefix.len() == 8 {
            *out.entry(prefix).or_default() += p;
            continue;
        }
        let pool = m.model.new_kv_pool(prompt.len() + 32);
        let mut cache = pool.new_sequence();
        let input: Vec<u32> = prompt.iter().chain(&prefix).copied().collect();
        let mut batch = ForwardBatch::new();
        batch.push(&input, &mut cache, LogitsRows::Last);
        let mut rows = m.model.forward(&mut batch).unwrap().seq_logits(0).unwrap();
        let mut c = compiler().compile(spec).unwrap();
        c.commit(&prefix).unwrap();
        c.mask_rows(&mut rows, &[]).unwrap();
        for (t, &q) in specula::sample::probabilities(&rows[0], params).iter().enumerate() {
            if q > 1e-9 {
                let mut next = prefix.clone();
                next.push(t as u32);
                stack.push((next, p * q as f64));
            }
        }
    }
    out
}

#[test]
fn constrained_sampling_under_speculation_draws_from_the_masked_target() {
    let m = smollm2();
    let spec = GrammarSpec::Regex("(yes|no|maybe|not sure)".into());
    let prompt =
        m.encode_chat(&[specula::tokenize::ChatMessage::user("Is the sea salty? Answer in one word.")]).unwrap();
    let params = SamplingParams { temperature: 1.0, max_tokens: Some(8), ..Default::default() };
    let exact = exact_constrained(&prompt, &spec, &params);
    // The drafter's q: every token of every possible output (allowed and likely), plus ids the
    // grammar forbids.
    let mut q = vec![0f32; m.model.config.vocab];
    for seq in exact.keys() {
        for &t in seq {
            q[t as usize] = 1.0;
        }
    }
    for t in [100u32, 2000, 30000] {
        q[t as usize] = 1.0;
    }
    let n = 1000;
    let mut counts: HashMap<Vec<u32>, usize> = HashMap::new();
    let mut accepted = 0;
    for seed in 0..n as u64 {
        let mut drafter = StochasticDrafter { rng: SamplerRng::from_seed(1_000_000 + seed), q: q.clone() };
        let params = SamplingParams { seed: Some(seed), ..params.clone() };
        let out = run_k(&prompt, &spec, params, Some(&mut drafter), 2);
        accepted += out.metrics.accepted;
        *counts.entry(out.tokens).or_default() += 1;
    }
    assert!(accepted > 0, "the drafter should get tokens accepted");
    let (stat, df) = chi_square(&counts, &exact, n);
    eprintln!("chi-square {stat:.1} on {df} degrees of freedom over {} outputs", exact.len());
    assert!(df >= 2, "too few outputs to test: {exact:?}");
    assert!(
        stat < chi_square_critical_001(df),
        "chi-square {stat:.1} >= critical {:.1} (df {df})",
        chi_square_critical_001(df)
    );
}

fn run_k(
    prompt: &[u32],
    spec: &GrammarSpec,
    params: SamplingParams,
    proposer: Option<&mut dyn Proposer>,
    k: usize,
) -> Generation {
    let m = smollm2();
    let pool = m.model.new_kv_pool(2048);
    let opts = GenerateOptions {
        stop_ids: m.stop_ids(),
        draft_len: DraftLen::Fixed(k),
        constraint: Some(compiler().compile(spec).unwrap()),
        ..GenerateOptions::default()
    };
    let target = EngineModel { model: &m.model, tokenizer: Some(&m.tokenizer) };
    generate(target, &pool, prompt, params, proposer, &opts, &mut |_| {}).unwrap()
}

#[test]
fn verification_rows_are_masked_in_the_state_after_each_draft_token() {
    let m = smollm2();
    let id = |s: &str| {
        let ids = m.tokenizer.encode(s, false).unwrap();
        assert_eq!(ids.len(), 1, "{s:?} should be one token");
        ids[0]
    };
    let (no, cat) = (id("no"), id("cat"));
    let stop = m.stop_ids();
    let mut c = compiler().compile(&GrammarSpec::Regex("(yes|no)".into())).unwrap();
    let mut rows = vec![vec![0f32; m.model.config.vocab]; 3];
    c.mask_rows(&mut rows, &[no, cat]).unwrap();
    // Row 0: at the start "no" is allowed, "cat" not.
    assert_eq!((rows[0][no as usize], rows[0][cat as usize]), (0.0, f32::NEG_INFINITY));
    // Row 1: after "no" only the end is allowed, with every stop token.
    assert!(stop.iter().all(|&s| rows[1][s as usize] == 0.0));
    assert_eq!(rows[1].iter().filter(|&&l| l == 0.0).count(), stop.len());
    // Row 2 follows a forbidden draft token: the verifier rejects "cat" first, never reads it.
    assert!(rows[2].iter().all(|&l| l == 0.0));
    // The grammar state is where it was.
    assert_eq!(c.allowed_prefix(&[no, cat]), 1);
    assert_eq!(c.allowed_prefix(&[cat]), 0);
}
