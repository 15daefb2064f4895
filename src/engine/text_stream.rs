//! Generated ids → streamed text, honouring stop strings: text that could be the start of a
//! stop string is held back until it is known not to be one.

use crate::sample::{scan_stop_strings, StopScan};
use crate::tokenize::{StreamDecoder, Tokenizer};

pub struct TextStream {
    decoder: StreamDecoder,
    stop_strings: Vec<String>,
    text: String,
    emitted: usize,
    stopped: bool,
}

impl TextStream {
    pub fn new(stop_strings: Vec<String>) -> Self {
        Self { decoder: StreamDecoder::new(true), stop_strings, text: String::new(), emitted: 0, stopped: false }
    }

    /// Feeds one token; returns the text now safe to show. After a stop string matched,
    /// returns empty strings and [`Self::stopped`] is true.
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32) -> String {
        if self.stopped {
            return String::new();
        }
        let piece = self.decoder.push(tokenizer, token);
        self.text.push_str(&piece);
        self.release()
    }

    /// Ends the stream: releases held-back text (no stop string matched it).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        let rest = self.decoder.finish();
        self.text.push_str(&rest);
        let out = self.release();
        if self.stopped {
            return out;
        }
        let tail = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out + &tail
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// All text shown so far.
    pub fn text(&self) -> &str {
        &self.text[..self.emitted]
    }

    fn release(&mut self) -> String {
        match scan_stop_strings(&self.text, self.emitted, &self.stop_strings) {
            StopScan::Matched { match_start, .. } => {
                let out = self.text[self.emitted..match_start].to_string();
                self.text.truncate(match_start);
                self.emitted = match_start;
                self.stopped = true;
                out
            }
            StopScan::Pending { emit_up_to } => {
                let out = self.text[self.emitted..emit_up_to].to_string();
                self.emitted = emit_up_to;
                out
            }
        }
    }
}
