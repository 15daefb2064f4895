//! Streaming detokenisation: turn generated ids into text one token at a time.
//!
//! Byte-level BPE tokens can hold part of a UTF-8 character (an emoji is often split over
//! two or three tokens), so text is only released once its bytes form whole characters.
//! The concatenation of everything `push` and `finish` return equals
//! `Tokenizer::decode(all_ids, skip_special)`, including U+FFFD for invalid bytes.

use super::gguf_bpe::Tokenizer;

/// Incremental decoder for one generated sequence.
#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    skip_special: bool,
    /// Bytes of a character whose remaining bytes have not arrived yet (at most 3).
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new(skip_special: bool) -> Self {
        Self { skip_special, pending: Vec::new() }
    }

    /// Feeds one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.push_bytes(tokenizer.piece(id, self.skip_special))
    }

    /// Feeds raw piece bytes; returns the newly completed text.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut consumed = 0;
        loop {
            match std::str::from_utf8(&self.pending[consumed..]) {
                Ok(valid) => {
                    out.push_str(valid);
                    consumed = self.pending.len();
                    break;
                }
                Err(err) => {
                    let valid_end = consumed + err.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&self.pending[consumed..valid_end]));
                    match err.error_len() {
                        // Invalid whatever follows: replace it now, exactly as a whole-sequence
                        // lossy decode would (one U+FFFD per maximal invalid sequence).
                        Some(invalid_len) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            consumed = valid_end + invalid_len;
                        }
                        // A character cut short by the end of the buffer: wait for more bytes.
                        None => {
                            consumed = valid_end;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        out
    }

    /// Ends the sequence: releases any held-back bytes (an unfinished character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }

    /// Whether bytes are held back waiting for the rest of a character.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream_all(chunks: &[&[u8]]) -> (Vec<String>, String) {
        let mut decoder = StreamDecoder::new(false);
        let mut outputs: Vec<String> = chunks.iter().map(|c| decoder.push_bytes(c)).collect();
        outputs.push(decoder.finish());
        let joined = outputs.concat();
        (outputs, joined)
    }

    #[test]
    fn holds_back_partial_utf8_until_the_character_completes() {
        let rocket = "🚀".as_bytes(); // F0 9F 9A 80
        let (outputs, joined) = stream_all(&[b"go ", &rocket[..1], &rocket[1..3], &rocket[3..], b"!"]);
        assert_eq!(outputs, vec!["go ", "", "", "🚀", "!", ""]);
        assert_eq!(joined, "go 🚀!");
    }

    #[test]
    fn two_byte_and_three_byte_characters_split_across_pieces() {
        let text = "héllo 世界";
        let bytes = text.as_bytes();
        // Feed one byte at a time: no output may ever contain a broken character.
        let chunks: Vec<&[u8]> = bytes.chunks(1).collect();
        let (outputs, joined) = stream_all(&chunks);
        assert_eq!(joined, text);
        assert!(outputs.iter().all(|s| !s.contains(char::REPLACEMENT_CHARACTER)));
        // 'é' (2 bytes) appears exactly when its second byte arrives.
        assert_eq!(outputs[1], "");
        assert_eq!(outputs[2], "é");
    }

    #[test]
    fn invalid_bytes_match_whole_sequence_lossy_decode() {
        // Stray continuation byte, a truncated 3-byte char followed by ASCII, a truncated tail.
        let chunks: [&[u8]; 5] = [b"a\x80", b"\xe4\xb8", b"b", b"\xf0\x9f", b"\x9a"];
        let whole: Vec<u8> = chunks.concat();
        let (_, joined) = stream_all(&chunks);
        assert_eq!(joined, String::from_utf8_lossy(&whole));
        assert_eq!(joined, "a\u{FFFD}\u{FFFD}b\u{FFFD}");
    }

    #[test]
    fn finish_flushes_and_resets() {
        let mut decoder = StreamDecoder::new(false);
        assert_eq!(decoder.push_bytes(&"世".as_bytes()[..2]), "");
        assert!(decoder.has_pending());
        assert_eq!(decoder.finish(), "\u{FFFD}");
        assert!(!decoder.has_pending());
        assert_eq!(decoder.push_bytes("ok".as_bytes()), "ok");
    }
}

#[cfg(test)]
mod model_tests {
    use super::*;
    use crate::tokenize::test_models::{self, ROUND_TRIP_TEXTS};

    fn stream(tokenizer: &Tokenizer, ids: &[u32], skip_special: bool) -> Vec<String> {
        let mut decoder = StreamDecoder::new(skip_special);
        let mut outputs: Vec<String> = ids.iter().map(|&id| decoder.push(tokenizer, id)).collect();
        outputs.push(decoder.finish());
        outputs
    }

    #[test]
    fn streamed_text_equals_whole_decode() {
        for (key, model, _) in test_models::all_available() {
            let tok = &model.tokenizer;
            for text in ROUND_TRIP_TEXTS {
                let ids = tok.encode(text, false).unwrap();
                for skip_special in [false, true] {
                    let outputs = stream(tok, &ids, skip_special);
                    assert_eq!(outputs.concat(), tok.decode(&ids, skip_special), "{key}: {text:?}");
                    // Never a broken character mid-stream: these texts are valid UTF-8.
                    assert!(outputs.iter().all(|s| !s.contains(char::REPLACEMENT_CHARACTER)), "{key}: {outputs:?}");
                }
            }
        }
    }

    #[test]
    fn emoji_split_over_tokens_is_released_whole() {
        let Some(model) = test_models::smollm2() else {
            return;
        };
        let tok = &model.tokenizer;
        let ids = tok.encode("🚀", false).unwrap();
        assert!(ids.len() > 1, "expected the emoji to span several tokens: {ids:?}");
        let outputs = stream(tok, &ids, false);
        // Nothing comes out until the last byte of the emoji arrives.
        let mut expected = vec![String::new(); ids.len() + 1];
        expected[ids.len() - 1] = "🚀".to_string();
        assert_eq!(outputs, expected);
        // A space sharing a token with the emoji's first bytes is released at once.
        let ids = tok.encode(" 🚀", false).unwrap();
        let outputs = stream(tok, &ids, false);
        assert_eq!(outputs[0], " ");
        assert_eq!(outputs.concat(), " 🚀");
    }
}
