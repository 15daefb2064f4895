//! The forward's profiler (`bench --mode ar --profile`) on a real model: every phase is
//! reached, and the int8 multiply-adds it counts for each matmul kind are the model's own.
//! One test in this binary, since the profiler is process-wide. Nothing here is timed.

mod common;

use candle_core::Device;
use specula::model::profile::{Phase, Profile, PROFILER};
use specula::model::{ForwardBatch, LogitsRows, Transformer, WeightFormat};

/// Profiles one forward of `m` new rows (logits for all) on top of `depth` cached tokens.
fn profile_block(model: &Transformer, depth: usize, m: usize) -> Profile {
    let pool = model.new_kv_pool(depth + m + 16);
    let mut cache = pool.new_sequence();
    let ids = |n: usize, salt: u32| (0..n as u32).map(|i| 300 + (i * 7919 + salt) % 20_000).collect::<Vec<_>>();
    let context = ids(depth, 0);
    let mut b = ForwardBatch::new();
    b.push(&context, &mut cache, LogitsRows::None);
    model.forward(&mut b).unwrap();
    drop(b);
    assert_eq!(PROFILER.snapshot(), Profile::default(), "nothing is recorded while the profiler is off");

    let block = ids(m, 17);
    PROFILER.reset();
    PROFILER.set_enabled(true);
    let mut b = ForwardBatch::new();
    b.push(&block, &mut cache, LogitsRows::All);
    let out = model.forward(&mut b);
    PROFILER.set_enabled(false);
    assert_eq!(out.unwrap().logits.dims(), [m, model.config.vocab]);
    let p = PROFILER.snapshot();
    PROFILER.reset();
    p
}

#[test]
fn profile_counts_every_matmul_of_a_forward() {
    let path = common::smollm2_path();
    let (depth, m) = (5, 3);
    for format in [None, Some(WeightFormat::F32)] {
        let model = Transformer::from_path(&path, format, &Device::Cpu).unwrap();
        let c = model.config.clone();
        let p = profile_block(&model, depth, m);
        let (q, kv, layers) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_layers);
        // Multiply-adds per row of each matmul kind, from the config alone.
        let per_row = [
            (Phase::Qkv, layers, layers * (q + 2 * kv) * c.hidden),
            (Phase::AttnOut, layers, layers * c.hidden * q),
            (Phase::GateUp, layers, layers * 2 * c.ffn * c.hidden),
            (Phase::Down, layers, layers * c.hidden * c.ffn),
            (Phase::LmHead, 1, c.vocab * c.hidden),
        ];
        // The file (SmolLM2-135M, Q4_1 with a Q8_0 embedding) is quantised throughout; f32
        // weights run no int8 products.
        let quantised = format.is_none();
        for (kind, calls, macs) in per_row {
            let t = p.get(kind);
            assert_eq!(t.calls, calls as u64, "{kind:?} {format:?}");
            assert_eq!(model.int8_matmul(kind), quantised, "{kind:?} {format:?}");
            let want = if quantised { (m * macs) as u64 } else { 0 };
            assert_eq!(t.int8_macs, want, "{kind:?} {format:?}");
            if quantised {
                assert!(t.int8_macs > 0, "{kind:?}");
            }
        }
        for (phase, calls) in [
            (Phase::Attention, layers),
            (Phase::Norm, 2 * layers + 1),
            (Phase::Rope, layers + 1),
            (Phase::Embedding, 1),
            (Phase::Elementwise, 3 * layers),
            (Phase::Logits, 0),
        ] {
            assert_eq!(p.get(phase).calls, calls as u64, "{phase:?} {format:?}");
            assert_eq!(p.get(phase).int8_macs, 0, "{phase:?}");
        }
        assert_eq!(p.forwards, 1);
        let in_forward: u64 = Phase::ALL.iter().filter(|ph| ph.in_forward()).map(|&ph| p.get(ph).nanos).sum();
        assert!(in_forward <= p.forward_nanos, "the phases are parts of the forward");
    }
}
