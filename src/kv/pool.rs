//! Block pool and per-sequence block tables, with prefix caching: full blocks of prompt
//! tokens are published under a hash of their whole prefix, and a later sequence whose prompt
//! starts the same way attaches them instead of recomputing them (vLLM's automatic prefix
//! caching). The forward is row-invariant, so attached K/V are bit for bit what recomputing
//! would write, and outputs do not change.

use super::block_kernels::KvView;
use super::events::{KvEvent, KvEventSink};
use half::{f16, slice::HalfFloatSliceExt};
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

/// Shape of the cache: identical for every layer of one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    pub dtype: KvDtype,
}

/// Element type of the cache. f16 is llama.cpp's default (half the memory traffic, and the
/// same rounding, which small models are sensitive to); f32 keeps rollback and batching
/// bit-for-bit comparable in tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvDtype {
    #[default]
    F16,
    F32,
}

impl KvDtype {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f16" => Ok(Self::F16),
            "f32" => Ok(Self::F32),
            other => Err(format!("unknown KV cache type `{other}` (expected f16 or f32)")),
        }
    }

    pub fn size(&self) -> usize {
        match self {
            Self::F16 => 2,
            Self::F32 => 4,
        }
    }
}

/// One layer's K or V buffer.
pub enum KvBuffer {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

impl KvBuffer {
    fn zeros(dtype: KvDtype, n: usize) -> Self {
        match dtype {
            KvDtype::F16 => Self::F16(vec![f16::ZERO; n]),
            KvDtype::F32 => Self::F32(vec![0f32; n]),
        }
    }

    fn store(&mut self, off: usize, src: &[f32]) {
        match self {
            Self::F16(b) => b[off..off + src.len()].convert_from_f32_slice(src),
            Self::F32(b) => b[off..off + src.len()].copy_from_slice(src),
        }
    }

    /// Copies `len` elements from `src` to `dst` (the ranges may overlap).
    fn copy_within(&mut self, src: usize, dst: usize, len: usize) {
        match self {
            Self::F16(b) => b.copy_within(src..src + len, dst),
            Self::F32(b) => b.copy_within(src..src + len, dst),
        }
    }

    /// `len` elements starting at `off`, in their stored type.
    #[inline]
    pub fn view(&self, off: usize, len: usize) -> KvView<'_> {
        match self {
            Self::F16(b) => KvView::F16(&b[off..off + len]),
            Self::F32(b) => KvView::F32(&b[off..off + len]),
        }
    }
}

impl KvLayout {
    /// Elements held by one block of one layer, for keys (values have the same size).
    pub fn block_floats(&self) -> usize {
        self.block_size * self.n_kv_heads * self.head_dim
    }

    /// Bytes of K and V for one token across all layers.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype.size()
    }
}

/// Returned when a sequence asks for more blocks than the pool has free. The engine can
/// handle it (wait, preempt, or refuse the request); nothing was changed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("KV cache exhausted: need {needed} more blocks, {free} free of {total} ({block_size} tokens each)")]
pub struct PoolExhausted {
    pub needed: usize,
    pub free: usize,
    pub total: usize,
    pub block_size: usize,
}

/// The pool's memory: per layer one K and one V buffer of `n_blocks` blocks, laid out as
/// `[block][kv head][slot in block][head dim]` so one head's keys in a block are contiguous.
pub struct PoolStorage {
    pub layout: KvLayout,
    pub k: Vec<KvBuffer>,
    pub v: Vec<KvBuffer>,
    /// Blocks nobody holds and nobody published.
    free: Vec<u32>,
    n_blocks: usize,
    prefix: PrefixIndex,
    /// Where publishing and evicting prefix blocks is reported (None: nowhere).
    events: Option<Arc<dyn KvEventSink>>,
}

/// Which blocks hold a published prompt prefix, and who holds each block.
struct PrefixIndex {
    /// Sequences holding each block.
    refs: Vec<u32>,
    /// Published blocks: their prefix key and their own tokens (checked on every match, so a
    /// hash collision can only cost a cache miss, never wrong K/V).
    published: Vec<Option<(u64, Box<[u32]>)>>,
    by_key: HashMap<u64, u32>,
    /// Published blocks nobody holds, oldest release first: reused last, evicted in this order.
    evictable: BTreeMap<u64, u32>,
    released_at: Vec<u64>,
    clock: u64,
}

impl PrefixIndex {
    fn new(n_blocks: usize) -> Self {
        Self {
            refs: vec![0; n_blocks],
            published: vec![None; n_blocks],
            by_key: HashMap::new(),
            evictable: BTreeMap::new(),
            released_at: vec![0; n_blocks],
            clock: 0,
        }
    }
}

/// The key of a block of tokens that follows the prefix whose key is `parent` (0 at the start).
fn prefix_key(parent: u64, tokens: &[u32]) -> u64 {
    // SipHash with fixed keys: the same on every run, which keeps behaviour reproducible.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl PoolStorage {
    /// Offset of the first slot of `kv_head` in `block`; slot s of that head starts
    /// `s * head_dim` later.
    #[inline]
    pub fn head_offset(&self, block: u32, kv_head: usize) -> usize {
        let l = &self.layout;
        ((block as usize * l.n_kv_heads + kv_head) * l.block_size) * l.head_dim
    }

    /// Blocks a sequence can still get: free ones, and published ones nobody holds (evicted
    /// on demand).
    fn available(&self) -> usize {
        self.free.len() + self.prefix.evictable.len()
    }

    /// A block for one sequence: a free one, or else the least recently released published one
    /// (its key is added to `evicted`).
    fn take_block(&mut self, evicted: &mut Vec<u64>) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.prefix.evictable.pop_first()?;
                if let Some((key, _)) = self.prefix.published[b as usize].take() {
                    self.prefix.by_key.remove(&key);
                    evicted.push(key);
                }
                b
            }
        };
        self.prefix.refs[b as usize] = 1;
        Some(b)
    }

    fn emit(&self, event: KvEvent) {
        if let Some(sink) = &self.events {
            sink.emit(event);
        }
    }

    /// One holder lets go of `b`.
    fn release(&mut self, b: u32) {
        let i = b as usize;
        self.prefix.refs[i] = self.prefix.refs[i].saturating_sub(1);
        if self.prefix.refs[i] > 0 {
            return;
        }
        if self.prefix.published[i].is_some() {
            self.prefix.clock += 1;
            self.prefix.released_at[i] = self.prefix.clock;
            self.prefix.evictable.insert(self.prefix.clock, b);
        } else {
            self.free.push(b);
        }
    }

    /// One more holder for a published block.
    fn hold(&mut self, b: u32) {
        let i = b as usize;
        if self.prefix.refs[i] == 0 {
            self.prefix.evictable.remove(&self.prefix.released_at[i]);
        }
        self.prefix.refs[i] += 1;
    }

    /// Stores one token's K and V (`[kv heads][head dim]` each) at `pos` of a sequence whose
    /// block table is `blocks`.
    pub fn write(&mut self, layer: usize, blocks: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let (hd, bs) = (self.layout.head_dim, self.layout.block_size);
        let block = blocks[pos / bs];
        for h in 0..self.layout.n_kv_heads {
            let off = self.head_offset(block, h) + (pos % bs) * hd;
            self.k[layer].store(off, &k[h * hd..(h + 1) * hd]);
            self.v[layer].store(off, &v[h * hd..(h + 1) * hd]);
        }
    }
}

/// Snapshot of pool occupancy, for metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvPoolStats {
    pub total_blocks: usize,
    /// Blocks a sequence can get: free, or holding a published prefix nobody uses (reused
    /// last, evicted on demand).
    pub free_blocks: usize,
    /// Published prefix blocks, held or not.
    pub cached_blocks: usize,
    pub block_size: usize,
}

/// A shared handle to one model's block pool.
#[derive(Clone)]
pub struct KvPool {
    inner: Arc<Mutex<PoolStorage>>,
}

impl KvPool {
    /// A pool that can hold `capacity_tokens` tokens (rounded up to whole blocks). Memory is
    /// zero-initialised lazily by the OS, so an unused pool costs little.
    pub fn new(layout: KvLayout, capacity_tokens: usize) -> Self {
        let n_blocks = capacity_tokens.div_ceil(layout.block_size).max(1);
        let floats = n_blocks * layout.block_floats();
        let storage = PoolStorage {
            layout,
            k: (0..layout.n_layers).map(|_| KvBuffer::zeros(layout.dtype, floats)).collect(),
            v: (0..layout.n_layers).map(|_| KvBuffer::zeros(layout.dtype, floats)).collect(),
            // Pop from the end: hand out low block ids first.
            free: (0..n_blocks as u32).rev().collect(),
            n_blocks,
            prefix: PrefixIndex::new(n_blocks),
            events: None,
        };
        Self { inner: Arc::new(Mutex::new(storage)) }
    }

    /// Reports every block published into, or evicted from, the prefix index to `sink` from
    /// now on (vLLM's KV-cache events).
    pub fn set_event_sink(&self, sink: Arc<dyn KvEventSink>) {
        self.lock().events = Some(sink);
    }

    pub fn layout(&self) -> KvLayout {
        self.lock().layout
    }

    pub fn stats(&self) -> KvPoolStats {
        let s = self.lock();
        KvPoolStats {
            total_blocks: s.n_blocks,
            free_blocks: s.available(),
            cached_blocks: s.prefix.by_key.len(),
            block_size: s.layout.block_size,
        }
    }

    /// A new, empty sequence cache drawing from this pool.
    pub fn new_sequence(&self) -> SeqCache {
        SeqCache { pool: self.clone(), blocks: Vec::new(), len: 0, keys: Vec::new() }
    }

    /// Locks the storage for a forward pass. A poisoned lock means a forward panicked midway;
    /// the cache contents are still well-formed floats, so keep going.
    pub fn lock(&self) -> MutexGuard<'_, PoolStorage> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn same_pool(&self, other: &KvPool) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// One sequence's view of the pool: its block table and how many token positions hold
/// valid K/V. Dropping it returns its blocks to the pool.
pub struct SeqCache {
    pool: KvPool,
    blocks: Vec<u32>,
    len: usize,
    /// Prefix keys of the leading full prompt blocks seen so far (attached, or offered for
    /// publishing), one per block.
    keys: Vec<u64>,
}

impl SeqCache {
    /// Tokens whose K/V are stored.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// Tokens that fit without allocating.
    pub fn capacity(&self, block_size: usize) -> usize {
        self.blocks.len() * block_size
    }

    /// Makes room for `total_len` tokens, allocating all needed blocks or none.
    pub fn reserve_locked(&mut self, storage: &mut PoolStorage, total_len: usize) -> Result<(), PoolExhausted> {
        let bs = storage.layout.block_size;
        let needed = total_len.div_ceil(bs).saturating_sub(self.blocks.len());
        if needed > storage.available() {
            return Err(PoolExhausted { needed, free: storage.available(), total: storage.n_blocks, block_size: bs });
        }
        let mut evicted = Vec::new();
        for _ in 0..needed {
            // Cannot fail: checked above.
            if let Some(b) = storage.take_block(&mut evicted) {
                self.blocks.push(b);
            }
        }
        if !evicted.is_empty() {
            storage.emit(KvEvent::BlocksRemoved { hashes: evicted });
        }
        Ok(())
    }

    /// For a new, empty sequence about to prefill `prompt`: attaches the longest run of
    /// published blocks that match its leading full blocks, and returns how many tokens they
    /// cover (their K/V need no computing). The last prompt token is never covered, so the
    /// prefill still produces the logits for the first generated token.
    pub fn attach_prefix(&mut self, prompt: &[u32]) -> usize {
        self.attach_prefix_limited(prompt, usize::MAX)
    }

    /// [`Self::attach_prefix`], covering at most `max_tokens` tokens (whole blocks).
    pub fn attach_prefix_limited(&mut self, prompt: &[u32], max_tokens: usize) -> usize {
        if !self.blocks.is_empty() {
            return 0;
        }
        let pool = self.pool.clone();
        let mut storage = pool.lock();
        let bs = storage.layout.block_size;
        let mut key = 0;
        let usable = prompt.len().saturating_sub(1).min(max_tokens);
        for block_tokens in prompt[..usable].chunks_exact(bs) {
            key = prefix_key(key, block_tokens);
            let Some(&b) = storage.prefix.by_key.get(&key) else { break };
            match &storage.prefix.published[b as usize] {
                Some((k, tokens)) if *k == key && **tokens == *block_tokens => {}
                _ => break,
            }
            storage.hold(b);
            self.blocks.push(b);
            self.keys.push(key);
        }
        self.len = self.blocks.len() * bs;
        self.len
    }

    /// Publishes the full blocks of `prompt` this sequence has computed (its K/V are stored),
    /// so later sequences can attach them. A block whose prefix is already published by
    /// another block stays private to this sequence.
    pub fn publish_prefix(&mut self, prompt: &[u32]) {
        let pool = self.pool.clone();
        let mut storage = pool.lock();
        let bs = storage.layout.block_size;
        let full = self.len.min(prompt.len()) / bs;
        // Blocks published by this call, as runs of consecutive blocks: one event per run
        // (tracked only when someone listens).
        let listening = storage.events.is_some();
        let mut runs: Vec<(Option<u64>, std::ops::Range<usize>)> = Vec::new();
        while self.keys.len() < full {
            let i = self.keys.len();
            let tokens = &prompt[i * bs..(i + 1) * bs];
            let parent = self.keys.last().copied();
            let key = prefix_key(parent.unwrap_or(0), tokens);
            let b = self.blocks[i];
            if storage.prefix.published[b as usize].is_none() && !storage.prefix.by_key.contains_key(&key) {
                storage.prefix.published[b as usize] = Some((key, tokens.into()));
                storage.prefix.by_key.insert(key, b);
                match runs.last_mut() {
                    _ if !listening => {}
                    Some((_, run)) if run.end == i => run.end = i + 1,
                    _ => runs.push((parent, i..i + 1)),
                }
            }
            self.keys.push(key);
        }
        if listening {
            for (parent, run) in runs {
                storage.emit(KvEvent::BlocksStored {
                    parent,
                    hashes: self.keys[run.clone()].to_vec(),
                    token_ids: prompt[run.start * bs..run.end * bs].to_vec(),
                    block_size: bs,
                });
            }
        }
    }

    /// Like [`Self::reserve_locked`], taking the lock itself.
    pub fn reserve(&mut self, total_len: usize) -> Result<(), PoolExhausted> {
        let pool = self.pool.clone();
        let mut storage = pool.lock();
        self.reserve_locked(&mut storage, total_len)
    }

    /// Marks `n` more positions (already written by a forward) as valid.
    pub(crate) fn advance(&mut self, n: usize, block_size: usize) {
        debug_assert!(self.len + n <= self.blocks.len() * block_size);
        self.len += n;
    }

    /// After a draft tree was verified: moves the K/V of the new rows `rows` (offsets from
    /// `first`, ascending, each at least its index: an accepted path through the tree) to
    /// positions `first, first + 1, …`, in every layer, and keeps exactly those, so the cache
    /// holds the committed path as if it had been decoded as a chain. A node's K/V do not
    /// depend on its slot (RoPE uses its depth), so moving them is exact.
    pub fn keep_rows(&mut self, first: usize, rows: &[usize]) {
        let pool = self.pool.clone();
        let mut storage = pool.lock();
        let (hd, bs, n_kv) = (storage.layout.head_dim, storage.layout.block_size, storage.layout.n_kv_heads);
        for (j, &r) in rows.iter().enumerate() {
            assert!(r >= j && rows.get(j + 1).is_none_or(|&next| next > r), "keep_rows: {rows:?} is not a path");
            let (src, dst) = (first + r, first + j);
            if src == dst || src >= self.len {
                continue;
            }
            let (sb, db) = (self.blocks[src / bs], self.blocks[dst / bs]);
            for h in 0..n_kv {
                let s = storage.head_offset(sb, h) + (src % bs) * hd;
                let d = storage.head_offset(db, h) + (dst % bs) * hd;
                for layer in 0..storage.layout.n_layers {
                    storage.k[layer].copy_within(s, d, hd);
                    storage.v[layer].copy_within(s, d, hd);
                }
            }
        }
        drop(storage);
        self.truncate(first + rows.len());
    }

    /// Rolls back to `len` tokens: everything after is forgotten and whole blocks past the
    /// new end go back to the pool. Truncating to a longer length is a no-op. Published
    /// blocks are never written again: a cut inside one (callers only roll back drafts, past
    /// the prompt) also lets it go, keeping the tokens before it.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        let pool = self.pool.clone();
        let mut storage = pool.lock();
        let bs = storage.layout.block_size;
        // The block the cut falls inside would be written again: not if it is published.
        let cut_block = self.blocks.get(len / bs).copied();
        let len = match cut_block {
            Some(b) if len % bs != 0 && storage.prefix.published[b as usize].is_some() => len / bs * bs,
            _ => len,
        };
        self.len = len;
        let keep = len.div_ceil(bs);
        self.keys.truncate(len / bs);
        while self.blocks.len() > keep {
            if let Some(b) = self.blocks.pop() {
                storage.release(b);
            }
        }
    }
}

impl Drop for SeqCache {
    fn drop(&mut self) {
        if self.blocks.is_empty() {
            return;
        }
        let mut storage = self.pool.lock();
        for b in self.blocks.drain(..).rev() {
            storage.release(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout { n_layers: 2, n_kv_heads: 1, head_dim: 4, block_size: 4, dtype: KvDtype::F16 }
    }

    #[test]
    fn reserve_truncate_and_drop_return_blocks() {
        let pool = KvPool::new(layout(), 16); // 4 blocks
        let mut a = pool.new_sequence();
        a.reserve(9).unwrap(); // 3 blocks
        assert_eq!(pool.stats().free_blocks, 1);
        a.advance(9, 4);
        a.truncate(5); // keeps 2 blocks
        assert_eq!(a.len(), 5);
        assert_eq!(pool.stats().free_blocks, 2);
        let mut b = pool.new_sequence();
        b.reserve(8).unwrap();
        assert_eq!(pool.stats().free_blocks, 0);
        drop(a);
        assert_eq!(pool.stats().free_blocks, 2);
        drop(b);
        assert_eq!(pool.stats().free_blocks, 4);
    }

    #[test]
    fn prefix_blocks_are_shared_then_evicted_last() {
        let pool = KvPool::new(layout(), 16); // 4 blocks of 4 tokens
        let prompt: Vec<u32> = (0..10).collect();
        let mut a = pool.new_sequence();
        assert_eq!(a.attach_prefix(&prompt), 0, "nothing published yet");
        a.reserve(10).unwrap();
        a.advance(10, 4);
        a.publish_prefix(&prompt);
        assert_eq!(pool.stats().cached_blocks, 2, "two full blocks of the prompt");

        // Same first 9 tokens (the attachable part of a 10-token prompt is its first 9).
        let mut b = pool.new_sequence();
        let mut other = prompt.clone();
        other[9] = 99;
        assert_eq!(b.attach_prefix(&other), 8);
        assert_eq!(b.blocks(), &a.blocks()[..2]);
        // A different second block stops the match after the first.
        let mut c = pool.new_sequence();
        let mut diverging = prompt.clone();
        diverging[5] = 77;
        assert_eq!(c.attach_prefix(&diverging), 4);
        assert_eq!(pool.stats().free_blocks, 1, "3 blocks held by a, shared by b and c");

        drop(a);
        drop(b);
        drop(c);
        let stats = pool.stats();
        assert_eq!((stats.free_blocks, stats.cached_blocks), (4, 2), "published blocks stay, evictable");

        // A later sequence still finds them; then filling the pool evicts them, oldest first.
        let mut d = pool.new_sequence();
        assert_eq!(d.attach_prefix(&prompt), 8);
        drop(d);
        let mut e = pool.new_sequence();
        e.reserve(16).unwrap();
        assert_eq!(pool.stats().cached_blocks, 0, "evicted to make room");
        assert!(e.reserve(17).is_err());
        drop(e);
        assert_eq!(pool.stats().free_blocks, 4);
    }

    #[test]
    fn a_cut_inside_a_published_block_never_writes_into_it() {
        let pool = KvPool::new(layout(), 16);
        let prompt: Vec<u32> = (0..9).collect();
        let mut a = pool.new_sequence();
        a.reserve(9).unwrap();
        a.advance(9, 4);
        a.publish_prefix(&prompt);
        let shared = a.blocks()[1];
        a.truncate(6); // inside the published second block
        assert_eq!(a.len(), 4, "kept up to the block boundary");
        assert_eq!(a.blocks().len(), 1);
        let mut b = pool.new_sequence();
        assert_eq!(b.attach_prefix(&prompt), 8, "the published block is intact and still found");
        assert_eq!(b.blocks()[1], shared);
    }

    /// Collects events, as a publisher's channel would.
    #[derive(Default)]
    struct Recorder(Mutex<Vec<KvEvent>>);

    impl KvEventSink for Recorder {
        fn emit(&self, event: KvEvent) {
            self.0.lock().unwrap().push(event);
        }
    }

    #[test]
    fn publishing_and_evicting_are_reported() {
        let pool = KvPool::new(layout(), 16); // 4 blocks of 4 tokens
        let recorder = Arc::new(Recorder::default());
        pool.set_event_sink(recorder.clone());
        let take = || std::mem::take(&mut *recorder.0.lock().unwrap());
        let prompt: Vec<u32> = (0..10).collect();
        let mut a = pool.new_sequence();
        a.reserve(10).unwrap();
        a.advance(10, 4);
        a.publish_prefix(&prompt);
        let (k0, k1) = (prefix_key(0, &prompt[..4]), prefix_key(prefix_key(0, &prompt[..4]), &prompt[4..8]));
        assert_eq!(
            take(),
            [KvEvent::BlocksStored {
                parent: None,
                hashes: vec![k0, k1],
                token_ids: prompt[..8].to_vec(),
                block_size: 4
            }]
        );
        // Publishing again, or attaching, reports nothing new.
        a.publish_prefix(&prompt);
        drop(a);
        let mut b = pool.new_sequence();
        let longer: Vec<u32> = (0..13).collect();
        assert_eq!(b.attach_prefix(&longer), 8);
        b.reserve(13).unwrap();
        b.advance(5, 4);
        b.publish_prefix(&longer);
        assert_eq!(
            take(),
            [KvEvent::BlocksStored {
                parent: Some(k1),
                hashes: vec![prefix_key(k1, &longer[8..12])],
                token_ids: longer[8..12].to_vec(),
                block_size: 4
            }]
        );
        drop(b);
        assert!(take().is_empty(), "released blocks stay published");
        // Filling the pool evicts the three published blocks, oldest release first.
        let mut c = pool.new_sequence();
        c.reserve(16).unwrap();
        let events = take();
        let [KvEvent::BlocksRemoved { hashes }] = &events[..] else { panic!("{events:?}") };
        let mut removed = hashes.clone();
        removed.sort_unstable();
        let mut stored = vec![k0, k1, prefix_key(k1, &longer[8..12])];
        stored.sort_unstable();
        assert_eq!(removed, stored);
    }

    #[test]
    fn exhaustion_is_an_error_and_changes_nothing() {
        let pool = KvPool::new(layout(), 8); // 2 blocks
        let mut a = pool.new_sequence();
        a.reserve(4).unwrap();
        let err = a.reserve(13).unwrap_err();
        assert_eq!(err.needed, 3);
        assert_eq!(err.free, 1);
        assert_eq!(a.blocks().len(), 1);
        assert_eq!(pool.stats().free_blocks, 1);
        assert!(err.to_string().contains("KV cache exhausted"));
    }
}
