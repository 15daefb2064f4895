//! Two drafters in one (`--drafter A+B`): each step A drafts first, and B drafts only when A
//! proposes nothing. Prompt lookup is the natural A: free to run, and right most of the time
//! when it finds a match, but it finds none on much of what a model writes; a learned drafter
//! (DFlash, EAGLE-3) as B drafts those steps instead of leaving them plain.
//!
//! Both drafters see every step (`begin`, `observe`), so B's context is complete whenever it is
//! asked for a draft. B catches up on the steps it missed only when it is asked to draft: DFlash
//! projects the waiting target hidden states in one pass then, so the steps A drafts cost B
//! nothing but keeping the taps (a draft model would otherwise feed every committed token
//! through itself on every step). A catch-up B reports ([`Proposer::pending_catch_up`], a draft
//! model's) runs in the engine's catch-up before B drafts, so it is timed as catching up and
//! priced as such: folded into B's drafting time, the prompt a draft model first feeds priced
//! it out of every later step.
//!
//! Before each step the engine asks which of the two will draft ([`Proposer::next_source`]:
//! B exactly when A knows it has nothing, as lookup does), and its draft-length policy prices
//! each drafter on its own acceptance and cost. Where A has a draft, B is the alternative
//! ([`Proposer::alternative_source`]): the planner compares the two drafters' expected gains
//! and names the one that drafts ([`Proposer::select_source`]). The sources of A (a drafter
//! may present several, as suffix decoding does by match length) come first, then B's.

use super::proposer::{DraftCostShape, Proposer};
use super::verify::Draft;
use anyhow::Result;
use candle_core::Tensor;
use std::ops::Range;

pub struct CombinedProposer<'a> {
    first: Box<dyn Proposer + 'a>,
    then: Box<dyn Proposer + 'a>,
    name: String,
    /// `first`'s tap layers followed by `then`'s: the engine hands over one tensor per entry,
    /// in this order, so `observe` splits them at `first`'s count.
    taps: Vec<usize>,
    /// Drafts made by each so far (for callers that inspect the proposer afterwards).
    pub drafts_by_first: u64,
    pub drafts_by_then: u64,
    /// The planner chose B for the next draft although A has one.
    then_chosen: bool,
    /// Whether B drafts next because A has nothing, as A said when the engine asked for the
    /// next source (None: not asked since the last draft, as at a fixed draft length).
    then_next: Option<bool>,
}

impl<'a> CombinedProposer<'a> {
    pub fn new(first: Box<dyn Proposer + 'a>, then: Box<dyn Proposer + 'a>) -> Self {
        let name = format!("{}+{}", first.name(), then.name());
        let taps = first.tap_layers().iter().chain(then.tap_layers()).copied().collect();
        Self { first, then, name, taps, drafts_by_first: 0, drafts_by_then: 0, then_chosen: false, then_next: None }
    }
}

impl Proposer for CombinedProposer<'_> {
    fn name(&self) -> &str {
        &self.name
    }

    fn tap_layers(&self) -> &[usize] {
        &self.taps
    }

    fn draft_cost_shape(&self) -> DraftCostShape {
        // What drafting costs is the second drafter's: a lookup is free.
        self.then.draft_cost_shape()
    }

    fn sources(&self) -> usize {
        self.first.sources() + self.then.sources()
    }

    fn source_cost_shape(&self, source: usize) -> DraftCostShape {
        match source.checked_sub(self.first.sources()) {
            None => self.first.source_cost_shape(source),
            Some(s) => self.then.source_cost_shape(s),
        }
    }

    // Where A cannot tell without drafting, its drafts and B's count as A's.
    fn next_source(&mut self, tokens: &[u32]) -> usize {
        self.then_chosen = false;
        let then_next = self.first.has_draft(tokens) == Some(false);
        self.then_next = Some(then_next);
        if then_next {
            self.first.sources() + self.then.next_source(tokens)
        } else {
            self.first.next_source(tokens)
        }
    }

    fn alternative_source(&mut self, tokens: &[u32]) -> Option<usize> {
        (self.first.has_draft(tokens) == Some(true)).then(|| self.first.sources() + self.then.next_source(tokens))
    }

    fn select_source(&mut self, source: usize) {
        self.then_chosen = source >= self.first.sources();
    }

    fn has_draft(&mut self, tokens: &[u32]) -> Option<bool> {
        match self.first.has_draft(tokens) {
            Some(false) => self.then.has_draft(tokens),
            known => known,
        }
    }

    fn restorable_prefix(&self, prompt: &[u32]) -> usize {
        self.first.restorable_prefix(prompt).min(self.then.restorable_prefix(prompt))
    }

    fn set_trees(&mut self, on: bool) -> bool {
        let first = self.first.set_trees(on);
        self.then.set_trees(on) || first
    }

    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.first.begin(prompt)?;
        self.then.begin(prompt)
    }

    fn observe(&mut self, tokens: &[u32], cached: Range<usize>, taps: &[Tensor]) -> Result<()> {
        // No taps at all: nothing was asked of the forward (a step with no rows to cache).
        let split = self.first.tap_layers().len().min(taps.len());
        self.first.observe(tokens, cached.clone(), &taps[..split])?;
        self.then.observe(tokens, cached, &taps[split..])
    }

    fn propose(&mut self, tokens: &[u32], max_len: usize) -> Result<Draft> {
        self.then_next = None;
        if std::mem::take(&mut self.then_chosen) && max_len > 0 {
            let draft = self.then.propose(tokens, max_len)?;
            self.drafts_by_then += u64::from(!draft.tokens.is_empty());
            return Ok(draft);
        }
        let draft = self.first.propose(tokens, max_len)?;
        if !draft.tokens.is_empty() || max_len == 0 {
            self.drafts_by_first += u64::from(!draft.tokens.is_empty());
            return Ok(draft);
        }
        let draft = self.then.propose(tokens, max_len)?;
        self.drafts_by_then += u64::from(!draft.tokens.is_empty());
        Ok(draft)
    }

    // The engine catches up before every draft, and most steps are A's: B's catching up waits
    // for a step B drafts: the one `next_source`/`select_source` named (what the planner
    // prices), else, where nothing was named, the one A's lookup leaves to B.
    fn pending_catch_up(&self, tokens: &[u32]) -> usize {
        let then =
            if self.then_next == Some(true) || self.then_chosen { self.then.pending_catch_up(tokens) } else { 0 };
        self.first.pending_catch_up(tokens) + then
    }

    fn catch_up(&mut self, tokens: &[u32]) -> Result<usize> {
        let first = self.first.catch_up(tokens)?;
        // A's lookup again only where `next_source` did not run it this step (a suffix
        // drafter's builds a draft).
        let then_drafts =
            self.then_chosen || self.then_next.unwrap_or_else(|| self.first.has_draft(tokens) == Some(false));
        Ok(first + if then_drafts { self.then.catch_up(tokens)? } else { 0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use std::sync::{Arc, Mutex};

    /// A drafter that proposes a fixed draft and records what it was told.
    struct Scripted {
        name: &'static str,
        taps: Vec<usize>,
        draft: Vec<u32>,
        log: Arc<Mutex<Vec<String>>>,
        /// Tokens it reports it must catch up on before drafting.
        pending: usize,
    }

    impl Proposer for Scripted {
        fn name(&self) -> &str {
            self.name
        }
        fn tap_layers(&self) -> &[usize] {
            &self.taps
        }
        fn begin(&mut self, prompt: &[u32]) -> Result<()> {
            self.log.lock().unwrap().push(format!("{} begin {}", self.name, prompt.len()));
            Ok(())
        }
        fn observe(&mut self, _tokens: &[u32], cached: Range<usize>, taps: &[Tensor]) -> Result<()> {
            let widths: Vec<usize> = taps.iter().map(|t| t.dim(1).unwrap()).collect();
            self.log.lock().unwrap().push(format!("{} observe {cached:?} {widths:?}", self.name));
            Ok(())
        }
        fn propose(&mut self, _tokens: &[u32], max_len: usize) -> Result<Draft> {
            self.log.lock().unwrap().push(format!("{} propose {max_len}", self.name));
            Ok(Draft::deterministic(self.draft.iter().copied().take(max_len).collect()))
        }
        fn pending_catch_up(&self, _tokens: &[u32]) -> usize {
            self.pending
        }
        fn catch_up(&mut self, _tokens: &[u32]) -> Result<usize> {
            self.log.lock().unwrap().push(format!("{} catch up {}", self.name, self.pending));
            Ok(std::mem::take(&mut self.pending))
        }
    }

    fn pair(first: Vec<u32>, then: Vec<u32>) -> (CombinedProposer<'static>, Arc<Mutex<Vec<String>>>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let a = Scripted { name: "a", taps: vec![], draft: first, log: log.clone(), pending: 0 };
        let b = Scripted { name: "b", taps: vec![3, 7], draft: then, log: log.clone(), pending: 0 };
        (CombinedProposer::new(Box::new(a), Box::new(b)), log)
    }

    #[test]
    fn the_second_drafts_only_when_the_first_has_nothing() {
        let (mut p, log) = pair(vec![1, 2, 3], vec![9, 9]);
        assert_eq!(p.name(), "a+b");
        assert_eq!(p.propose(&[5], 2).unwrap().tokens, [1, 2]);
        assert_eq!(log.lock().unwrap().as_slice(), ["a propose 2"]);
        let (mut p, log) = pair(vec![], vec![9, 8, 7]);
        assert_eq!(p.propose(&[5], 2).unwrap().tokens, [9, 8]);
        assert_eq!(log.lock().unwrap().as_slice(), ["a propose 2", "b propose 2"]);
        assert_eq!((p.drafts_by_first, p.drafts_by_then), (0, 1));
        // Nothing asked for: neither drafts.
        assert!(p.propose(&[5], 0).unwrap().tokens.is_empty());
        assert_eq!(log.lock().unwrap().len(), 3);
    }

    #[test]
    fn says_which_drafter_drafts_next() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let lookup = crate::speculative::ngram::NgramProposer::new(1, 3).unwrap();
        let b = Scripted { name: "b", taps: vec![], draft: vec![9], log: log.clone(), pending: 0 };
        let mut p = CombinedProposer::new(Box::new(lookup), Box::new(b));
        assert_eq!(p.sources(), 2);
        assert_eq!(p.source_cost_shape(0), DraftCostShape::PerToken);
        // 7 occurred before, followed by 8: lookup drafts.
        let matching = [7, 8, 5, 7];
        p.begin(&matching).unwrap();
        assert_eq!((p.next_source(&matching), p.has_draft(&matching)), (0, Some(true)));
        assert_eq!(p.propose(&matching, 2).unwrap().tokens, [8, 5]);
        // No earlier 6: the second drafts, and what it can tell is all that is known.
        let fresh = [7, 8, 5, 7, 8, 6];
        assert_eq!((p.next_source(&fresh), p.has_draft(&fresh)), (1, None));
        assert_eq!(p.propose(&fresh, 2).unwrap().tokens, [9]);
        // A first drafter that cannot tell ahead: its steps and the second's count as its own.
        let (mut p, _) = pair(vec![], vec![9]);
        assert_eq!(p.next_source(&fresh), 0);
    }

    #[test]
    fn both_see_every_step_and_each_gets_its_own_taps() {
        let (mut p, log) = pair(vec![], vec![]);
        assert_eq!(p.tap_layers(), [3, 7]);
        p.begin(&[1, 2, 3]).unwrap();
        let taps = [
            Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap(),
            Tensor::zeros((2, 6), DType::F32, &Device::Cpu).unwrap(),
        ];
        p.observe(&[1, 2, 3], 0..2, &taps).unwrap();
        assert_eq!(
            log.lock().unwrap().as_slice(),
            ["a begin 3", "b begin 3", "a observe 0..2 []", "b observe 0..2 [4, 6]"]
        );
    }

    #[test]
    fn the_second_catches_up_in_the_engines_catch_up_only_when_it_drafts_next() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let lookup = crate::speculative::ngram::NgramProposer::new(1, 3).unwrap();
        let b = Scripted { name: "b", taps: vec![], draft: vec![9], log: log.clone(), pending: 40 };
        let mut p = CombinedProposer::new(Box::new(lookup), Box::new(b));
        // Lookup has a match and drafts: the second's catching up waits.
        let matching = [7, 8, 5, 7];
        p.begin(&matching).unwrap();
        assert_eq!(p.next_source(&matching), 0);
        assert_eq!((p.pending_catch_up(&matching), p.catch_up(&matching).unwrap()), (0, 0));
        // The planner chose the second although lookup has a draft: it catches up first.
        p.select_source(1);
        assert_eq!((p.pending_catch_up(&matching), p.catch_up(&matching).unwrap()), (40, 40));
        assert_eq!(p.propose(&matching, 2).unwrap().tokens, [9]);
        assert_eq!(log.lock().unwrap().as_slice(), ["b begin 4", "b catch up 40", "b propose 2"]);
        // No match: the second drafts, after catching up on what it missed.
        let lookup = crate::speculative::ngram::NgramProposer::new(1, 3).unwrap();
        let b = Scripted { name: "b", taps: vec![], draft: vec![9], log, pending: 12 };
        let mut p = CombinedProposer::new(Box::new(lookup), Box::new(b));
        let fresh = [7, 8, 5, 6];
        p.begin(&fresh).unwrap();
        assert_eq!(p.next_source(&fresh), 1);
        assert_eq!((p.pending_catch_up(&fresh), p.catch_up(&fresh).unwrap()), (12, 12));
        assert_eq!(p.propose(&fresh, 2).unwrap().tokens, [9]);
    }
}
