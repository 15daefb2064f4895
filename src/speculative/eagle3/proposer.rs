//! The EAGLE-3 proposer: a chain drafter. It keeps the drafter's K/V for every committed row
//! (row t pairs token t + 1 with the target's fused states at t), and drafts by running the
//! layer one row at a time on its own outputs.
//!
//! Invariant (the engine's): when `propose(tokens, ..)` runs, the target's cache holds
//! `tokens[..e]` with `e = tokens.len() − 1`, and `observe` has handed over the target's states
//! for exactly those rows. The drafter then holds rows `..e`; the output of row e − 1 (token e
//! with the target's states at e − 1) scores the first draft. Draft rows are appended for the
//! draft only and cut off before `propose` returns, so no rejected token leaves a trace.
//!
//! A sliding-window drafter (speculators' `sliding_attention`, window W) keeps only the last W
//! committed rows: committed rows are run with a windowed causal mask, and a draft chain sees
//! those W rows and its own, as speculators trains it (see `Eagle3Config::window`).

use super::model::Eagle3Drafter;
use crate::speculative::dflash::TargetHead;
use crate::speculative::draft::{expanding_tree, top_candidates, CHAIN_TREE_CANDIDATES, EXPAND_WIDTH};
use crate::speculative::nn::{LayerKv, RowBuffer};
use crate::speculative::proposer::Proposer;
use crate::speculative::verify::Draft;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor, D};
use std::ops::Range;
use std::sync::Arc;

/// User-settable knobs of an EAGLE-3 proposer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Eagle3Settings {
    /// Draft at most this many tokens per step. None: as many as the engine asks for.
    pub max_draft: Option<usize>,
}

pub struct Eagle3Proposer {
    drafter: Arc<Eagle3Drafter>,
    head: TargetHead,
    taps: Vec<usize>,
    settings: Eagle3Settings,
    k: RowBuffer,
    v: RowBuffer,
    /// The drafter holds rows `base..end` (base > 0 only after rows it never saw).
    base: usize,
    end: usize,
    /// The pre-norm output of row `end − 1`.
    last: Option<Tensor>,
    /// Committed rows whose target states arrived but were not run yet (contiguous from `end`):
    /// running them waits for the next draft, so a drafter the policy leaves idle costs nothing.
    pending: Vec<(usize, Vec<Tensor>)>,
    /// Draft trees: EAGLE-2's dynamic expansion ([`Proposer::set_trees`]).
    trees: bool,
}

impl Eagle3Proposer {
    /// A proposer for one sequence; `head` is the target the drafter was checked against, and
    /// `taps` the target layers it fuses.
    pub fn new(
        drafter: Arc<Eagle3Drafter>,
        head: TargetHead,
        taps: Vec<usize>,
        settings: Eagle3Settings,
    ) -> Result<Self> {
        if settings.max_draft == Some(0) {
            bail!("eagle3 max must be at least 1");
        }
        Ok(Self {
            drafter,
            head,
            taps,
            settings,
            k: RowBuffer::default(),
            v: RowBuffer::default(),
            base: 0,
            end: 0,
            last: None,
            pending: Vec::new(),
            trees: false,
        })
    }

    pub fn drafter(&self) -> &Eagle3Drafter {
        &self.drafter
    }

    /// The committed rows whose K/V the drafter holds, as positions.
    pub fn rows(&self) -> Range<usize> {
        self.base..self.end
    }

    fn pending_end(&self) -> usize {
        self.pending.last().map_or(self.end, |(start, taps)| start + taps[0].dim(0).unwrap_or(0))
    }

    fn reset_at(&mut self, at: usize) {
        self.k = RowBuffer::default();
        self.v = RowBuffer::default();
        self.base = at;
        self.end = at;
        self.last = None;
        self.pending.clear();
    }

    fn past(&self) -> Result<LayerKv> {
        let empty = self.drafter.empty_kv()?;
        Ok(LayerKv { k: self.k.view(&empty.k)?, v: self.v.view(&empty.v)? })
    }

    /// Runs the pending rows through the drafter in one pass (they need `tokens[end + 1..]`).
    fn flush(&mut self, tokens: &[u32]) -> Result<usize> {
        if self.pending.is_empty() {
            return Ok(0);
        }
        let start = self.pending[0].0;
        let end = self.pending_end();
        if tokens.len() < end + 1 {
            bail!("EAGLE-3: rows up to {end} were cached but only {} tokens are committed", tokens.len());
        }
        let pending = std::mem::take(&mut self.pending);
        let fused: Vec<Tensor> = (0..self.taps.len())
            .map(|i| {
                let parts: Vec<&Tensor> = pending.iter().map(|(_, t)| &t[i]).collect();
                self.head.hidden_state(self.taps[i], &Tensor::cat(&parts, 0)?)
            })
            .collect::<Result<_>>()?;
        let features = self.drafter.fuse(&Tensor::cat(&fused, 1)?)?;
        let embeds = self.drafter.embed(&tokens[start + 1..end + 1], Some(&self.head))?;
        let positions: Vec<usize> = (start..end).collect();
        let past = self.past()?;
        let window = self.drafter.config.window;
        // The held rows end where the pending ones start, so positions are consecutive.
        let mask = window
            .map(|w| super::model::windowed_causal_mask(past.k.dim(1)?, end - start, w, self.drafter.device()))
            .transpose()?;
        let (out, kv) = self.drafter.forward(&embeds, &features, &positions, &past, mask.as_ref())?;
        self.k.append(&kv.k)?;
        self.v.append(&kv.v)?;
        self.end = end;
        if let Some(w) = window {
            // Nothing after this sees further back than the last W committed rows.
            self.k.keep_last(w);
            self.v.keep_last(w);
            self.base = self.end - self.k.len();
        }
        self.last = Some(out.narrow(0, end - start - 1, 1)?);
        Ok(end - start)
    }

    /// EAGLE-2's dynamic tree ([`expanding_tree`]): each depth runs its most probable nodes
    /// in one pass, every node seeing the committed rows, its own ancestors' draft rows and
    /// itself, at the position of its depth; `last` is the output that scores the first
    /// position. Draft rows are appended to the drafter's cache, which the caller truncates.
    fn expanding_tree(&mut self, e: usize, last: &Tensor, max_nodes: usize, max_depth: usize) -> Result<Draft> {
        let logits = |p: &Self, h: &Tensor| -> Result<Vec<f32>> {
            Ok(p.drafter.logits(h)?.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
        };
        let rank = |p: &Self, l: &[f32]| top_candidates(l, CHAIN_TREE_CANDIDATES, |id| p.drafter.target_token(id));
        let root = rank(self, &logits(self, last)?);
        let held = self.end - self.base;
        // Per node: the output that scored it (its parent's; `last` for the first depth), and
        // once run, its row in the cache.
        let mut scored_by: Vec<Tensor> = vec![last.clone(); root.len()];
        let mut row_of: Vec<Option<usize>> = vec![None; root.len()];
        expanding_tree(max_nodes, max_depth, EXPAND_WIDTH, root, |nodes, chosen| {
            let past = self.past()?;
            let m = past.k.dim(1)?;
            let tokens: Vec<u32> = chosen.iter().map(|&n| nodes[n].token).collect();
            let embeds = self.drafter.embed(&tokens, Some(&self.head))?;
            let features = Tensor::cat(&chosen.iter().map(|&n| &scored_by[n]).collect::<Vec<_>>(), 0)?;
            let positions: Vec<usize> = chosen.iter().map(|&n| e + nodes[n].depth).collect();
            // Row i sees the committed rows, its ancestors' rows and itself.
            let n = chosen.len();
            let mut mask = vec![f32::NEG_INFINITY; n * (m + n)];
            for (i, &node) in chosen.iter().enumerate() {
                let row = &mut mask[i * (m + n)..(i + 1) * (m + n)];
                row[..held].fill(0.0);
                let mut up = nodes[node].parent;
                while let Some(a) = up {
                    if let Some(r) = row_of[a] {
                        row[r] = 0.0;
                    }
                    up = nodes[a].parent;
                }
                row[m + i] = 0.0;
            }
            let mask = Tensor::from_vec(mask, (n, m + n), self.drafter.device())?;
            let (out, kv) = self.drafter.forward(&embeds, &features, &positions, &past, Some(&mask))?;
            self.k.append(&kv.k)?;
            self.v.append(&kv.v)?;
            let mut candidates = Vec::with_capacity(n);
            for (i, &node) in chosen.iter().enumerate() {
                let h = out.narrow(0, i, 1)?;
                let c = rank(self, &logits(self, &h)?);
                row_of.resize(row_of.len().max(nodes.len()), None);
                row_of[node] = Some(m + i);
                // The children this returns are scored by this node's output.
                scored_by.extend(std::iter::repeat_n(h, c.len()));
                candidates.push(c);
            }
            Ok(candidates)
        })
    }
}

impl Proposer for Eagle3Proposer {
    fn name(&self) -> &str {
        "eagle3"
    }

    fn tap_layers(&self) -> &[usize] {
        &self.taps
    }

    fn begin(&mut self, _prompt: &[u32]) -> Result<()> {
        self.reset_at(0);
        Ok(())
    }

    fn observe(&mut self, _tokens: &[u32], cached: Range<usize>, taps: &[Tensor]) -> Result<()> {
        if cached.is_empty() {
            return Ok(());
        }
        if taps.len() != self.taps.len() {
            bail!("EAGLE-3 needs {} target taps, got {}", self.taps.len(), taps.len());
        }
        for t in taps {
            if t.rank() != 2 || t.dim(0)? != cached.len() {
                bail!("EAGLE-3: a target tap of shape {:?} for {} cached rows", t.dims(), cached.len());
            }
        }
        // Rows the engine ran again replace ours.
        if cached.start < self.end {
            if cached.start <= self.base {
                self.reset_at(cached.start);
            } else {
                self.k.truncate(cached.start - self.base);
                self.v.truncate(cached.start - self.base);
                self.end = cached.start;
                self.last = None;
                self.pending.clear();
            }
        } else {
            self.pending.retain(|(start, _)| *start < cached.start);
            if let Some((start, rows)) = self.pending.last_mut() {
                let keep = cached.start - *start;
                if rows[0].dim(0)? > keep {
                    *rows = rows.iter().map(|t| t.narrow(0, 0, keep)).collect::<candle_core::Result<_>>()?;
                }
            }
        }
        // Rows that never ran through the target (a restored prefix) have no states: the
        // drafter's context restarts after them.
        if cached.start > self.pending_end() {
            self.reset_at(cached.start);
        }
        self.pending.push((cached.start, taps.to_vec()));
        Ok(())
    }

    fn pending_catch_up(&self, _tokens: &[u32]) -> usize {
        self.pending_end() - self.end
    }

    fn catch_up(&mut self, tokens: &[u32]) -> Result<usize> {
        self.flush(tokens)
    }

    fn set_trees(&mut self, on: bool) -> bool {
        self.trees = on;
        true
    }

    fn propose(&mut self, tokens: &[u32], max_len: usize) -> Result<Draft> {
        let k = max_len.min(self.settings.max_draft.unwrap_or(usize::MAX));
        if k == 0 || tokens.is_empty() {
            return Ok(Draft::default());
        }
        self.flush(tokens)?;
        let e = tokens.len() - 1;
        let Some(mut h) = self.last.clone().filter(|_| self.end == e) else { return Ok(Draft::default()) };
        let held = self.end - self.base;
        if self.trees {
            let result = self.expanding_tree(e, &h, max_len, k);
            self.k.truncate(held);
            self.v.truncate(held);
            return result;
        }
        let mut draft = Vec::with_capacity(k);
        let result = (|| -> Result<()> {
            for j in 0..k {
                let id = self.drafter.logits(&h)?.argmax(D::Minus1)?.to_vec1::<u32>()?[0];
                let token = self.drafter.target_token(id);
                draft.push(token);
                if j + 1 == k {
                    break;
                }
                let embeds = self.drafter.embed(&[token], Some(&self.head))?;
                let (out, kv) = self.drafter.forward(&embeds, &h, &[e + j], &self.past()?, None)?;
                self.k.append(&kv.k)?;
                self.v.append(&kv.v)?;
                h = out;
            }
            Ok(())
        })();
        // Draft rows never outlive the draft.
        self.k.truncate(held);
        self.v.truncate(held);
        result?;
        Ok(Draft::deterministic(draft))
    }
}
