//! Time of one layer's paged attention for blocks of m new rows of one sequence on top of a
//! cached context: how attention's share of a verified row moves with m.
//!
//! `cargo run --release --example attention_rows -- [HEADS] [KV_HEADS] [HEAD_DIM] [CACHED]`
//! (default: SmolLM2-135M's 9 heads, 3 KV heads, 64 wide, on 256 cached tokens; Qwen2.5-1.5B
//! is `12 2 128`). f16 cache in blocks of 16, as the engine keeps it. Threads:
//! `CANDLE_NUM_THREADS`.

use anyhow::Result;
use specula::kv::{paged_attention, AttentionSeq, KvDtype, KvLayout, KvPool};
use std::time::Instant;

/// `n` values in [-0.5, 0.5) that differ with `seed` (multiplicative hashing, as `matmul_rows`).
fn values(seed: u64, n: usize) -> Vec<f32> {
    (0..n as u64).map(|i| ((seed * 7919 + i).wrapping_mul(2654435761) % 1000) as f32 / 1000.0 - 0.5).collect()
}

fn main() -> Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse()).collect::<Result<_, _>>()?;
    let arg = |i: usize, default: usize| args.get(i).copied().unwrap_or(default);
    let (n_heads, n_kv, hd, cached) = (arg(0, 9), arg(1, 3), arg(2, 64), arg(3, 256));
    let max_m = 16;
    let layout = KvLayout { dtype: KvDtype::F16, n_layers: 1, n_kv_heads: n_kv, head_dim: hd, block_size: 16 };
    let pool = KvPool::new(layout, cached + max_m + 16);
    let mut cache = pool.new_sequence();
    let mut storage = pool.lock();
    cache.reserve_locked(&mut storage, cached + max_m).map_err(|e| anyhow::anyhow!("{e}"))?;
    for p in 0..cached + max_m {
        storage.write(0, cache.blocks(), p, &values(p as u64, n_kv * hd), &values(1_000_000 + p as u64, n_kv * hd));
    }
    println!(
        "{n_heads} heads, {n_kv} KV heads, head dim {hd}, {cached} cached; µs per layer (best of 5 rounds of 200)"
    );
    println!("{:>4} {:>10} {:>10}", "m", "µs", "µs / row");
    for m in [1usize, 2, 4, 8, 12, 16] {
        let q = values(7 + m as u64, m * n_heads * hd);
        let mut out = vec![0f32; q.len()];
        let seq = AttentionSeq { row_start: 0, n_rows: m, cached, blocks: cache.blocks(), parents: None };
        let mut best = f64::MAX;
        for _round in 0..5 {
            let reps = 200;
            let t = Instant::now();
            for _ in 0..reps {
                paged_attention(&storage, 0, &q, n_heads, std::slice::from_ref(&seq), 0.125, None, &mut out);
            }
            best = best.min(t.elapsed().as_secs_f64() / reps as f64);
        }
        println!("{m:>4} {:>10.2} {:>10.2}", best * 1e6, best * 1e6 / m as f64);
    }
    Ok(())
}
