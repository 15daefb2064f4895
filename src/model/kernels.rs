//! Which kernels run the matmuls, in one place: the weight format and the on/off switches,
//! read from the environment once ([`KernelSettings::from_env`]) and passed to the loader.
//! docs/kernels.md lists every environment variable the project reads.

use super::gguf::GgufFile;
use super::quant_matmul;
pub use super::quant_matmul::ActivationLevels;
use anyhow::{bail, Result};
use candle_core::quantized::GgmlDType;

/// How matmul weights are held in memory. `Native` keeps the file's types; the others
/// convert at load time (candle runs Q4_1/Q5_0 with scalar code on x86, Q8_0/Q4_0 with AVX2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    Native,
    Q8_0,
    Q4_0,
    F16,
    F32,
}

impl WeightFormat {
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "native" => Self::Native,
            "q8_0" => Self::Q8_0,
            "q4_0" => Self::Q4_0,
            "f16" => Self::F16,
            "f32" => Self::F32,
            other => bail!("unknown weight format `{other}` (expected native, q8_0, q4_0, f16 or f32)"),
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Q8_0 => "q8_0",
            Self::Q4_0 => "q4_0",
            Self::F16 => "f16",
            Self::F32 => "f32",
        }
    }

    /// The default for a file, chosen by measurement (docs/performance.md): keep the file's
    /// types where there are fast kernels for them (ours for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and
    /// the Q4_K/Q5_K/Q6_K k-quants on CPUs with AVX-512 VNNI or AVX2, candle's repacked ones for
    /// widths that are multiples of 256); otherwise convert to Q8_0, which runs on our kernel
    /// (or, without them, is padded onto candle's repacked one; see `linear`). Without our
    /// kernels, Q4_0/Q4_1/Q5_0/Q5_1 run scalar in candle, and any width that is not a multiple
    /// of 256 misses its repacked kernels. `kernels` says which kernels may run (its `weights`
    /// is not read here).
    pub fn default_for(file: &GgufFile, kernels: &KernelSettings) -> Self {
        let slow = file.content.tensor_infos.iter().filter(|(name, _)| name.starts_with("blk.")).any(|(_, t)| {
            let dims = t.shape.dims();
            let k = dims.last().copied().unwrap_or(0);
            let ours = t.shape.rank() == 2 && kernels.packed_kernels_take(t.ggml_dtype, dims[0], k);
            !ours
                && (matches!(t.ggml_dtype, GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1 | GgmlDType::Q4_0)
                    || (t.shape.rank() == 2 && k % 256 != 0 && repacked_q8_available(kernels)))
        });
        if slow {
            Self::Q8_0
        } else {
            Self::Native
        }
    }
}

/// Whether candle's repacked Q8_0 kernel is allowed (`kernels.candle_repack`) and runs on this
/// CPU (it needs VNNI dot products).
pub fn repacked_q8_available(kernels: &KernelSettings) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        kernels.candle_repack
            && ((is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni"))
                || (is_x86_feature_detected!("avxvnni") && is_x86_feature_detected!("avx2")))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = kernels;
        false
    }
}

/// Kernel choices for loading a model. The default is what runs without any setting: the
/// measured weight format for the file and every kernel the CPU has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSettings {
    /// Weight format in memory; `None` picks the measured default for the file
    /// ([`WeightFormat::default_for`]).
    pub weights: Option<WeightFormat>,
    /// Our AVX-512 VNNI kernels for Q8_0, Q4_1 and Q5_0 matrices (`quant_matmul`), where the
    /// CPU has them. Off: those types run on candle's kernels.
    pub vnni_kernels: bool,
    /// candle's repacked Q8_0 kernel for input widths that are not multiples of 256, by
    /// zero-padding them (`linear`), where the CPU has VNNI dot products.
    pub candle_repack: bool,
    /// AMX tiles where the CPU has them: our kernels' matmuls of more than 8 rows
    /// (`quant_matmul::amx`, the same results as VNNI), and candle's AMX kernel for the Q4_K
    /// batches of 32 rows or more that ours do not take (it keeps its own one-byte-per-weight
    /// copy of those matrices). Off, everything runs on VNNI, and such candle batches in
    /// chunks below its threshold (same results).
    pub amx: bool,
    /// How our kernels quantise activations (docs/kernels.md).
    pub activation_levels: ActivationLevels,
}

impl Default for KernelSettings {
    fn default() -> Self {
        Self {
            weights: None,
            vnni_kernels: true,
            candle_repack: true,
            amx: true,
            activation_levels: ActivationLevels::Outliers,
        }
    }
}

/// Switch name, deprecated aliases still honoured.
const NO_VNNI_KERNELS: (&str, &[&str]) = ("SPECULA_NO_VNNI_KERNELS", &["SPECULA_NO_Q8_KERNEL"]);
const NO_CANDLE_REPACK: (&str, &[&str]) = ("SPECULA_NO_CANDLE_REPACK", &["SPECULA_NO_PAD"]);
const NO_AMX: (&str, &[&str]) = ("SPECULA_NO_AMX", &[]);
const ACTIVATION_LEVELS: &str = "SPECULA_ACTIVATION_LEVELS";
/// Deprecated: `SPECULA_ACTIVATION_LEVELS=one`.
const ONE_LEVEL_ACTIVATIONS: &str = "SPECULA_ONE_LEVEL_ACTIVATIONS";

impl KernelSettings {
    /// The settings from the environment: `SPECULA_NO_VNNI_KERNELS`, `SPECULA_NO_CANDLE_REPACK`,
    /// `SPECULA_NO_AMX` (see [`env_flag`]) and `SPECULA_ACTIVATION_LEVELS` (`one`, `outliers`
    /// or `two`). Read on the first call only, so every model of a process loads with the same
    /// kernels.
    pub fn from_env() -> Self {
        static SETTINGS: std::sync::OnceLock<KernelSettings> = std::sync::OnceLock::new();
        *SETTINGS.get_or_init(|| {
            let off = |(name, aliases): (&str, &[&str])| {
                std::iter::once(name).chain(aliases.iter().copied()).any(|n| {
                    let on = env_flag(n);
                    if on && n != name {
                        eprintln!("warning: {n} is deprecated; use {name}");
                    }
                    on
                })
            };
            Self {
                weights: None,
                vnni_kernels: !off(NO_VNNI_KERNELS),
                candle_repack: !off(NO_CANDLE_REPACK),
                amx: !off(NO_AMX),
                activation_levels: activation_levels_from_env(),
            }
        })
    }

    /// Whether a `[n, k]` matrix of `dtype` runs on our packed kernels (`quant_matmul`): they
    /// are allowed, this CPU runs them, and they take that type and shape. The one place this
    /// is decided, for the default weight format and for loading each matrix.
    pub fn packed_kernels_take(&self, dtype: GgmlDType, n: usize, k: usize) -> bool {
        self.vnni_kernels && quant_matmul::available() && quant_matmul::supports(dtype, n, k)
    }

    /// The same settings with a weight format (`None`: the file's default).
    pub fn with_weights(self, weights: Option<WeightFormat>) -> Self {
        Self { weights, ..self }
    }
}

fn activation_levels_from_env() -> ActivationLevels {
    if let Some(levels) =
        std::env::var(ACTIVATION_LEVELS).ok().and_then(|v| ActivationLevels::parse(ACTIVATION_LEVELS, &v))
    {
        return levels;
    }
    if env_flag(ONE_LEVEL_ACTIVATIONS) {
        eprintln!("warning: {ONE_LEVEL_ACTIVATIONS} is deprecated; use {ACTIVATION_LEVELS}=one");
        return ActivationLevels::One;
    }
    KernelSettings::default().activation_levels
}

/// An on/off setting from the environment, parsed one way for every switch: `1`, `true`,
/// `yes` or `on` (any case) is on; absent, empty, `0`, `false`, `no` or `off` is off. Any
/// other value is off, with a warning.
pub fn env_flag(name: &str) -> bool {
    parse_flag(name, std::env::var(name).ok().as_deref())
}

fn parse_flag(name: &str, value: Option<&str>) -> bool {
    let Some(v) = value else { return false };
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => true,
        "" | "0" | "false" | "no" | "off" => false,
        other => {
            eprintln!("warning: {name}={other:?} is not a boolean (1/true/yes/on or 0/false/no/off); taken as off");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_parse_one_way() {
        for on in ["1", "true", "TRUE", "yes", "On", " 1 "] {
            assert!(parse_flag("X", Some(on)), "{on:?}");
        }
        for off in ["", "0", "false", "no", "off", "2", "maybe"] {
            assert!(!parse_flag("X", Some(off)), "{off:?}");
        }
        assert!(!parse_flag("X", None));
    }

    #[test]
    fn activation_levels_parse() {
        assert_eq!(ActivationLevels::parse("X", "One"), Some(ActivationLevels::One));
        assert_eq!(ActivationLevels::parse("X", " outliers"), Some(ActivationLevels::Outliers));
        assert_eq!(ActivationLevels::parse("X", "2"), Some(ActivationLevels::Two));
        assert_eq!(ActivationLevels::parse("X", "three"), None);
        assert_eq!(ActivationLevels::parse("X", ""), None);
    }

    #[test]
    fn defaults_turn_every_kernel_on() {
        let d = KernelSettings::default();
        assert!(d.vnni_kernels && d.candle_repack && d.amx && d.weights.is_none());
        assert_eq!(d.activation_levels, ActivationLevels::Outliers);
        assert_eq!(d.with_weights(Some(WeightFormat::F32)).weights, Some(WeightFormat::F32));
    }
}
