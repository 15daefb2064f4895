//! Draft-model proposer: a smaller model with the same tokenizer, drafting autoregressively.
