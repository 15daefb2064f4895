use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use std::time::Instant;
fn main() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for (n, k) in [(1536usize, 576usize), (1536, 768), (576, 1536)] {
    let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
    for dt in [GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q4K] {
        let q = QTensor::quantize(&w, dt);
        let Ok(q) = q else { println!("{dt:?} n/a"); continue };
        let mm = QMatMul::from_qtensor(q)?;
        for m in [1usize, 4, 16] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
            dev.with_context(|| -> anyhow::Result<()> {
                for _ in 0..5 { mm.forward(&x)?; }
                let t = Instant::now();
                let iters = 200;
                for _ in 0..iters { mm.forward(&x)?; }
                println!("{n}x{k} {dt:?} m={m}: {:.1} us", t.elapsed().as_secs_f64() * 1e6 / iters as f64);
                Ok(())
            })?;
        }
    }
    }
    Ok(())
}
