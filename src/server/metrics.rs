//! Prometheus metrics, written by hand in the text exposition format: request counts, queue
//! depth, running sequences, KV blocks, tokens, speculation counts, and TTFT / inter-token
//! latency histograms.

use crate::engine::EngineSnapshot;
use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A cumulative histogram with fixed upper bounds (seconds).
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    pub fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(self.counts.iter_mut()) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        self.write_labelled(out, name, help, "");
    }

    /// The histogram with `labels` (`key="value",…`, already escaped) on every sample.
    fn write_labelled(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let sep = if labels.is_empty() { "" } else { "," };
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {c}");
        }
        let braces = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}\n{name}_sum{braces} {}\n{name}_count{braces} {}",
            self.count, self.sum, self.count
        );
    }
}

const TTFT_BOUNDS: &[f64] = &[0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
const ITL_BOUNDS: &[f64] = &[0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12];
/// Window of the tokens-per-second gauge.
const RATE_WINDOW: Duration = Duration::from_secs(10);

struct Inner {
    /// (endpoint, status) → count.
    requests: BTreeMap<(&'static str, u16), u64>,
    ttft: Histogram,
    itl: Histogram,
    /// Recent (time, tokens) deliveries, for the tokens/s gauge.
    recent: VecDeque<(Instant, usize)>,
}

/// Counters the HTTP layer keeps; the engine's own counters come from its snapshot.
pub struct ServerMetrics {
    inner: Mutex<Inner>,
}

impl Default for ServerMetrics {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Inner {
                requests: BTreeMap::new(),
                ttft: Histogram::new(TTFT_BOUNDS),
                itl: Histogram::new(ITL_BOUNDS),
                recent: VecDeque::new(),
            }),
        }
    }
}

impl ServerMetrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn request(&self, endpoint: &'static str, status: u16) {
        *self.lock().requests.entry((endpoint, status)).or_default() += 1;
    }

    pub fn first_token(&self, ttft: Duration) {
        self.lock().ttft.observe(ttft.as_secs_f64());
    }

    /// `tokens` arrived together `gap` after the previous ones: each counts `gap / tokens`.
    pub fn tokens_after(&self, gap: Duration, tokens: usize) {
        if tokens == 0 {
            return;
        }
        let mut inner = self.lock();
        let each = gap.as_secs_f64() / tokens as f64;
        for _ in 0..tokens {
            inner.itl.observe(each);
        }
    }

    pub fn delivered(&self, tokens: usize) {
        let now = Instant::now();
        let mut inner = self.lock();
        inner.recent.push_back((now, tokens));
        while inner.recent.front().is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW) {
            inner.recent.pop_front();
        }
    }

    /// The exposition text: specula's own metrics, then the same state under vLLM's names
    /// with its `model_name` label (what routers and the Inference Extension's endpoint picker
    /// read).
    pub fn render(&self, e: &EngineSnapshot, model_name: &str) -> String {
        let mut out = self.render_specula(e);
        self.render_vllm(&mut out, e, model_name);
        out
    }

    fn render_specula(&self, e: &EngineSnapshot) -> String {
        let mut inner = self.lock();
        let now = Instant::now();
        while inner.recent.front().is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW) {
            inner.recent.pop_front();
        }
        let window_tokens: usize = inner.recent.iter().map(|(_, n)| n).sum();
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
        };
        metric("specula_requests_waiting", "gauge", "Requests queued for admission.", e.waiting.to_string());
        metric("specula_requests_running", "gauge", "Sequences in the running batch.", e.running.to_string());
        metric("specula_kv_blocks_total", "gauge", "KV cache blocks in the pool.", e.kv_total_blocks.to_string());
        metric("specula_kv_blocks_free", "gauge", "KV cache blocks free.", e.kv_free_blocks.to_string());
        metric(
            "specula_kv_blocks_used",
            "gauge",
            "KV cache blocks held by sequences.",
            (e.kv_total_blocks - e.kv_free_blocks).to_string(),
        );
        metric(
            "specula_kv_blocks_cached",
            "gauge",
            "KV cache blocks holding a reusable prompt prefix (free ones among them are evicted on demand).",
            e.kv_cached_blocks.to_string(),
        );
        metric("specula_kv_block_size", "gauge", "Tokens per KV block.", e.kv_block_size.to_string());
        metric(
            "specula_suffix_cache_bytes",
            "gauge",
            "Bytes held by the suffix drafter's cache of recent requests.",
            e.suffix_cache_bytes.to_string(),
        );
        metric(
            "specula_suffix_cache_requests",
            "gauge",
            "Requests held by the suffix drafter's cache.",
            e.suffix_cache_sequences.to_string(),
        );
        metric(
            "specula_suffix_cache_evicted_requests_total",
            "counter",
            "Requests evicted from the suffix drafter's cache to stay within its budget.",
            e.suffix_cache_evicted.to_string(),
        );
        metric(
            "specula_generated_tokens_total",
            "counter",
            "Tokens generated for requests.",
            e.generated_tokens.to_string(),
        );
        metric(
            "specula_prefill_tokens_total",
            "counter",
            "Prompt tokens prefilled (recomputation included).",
            e.prefill_tokens.to_string(),
        );
        metric(
            "specula_prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens whose K/V came from the prefix cache instead of a prefill.",
            e.prefix_cache_hit_tokens.to_string(),
        );
        metric(
            "specula_tokens_per_second",
            "gauge",
            "Tokens delivered per second over the last 10 seconds.",
            format!("{}", window_tokens as f64 / RATE_WINDOW.as_secs_f64()),
        );
        metric("specula_engine_steps_total", "counter", "Batched forward steps.", e.steps.to_string());
        metric("specula_engine_rows_total", "counter", "Token rows through the forward.", e.rows.to_string());
        metric(
            "specula_engine_busy_seconds_total",
            "counter",
            "Seconds the engine spent in steps.",
            format!("{}", e.busy_secs),
        );
        metric(
            "specula_engine_forward_seconds_total",
            "counter",
            "Of the busy seconds, those in the model's forward.",
            format!("{}", e.forward_secs),
        );
        metric(
            "specula_preemptions_total",
            "counter",
            "Sequences preempted (KV freed, recomputed later).",
            e.preemptions.to_string(),
        );
        metric(
            "specula_draft_tokens_total",
            "counter",
            "Draft tokens verified (each node of a draft tree counts one).",
            e.drafted.to_string(),
        );
        metric("specula_draft_tokens_accepted_total", "counter", "Draft tokens accepted.", e.accepted.to_string());
        metric(
            "specula_draft_tree_steps_total",
            "counter",
            "Per-sequence verify steps whose draft was a tree.",
            e.tree_steps.to_string(),
        );

        metric(
            "specula_verify_steps_total",
            "counter",
            "Per-sequence decode/verify steps.",
            e.verify_steps.to_string(),
        );
        let tau = crate::speculative::metrics::tau(e.accepted, e.verify_steps);
        metric(
            "specula_acceptance_length",
            "gauge",
            "Mean tokens committed per verify step (accepted drafts + 1).",
            format!("{tau}"),
        );
        metric(
            "specula_requests_finished_total",
            "counter",
            "Requests the engine finished.",
            e.finished_requests.to_string(),
        );
        metric(
            "specula_requests_cancelled_total",
            "counter",
            "Requests whose client went away.",
            e.cancelled_requests.to_string(),
        );
        metric(
            "specula_requests_failed_total",
            "counter",
            "Requests the engine could not complete.",
            e.failed_requests.to_string(),
        );
        let _ = writeln!(
            out,
            "# HELP specula_draft_tokens_accepted_by_rank_total Accepted draft tokens by sibling rank (0: the drafter's first choice; 3: the fourth and beyond).\n# TYPE specula_draft_tokens_accepted_by_rank_total counter"
        );
        for (rank, n) in e.accepted_by_rank.iter().enumerate() {
            let _ = writeln!(out, "specula_draft_tokens_accepted_by_rank_total{{rank=\"{rank}\"}} {n}");
        }
        let _ = writeln!(out, "# HELP specula_http_requests_total HTTP requests by endpoint and status.\n# TYPE specula_http_requests_total counter");
        for ((endpoint, status), n) in &inner.requests {
            let _ = writeln!(out, "specula_http_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}");
        }
        inner.ttft.write(
            &mut out,
            "specula_time_to_first_token_seconds",
            "Time from request arrival to its first token.",
        );
        inner.itl.write(
            &mut out,
            "specula_inter_token_latency_seconds",
            "Time between tokens of a stream (tokens arriving together share the gap).",
        );
        out
    }
}

impl ServerMetrics {
    /// vLLM's names for what [`Self::render_specula`] reports, as vLLM's V1 engine exports
    /// them, plus the older name of the KV gauge that earlier endpoint pickers read.
    fn render_vllm(&self, out: &mut String, e: &EngineSnapshot, model_name: &str) {
        let inner = self.lock();
        let labels = format!("model_name=\"{}\"", escape_label(model_name));
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value}");
        };
        metric("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", e.waiting.to_string());
        metric("vllm:num_requests_running", "gauge", "Requests in the running batch.", e.running.to_string());
        let usage = if e.kv_total_blocks == 0 {
            0.0
        } else {
            (e.kv_total_blocks - e.kv_free_blocks.min(e.kv_total_blocks)) as f64 / e.kv_total_blocks as f64
        };
        metric("vllm:kv_cache_usage_perc", "gauge", "KV cache usage as a fraction (1 = full).", format!("{usage}"));
        metric(
            "vllm:gpu_cache_usage_perc",
            "gauge",
            "KV cache usage as a fraction (vLLM's older name).",
            format!("{usage}"),
        );
        metric(
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            (e.prefix_cache_hit_tokens + e.prefill_tokens).to_string(),
        );
        metric(
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prompt tokens found in the prefix cache.",
            e.prefix_cache_hit_tokens.to_string(),
        );
        metric("vllm:prompt_tokens_total", "counter", "Prompt tokens prefilled.", e.prefill_tokens.to_string());
        metric("vllm:generation_tokens_total", "counter", "Tokens generated.", e.generated_tokens.to_string());
        metric("vllm:num_preemptions_total", "counter", "Preemptions.", e.preemptions.to_string());
        metric(
            "vllm:spec_decode_num_drafts_total",
            "counter",
            "Verify steps that had a draft.",
            e.draft_steps.to_string(),
        );
        metric(
            "vllm:spec_decode_num_draft_tokens_total",
            "counter",
            "Draft tokens verified (a tree's nodes count one each).",
            e.drafted.to_string(),
        );
        metric(
            "vllm:spec_decode_num_accepted_tokens_total",
            "counter",
            "Draft tokens accepted.",
            e.accepted.to_string(),
        );
        let _ = writeln!(
            out,
            "# HELP vllm:cache_config_info KV cache settings.\n# TYPE vllm:cache_config_info gauge\n\
             vllm:cache_config_info{{{labels},block_size=\"{}\",num_gpu_blocks=\"{}\"}} 1",
            e.kv_block_size, e.kv_total_blocks
        );
        inner.ttft.write_labelled(
            out,
            "vllm:time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            &labels,
        );
        inner.itl.write_labelled(out, "vllm:inter_token_latency_seconds", "Time between tokens of a stream.", &labels);
    }
}

/// A Prometheus label value: backslash, double quote and newline escaped.
fn escape_label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(5.0);
        let mut s = String::new();
        h.write(&mut s, "x", "help");
        assert!(s.contains("x_bucket{le=\"0.1\"} 1\n"));
        assert!(s.contains("x_bucket{le=\"1\"} 2\n"));
        assert!(s.contains("x_bucket{le=\"+Inf\"} 3\n"));
        assert!(s.contains("x_count 3\n"));
    }

    #[test]
    fn renders_engine_and_http_counters() {
        let m = ServerMetrics::default();
        m.request("chat", 200);
        m.request("chat", 200);
        m.request("completion", 400);
        m.first_token(Duration::from_millis(30));
        m.tokens_after(Duration::from_millis(40), 4);
        let snap = EngineSnapshot {
            kv_total_blocks: 10,
            kv_free_blocks: 7,
            verify_steps: 4,
            accepted: 6,
            ..Default::default()
        };
        let text = m.render(&snap, "m\"x");
        assert!(text.contains("vllm:kv_cache_usage_perc{model_name=\"m\\\"x\"} 0.3\n"), "{text}");
        assert!(text.contains("vllm:inter_token_latency_seconds_bucket{model_name=\"m\\\"x\",le=\"0.01\"} 4\n"));
        assert!(text.contains("vllm:time_to_first_token_seconds_count{model_name=\"m\\\"x\"} 1\n"));
        assert!(text.contains("specula_kv_blocks_used 3\n"));
        assert!(text.contains("specula_http_requests_total{endpoint=\"chat\",status=\"200\"} 2\n"));
        assert!(text.contains("specula_acceptance_length 2.5\n"));
        assert!(text.contains("specula_inter_token_latency_seconds_count 4\n"));
        assert!(text.contains("specula_inter_token_latency_seconds_bucket{le=\"0.01\"} 4\n"));
    }
}
