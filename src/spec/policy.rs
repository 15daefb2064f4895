//! Draft-length policy: fixed, or adaptive from the verify-cost curve and acceptance.
