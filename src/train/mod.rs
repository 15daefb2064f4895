//! Training DFlash drafters: the data they learn from, made by the target itself.
//!
//! - [`data`]: `specula train data`: the target answers prompts on the batching engine and the
//!   prompt + response token ids (with a loss mask over the response) are written as JSON-line
//!   shards, resumably. Evaluation sets are refused ([`data::EVAL_SETS`]).

pub mod data;
