//! Time of one quantised matmul for blocks of m activation rows, on our VNNI kernels, on AMX
//! tiles (where the CPU has them) and on candle's kernels for the same type, alternating, with the achieved int8 multiply-adds per
//! second: how the cost of a verified row moves with m, matrix by matrix.
//!
//! `cargo run --release --example matmul_rows -- [TYPE] [N] [K]` (default: Q4_K, the
//! Qwen2.5-1.5B MLP's 8960 × 1536). TYPE: q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k or q6_k.
//! Threads:
//! `CANDLE_NUM_THREADS`.

use anyhow::{bail, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use specula::model::{KernelSettings, Linear, WeightFormat};
use std::sync::Arc;
use std::time::Instant;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dtype = match args.first().map(|s| s.to_ascii_lowercase()).as_deref() {
        None | Some("q4_k") => GgmlDType::Q4K,
        Some("q6_k") => GgmlDType::Q6K,
        Some("q8_0") => GgmlDType::Q8_0,
        Some("q4_1") => GgmlDType::Q4_1,
        Some("q5_0") => GgmlDType::Q5_0,
        Some("q4_0") => GgmlDType::Q4_0,
        Some("q5_1") => GgmlDType::Q5_1,
        Some("q5_k") => GgmlDType::Q5K,
        Some(other) => bail!("unknown type {other}"),
    };
    let n: usize = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(8960);
    let k: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(1536);
    let dev = Device::Cpu;
    let w: Vec<f32> = (0..n * k).map(|i| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0).collect();
    let q = Arc::new(QTensor::quantize(&Tensor::from_vec(w, (n, k), &dev)?, dtype)?);
    let base = KernelSettings::default();
    let mut kernels = vec![(
        "vnni",
        Linear::from_qtensor(q.clone(), None, WeightFormat::Native, &KernelSettings { amx: false, ..base }, &dev)?,
    )];
    kernels.push(("amx", Linear::from_qtensor(q.clone(), None, WeightFormat::Native, &base, &dev)?));
    let candle = KernelSettings { vnni_kernels: false, amx: false, ..base };
    kernels.push(("candle", Linear::from_qtensor(q, None, WeightFormat::Native, &candle, &dev)?));
    println!("{dtype:?} {n}x{k}; ms per matmul (G int8 multiply-adds/s)");
    print!("{:>4}", "m");
    for (name, _) in &kernels {
        print!(" {name:>18}");
    }
    println!();
    for m in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 24, 32] {
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 40503) % 997) as f32 / 498.5 - 1.0).collect();
        let x = Tensor::from_vec(x, (m, k), &dev)?;
        let mut best = vec![f64::MAX; kernels.len()];
        for _round in 0..5 {
            for (i, (_, lin)) in kernels.iter().enumerate() {
                lin.forward(&x)?;
                let reps = 20;
                let t = Instant::now();
                for _ in 0..reps {
                    lin.forward(&x)?;
                }
                best[i] = best[i].min(t.elapsed().as_secs_f64() / reps as f64);
            }
        }
        print!("{m:>4}");
        for s in best {
            print!(" {:>8.3} ({:>6.0})", s * 1e3, (m * n * k) as f64 / s / 1e9);
        }
        println!();
    }
    Ok(())
}
