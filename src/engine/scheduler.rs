//! Continuous-batching scheduler: which sequences run in the next step, with how many rows.
//!
//! Two queues, both in arrival order: `waiting` (not started, or preempted) and `running`
//! (holding KV blocks). Every step has a row budget, spent in this order:
//! 1. one row for every decoding sequence (its pending token). When the pool cannot hold
//!    those rows, the newest running sequence is preempted: its KV cache is dropped and it
//!    goes back to the front of `waiting`, to be recomputed later from its committed tokens;
//! 2. draft tokens for decoding sequences, where speculation pays (see [`crate::speculative::planner`]);
//! 3. prefill chunks of running sequences still prefilling (chunked prefill);
//! 4. admission of waiting sequences, strictly first come first served (the queue head
//!    blocks the ones behind it), when the whole prompt fits in the free blocks.
//!
//! Invariant: every running sequence arrived before every waiting one, so FIFO order is
//! global and the newest running sequence is always the preemption victim.

use crate::speculative::planner::{allocate_drafts, DraftBid};
use crate::speculative::StepCost;
use std::collections::VecDeque;

/// What the scheduler needs to know about a sequence.
pub trait SchedSeq {
    /// Tokens whose K/V are in the cache.
    fn cached(&self) -> usize;
    /// Committed tokens (prompt and output); `total - cached` are pending.
    fn total(&self) -> usize;
    /// KV blocks the sequence holds.
    fn blocks_held(&self) -> usize;
    /// Drops the sequence's KV cache (preemption); its committed tokens stay.
    fn release_kv(&mut self);
    /// Its draft wish for this step, asked only while it is decoding.
    fn draft_bid(&self) -> DraftBid {
        DraftBid::default()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Rows (new tokens) per forward.
    pub step_tokens: usize,
    /// Sequences in the running batch at most.
    pub max_running: usize,
    /// Tokens per KV block.
    pub block_size: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotKind {
    /// The pending token plus `draft` draft tokens; logits for every row.
    Decode { draft: usize },
    /// A chunk of pending tokens; `last` = it reaches the last committed token, whose logits
    /// give the next token.
    Prefill { last: bool },
}

/// One sequence's part of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Index into `running` (after this step's admissions).
    pub index: usize,
    /// Pending tokens fed (drafts not counted).
    pub rows: usize,
    pub kind: SlotKind,
}

/// The plan of one step.
#[derive(Debug)]
pub struct StepPlan<T> {
    /// In `running` order.
    pub slots: Vec<Slot>,
    /// Indices into `running` of sequences admitted this step (new or recomputing).
    pub admitted: Vec<usize>,
    /// Sequences preempted this step (now at the front of `waiting`).
    pub preempted: usize,
    /// Waiting sequences that cannot fit even in an empty pool: removed, for the caller to end.
    pub unfittable: Vec<T>,
}

impl<T> StepPlan<T> {
    pub fn rows(&self) -> usize {
        self.slots.iter().map(|s| s.rows + if let SlotKind::Decode { draft } = s.kind { draft } else { 0 }).sum()
    }
}

pub struct Scheduler<T> {
    config: SchedulerConfig,
    pub waiting: VecDeque<T>,
    pub running: Vec<T>,
}

impl<T: SchedSeq> Scheduler<T> {
    pub fn new(mut config: SchedulerConfig) -> Self {
        config.step_tokens = config.step_tokens.max(1);
        config.block_size = config.block_size.max(1);
        // Every running sequence must be able to decode in every step.
        config.max_running = config.max_running.clamp(1, config.step_tokens);
        Self { config, waiting: VecDeque::new(), running: Vec::new() }
    }

    pub fn config(&self) -> SchedulerConfig {
        self.config
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Plans the next step given the pool's free and total blocks. `costs` enables drafts.
    pub fn schedule(&mut self, free_blocks: usize, total_blocks: usize, costs: Option<&StepCost>) -> StepPlan<T> {
        let mut preempted = 0;
        let mut unfittable = Vec::new();
        let mut free = free_blocks;
        loop {
            let plan = self.plan_once(&mut free, total_blocks, costs, &mut preempted, &mut unfittable);
            // Nothing could run although sequences hold blocks (every one of them is stuck
            // prefilling with no block to grow into): free the newest and plan again.
            if plan.0.is_empty() && !self.running.is_empty() {
                self.preempt_newest(&mut free);
                preempted += 1;
                continue;
            }
            return StepPlan { slots: plan.0, admitted: plan.1, preempted, unfittable };
        }
    }

    fn preempt_newest(&mut self, free: &mut usize) {
        if let Some(mut victim) = self.running.pop() {
            *free += victim.blocks_held();
            victim.release_kv();
            self.waiting.push_front(victim);
        }
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.config.block_size)
    }

    fn plan_once(
        &mut self,
        free: &mut usize,
        total_blocks: usize,
        costs: Option<&StepCost>,
        preempted: &mut usize,
        unfittable: &mut Vec<T>,
    ) -> (Vec<Slot>, Vec<usize>) {
        let bs = self.config.block_size;
        let decoding = |s: &T| s.total() - s.cached() == 1;

        // 1. Decode rows, preempting the newest sequences until they fit.
        loop {
            let need: usize = self
                .running
                .iter()
                .filter(|s| decoding(s))
                .map(|s| self.blocks_for(s.cached() + 1).saturating_sub(s.blocks_held()))
                .sum();
            if need <= *free || self.running.is_empty() {
                break;
            }
            self.preempt_newest(free);
            *preempted += 1;
        }
        let mut rows_left = self.config.step_tokens;
        let mut slots = Vec::new();
        let mut decode_idx = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if decoding(s) {
                *free -= self.blocks_for(s.cached() + 1).saturating_sub(s.blocks_held());
                rows_left -= 1;
                decode_idx.push(i);
                slots.push(Slot { index: i, rows: 1, kind: SlotKind::Decode { draft: 0 } });
            }
        }

        // 2. Drafts, where they pay (or are asked for exactly) and fit.
        {
            let bids: Vec<DraftBid> = decode_idx.iter().map(|&i| self.running[i].draft_bid()).collect();
            if bids.iter().any(|b| b.max_len > 0) {
                let blocks_for = |tokens: usize| tokens.div_ceil(bs);
                // Blocks each decoding sequence will hold this step, growing with its draft.
                let mut planned: Vec<usize> = decode_idx
                    .iter()
                    .map(|&i| self.running[i].blocks_held().max(blocks_for(self.running[i].cached() + 1)))
                    .collect();
                let cached: Vec<usize> = decode_idx.iter().map(|&i| self.running[i].cached()).collect();
                let mut can_grow = |j: usize, k: usize| {
                    let need = blocks_for(cached[j] + 1 + k).saturating_sub(planned[j]);
                    if rows_left == 0 || need > *free {
                        return false;
                    }
                    rows_left -= 1;
                    *free -= need;
                    planned[j] += need;
                    true
                };
                let lens = allocate_drafts(costs, &bids, &mut can_grow);
                for (slot, k) in slots.iter_mut().zip(lens) {
                    slot.kind = SlotKind::Decode { draft: k };
                }
            }
        }

        // 3. Prefill chunks of running sequences, oldest first.
        for (i, s) in self.running.iter().enumerate() {
            if rows_left == 0 {
                break;
            }
            if decoding(s) {
                continue;
            }
            let pending = s.total() - s.cached();
            let slack = (s.blocks_held() * bs).saturating_sub(s.cached());
            let chunk = pending.min(rows_left).min(slack + *free * bs);
            if chunk == 0 {
                continue;
            }
            *free -= self.blocks_for(s.cached() + chunk).saturating_sub(s.blocks_held());
            rows_left -= chunk;
            slots.push(Slot { index: i, rows: chunk, kind: SlotKind::Prefill { last: chunk == pending } });
        }

        // 4. Admission, first come first served.
        let mut admitted = Vec::new();
        while rows_left > 0 && self.running.len() < self.config.max_running {
            let Some(w) = self.waiting.front() else { break };
            // The whole prompt (and the first token) must fit: in an empty pool, or else the
            // request can never run; in the free blocks (with a block of growth room for
            // every running sequence), or else it waits its turn.
            let whole = self.blocks_for(w.total() + 1);
            if whole > total_blocks {
                if let Some(w) = self.waiting.pop_front() {
                    unfittable.push(w);
                }
                continue;
            }
            // Blocks it already holds (a prompt prefix attached from the cache) count.
            let need = whole.saturating_sub(w.blocks_held());
            if need + self.running.len() > *free && !self.running.is_empty() {
                break;
            }
            if need > *free {
                break;
            }
            let Some(w) = self.waiting.pop_front() else { break };
            let pending = w.total() - w.cached();
            let chunk = pending.min(rows_left);
            *free -= self.blocks_for(w.cached() + chunk).saturating_sub(w.blocks_held());
            rows_left -= chunk;
            let index = self.running.len();
            self.running.push(w);
            admitted.push(index);
            slots.push(Slot { index, rows: chunk, kind: SlotKind::Prefill { last: chunk == pending } });
        }
        slots.sort_by_key(|s| s.index);
        (slots, admitted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sequence with a fake cache: `cached` tokens in `blocks` blocks.
    #[derive(Debug, Clone)]
    struct Fake {
        id: usize,
        total: usize,
        cached: usize,
        blocks: usize,
        bid: DraftBid,
    }

    impl SchedSeq for Fake {
        fn cached(&self) -> usize {
            self.cached
        }
        fn total(&self) -> usize {
            self.total
        }
        fn blocks_held(&self) -> usize {
            self.blocks
        }
        fn release_kv(&mut self) {
            self.cached = 0;
            self.blocks = 0;
        }
        fn draft_bid(&self) -> DraftBid {
            self.bid
        }
    }

    const BS: usize = 4;

    fn fake(id: usize, prompt: usize) -> Fake {
        Fake { id, total: prompt, cached: 0, blocks: 0, bid: DraftBid::default() }
    }

    fn sched(step_tokens: usize, max_running: usize) -> Scheduler<Fake> {
        Scheduler::new(SchedulerConfig { step_tokens, max_running, block_size: BS })
    }

    /// Carries out a plan the way the engine does: caches grow by the rows, drafts are
    /// rolled back, a slot that reaches the end commits one token. Returns free blocks.
    fn run(s: &mut Scheduler<Fake>, plan: &StepPlan<Fake>, mut free: usize) -> usize {
        for slot in &plan.slots {
            let f = &mut s.running[slot.index];
            let draft = if let SlotKind::Decode { draft } = slot.kind { draft } else { 0 };
            let peak = f.cached + slot.rows + draft;
            let need = peak.div_ceil(BS).saturating_sub(f.blocks);
            assert!(need <= free, "plan overcommits the pool");
            free -= need;
            f.blocks += need;
            f.cached += slot.rows;
            // Roll back drafts: keep whole blocks up to the committed length.
            let keep = f.cached.div_ceil(BS);
            free += f.blocks - keep;
            f.blocks = keep;
            let reached_end = matches!(slot.kind, SlotKind::Decode { .. } | SlotKind::Prefill { last: true });
            if reached_end {
                f.total += 1;
            }
        }
        free
    }

    #[test]
    fn chunked_prefill_then_decode_within_the_budget() {
        let mut s = sched(8, 4);
        s.waiting.push_back(fake(0, 10));
        let mut free = 100;
        let plan = s.schedule(free, 100, None);
        assert_eq!(plan.slots, vec![Slot { index: 0, rows: 8, kind: SlotKind::Prefill { last: false } }]);
        free = run(&mut s, &plan, free);
        let plan = s.schedule(free, 100, None);
        assert_eq!(plan.slots, vec![Slot { index: 0, rows: 2, kind: SlotKind::Prefill { last: true } }]);
        free = run(&mut s, &plan, free);
        assert_eq!(s.running[0].total, 11);
        let plan = s.schedule(free, 100, None);
        assert_eq!(plan.slots, vec![Slot { index: 0, rows: 1, kind: SlotKind::Decode { draft: 0 } }]);
    }

    #[test]
    fn decode_and_prefill_share_one_step_and_admission_is_fifo() {
        let mut s = sched(6, 4);
        for (id, len) in [(0, 3), (1, 9), (2, 2)] {
            s.waiting.push_back(fake(id, len));
        }
        let mut free = 100;
        let plan = s.schedule(free, 100, None);
        // Seq 0 prefills whole (3 rows); seq 1 gets the other 3 rows; seq 2 waits.
        assert_eq!(plan.slots.len(), 2);
        assert_eq!((plan.slots[0].rows, plan.slots[1].rows), (3, 3));
        assert_eq!(s.waiting.len(), 1);
        free = run(&mut s, &plan, free);
        let plan = s.schedule(free, 100, None);
        // Seq 0 decodes (1 row), seq 1 continues its prefill (5 rows), seq 2 still waits
        // behind it: the budget is spent.
        assert_eq!(plan.slots[0].kind, SlotKind::Decode { draft: 0 });
        assert_eq!(plan.slots[1], Slot { index: 1, rows: 5, kind: SlotKind::Prefill { last: false } });
        assert_eq!(s.waiting.front().map(|f| f.id), Some(2));
    }

    #[test]
    fn blocks_a_waiting_sequence_already_holds_count_towards_its_admission() {
        // A 4-block pool; the request needs 4 blocks for its tokens + 1, and holds 2 of them
        // already (a cached prefix): it fits in the 2 free ones.
        let mut s = sched(64, 4);
        let total = 4 * BS - 1;
        s.waiting.push_back(Fake { id: 0, total, cached: 2 * BS, blocks: 2, bid: DraftBid::default() });
        let plan = s.schedule(2, 4, None);
        assert_eq!(plan.admitted, vec![0]);
        assert_eq!(plan.slots[0].rows, total - 2 * BS);
    }

    #[test]
    fn preempts_the_newest_when_blocks_run_out_and_recomputes_it_first() {
        let mut s = sched(64, 4);
        // 4 blocks of 4 tokens: two sequences of 7 tokens + first token fill 2 blocks each.
        s.waiting.push_back(fake(0, 7));
        s.waiting.push_back(fake(1, 7));
        s.waiting.push_back(fake(2, 3));
        let total = 4;
        let mut free = total;
        let plan = s.schedule(free, total, None);
        assert_eq!(plan.admitted, vec![0], "seq 1 needs growth room for seq 0; it waits");
        free = run(&mut s, &plan, free);
        let plan = s.schedule(free, total, None);
        free = run(&mut s, &plan, free);
        // Seq 0: 8 tokens cached in 2 blocks, one pending; free 2.
        assert_eq!((s.running[0].cached, s.running[0].blocks), (8, 2));
        assert_eq!(s.running.len(), 1);
        assert_eq!(free, 2);
        // Let seq 1 in by hand to create pressure: it fills the other two blocks.
        let mut one = s.waiting.pop_front().unwrap();
        one.cached = 7;
        one.total = 8;
        one.blocks = 2;
        s.running.push(one);
        free = 0;
        // Seq 0 needs a new block for position 8: seq 1 (newest) is preempted.
        let plan = s.schedule(free, total, None);
        assert_eq!(plan.preempted, 1);
        assert_eq!(s.running.len(), 1);
        assert_eq!(s.waiting.front().map(|f| (f.id, f.cached, f.total)), Some((1, 0, 8)));
        assert_eq!(s.waiting[1].id, 2, "the preempted sequence goes before later arrivals");
        assert_eq!(plan.slots, vec![Slot { index: 0, rows: 1, kind: SlotKind::Decode { draft: 0 } }]);
    }

    #[test]
    fn a_request_that_can_never_fit_is_handed_back() {
        let mut s = sched(64, 4);
        s.waiting.push_back(fake(0, 100));
        s.waiting.push_back(fake(1, 3));
        let plan = s.schedule(8, 8, None);
        assert_eq!(plan.unfittable.iter().map(|f| f.id).collect::<Vec<_>>(), vec![0]);
        assert_eq!(plan.admitted, vec![0]);
        assert_eq!(s.running[0].id, 1);
    }

    #[test]
    fn max_running_caps_the_batch() {
        let mut s = sched(64, 2);
        for id in 0..5 {
            s.waiting.push_back(fake(id, 2));
        }
        let plan = s.schedule(100, 100, None);
        assert_eq!(plan.admitted.len(), 2);
        assert_eq!(s.waiting.len(), 3);
    }

    #[test]
    fn drafts_go_to_decoding_sequences_when_they_pay() {
        let costs = StepCost::from_points(vec![(1, 10.0), (4, 10.5), (8, 20.0), (64, 146.0)]);
        let mut s = sched(64, 4);
        let mut f = fake(0, 5);
        f.cached = 4;
        f.blocks = 1;
        f.bid = DraftBid { alpha: 0.9, max_len: 6, ..DraftBid::default() };
        s.running.push(f);
        let plan = s.schedule(10, 11, Some(&costs));
        let SlotKind::Decode { draft } = plan.slots[0].kind else { panic!("{plan:?}") };
        assert!((2..=6).contains(&draft), "{draft}");
        // No free block: drafts only fill the slots left in the blocks it holds.
        s.running[0].blocks = 2;
        let plan = s.schedule(0, 2, Some(&costs));
        let SlotKind::Decode { draft } = plan.slots[0].kind else { panic!("{plan:?}") };
        assert!((2..=3).contains(&draft), "{draft}");
    }

    #[test]
    fn stuck_prefills_are_unblocked_by_preemption() {
        let mut s = sched(64, 4);
        // Two half-prefilled sequences fill the pool; neither can grow.
        for id in 0..2 {
            let mut f = fake(id, 12);
            f.cached = 8;
            f.blocks = 2;
            s.running.push(f);
        }
        let plan = s.schedule(0, 4, None);
        assert_eq!(plan.preempted, 1);
        assert_eq!(plan.slots, vec![Slot { index: 0, rows: 4, kind: SlotKind::Prefill { last: true } }]);
        assert_eq!(s.waiting[0].id, 1);
    }
}
