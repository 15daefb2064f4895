//! Which kernels run the matmuls, in one place: the weight format and the on/off switches,
//! read from the environment once ([`KernelSettings::from_env`]) and passed to the loader.
//! docs/kernels.md lists every environment variable the project reads.

use super::gguf::WeightFormat;

/// Kernel choices for loading a model. The default is what runs without any setting: the
/// measured weight format for the file and every kernel the CPU has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSettings {
    /// Weight format in memory; `None` picks the measured default for the file
    /// ([`WeightFormat::default_for`]).
    pub weights: Option<WeightFormat>,
    /// Our AVX-512 VNNI kernels for Q8_0, Q4_1 and Q5_0 matrices (`vnni_matmul`), where the
    /// CPU has them. Off: those types run on candle's kernels.
    pub vnni_kernels: bool,
    /// candle's repacked Q8_0 kernel for input widths that are not multiples of 256, by
    /// zero-padding them (`linear`), where the CPU has VNNI dot products.
    pub candle_repack: bool,
    /// candle's AMX kernel for Q4_K batches of 32 rows or more, where the CPU has AMX. It
    /// keeps its own one-byte-per-weight copy of every Q4_K matrix (+1.4 GB for
    /// Qwen2.5-1.5B); off, such batches run in chunks below the threshold (same results).
    pub amx: bool,
    /// How our kernels quantise activations (docs/kernels.md).
    pub activation_levels: ActivationLevels,
}

/// How our kernels quantise each block of 32 activations: one 8-bit level (llama.cpp's
/// arithmetic); one level with each row's outliers (the largest value of the blocks whose
/// scale is large) taken out and multiplied in f32 (the default: worst-step log-prob errors
/// 1.1–5× smaller than llama.cpp's, about a tenth more prefill time than one level); or a second
/// 8-bit level for what the first leaves over (within f32 rounding of the dense product, twice
/// the integer dot products). See `vnni_matmul`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationLevels {
    One,
    Outliers,
    Two,
}

impl ActivationLevels {
    fn parse(name: &str, value: &str) -> Option<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "one" | "1" => Some(Self::One),
            "outliers" => Some(Self::Outliers),
            "two" | "2" => Some(Self::Two),
            "" => None,
            other => {
                eprintln!("warning: {name}={other:?} is not one, outliers or two; ignored");
                None
            }
        }
    }
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
