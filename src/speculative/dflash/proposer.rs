//! The DFlash proposer: keeps the drafter's context K/V in step with the target's commits and
//! drafts a block per step (spec §3.3).
//!
//! Invariant (the engine's): when `propose(tokens, ..)` runs, the target's cache holds
//! `tokens[..start]` with `start = tokens.len() − 1`, and `observe` has handed over the target's
//! hidden states for exactly those rows. The drafter's cache then holds the context K/V of rows
//! `..start` (or the last `context_window` of them); the anchor `tokens[start]` enters the block,
//! not the context. Block K/V are computed inside each draft and never kept, and `observe` only
//! ever sees committed rows, so no rejected token can leave a trace (spec §3.4).

use super::model::{DflashDrafter, LayerKv, Packing, TargetHead};
use crate::speculative::draft::{best_first_tree, top_candidates, Candidates};
use crate::speculative::nn::RowBuffer;
use crate::speculative::proposer::{DraftCostShape, Proposer};
use crate::speculative::verify::Draft;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor, D};
use std::ops::Range;
use std::sync::Arc;

/// User-settable knobs of a DFlash proposer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DflashSettings {
    /// Block rows B (the anchor plus B − 1 masks). None: the checkpoint's `block_size`.
    pub block_size: Option<usize>,
    /// Propose at most this many of the block's drafts (the block keeps its size). None: all.
    pub max_draft: Option<usize>,
    /// Keep only the last W committed context rows' K/V: bounds the drafter's memory and
    /// per-step cost on long contexts, at the price of drafts that no longer see older context
    /// (they then differ from the reference, which attends to everything). None: unbounded.
    pub context_window: Option<usize>,
}

/// The drafter's per-layer context K/V for rows `end − kept .. end` (absolute positions).
#[derive(Default)]
struct ContextCache {
    layers: Vec<(RowBuffer, RowBuffer)>,
    /// One past the last context row ingested (absolute position).
    end: usize,
    /// Rows held (the last `kept` before `end`).
    kept: usize,
}

impl ContextCache {
    fn clear_at(&mut self, end: usize) {
        self.layers.clear();
        self.end = end;
        self.kept = 0;
    }

    /// Forgets rows at positions `end..`.
    fn truncate(&mut self, end: usize) {
        if end >= self.end {
            return;
        }
        let first = self.end - self.kept;
        if end <= first {
            return self.clear_at(end);
        }
        self.kept = end - first;
        self.end = end;
        for (k, v) in &mut self.layers {
            k.truncate(self.kept);
            v.truncate(self.kept);
        }
    }

    fn append(&mut self, kv: Vec<LayerKv>, rows: usize) -> Result<()> {
        if self.layers.is_empty() {
            self.layers = kv.iter().map(|_| Default::default()).collect();
        }
        for ((k, v), new) in self.layers.iter_mut().zip(&kv) {
            k.append(&new.k)?;
            v.append(&new.v)?;
        }
        self.end += rows;
        self.kept += rows;
        Ok(())
    }

    fn keep_last(&mut self, n: usize) {
        self.kept = self.kept.min(n);
        for (k, v) in &mut self.layers {
            k.keep_last(n);
            v.keep_last(n);
        }
    }

    fn positions(&self) -> Vec<usize> {
        (self.end - self.kept..self.end).collect()
    }
}

pub struct DflashProposer {
    drafter: Arc<DflashDrafter>,
    head: TargetHead,
    settings: DflashSettings,
    cache: ContextCache,
    /// The sequence's prompt, and whether its context rows were handed to the drafter's
    /// [`super::ContextStore`] yet.
    prompt: Vec<u32>,
    prompt_stored: bool,
    /// Committed rows whose target taps arrived but are not projected into the context yet
    /// (contiguous from `cache.end`): projecting waits until a draft is asked for, so a drafter
    /// the policy leaves idle costs nothing per token.
    pending: Vec<(usize, Vec<Tensor>)>,
    /// Draft trees instead of chains ([`Proposer::set_trees`]).
    trees: bool,
}

/// Candidates per block position a draft tree chooses from (measured on SmolLM2's drafter:
/// 2 → τ 2.08, 3 → 2.20, 4 → 2.26, 8 → 2.27 with 15 nodes).
const TREE_CANDIDATES: usize = 4;

impl DflashProposer {
    /// A proposer for one sequence. `head` must come from the target the drafter was checked
    /// against ([`super::DflashConfig::check_target`]).
    pub fn new(drafter: Arc<DflashDrafter>, head: TargetHead, settings: DflashSettings) -> Result<Self> {
        if let Some(b) = settings.block_size {
            if b < 2 {
                bail!("DFlash block size must be at least 2 (the anchor and one mask), got {b}");
            }
        }
        if settings.max_draft == Some(0) {
            bail!("DFlash max_draft must be at least 1");
        }
        if settings.context_window == Some(0) {
            bail!("DFlash context window must be at least 1 row");
        }
        Ok(Self {
            drafter,
            head,
            settings,
            cache: ContextCache::default(),
            prompt: Vec::new(),
            prompt_stored: false,
            pending: Vec::new(),
            trees: false,
        })
    }

    pub fn drafter(&self) -> &DflashDrafter {
        &self.drafter
    }

    /// B: block rows per draft.
    pub fn block_size(&self) -> usize {
        self.settings.block_size.unwrap_or(self.drafter.config.block_size)
    }

    /// Context rows whose K/V the drafter holds, as absolute positions `start..end`.
    pub fn context_rows(&self) -> Range<usize> {
        self.cache.end - self.cache.kept..self.pending_end()
    }

    /// One past the last row handed over (projected or pending).
    fn pending_end(&self) -> usize {
        self.pending.last().map_or(self.cache.end, |(start, taps)| start + taps[0].dim(0).unwrap_or(0))
    }

    /// Projects the pending rows into the context cache, all in one pass.
    fn flush(&mut self) -> Result<usize> {
        if self.pending.is_empty() {
            return Ok(0);
        }
        let pending = std::mem::take(&mut self.pending);
        let start = pending[0].0;
        let taps: Vec<Tensor> = (0..pending[0].1.len())
            .map(|i| {
                let parts: Vec<&Tensor> = pending.iter().map(|(_, t)| &t[i]).collect();
                let layer = self.drafter.config.target_layer_ids[i];
                self.head.hidden_state(layer, &Tensor::cat(&parts, 0)?)
            })
            .collect::<Result<_>>()?;
        let rows = taps[0].dim(0)?;
        let features = self.drafter.context_features(&taps)?;
        let positions: Vec<usize> = (start..start + rows).collect();
        let kv = self.drafter.context_kv(&features, &positions)?;
        self.cache.append(kv, rows)?;
        self.store_prompt_rows()?;
        Ok(rows)
    }

    /// The draft logits `[masks, drafter vocab]` of a block `[tokens.last(), MASK × masks]` at positions
    /// `start..=start + masks` (`start = tokens.len() − 1`) against the context cache: row i
    /// scores the token at `start + 1 + i`.
    pub fn draft_logits(&mut self, tokens: &[u32], masks: usize) -> Result<Tensor> {
        let Some((&anchor, _)) = tokens.split_last() else { bail!("DFlash cannot draft without a committed token") };
        let start = tokens.len() - 1;
        self.flush()?;
        // The anchor's own row (and anything after it) must not be context: defensive, the
        // engine never hands those over before they are committed and cached.
        self.cache.truncate(start);
        let cfg = &self.drafter.config;
        let mut ids = vec![cfg.mask_token_id; masks + 1];
        ids[0] = anchor;
        let mut block = self.head.embed(&ids)?;
        if cfg.input_embedding_scale != 1.0 {
            block = (block * cfg.input_embedding_scale)?;
        }
        let positions: Vec<usize> = (start..=start + masks).collect();
        let context: Vec<LayerKv> = match self.cache.layers.is_empty() {
            true => {
                let empty = Tensor::zeros((cfg.n_kv_heads, 0, cfg.head_dim), DType::F32, self.drafter.device())?;
                vec![LayerKv { k: empty.clone(), v: empty }; cfg.n_layers]
            }
            false => self
                .cache
                .layers
                .iter()
                .map(|(k, v)| Ok(LayerKv { k: k.view(&block)?, v: v.view(&block)? }))
                .collect::<Result<_>>()?,
        };
        let hidden =
            self.drafter.forward_block(&block, &positions, &context, &self.cache.positions(), Packing::ONE_BLOCK)?;
        self.drafter.logits(&self.head, &hidden.narrow(0, 1, masks)?)
    }
}

impl DflashProposer {
    /// Once the drafter holds the context rows of the whole prompt, a copy goes to the
    /// drafter's store, for later requests that share a prefix with it.
    fn store_prompt_rows(&mut self) -> Result<()> {
        let n = self.prompt.len();
        if self.prompt_stored || n == 0 || self.settings.context_window.is_some() {
            return Ok(());
        }
        if self.cache.end < n || self.cache.end > self.cache.kept || self.cache.layers.is_empty() {
            return Ok(());
        }
        let layers = self
            .cache
            .layers
            .iter()
            .map(|(k, v)| {
                let like = k.data().expect("rows were appended");
                Ok(LayerKv { k: k.view(like)?.narrow(1, 0, n)?.copy()?, v: v.view(like)?.narrow(1, 0, n)?.copy()? })
            })
            .collect::<Result<Vec<_>>>()?;
        self.drafter.context_store.put(self.head.embedding(), &self.prompt, layers);
        self.prompt_stored = true;
        Ok(())
    }
}

impl Proposer for DflashProposer {
    fn name(&self) -> &str {
        "dflash"
    }

    fn tap_layers(&self) -> &[usize] {
        &self.drafter.config.target_layer_ids
    }

    fn draft_cost_shape(&self) -> DraftCostShape {
        // One forward over the whole block, whatever length is asked for.
        DraftCostShape::PerDraft
    }

    fn restorable_prefix(&self, prompt: &[u32]) -> usize {
        // A windowed context is not kept whole, so there is nothing to store or restore.
        if self.settings.context_window.is_some() {
            return 0;
        }
        self.drafter.context_store.restorable(self.head.embedding(), prompt)
    }

    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.cache.clear_at(0);
        self.prompt = prompt.to_vec();
        self.prompt_stored = false;
        Ok(())
    }

    fn observe(&mut self, tokens: &[u32], cached: Range<usize>, taps: &[Tensor]) -> Result<()> {
        if cached.is_empty() {
            return Ok(());
        }
        // The first rows the target computed follow a prefix it restored from its cache: the
        // drafter restores its context rows for that prefix from its own store.
        if self.cache.end == 0 && self.pending.is_empty() && cached.start > 0 && self.settings.context_window.is_none()
        {
            if let Some(kv) = self.drafter.context_store.take(self.head.embedding(), tokens, cached.start) {
                self.cache.append(kv, cached.start)?;
            }
        }
        // Rows the engine ran again replace ours; rows that never ran through the target (a
        // restored prefix) have no features, so the context restarts after them (spec §3.7).
        if cached.start < self.cache.end {
            self.pending.clear();
        } else {
            self.pending.retain(|(start, _)| *start < cached.start);
            if let Some((start, taps)) = self.pending.last_mut() {
                let keep = cached.start - *start;
                if taps[0].dim(0)? > keep {
                    *taps = taps.iter().map(|t| t.narrow(0, 0, keep)).collect::<candle_core::Result<_>>()?;
                }
            }
        }
        self.cache.truncate(cached.start);
        if cached.start > self.pending_end() {
            self.pending.clear();
            self.cache.clear_at(cached.start);
        }
        for t in taps {
            if t.rank() != 2 || t.dim(0)? != cached.len() {
                bail!("DFlash: a target tap of shape {:?} for {} cached rows", t.dims(), cached.len());
            }
        }
        if taps.len() != self.drafter.config.target_layer_ids.len() {
            bail!("DFlash needs {} target taps, got {}", self.drafter.config.target_layer_ids.len(), taps.len());
        }
        // Without a window, projecting waits for the next draft (see `pending`).
        if self.settings.context_window.is_none() {
            self.pending.push((cached.start, taps.to_vec()));
            return Ok(());
        }
        // Rows that would fall out of the window right away are not projected at all.
        let skip = self.settings.context_window.map_or(0, |w| cached.len().saturating_sub(w));
        if skip > 0 {
            self.cache.clear_at(cached.start + skip);
        }
        if taps.len() != self.drafter.config.target_layer_ids.len() {
            bail!("DFlash needs {} target taps, got {}", self.drafter.config.target_layer_ids.len(), taps.len());
        }
        let taps: Vec<Tensor> = taps
            .iter()
            .zip(&self.drafter.config.target_layer_ids)
            .map(|(t, &layer)| self.head.hidden_state(layer, &t.narrow(0, skip, cached.len() - skip)?))
            .collect::<Result<_>>()?;
        let features = self.drafter.context_features(&taps)?;
        let positions: Vec<usize> = (cached.start + skip..cached.end).collect();
        let kv = self.drafter.context_kv(&features, &positions)?;
        self.cache.append(kv, positions.len())?;
        if let Some(w) = self.settings.context_window {
            self.cache.keep_last(w);
        }
        self.store_prompt_rows()?;
        Ok(())
    }

    fn pending_catch_up(&self, _tokens: &[u32]) -> usize {
        self.pending_end() - self.cache.end
    }

    fn catch_up(&mut self, _tokens: &[u32]) -> Result<usize> {
        self.flush()
    }

    fn set_trees(&mut self, on: bool) -> bool {
        self.trees = on;
        true
    }

    fn propose(&mut self, tokens: &[u32], max_len: usize) -> Result<Draft> {
        // The block shrinks when fewer drafts are wanted this step, as the reference shrinks its
        // verify block near max_new_tokens; `max_draft` only caps what is proposed.
        let masks = max_len.min(self.block_size() - 1);
        if masks == 0 || tokens.is_empty() {
            return Ok(Draft::default());
        }
        let logits = self.draft_logits(tokens, masks)?;
        if self.trees {
            // The block's per-position distributions do not depend on the tokens drafted
            // before them, so any path through their top candidates is a draft: keep the most
            // probable paths (DDTree's best-first search).
            let depth = masks.min(self.settings.max_draft.unwrap_or(usize::MAX));
            let rows = logits.narrow(0, 0, depth)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let positions: Vec<Candidates> = rows
                .iter()
                .map(|row| top_candidates(row, TREE_CANDIDATES, |id| self.drafter.target_token(id)))
                .collect();
            return Ok(best_first_tree(&positions, max_len, false));
        }
        let mut draft: Vec<u32> =
            logits.argmax(D::Minus1)?.to_vec1::<u32>()?.into_iter().map(|id| self.drafter.target_token(id)).collect();
        draft.truncate(self.settings.max_draft.unwrap_or(usize::MAX));
        Ok(Draft::deterministic(draft))
    }
}
