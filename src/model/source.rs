//! Where weights come from: a GGUF file or a Hugging Face model directory. The transformer
//! asks for tensors by their GGUF names; each source maps and converts.

use super::gguf::GgufFile;
use anyhow::Result;
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

pub trait TensorSource {
    /// Human-readable origin, for error messages.
    fn origin(&self) -> String;
    fn has_tensor(&self, gguf_name: &str) -> bool;
    /// A tensor by its GGUF name, in the source's own type (dense types for safetensors).
    fn qtensor(&mut self, gguf_name: &str, device: &Device) -> Result<QTensor>;
    /// A small tensor (norm weights, biases) as dense f32.
    fn dense(&mut self, gguf_name: &str, device: &Device) -> Result<Tensor> {
        Ok(self.qtensor(gguf_name, device)?.dequantize(device)?)
    }
}

impl TensorSource for GgufFile {
    fn origin(&self) -> String {
        self.path.display().to_string()
    }

    fn has_tensor(&self, gguf_name: &str) -> bool {
        GgufFile::has_tensor(self, gguf_name)
    }

    fn qtensor(&mut self, gguf_name: &str, device: &Device) -> Result<QTensor> {
        GgufFile::qtensor(self, gguf_name, device)
    }
}
