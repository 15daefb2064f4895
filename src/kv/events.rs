//! What the prefix index did, for whoever tracks which prefixes this server has cached (a
//! prefix-aware router). The pool reports plain values to a [`KvEventSink`]; encoding and
//! networking live above the engine, so `kv` knows nothing of them.

/// One change to the prefix index. Hashes are the pool's 64-bit prefix keys: the key of a
/// block covers its own tokens and, through its parent's key, every token before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive blocks of one prompt were published, in prompt order: `hashes[0]` follows
    /// the prefix whose key is `parent` (None: it starts the prompt), and each later hash
    /// follows the one before it. `token_ids` holds all their tokens, `block_size` per block.
    BlocksStored { parent: Option<u64>, hashes: Vec<u64>, token_ids: Vec<u32>, block_size: usize },
    /// Published blocks were evicted: their prefixes can no longer be attached.
    BlocksRemoved { hashes: Vec<u64> },
    /// Every published block was dropped at once.
    AllBlocksCleared,
}

/// Receives the pool's events. Called with the pool's lock held, from the engine's step:
/// implementations must return at once (queue or drop, never wait).
pub trait KvEventSink: Send + Sync {
    fn emit(&self, event: KvEvent);
}
