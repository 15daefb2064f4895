//! Models: GGUF weights, architectures, and one forward over a packed batch of sequences that
//! returns the logits rows and hidden-state taps asked for.

pub mod accuracy;
mod batch;
mod config;
mod elementwise;
mod gguf;
mod hf;
mod kernels;
mod linear;
pub mod profile;
mod quant_matmul;
mod rope;
mod source;
mod transformer;

pub use batch::{ForwardBatch, ForwardOutput, LogitsRows, SeqInput};
pub use config::{Activation, Arch, DecoderExtras, Llama3Rope, ModelConfig, RopeStyle, SlidingWindow};
pub use gguf::GgufFile;
pub use hf::HfModelDir;
pub use kernels::{env_flag, repacked_q8_available, ActivationLevels, KernelSettings, WeightFormat};
pub use linear::Linear;
pub use source::TensorSource;
pub use transformer::Transformer;
