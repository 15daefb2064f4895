//! Draft-model proposer: a smaller model with the same tokenizer, drafting autoregressively.
//!
//! The drafter keeps its own paged KV cache over a prefix of the committed tokens. On
//! `propose` it first catches up (feeds the committed tokens it has not seen, in one forward),
//! then drafts greedily, one token per forward. The last draft token is never fed: if the
//! target accepted it, the next draft's first forward feeds it along with the target's token.
//! On `observe` it truncates its cache to the longest prefix it shares with the committed
//! tokens, so no rejected draft token survives.
//!
//! Drafts are greedy (deterministic, `probs` None) at every temperature: the verifier treats
//! them as one-hot, which keeps sampling exact, and greedy drafts are accepted more often than
//! sampled ones.
//!
//! [`DraftModelSettings`] load the draft model in another weight format or with its head cut
//! to the first N token ids, which makes each drafted token cheaper.

use super::draft::{chain_with_alternatives, top_candidates, CHAIN_TREE_CANDIDATES};
use super::proposer::Proposer;
use super::verify::Draft;
use crate::kv::{PoolExhausted, SeqCache};
use crate::model::{ForwardBatch, LogitsRows, Transformer, WeightFormat};
use crate::tokenize::Tokenizer;
use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use std::ops::Range;
use std::sync::Arc;

/// Rows per catch-up forward (a long prompt is fed in chunks like a prefill).
const CATCH_UP_CHUNK: usize = 512;

/// Pending tokens that `propose` feeds in its first forward, with the last committed token,
/// instead of `catch_up` feeding them in a forward of their own: a forward of a few rows costs
/// about what one row costs, and after a draft accepted in full one token (the last draft
/// token, never fed) is pending. Feeding it alone cost a whole draft-model forward on every
/// such step.
const FOLDED_ROWS: usize = 4;

pub struct DraftModelProposer {
    model: Arc<Transformer>,
    cache: SeqCache,
    /// The tokens whose K/V `cache` holds (`cache.len() == fed.len()`).
    fed: Vec<u32>,
    /// Draft tokens past which the target's generation ends (not drafted beyond).
    stop_ids: Vec<u32>,
    /// Draft trees: runner-ups at each position as leaves ([`Proposer::set_trees`]).
    trees: bool,
}

impl DraftModelProposer {
    /// A drafter over `model` with its own KV pool of `kv_tokens` tokens. `stop_ids`: tokens
    /// that end generation; drafting stops after proposing one.
    pub fn new(model: Arc<Transformer>, kv_tokens: usize, stop_ids: Vec<u32>) -> Self {
        let pool = model.new_kv_pool(kv_tokens.max(16));
        Self { cache: pool.new_sequence(), model, fed: Vec::new(), stop_ids, trees: false }
    }

    /// The tokens whose K/V the drafter's cache holds: always a prefix of the committed
    /// tokens after `observe`, followed by its own draft tokens during `propose`.
    pub fn cached_tokens(&self) -> &[u32] {
        &self.fed
    }

    /// Forgets everything after the first `len` fed tokens.
    fn truncate(&mut self, len: usize) {
        self.fed.truncate(len);
        self.cache.truncate(len);
    }

    /// Feeds `tokens` on top of the cache, returning the logits of the last one (when `logits`).
    fn feed(&mut self, tokens: &[u32], logits: bool) -> Result<Option<Vec<f32>>> {
        let mut last = None;
        for chunk in tokens.chunks(CATCH_UP_CHUNK) {
            let is_last = logits && chunk.as_ptr_range().end == tokens.as_ptr_range().end;
            let mut batch = ForwardBatch::new();
            batch.push(chunk, &mut self.cache, if is_last { LogitsRows::Last } else { LogitsRows::None });
            let out = self.model.forward(&mut batch)?;
            self.fed.extend_from_slice(chunk);
            if is_last {
                last = out.seq_logits(0)?.pop();
            }
        }
        if logits && last.is_none() {
            bail!("draft model returned no logits");
        }
        Ok(last)
    }

    /// Committed tokens to keep (the prefix the cache shares with `tokens`), always re-feeding
    /// at least the last one: its logits give the first draft token.
    fn shared_prefix(&self, tokens: &[u32]) -> usize {
        common_prefix(&self.fed, tokens).min(tokens.len().saturating_sub(1))
    }

    /// The chain's tree: its runner-ups at each position as leaves. Drafting stops after a
    /// stop token, as the chain does.
    fn draft_tree(&mut self, tokens: &[u32], max_nodes: usize) -> Result<Draft> {
        let shared = self.shared_prefix(tokens);
        self.truncate(shared);
        let ctx = self.model.config.context_len;
        let mut stopped = false;
        chain_with_alternatives(max_nodes, max_nodes, |best| {
            let logits = match best {
                None => self.feed(&tokens[shared..], true)?.unwrap_or_default(),
                Some(t) if self.stop_ids.contains(&t) || self.fed.len() + 1 >= ctx => {
                    stopped = true;
                    Vec::new()
                }
                Some(t) => self.feed(&[t], true)?.unwrap_or_default(),
            };
            Ok(if stopped { Vec::new() } else { top_candidates(&logits, CHAIN_TREE_CANDIDATES, |id| id) })
        })
    }

    fn draft(&mut self, tokens: &[u32], max_len: usize) -> Result<Vec<u32>> {
        // Keep the shared prefix, but always re-feed at least the last committed token: its
        // logits give the first draft token.
        let shared = self.shared_prefix(tokens);
        self.truncate(shared);
        let mut logits = self.feed(&tokens[shared..], true)?.unwrap_or_default();
        let mut draft = Vec::with_capacity(max_len);
        loop {
            let next = crate::sample::argmax(&logits);
            draft.push(next);
            if draft.len() == max_len || self.stop_ids.contains(&next) {
                return Ok(draft);
            }
            logits = self.feed(&[next], true)?.unwrap_or_default();
        }
    }
}

/// `draft-model:MODEL[,weights=FORMAT][,vocab=N]`: how the draft model is loaded. Drafting
/// reads the whole draft model once per drafted token, so its bytes set its cost; the verifier
/// checks every draft, so neither changes what the target writes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DraftModelSettings {
    /// Weight format in memory (`--weights`' values); None: the file's measured default.
    pub weights: Option<WeightFormat>,
    /// Draft only the first N token ids: the LM head keeps those rows
    /// ([`Transformer::keep_head_rows`]). None: the whole vocabulary.
    pub vocab: Option<usize>,
}

impl DraftModelSettings {
    /// What tells two loads of one file apart (empty for the default).
    pub fn variant(&self) -> String {
        label_settings(self)
    }
}

/// `MODEL[,weights=FORMAT][,vocab=N]` → the model (a key or a path) and its settings.
pub fn parse_drafter_arg(arg: &str) -> Result<(String, DraftModelSettings)> {
    let mut settings = DraftModelSettings::default();
    let mut model = arg;
    while let Some((head, last)) = model.rsplit_once(',') {
        let Some((key, value)) = last.split_once('=') else { break };
        let value = value.trim();
        match key.trim() {
            "weights" => {
                let format = WeightFormat::parse(value)?;
                if settings.weights.replace(format).is_some() {
                    bail!("draft-model setting `weights` given twice");
                }
            }
            "vocab" => {
                let n = value.parse::<usize>().ok().filter(|&n| n >= 1).with_context(|| {
                    format!("draft-model setting `vocab` needs a positive whole number, got `{value}`")
                })?;
                if settings.vocab.replace(n).is_some() {
                    bail!("draft-model setting `vocab` given twice");
                }
            }
            _ => break,
        }
        model = head;
    }
    if model.is_empty() {
        bail!("draft-model needs a model: --drafter draft-model:KEY|PATH[,weights=FORMAT][,vocab=N]");
    }
    Ok((model.to_string(), settings))
}

/// `,weights=…,vocab=…` as written back for labels (settings in a fixed order).
fn label_settings(settings: &DraftModelSettings) -> String {
    let mut label = String::new();
    if let Some(format) = settings.weights {
        label.push_str(&format!(",weights={}", format.name()));
    }
    if let Some(n) = settings.vocab {
        label.push_str(&format!(",vocab={n}"));
    }
    label
}

/// `draft-model:MODEL,...` for tables and logs.
pub fn drafter_label(model: &str, settings: &DraftModelSettings) -> String {
    format!("draft-model:{model}{}", label_settings(settings))
}

/// Length of the longest common prefix.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Proposer for DraftModelProposer {
    fn name(&self) -> &str {
        "draft-model"
    }

    fn set_trees(&mut self, on: bool) -> bool {
        self.trees = on;
        true
    }

    fn begin(&mut self, _prompt: &[u32]) -> Result<()> {
        // The prompt is fed lazily by the first propose, so a request that never drafts
        // (draft length 0) costs the drafter nothing.
        self.truncate(0);
        Ok(())
    }

    fn observe(&mut self, tokens: &[u32], _cached: Range<usize>, _taps: &[Tensor]) -> Result<()> {
        let shared = common_prefix(&self.fed, tokens);
        self.truncate(shared);
        Ok(())
    }

    fn pending_catch_up(&self, tokens: &[u32]) -> usize {
        match tokens.len().saturating_sub(1) - self.shared_prefix(tokens) {
            n if n <= FOLDED_ROWS => 0,
            n => n,
        }
    }

    fn catch_up(&mut self, tokens: &[u32]) -> Result<usize> {
        let shared = self.shared_prefix(tokens);
        let end = tokens.len().saturating_sub(1);
        if end <= shared + FOLDED_ROWS || end > self.model.config.context_len {
            return Ok(0);
        }
        self.truncate(shared);
        match self.feed(&tokens[shared..end], false) {
            Ok(_) => Ok(end - shared),
            // The drafter's pool is full: `propose` drafts nothing then.
            Err(e) if e.is::<PoolExhausted>() => Ok(0),
            Err(e) => Err(e),
        }
    }

    fn propose(&mut self, tokens: &[u32], max_len: usize) -> Result<Draft> {
        let ctx = self.model.config.context_len;
        if max_len == 0 || tokens.is_empty() || tokens.len() + max_len > ctx {
            return Ok(Draft::default());
        }
        let draft = if self.trees {
            self.draft_tree(tokens, max_len)
        } else {
            self.draft(tokens, max_len).map(Draft::deterministic)
        };
        match draft {
            Ok(draft) => Ok(draft),
            // The drafter's own pool is full: draft nothing rather than fail the request.
            // Whatever was fed stays consistent (a failed forward changes no cache).
            Err(e) if e.is::<PoolExhausted>() => Ok(Draft::default()),
            Err(e) => Err(e),
        }
    }
}

/// Checks that a draft model's vocabulary is the target's: same size, same special ids, same
/// text for every token. The first difference is the error.
pub fn check_vocab_compatible(target: &Tokenizer, draft: &Tokenizer) -> Result<()> {
    if target.vocab_size() != draft.vocab_size() {
        bail!("vocabulary sizes differ: target {} tokens, draft {}", target.vocab_size(), draft.vocab_size());
    }
    let specials = [
        ("BOS", target.bos_id(), draft.bos_id()),
        ("EOS", target.eos_id(), draft.eos_id()),
        ("end-of-turn", target.eot_id(), draft.eot_id()),
    ];
    for (name, t, d) in specials {
        if t != d {
            bail!("{name} token ids differ: target {t:?}, draft {d:?}");
        }
    }
    if target.stop_ids() != draft.stop_ids() {
        bail!("stop token ids differ: target {:?}, draft {:?}", target.stop_ids(), draft.stop_ids());
    }
    for id in 0..target.vocab_size() as u32 {
        let (t, d) = (target.token_text(id), draft.token_text(id));
        if t != d {
            bail!("token {id} differs: target {:?}, draft {:?}", t.unwrap_or(""), d.unwrap_or(""));
        }
    }
    Ok(())
}
