//! Block pool and per-sequence block tables.

use super::block_kernels::KvView;
use half::{f16, slice::HalfFloatSliceExt};
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
    free: Vec<u32>,
    n_blocks: usize,
}

impl PoolStorage {
    /// Offset of the first slot of `kv_head` in `block`; slot s of that head starts
    /// `s * head_dim` later.
    #[inline]
    pub fn head_offset(&self, block: u32, kv_head: usize) -> usize {
        let l = &self.layout;
        ((block as usize * l.n_kv_heads + kv_head) * l.block_size) * l.head_dim
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
    pub free_blocks: usize,
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
        };
        Self { inner: Arc::new(Mutex::new(storage)) }
    }

    pub fn layout(&self) -> KvLayout {
        self.lock().layout
    }

    pub fn stats(&self) -> KvPoolStats {
        let s = self.lock();
        KvPoolStats { total_blocks: s.n_blocks, free_blocks: s.free.len(), block_size: s.layout.block_size }
    }

    /// A new, empty sequence cache drawing from this pool.
    pub fn new_sequence(&self) -> SeqCache {
        SeqCache { pool: self.clone(), blocks: Vec::new(), len: 0 }
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
        if needed > storage.free.len() {
            return Err(PoolExhausted { needed, free: storage.free.len(), total: storage.n_blocks, block_size: bs });
        }
        for _ in 0..needed {
            // Cannot fail: checked above.
            if let Some(b) = storage.free.pop() {
                self.blocks.push(b);
            }
        }
        Ok(())
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

    /// Rolls back to `len` tokens: everything after is forgotten and whole blocks past the
    /// new end go back to the pool. Truncating to a longer length is a no-op.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        self.len = len;
        let pool = self.pool.clone();
        let mut storage = pool.lock();
        let keep = len.div_ceil(storage.layout.block_size);
        while self.blocks.len() > keep {
            if let Some(b) = self.blocks.pop() {
                storage.free.push(b);
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
        storage.free.extend(self.blocks.drain(..).rev());
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
