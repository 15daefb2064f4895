//! Models: GGUF weights, architectures, and one forward over a packed batch of sequences that
//! returns the logits rows and hidden-state taps asked for.

pub mod accuracy;
mod batch;
mod config;
mod elementwise;
mod gguf;
mod hf;
mod linear;
mod rope;
mod source;
mod transformer;
mod vnni_matmul;

pub use batch::{ForwardBatch, ForwardOutput, LogitsRows, SeqInput};
pub use config::{Arch, ModelConfig, RopeStyle};
pub use gguf::{GgufFile, WeightFormat};
pub use hf::HfModelDir;
pub use linear::{repacked_q8_available, Linear};
pub use source::TensorSource;
pub use transformer::Transformer;

/// An on/off setting from the environment: set, non-empty and not "0".
fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0")
}
