use super::portable::*;
use super::*;
use candle_core::{Device, Tensor};

const ALL_TYPES: [GgmlDType; 8] = [
    GgmlDType::Q8_0,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// Whether the type's blocks are 256 inputs (the k-quants).
fn super_blocks(dtype: GgmlDType) -> bool {
    matches!(dtype, GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K)
}

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..len)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
        })
        .collect()
}

const ALL_LEVELS: [ActivationLevels; 3] = [ActivationLevels::One, ActivationLevels::Outliers, ActivationLevels::Two];

fn packed(dtype: GgmlDType, n: usize, k: usize) -> (PackedMatrix, Vec<f32>) {
    packed_levels(dtype, n, k, ActivationLevels::Two)
}

fn packed_levels(dtype: GgmlDType, n: usize, k: usize, levels: ActivationLevels) -> (PackedMatrix, Vec<f32>) {
    let w = Tensor::from_vec(random(n * k, 7), (n, k), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, dtype).unwrap();
    let dense = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    (PackedMatrix::from_qtensor(&q, levels, true).unwrap().unwrap(), dense)
}

#[test]
fn kernels_equal_the_portable_loops_bitwise_and_every_row_count_agrees() {
    if !available() {
        eprintln!("skipped: no vector kernels on this CPU");
        return;
    }
    for (dtype, levels) in ALL_TYPES.into_iter().flat_map(|d| ALL_LEVELS.map(|l| (d, l))) {
        let (n, k) = (48, if super_blocks(dtype) { 768 } else { 576 });
        let (p, _) = packed_levels(dtype, n, k, levels);
        let x = with_outliers(random(19 * k, 11));
        let expected = matmul_portable(&p, &x);
        for isa in runnable_isas() {
            let all = p.matmul_on(&x, isa).unwrap();
            assert_eq!(all, expected, "{dtype:?} {isa:?}");
            for (r, row) in all.chunks_exact(n).enumerate() {
                let alone = p.matmul_on(&x[r * k..(r + 1) * k], isa).unwrap();
                assert_eq!(row, alone.as_slice(), "{dtype:?} {isa:?} row {r} alone");
            }
            let first = p.matmul_on(&x[..5 * k], isa).unwrap();
            assert_eq!(&all[..5 * n], first.as_slice(), "{dtype:?} {isa:?} first 5 rows");
        }
    }
}

/// Every pass size of every kernel: the first `m` rows of 32, for each `m` from 1 to 32 (passes
/// of 8 rows on VNNI and AVX2, of 16 on AMX, and their remainders), give bit for bit the
/// portable loops' rows, for every weight type and activation scheme.
#[test]
fn every_row_count_from_1_to_32_gives_each_row_its_one_row_result() {
    if !available() {
        eprintln!("skipped: no vector kernels on this CPU");
        return;
    }
    for (dtype, levels) in ALL_TYPES.into_iter().flat_map(|d| ALL_LEVELS.map(|l| (d, l))) {
        let (n, k) = (32, if super_blocks(dtype) { 512 } else { 320 });
        let (p, _) = packed_levels(dtype, n, k, levels);
        let x = with_outliers(random(32 * k, 23));
        let expected = matmul_portable(&p, &x);
        for isa in runnable_isas() {
            for m in 1..=32 {
                let got = p.matmul_on(&x[..m * k], isa).unwrap();
                assert!(got == expected[..m * n], "{dtype:?} {levels:?} {isa:?}: {m} rows");
            }
        }
    }
}

/// The real tiles where the CPU has them: the kernels through `tileloadd`/`tdpbsud` agree
/// with the scalar model of the tiles and with the VNNI kernels, bit for bit.
#[test]
fn amx_tiles_agree_with_their_model_and_the_vnni_kernels() {
    if isa() != Some(Isa::Avx512Vnni) || !amx::available() {
        eprintln!("SKIPPED (no AMX)");
        return;
    }
    for (dtype, levels) in ALL_TYPES.into_iter().flat_map(|d| ALL_LEVELS.map(|l| (d, l))) {
        let (n, k) = (64, if super_blocks(dtype) { 768 } else { 576 });
        let (p, _) = packed_levels(dtype, n, k, levels);
        let x = with_outliers(random(40 * k, 29));
        let vnni = p.matmul_on(&x, Isa::Avx512Vnni).unwrap();
        assert_eq!(p.matmul_on(&x, Isa::Amx).unwrap(), vnni, "{dtype:?} {levels:?}");
        assert_eq!(p.matmul_on(&x, Isa::AmxModel).unwrap(), vnni, "{dtype:?} {levels:?} model");
    }
}

/// `tdpbssd` on the model: signed A bytes times signed B bytes, summed per 4 into the i32
/// destination, which keeps what it held; bytes past a tile's configured rows and columns
/// read and write as zeros.
#[test]
fn the_tile_model_multiplies_signed_bytes_as_tdpbssd() {
    use amx::{TileConfig, TileModel, TileUnit};
    let (m, kk, nn) = (5usize, 3usize, 7usize); // rows, groups of 4 inputs, output columns
    let a: Vec<u8> = (0..m * 64).map(|i| (i * 37 % 256) as u8).collect();
    let b: Vec<u8> = (0..kk * 64).map(|i| (i * 91 % 256) as u8).collect();
    let mut c = vec![0u8; m * 64];
    let cfg =
        TileConfig::for_test(&[(m as u8, (nn * 4) as u16), (m as u8, (kk * 4) as u16), (kk as u8, (nn * 4) as u16)]);
    let mut unit = TileModel::new();
    unsafe {
        unit.configure(&cfg);
        unit.zero::<0>();
        unit.load::<1>(a.as_ptr(), 64);
        unit.load::<2>(b.as_ptr(), 64);
        unit.dot::<0, 1, 2>();
        unit.dot::<0, 1, 2>();
        unit.store::<0>(c.as_mut_ptr(), 64);
    }
    for row in 0..m {
        for col in 0..16 {
            let got = i32::from_le_bytes(c[row * 64 + 4 * col..][..4].try_into().unwrap());
            let want: i32 = if col < nn {
                2 * (0..4 * kk)
                    .map(|i| a[row * 64 + i] as i8 as i32 * b[(i / 4) * 64 + 4 * col + i % 4] as i8 as i32)
                    .sum::<i32>()
            } else {
                0
            };
            assert_eq!(got, want, "row {row} column {col}");
        }
    }
}

/// The largest integer sums the kernels can meet: every block's weights at the top of their
/// range (one value at the bottom sets the scale) against activations that all quantise to
/// +127 or −127. The AVX2 kernels add several groups' products in 16 bits before widening;
/// any overflow there would part them from the portable loops' 32-bit sums. Blocks of
/// subnormal values, whose reciprocal scale overflows (they used to quantise to −128 and
/// flip Q8_0's signed products on AVX2), count as zeros on every path.
#[test]
fn kernels_stay_exact_at_the_largest_integer_sums() {
    if !available() {
        eprintln!("skipped: no vector kernels on this CPU");
        return;
    }
    for dtype in ALL_TYPES {
        let (n, k) = (32, if super_blocks(dtype) { 512 } else { 256 });
        let w: Vec<f32> = (0..n * k).map(|i| if i % BLOCK == 0 { -1.0 } else { 0.999 }).collect();
        let q = QTensor::quantize(&Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap(), dtype).unwrap();
        for levels in ALL_LEVELS {
            let p = PackedMatrix::from_qtensor(&q, levels, true).unwrap().unwrap();
            let x: Vec<f32> = [1.0f32, -1.0, -1e-40, 1e-40].iter().flat_map(|&v| vec![v; k]).collect();
            let expected = matmul_portable(&p, &x);
            assert!(expected[..2 * n].iter().all(|v| v.abs() > 100.0), "{dtype:?} {levels:?}: {expected:?}");
            assert!(expected[2 * n..].iter().all(|&v| v == 0.0), "{dtype:?} {levels:?}: {expected:?}");
            for isa in runnable_isas() {
                assert_eq!(p.matmul_on(&x, isa).unwrap(), expected, "{dtype:?} {levels:?} {isa:?}");
            }
        }
    }
}

/// Every kernel family this CPU runs: on an AVX-512 machine the AVX2 kernels are checked too.
fn runnable_isas() -> Vec<Isa> {
    let mut isas = Vec::new();
    if isa() == Some(Isa::Avx512Vnni) {
        isas.push(Isa::Avx512Vnni);
        isas.push(Isa::AmxModel);
        if amx::available() {
            isas.push(Isa::Amx);
        }
    }
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
        isas.push(Isa::Avx2);
    }
    isas
}

#[test]
fn q8_0_extreme_weights_and_activations_stay_exact_on_every_kernel() {
    // Q8_0 weights and activations at +-127: AVX2 multiplies them through
    // 16-bit pair sums, which must not saturate.
    if !available() {
        eprintln!("skipped: no vector kernels on this CPU");
        return;
    }
    let (n, k) = (32, 256);
    let w: Vec<f32> = (0..n * k)
        .map(|i| {
            if i % 3 == 0 {
                -1.0
            } else if i % 3 == 1 {
                1.0
            } else {
                -0.5
            }
        })
        .collect();
    let q = QTensor::quantize(&Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap(), GgmlDType::Q8_0).unwrap();
    for levels in ALL_LEVELS {
        let p = PackedMatrix::from_qtensor(&q, levels, true).unwrap().unwrap();
        let x: Vec<f32> = (0..3 * k).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 }).collect();
        let expected = matmul_portable(&p, &x);
        for isa in runnable_isas() {
            assert_eq!(p.matmul_on(&x, isa).unwrap(), expected, "{isa:?} {levels:?}");
        }
    }
}

#[test]
fn prefill_sized_inputs_quantised_on_all_cores_agree_with_the_portable_loops() {
    if !available() {
        eprintln!("skipped: no vector kernels on this CPU");
        return;
    }
    let (n, k) = (32, 768);
    let rows = SERIAL_QUANT_BLOCKS * BLOCK / k + 3;
    for (dtype, levels) in ALL_TYPES.into_iter().flat_map(|d| ALL_LEVELS.map(|l| (d, l))) {
        let (p, _) = packed_levels(dtype, n, k, levels);
        let x = with_outliers(random(rows * k, 13));
        let expected = matmul_portable(&p, &x);
        for isa in runnable_isas() {
            assert_eq!(p.matmul_on(&x, isa).unwrap(), expected, "{dtype:?} {levels:?} {isa:?}");
        }
    }
}

#[test]
fn vector_and_portable_quantisation_agree_bitwise_down_to_subnormals() {
    // Small activations put the remainders' scales far down f32's range; both paths must
    // round them alike. (Below ~1e-36 the first scale itself is subnormal and its inverse
    // overflows, in llama.cpp's arithmetic too; activations never come near that.)
    for magnitude in [1.0f32, 1e-3, 1e-5, 1e-7, 1e-9, 1e-30, 0.0] {
        let x: Vec<f32> = random(8 * BLOCK, 3).iter().map(|v| v * magnitude).collect();
        let n = x.len() / BLOCK;
        let mut fast = (vec![0i8; x.len()], vec![0i8; x.len()], vec![ActBlock::default(); n]);
        let mut slow = fast.clone();
        quantize_range(&x, &mut fast.0, &mut fast.1, &mut fast.2, true);
        quantize_range_portable(&x, &mut slow.0, &mut slow.1, &mut slow.2, true);
        assert_eq!((&fast.0, &fast.1), (&slow.0, &slow.1), "{magnitude}");
        let bits = |b: &[ActBlock]| {
            b.iter()
                .map(|a| (a.d.to_bits(), a.d_r.to_bits(), a.sum, a.sum_r, a.sum_lo, a.sum_r_lo, a.s.to_bits()))
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&fast.2), bits(&slow.2), "{magnitude}");
        // The AVX2 path too, which AVX-512 machines skip above.
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            let mut avx2 = (vec![0i8; x.len()], vec![0i8; x.len()], vec![ActBlock::default(); n]);
            for two_level in [true, false] {
                quantize_range_portable(&x, &mut slow.0, &mut slow.1, &mut slow.2, two_level);
                // SAFETY: the features were detected.
                unsafe { avx2::quantize_range(&x, &mut avx2.0, &mut avx2.1, &mut avx2.2, two_level) };
                assert_eq!(avx2.0, slow.0, "AVX2 {magnitude} {two_level}");
                if two_level {
                    assert_eq!(avx2.1, slow.1, "AVX2 {magnitude}");
                }
                assert_eq!(bits(&avx2.2), bits(&slow.2), "AVX2 {magnitude} {two_level}");
            }
        }
    }
}

#[test]
fn vector_and_portable_outlier_scans_agree() {
    for seed in 0..200u64 {
        let mut xs = random(BLOCK, seed);
        // Ties and zeros as well as distinct values.
        if seed % 3 == 0 {
            xs[(seed as usize * 7) % BLOCK] = xs[(seed as usize * 5) % BLOCK];
        }
        if seed % 5 == 0 {
            xs.iter_mut().step_by(2).for_each(|v| *v = 0.0);
        }
        let taken = (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32
            & if seed % 2 == 0 { 0x0101_0101 } else { u32::MAX };
        assert_eq!(largest_untaken(&xs, taken), largest_untaken_portable(&xs, taken), "seed {seed}");
    }
    assert_eq!(largest_untaken(&[1.0; BLOCK], u32::MAX), (BLOCK, 0.0));
}

#[test]
fn results_are_close_to_the_dense_product() {
    if !available() {
        eprintln!("skipped: no vector kernels on this CPU");
        return;
    }
    for dtype in ALL_TYPES {
        let (n, k) = (32, if super_blocks(dtype) { 512 } else { 96 });
        let (p, dense) = packed(dtype, n, k);
        let x = random(3 * k, 5);
        let got = p.matmul(&x).unwrap();
        for r in 0..3 {
            for c in 0..n {
                let exact: f32 = (0..k).map(|i| x[r * k + i] * dense[c * k + i]).sum();
                let norm: f32 = (0..k).map(|i| (x[r * k + i] * dense[c * k + i]).abs()).sum();
                // Two levels leave each activation within max|x|/(2·127·254) or so:
                // ~1e-5 of the terms' sum, against ~2e-3 for one level.
                let err = (got[r * n + c] - exact).abs();
                assert!(err <= 1e-4 * norm, "{dtype:?} {r},{c}: {} vs {exact}", got[r * n + c]);
            }
        }
    }
}

/// One value in every 7th block of 32 set to ±40 (the others within ±2), as activations' outlier channels
/// are: the outliers setting then takes it out of its block, and leaves the others alone.
fn with_outliers(mut x: Vec<f32>) -> Vec<f32> {
    for (b, block) in x.chunks_exact_mut(BLOCK).enumerate() {
        if b % 7 == 3 {
            block[b % BLOCK] = if b % 2 == 0 { 40.0 } else { -40.0 };
        }
    }
    x
}

#[test]
fn outliers_leave_their_blocks_and_land_between_one_and_two_levels() {
    if !available() {
        eprintln!("skipped: no vector kernels on this CPU");
        return;
    }
    let (n, k) = (32, 1024);
    let x = with_outliers(random(4 * k, 17));
    let rows = QuantizedRows::new(&x, k, ActivationLevels::Outliers);
    let taken: Vec<usize> =
        (0..4).flat_map(|r| rows.outliers(r).iter().map(move |o| r * 32 + o.block as usize)).collect();
    assert_eq!(taken, (0..4 * 32).filter(|b| b % 7 == 3).collect::<Vec<_>>());
    for o in (0..4).flat_map(|r| rows.outliers(r)) {
        assert_eq!(o.at as usize, (o.block as usize) % BLOCK);
    }
    for dtype in ALL_TYPES {
        let err = |levels| {
            let (p, dense) = packed_levels(dtype, n, k, levels);
            let got = p.matmul(&x).unwrap();
            let mut sq = 0f64;
            for r in 0..4 {
                for c in 0..n {
                    let exact: f64 = (0..k).map(|i| x[r * k + i] as f64 * dense[c * k + i] as f64).sum();
                    sq += (got[r * n + c] as f64 - exact).powi(2);
                }
            }
            sq.sqrt()
        };
        let (one, outliers, two) =
            (err(ActivationLevels::One), err(ActivationLevels::Outliers), err(ActivationLevels::Two));
        // The outliers' blocks carry 400× the others' squared error, so taking the
        // outliers out removes most of it.
        assert!(outliers < 0.3 * one && two < outliers, "{dtype:?}: one {one} outliers {outliers} two {two}");
    }
}

#[test]
fn other_types_and_shapes_are_refused() {
    assert!(!supports(GgmlDType::Q8_0, 24, 64));
    assert!(!supports(GgmlDType::Q4_1, 32, 48));
    assert!(supports(GgmlDType::Q4K, 32, 256) && !supports(GgmlDType::Q4K, 32, 224));
    assert!(
        supports(GgmlDType::Q6K, 32, 512) && supports(GgmlDType::Q5K, 32, 256) && !supports(GgmlDType::Q5K, 32, 96)
    );
    assert!(
        supports(GgmlDType::Q8_0, 32, 64) && supports(GgmlDType::Q4_1, 32, 64) && supports(GgmlDType::Q4_0, 32, 64)
    );
    assert!(supports(GgmlDType::Q5_0, 32, 64) && supports(GgmlDType::Q5_1, 32, 64));
    assert!(
        !supports(GgmlDType::Q3K, 32, 256) && !supports(GgmlDType::Q2K, 32, 256) && !supports(GgmlDType::F16, 32, 64)
    );
}

/// `len` reproducible bytes: any bit pattern, as a file's blocks may hold.
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = 0x2545_f491_4f6c_dd1d ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// `check(block, j, lane)` for 50 random super-blocks of `bytes` bytes, each of their blocks
/// `j` and lanes at both ends of a tile and inside it.
fn each_block_and_lane(bytes: usize, mut check: impl FnMut(&[u8], usize, usize)) {
    for seed in 0..50 {
        let block = random_bytes(bytes, seed);
        for j in 0..BLOCKS_PER_SUPER {
            for lane in [0, 5, TILE_N - 1] {
                check(&block, j, lane);
            }
        }
    }
}

/// Packing a Q4_K block straight from its bytes gives what unpacking its values first does,
/// for every block of a super-block and every lane.
#[test]
fn q4k_blocks_repack_as_their_values_pack() {
    each_block_and_lane(Q4K_BYTES, |block, j, lane| {
        let (values, _) = q4k_values(block);
        let (mut want, mut got) = (vec![0u8; TILE_N * BLOCK / 2], vec![0u8; TILE_N * BLOCK / 2]);
        pack_nibbles(&values[j * BLOCK..(j + 1) * BLOCK], &mut want, 0, lane);
        repack_q4k_block(block, j, &mut got, 0, lane);
        assert_eq!(got, want, "block {j} lane {lane}");
    });
}

/// The same for Q6_K: nibbles, top bits and lanes as the values' packing gives them.
#[test]
fn q6k_blocks_repack_as_their_values_pack() {
    each_block_and_lane(Q6K_BYTES, |block, j, lane| {
        let (values, scales) = q6k_values(block);
        assert_eq!((scales[2 * j], scales[2 * j + 1]), (block[192 + 2 * j] as i8, block[193 + 2 * j] as i8));
        let vals = &values[j * BLOCK..(j + 1) * BLOCK];
        let (mut qs_want, mut qh_want) = (vec![0u8; TILE_N * BLOCK / 2], vec![0u8; TILE_N * BLOCK / 4]);
        pack_nibbles(vals, &mut qs_want, 0, lane);
        for (input, v) in vals.iter().enumerate() {
            let (g, i) = (input / 4, input % 4);
            qh_want[((g / 4) * TILE_N + lane) * 4 + i] |= (v >> 4) << (2 * (g % 4));
        }
        let (mut qs, mut qh) = (vec![0u8; TILE_N * BLOCK / 2], vec![0u8; TILE_N * BLOCK / 4]);
        repack_q6k_block(block, j, (&mut qs, 0), (&mut qh, 0), lane);
        assert_eq!((qs, qh), (qs_want, qh_want), "block {j} lane {lane}");
    });
}
