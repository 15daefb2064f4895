//! SentencePiece-style tokenizers ("llama" model in GGUF terms: Llama 2, Gemma), encoded the
//! way llama.cpp encodes them, so prompts get the same ids.
//!
//! Text is cut at special tokens first (control and user-defined tokens written in the text
//! are single tokens, the longest matched first), spaces become `▁`, and each remaining
//! piece starts as one symbol per character. Then, over and over, the adjacent pair whose
//! concatenation is the vocabulary token with the highest score is merged (ties: the
//! leftmost pair). A final symbol that is not a token is spelled as `<0xXX>` byte tokens.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// The SentencePiece word-boundary mark that stands for a space.
pub const SPACE_MARK: char = '\u{2581}';

/// The encoder's view of a vocabulary: token text → id, scores, and the special tokens
/// matched whole.
pub struct SpmEncoder {
    text_to_id: HashMap<String, u32>,
    scores: Vec<f32>,
    /// Matched whole in text, longest first (ties by id).
    specials: Vec<(String, u32)>,
    /// `<0xXX>` ids by byte value, or the single-byte token, or `unk`.
    byte_ids: [Option<u32>; 256],
    unk: Option<u32>,
    /// Prepend a space to text at the start and after each special token (Llama 2: yes,
    /// Gemma: no; `tokenizer.ggml.add_space_prefix`).
    add_space_prefix: bool,
}

/// A candidate merge of two adjacent symbols.
struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// Highest score first; among equal scores, the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.left.cmp(&self.left))
    }
}

/// A symbol of the piece being merged: bytes `start..start+len` of the text, linked to its
/// neighbours (`usize::MAX` for none).
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

const NONE: usize = usize::MAX;

impl SpmEncoder {
    /// `texts`, `scores`: the vocabulary; `whole`: which ids are matched whole in text.
    pub fn new(
        texts: &[String],
        scores: Vec<f32>,
        whole: impl Fn(u32) -> bool,
        unk: Option<u32>,
        add_space_prefix: bool,
    ) -> Self {
        let text_to_id: HashMap<String, u32> = texts.iter().enumerate().map(|(id, t)| (t.clone(), id as u32)).collect();
        let mut specials: Vec<(String, u32)> = texts
            .iter()
            .enumerate()
            .filter(|(id, t)| !t.is_empty() && whole(*id as u32))
            .map(|(id, t)| (t.clone(), id as u32))
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let byte_ids = std::array::from_fn(|b| {
            text_to_id
                .get(&format!("<0x{b:02X}>"))
                .or_else(|| (b < 0x80).then(|| text_to_id.get(&(b as u8 as char).to_string())).flatten())
                .copied()
                .or(unk)
        });
        Self { text_to_id, scores, specials, byte_ids, unk, add_space_prefix }
    }

    /// Text → ids (no BOS/EOS).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut prev_special = true;
        for fragment in self.partition(text) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(piece) => {
                    let mut escaped = String::with_capacity(piece.len() + 3);
                    if self.add_space_prefix && prev_special {
                        escaped.push(SPACE_MARK);
                    }
                    escaped.extend(piece.chars().map(|c| if c == ' ' { SPACE_MARK } else { c }));
                    self.encode_piece(&escaped, &mut out);
                    prev_special = false;
                }
            }
        }
        out
    }

    /// Cuts `text` at special tokens: each special token, longest first, splits every piece
    /// of text not yet matched at all its occurrences (llama.cpp's partition).
    fn partition<'t>(&self, text: &'t str) -> Vec<Fragment<'t>> {
        let mut fragments = vec![Fragment::Text(text)];
        for (special, id) in self.specials.iter().filter(|(s, _)| text.contains(s.as_str())) {
            let mut next = Vec::with_capacity(fragments.len());
            for fragment in fragments {
                let Fragment::Text(mut rest) = fragment else {
                    next.push(fragment);
                    continue;
                };
                while let Some(at) = rest.find(special.as_str()) {
                    if at > 0 {
                        next.push(Fragment::Text(&rest[..at]));
                    }
                    next.push(Fragment::Token(*id));
                    rest = &rest[at + special.len()..];
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            fragments = next;
        }
        fragments
    }

    /// One piece of escaped text (no special tokens in it) → ids, appended to `out`.
    fn encode_piece(&self, text: &str, out: &mut Vec<u32>) {
        let mut symbols: Vec<Symbol> = text
            .char_indices()
            .enumerate()
            .map(|(i, (start, c))| Symbol { start, len: c.len_utf8(), prev: i.wrapping_sub(1), next: i + 1 })
            .collect();
        let Some(last) = symbols.last_mut() else { return };
        last.next = NONE;
        let mut queue = BinaryHeap::new();
        for i in 1..symbols.len() {
            self.push_bigram(text, &symbols, i - 1, i, &mut queue);
        }
        while let Some(b) = queue.pop() {
            let (left, right) = (symbols[b.left], symbols[b.right]);
            // Stale: one side has merged with something else since.
            if left.len == 0 || right.len == 0 || left.len + right.len != b.len {
                continue;
            }
            symbols[b.left].len += right.len;
            symbols[b.right].len = 0;
            symbols[b.left].next = right.next;
            if right.next != NONE {
                symbols[right.next].prev = b.left;
            }
            if left.prev != NONE {
                self.push_bigram(text, &symbols, left.prev, b.left, &mut queue);
            }
            if right.next != NONE {
                self.push_bigram(text, &symbols, b.left, right.next, &mut queue);
            }
        }
        let mut i = 0;
        while i != NONE {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.text_to_id.get(piece) {
                Some(&id) => out.push(id),
                None => out.extend(piece.bytes().filter_map(|b| self.byte_ids[b as usize])),
            }
            i = s.next;
        }
    }

    fn push_bigram(&self, text: &str, symbols: &[Symbol], left: usize, right: usize, queue: &mut BinaryHeap<Bigram>) {
        let (l, r) = (symbols[left], symbols[right]);
        let merged = &text[l.start..l.start + l.len + r.len];
        if let Some(&id) = self.text_to_id.get(merged) {
            let score = self.scores.get(id as usize).copied().unwrap_or(0.0);
            queue.push(Bigram { left, right, score, len: merged.len() });
        }
    }

    /// The id used for bytes that have no token of their own.
    pub fn unk(&self) -> Option<u32> {
        self.unk
    }
}

enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoder(vocab: &[(&str, f32)], specials: &[u32], add_space_prefix: bool) -> SpmEncoder {
        let texts: Vec<String> = vocab.iter().map(|(t, _)| t.to_string()).collect();
        let scores = vocab.iter().map(|(_, s)| *s).collect();
        SpmEncoder::new(&texts, scores, |id| specials.contains(&id), Some(0), add_space_prefix)
    }

    #[test]
    fn merges_highest_scoring_pairs_first_and_spells_the_rest_as_bytes() {
        let vocab = [
            ("<unk>", 0.0),
            ("a", -1.0),
            ("b", -1.0),
            ("ab", -3.0),
            ("bc", -2.0),
            ("c", -1.0),
            ("<0x7A>", 0.0), // 'z'
            ("\u{2581}", -1.0),
            ("<s>", 0.0),
        ];
        let e = encoder(&vocab, &[8], false);
        // "bc" (−2) beats "ab" (−3); "a"+"bc" is not a token, so a, bc.
        assert_eq!(e.encode("abc"), vec![1, 4]);
        // "ab" merges; "abz" is not a token and z has only its byte token.
        assert_eq!(e.encode("abz"), vec![3, 6]);
        // Special tokens are cut out first; spaces become ▁.
        assert_eq!(e.encode("a<s> b"), vec![1, 8, 7, 2]);
        // Characters with no token and no byte token fall back to unk, byte by byte.
        assert_eq!(e.encode("é"), vec![0, 0]);
    }

    #[test]
    fn equal_scores_merge_leftmost_first_and_space_prefix_follows_the_flag() {
        let vocab = [("<unk>", 0.0), ("x", -1.0), ("xx", -1.0), ("\u{2581}", -2.0), ("\u{2581}x", -0.5)];
        let e = encoder(&vocab, &[], false);
        assert_eq!(e.encode("xxx"), vec![2, 1]);
        let prefixed = encoder(&vocab, &[], true);
        assert_eq!(prefixed.encode("x"), vec![4]);
        assert_eq!(e.encode("x"), vec![1]);
    }
}
