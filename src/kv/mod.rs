//! Paged KV cache: a pool of fixed-size blocks shared by all sequences, a block table per
//! sequence, append / truncate (rollback after rejected drafts), and freeing in `Drop` so a
//! cancelled request can never leak blocks.

mod attention;
mod block_kernels;
mod events;
mod pool;

pub use attention::{paged_attention, tree_path, AttentionSeq, NO_PARENT};
pub use events::{KvEvent, KvEventSink};
pub use pool::{KvBuffer, KvDtype, KvLayout, KvPool, KvPoolStats, PoolExhausted, PoolStorage, SeqCache};
