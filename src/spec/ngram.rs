//! N-gram prompt-lookup proposer.
