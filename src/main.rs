fn main() {
    configure_thread_pools();
    std::process::exit(specula::cli::main());
}

/// candle runs quantized matmuls (and our attention) on its own pool, whose idle workers spin
/// between operations, and its element-wise ops on a rayon pool. Both sized to every core
/// means the element-wise ops share the cores with spinning workers: about 8% of batched
/// decode throughput here (docs/benchmarks/serving.md). So rayon gets one thread unless the
/// user sized the pools; the matmul pool keeps candle's default. Training is the exception:
/// its backward pass is mostly large element-wise ops, which run about 15% faster with rayon on
/// every core (`train dflash` on SmolLM2: 383–393 scored block rows/s against 303–338).
/// Runs before any thread starts.
fn configure_thread_pools() {
    if std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return;
    }
    let training = std::env::args().nth(1).is_some_and(|a| a == "train");
    if training {
        return;
    }
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        // Read before RAYON_NUM_THREADS is set: it is candle's default from the CPU topology.
        std::env::set_var("CANDLE_NUM_THREADS", candle_core::utils::get_num_threads().to_string());
    }
    std::env::set_var("RAYON_NUM_THREADS", "1");
}
