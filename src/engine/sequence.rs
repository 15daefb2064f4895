//! One request's decoding state.

use crate::kv::SeqCache;
use crate::sample::{SamplerRng, SamplingParams};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The model's context (or the KV pool) is full.
    ContextFull,
    /// The consumer stopped listening.
    Cancelled,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub fn openai(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length | FinishReason::ContextFull => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Committed tokens and the KV cache behind them.
///
/// Invariant: the cache holds K/V for every committed token except the last one, which is
/// the pending input of the next step (after prefill, the pending token is the first one
/// sampled). So a step's input is `tokens[cache.len()..]` followed by the draft.
pub struct Sequence {
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub cache: SeqCache,
    pub params: SamplingParams,
    pub rng: SamplerRng,
}

impl Sequence {
    pub fn new(prompt: &[u32], cache: SeqCache, params: SamplingParams) -> Self {
        let rng = SamplerRng::for_params(&params);
        Self { tokens: prompt.to_vec(), prompt_len: prompt.len(), cache, params, rng }
    }

    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Tokens not yet in the cache: the whole prompt before prefill, then one.
    pub fn pending(&self) -> &[u32] {
        &self.tokens[self.cache.len()..]
    }

    pub fn is_prefilled(&self) -> bool {
        self.tokens.len() > self.prompt_len
    }
}
