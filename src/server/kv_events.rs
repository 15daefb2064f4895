//! KV-cache events for prefix-aware routers (`specula serve --kv-events ENDPOINT`): what the
//! prefix cache stored and evicted, published the way vLLM publishes it, so a subscriber
//! written for vLLM (llm-d's precise prefix-cache scorer, Dynamo's KV router) reads it as is.
//!
//! # Wire format (vLLM's `vllm/distributed/kv_events.py`, in our own words)
//!
//! A ZeroMQ PUB socket. Each message has three frames:
//! 1. the topic (UTF-8; empty by default, so a subscription to "" receives everything);
//! 2. a sequence number: 8 bytes, big-endian, unsigned, 0 for the first message after start
//!    and one more for each message after it;
//! 3. the payload: one `KVEventBatch` in MessagePack.
//!
//! vLLM declares these as msgspec structs with `array_like=True`: a struct is a MessagePack
//! array of its fields in declaration order, and trailing fields still at their default are
//! left out (`omit_defaults=True`). Events are a tagged union (`tag=True`): the class name
//! comes first in the array, as a string.
//!
//! - `KVEventBatch`: `[ts, events, data_parallel_rank]`: `ts` a float64 (seconds since the
//!   Unix epoch), `events` an array of events, `data_parallel_rank` always 0 here.
//! - `BlockStored`: `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
//!   lora_id, medium, lora_name]`: consecutive full blocks of one prompt, `token_ids` their
//!   tokens (`block_size` per block), `parent_block_hash` the hash of the block before the
//!   first (nil when the first block starts the prompt), `lora_id` and `lora_name` nil,
//!   `medium` "GPU" (vLLM's name for the primary KV tier; here it is whatever device holds
//!   the pool). vLLM's later, defaulted fields (`extra_keys`, `group_idx`, cache-spec kind and
//!   window) stay at their defaults and are left out.
//! - `BlockRemoved`: `["BlockRemoved", block_hashes, medium]`: blocks evicted from the
//!   prefix cache.
//! - `AllBlocksCleared`: `["AllBlocksCleared"]`. vLLM sends it when its prefix cache is reset
//!   on request; specula's pool is never reset, so it is not sent.
//!
//! Block hashes are MessagePack unsigned integers of up to 64 bits: specula's own prefix key
//! of the block (SipHash of the parent's key and the block's token ids), so a block's hash
//! names its whole prefix. vLLM's integer hashes (the low 64 bits of its block hash) are the
//! same kind of value, computed differently: hashes are only comparable between specula
//! servers (of one version), which is all a router needs, as it keys its index by the
//! hashes it receives and by the token ids in `BlockStored`.
//!
//! The newest vLLM sources declare these structs without `array_like` (a batch and its events
//! as MessagePack maps keyed by field name, the tag under "type"). specula sends the array
//! form, the one vLLM introduced these events with; a subscriber decoding only the
//! map form would need that form added here.
//!
//! The endpoint follows vLLM's rule: one with `*`, `::` or `ipc://` is bound, any other is
//! connected to (the subscriber binds). The pool's events reach this publisher through a
//! bounded queue ([`KV_EVENT_QUEUE`] events): when the publisher lags, events are dropped and
//! counted (`specula_kv_events_dropped_total`), never waited for. Like vLLM's publisher, a
//! subscriber that joins late sees only what is published after it joined; vLLM's optional
//! replay socket is not implemented.

use crate::engine::{KvEventSender, KV_EVENT_QUEUE};
use crate::kv::KvEvent;
use anyhow::{bail, Context, Result};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::Receiver;
use zeromq::{Socket, SocketSend, ZmqMessage};

/// vLLM's default endpoint.
pub const DEFAULT_ENDPOINT: &str = "tcp://*:5557";

/// The most events one batch carries (the queue is drained into batches of up to this many).
const MAX_BATCH_EVENTS: usize = 1024;

/// vLLM's name for the tier the blocks live in.
const MEDIUM: &str = "GPU";

/// Where and how to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    pub endpoint: String,
    pub topic: String,
    /// Events queued for the publisher at most.
    pub queue_events: usize,
}

impl KvEventsConfig {
    /// Publishing on `endpoint` with vLLM's defaults otherwise.
    pub fn at(endpoint: &str) -> Self {
        Self { endpoint: endpoint.to_string(), topic: String::new(), queue_events: KV_EVENT_QUEUE }
    }

    /// vLLM's `--kv-events-config` JSON: `enable_kv_cache_events`, `publisher` ("zmq" or
    /// "null"), `endpoint`, `topic`, `max_queue_size`; `hwm` and `buffer_steps` are accepted
    /// and ignored. None when it leaves events off.
    pub fn from_vllm_json(text: &str) -> Result<Option<Self>> {
        let value: serde_json::Value = serde_json::from_str(text).context("--kv-events-config is not JSON")?;
        let Some(fields) = value.as_object() else { bail!("--kv-events-config must be a JSON object") };
        let mut config = Self::at(DEFAULT_ENDPOINT);
        let mut enabled = false;
        let mut publisher = "zmq".to_string();
        for (key, v) in fields {
            let wrong = || anyhow::anyhow!("--kv-events-config: `{key}` has the wrong type ({v})");
            match key.as_str() {
                "enable_kv_cache_events" => enabled = v.as_bool().ok_or_else(wrong)?,
                "publisher" => publisher = v.as_str().ok_or_else(wrong)?.to_string(),
                "endpoint" => config.endpoint = v.as_str().ok_or_else(wrong)?.to_string(),
                "topic" => config.topic = v.as_str().ok_or_else(wrong)?.to_string(),
                "max_queue_size" => {
                    config.queue_events = v.as_u64().filter(|&n| n > 0).ok_or_else(wrong)?.min(1 << 24) as usize
                }
                "hwm" | "buffer_steps" => {}
                "replay_endpoint" if v.is_null() => {}
                "replay_endpoint" => bail!("--kv-events-config: a replay endpoint is not supported"),
                other => bail!("--kv-events-config: unknown setting `{other}`"),
            }
        }
        match publisher.as_str() {
            "zmq" => {}
            "null" => return Ok(None),
            other => bail!("--kv-events-config: unknown publisher `{other}` (zmq or null)"),
        }
        Ok(enabled.then_some(config))
    }
}

/// The events setting of `serve`: `--kv-events ENDPOINT` or vLLM's `--kv-events-config JSON`
/// (at most one of them). None when neither turns events on.
pub fn kv_events_config(endpoint: Option<&str>, vllm_json: Option<&str>) -> Result<Option<KvEventsConfig>> {
    match (endpoint, vllm_json) {
        (Some(_), Some(_)) => bail!("give --kv-events or --kv-events-config, not both"),
        (Some(endpoint), None) => Ok(Some(KvEventsConfig::at(endpoint))),
        (None, Some(json)) => KvEventsConfig::from_vllm_json(json),
        (None, None) => Ok(None),
    }
}

/// Starts publishing as `serve`'s flags say (nothing when they leave events off) and returns
/// the sender the engine hands its pool. Fails when the endpoint is malformed or cannot be
/// bound.
pub fn start_kv_event_publisher(endpoint: Option<&str>, vllm_json: Option<&str>) -> Result<Option<KvEventSender>> {
    match kv_events_config(endpoint, vllm_json)? {
        Some(config) => KvEventPublisher::start(config).map(Some),
        None => Ok(None),
    }
}

/// The publisher: its own thread and single-threaded runtime, so the server's runtime and
/// the engine's step never wait on a subscriber.
pub struct KvEventPublisher;

impl KvEventPublisher {
    /// Opens the socket (binding or connecting, as vLLM decides from the endpoint), then
    /// publishes every event the returned sender is given until all its clones are gone.
    pub fn start(config: KvEventsConfig) -> Result<KvEventSender> {
        let (bind, address) = socket_address(&config.endpoint)?;
        let (sender, events) = KvEventSender::channel(config.queue_events);
        let (opened_tx, opened_rx) = std::sync::mpsc::channel::<Result<()>>();
        std::thread::Builder::new().name("specula-kv-events".into()).spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = opened_tx.send(Err(e.into()));
                    return;
                }
            };
            rt.block_on(async move {
                let mut socket = zeromq::PubSocket::new();
                if bind {
                    if let Err(e) = socket.bind(&address).await {
                        let _ = opened_tx.send(Err(anyhow::anyhow!("--kv-events: cannot bind {address}: {e}")));
                        return;
                    }
                    let _ = opened_tx.send(Ok(()));
                } else {
                    // The subscriber binds; it may come up after us, so keep trying (events
                    // before then have nobody to go to, as with vLLM).
                    let _ = opened_tx.send(Ok(()));
                    while let Err(e) = socket.connect(&address).await {
                        tracing::debug!("kv events: connecting to {address}: {e}");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
                publish(socket, events, config.topic.into_bytes()).await;
            });
        })?;
        opened_rx.recv().context("the KV event publisher thread stopped")??;
        eprintln!("specula: publishing KV-cache events on {}", config.endpoint);
        Ok(sender)
    }
}

/// Whether to bind (else connect) and the address in the form the socket takes: vLLM binds
/// endpoints with a wildcard host (`*`, `::`) or `ipc://`, and connects to the rest.
fn socket_address(endpoint: &str) -> Result<(bool, String)> {
    if endpoint.starts_with("ipc://") || endpoint.starts_with("inproc://") {
        bail!("--kv-events: only tcp:// endpoints are supported, not {endpoint}");
    }
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        bail!("--kv-events: expected tcp://HOST:PORT, got {endpoint}");
    };
    let Some((host, port)) = rest.rsplit_once(':') else { bail!("--kv-events: no port in {endpoint}") };
    port.parse::<u16>().map_err(|_| anyhow::anyhow!("--kv-events: bad port in {endpoint}"))?;
    Ok(match host {
        "*" => (true, format!("tcp://0.0.0.0:{port}")),
        "[::]" | "::" => (true, format!("tcp://[::]:{port}")),
        _ if host.contains("::") => (true, endpoint.to_string()),
        _ => (false, endpoint.to_string()),
    })
}

/// Sends every queued event, batched, until the queue's senders are gone.
async fn publish(mut socket: zeromq::PubSocket, mut events: Receiver<KvEvent>, topic: Vec<u8>) {
    let mut seq: u64 = 0;
    let mut batch = Vec::new();
    while let Some(first) = events.recv().await {
        batch.clear();
        batch.push(first);
        while batch.len() < MAX_BATCH_EVENTS {
            match events.try_recv() {
                Ok(event) => batch.push(event),
                Err(_) => break,
            }
        }
        let ts = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let mut message = ZmqMessage::from(topic.clone());
        message.push_back(seq.to_be_bytes().to_vec().into());
        message.push_back(encode_batch(ts, &batch).into());
        if let Err(e) = socket.send(message).await {
            tracing::warn!("kv events: sending batch {seq}: {e}");
        }
        seq += 1;
    }
}

/// One `KVEventBatch` in MessagePack (see the module's documentation).
pub fn encode_batch(ts: f64, events: &[KvEvent]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.len() * 64);
    msgpack::array(&mut out, 3);
    msgpack::float(&mut out, ts);
    msgpack::array(&mut out, events.len());
    for event in events {
        encode_event(&mut out, event);
    }
    msgpack::uint(&mut out, 0); // data_parallel_rank
    out
}

fn encode_event(out: &mut Vec<u8>, event: &KvEvent) {
    match event {
        KvEvent::BlocksStored { parent, hashes, token_ids, block_size } => {
            msgpack::array(out, 8);
            msgpack::str(out, "BlockStored");
            msgpack::array(out, hashes.len());
            hashes.iter().for_each(|&h| msgpack::uint(out, h));
            match parent {
                Some(p) => msgpack::uint(out, *p),
                None => msgpack::nil(out),
            }
            msgpack::array(out, token_ids.len());
            token_ids.iter().for_each(|&t| msgpack::uint(out, t.into()));
            msgpack::uint(out, *block_size as u64);
            msgpack::nil(out); // lora_id
            msgpack::str(out, MEDIUM);
            msgpack::nil(out); // lora_name
        }
        KvEvent::BlocksRemoved { hashes } => {
            msgpack::array(out, 3);
            msgpack::str(out, "BlockRemoved");
            msgpack::array(out, hashes.len());
            hashes.iter().for_each(|&h| msgpack::uint(out, h));
            msgpack::str(out, MEDIUM);
        }
        KvEvent::AllBlocksCleared => {
            msgpack::array(out, 1);
            msgpack::str(out, "AllBlocksCleared");
        }
    }
}

/// The few MessagePack forms the events need, each in its shortest encoding.
mod msgpack {
    pub fn nil(out: &mut Vec<u8>) {
        out.push(0xc0);
    }

    pub fn uint(out: &mut Vec<u8>, v: u64) {
        match v {
            0..=0x7f => out.push(v as u8),
            0x80..=0xff => out.extend_from_slice(&[0xcc, v as u8]),
            0x100..=0xffff => {
                out.push(0xcd);
                out.extend_from_slice(&(v as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                out.push(0xce);
                out.extend_from_slice(&(v as u32).to_be_bytes());
            }
            _ => {
                out.push(0xcf);
                out.extend_from_slice(&v.to_be_bytes());
            }
        }
    }

    pub fn float(out: &mut Vec<u8>, v: f64) {
        out.push(0xcb);
        out.extend_from_slice(&v.to_be_bytes());
    }

    pub fn str(out: &mut Vec<u8>, s: &str) {
        let n = s.len();
        match n {
            0..=31 => out.push(0xa0 | n as u8),
            32..=0xff => out.extend_from_slice(&[0xd9, n as u8]),
            0x100..=0xffff => {
                out.push(0xda);
                out.extend_from_slice(&(n as u16).to_be_bytes());
            }
            _ => {
                out.push(0xdb);
                out.extend_from_slice(&(n as u32).to_be_bytes());
            }
        }
        out.extend_from_slice(s.as_bytes());
    }

    /// The header of an array of `n` items (the items follow).
    pub fn array(out: &mut Vec<u8>, n: usize) {
        match n {
            0..=15 => out.push(0x90 | n as u8),
            16..=0xffff => {
                out.push(0xdc);
                out.extend_from_slice(&(n as u16).to_be_bytes());
            }
            _ => {
                out.push(0xdd);
                out.extend_from_slice(&(n as u32).to_be_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_encode_as_vllm_array_like_structs() {
        let events = [
            KvEvent::BlocksStored { parent: None, hashes: vec![1, u64::MAX], token_ids: vec![5, 300], block_size: 1 },
            KvEvent::BlocksStored { parent: Some(0x1234), hashes: vec![7], token_ids: vec![], block_size: 16 },
            KvEvent::BlocksRemoved { hashes: vec![0x1_0000_0000] },
            KvEvent::AllBlocksCleared,
        ];
        let mut expected = vec![0x93, 0xcb];
        expected.extend_from_slice(&1.5f64.to_be_bytes());
        expected.push(0x94);
        expected.extend_from_slice(&[0x98, 0xab]);
        expected.extend_from_slice(b"BlockStored");
        expected.extend_from_slice(&[0x92, 0x01, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        expected.extend_from_slice(&[0xc0, 0x92, 0x05, 0xcd, 0x01, 0x2c, 0x01, 0xc0, 0xa3]);
        expected.extend_from_slice(b"GPU");
        expected.push(0xc0);
        expected.extend_from_slice(&[0x98, 0xab]);
        expected.extend_from_slice(b"BlockStored");
        expected.extend_from_slice(&[0x91, 0x07, 0xcd, 0x12, 0x34, 0x90, 0x10, 0xc0, 0xa3]);
        expected.extend_from_slice(b"GPU");
        expected.push(0xc0);
        expected.extend_from_slice(&[0x93, 0xac]);
        expected.extend_from_slice(b"BlockRemoved");
        expected.extend_from_slice(&[0x91, 0xcf, 0, 0, 0, 1, 0, 0, 0, 0, 0xa3]);
        expected.extend_from_slice(b"GPU");
        expected.extend_from_slice(&[0x91, 0xb0]);
        expected.extend_from_slice(b"AllBlocksCleared");
        expected.push(0x00);
        assert_eq!(encode_batch(1.5, &events), expected);
    }

    #[test]
    fn long_arrays_and_strings_use_wider_headers() {
        let mut out = Vec::new();
        msgpack::array(&mut out, 16);
        msgpack::array(&mut out, 70_000);
        msgpack::str(&mut out, &"x".repeat(40));
        assert_eq!(&out[..8], &[0xdc, 0x00, 0x10, 0xdd, 0x00, 0x01, 0x11, 0x70]);
        assert_eq!(&out[8..10], &[0xd9, 40]);
    }

    #[test]
    fn endpoints_bind_or_connect_as_vllm_decides() {
        assert_eq!(socket_address("tcp://*:5557").unwrap(), (true, "tcp://0.0.0.0:5557".into()));
        assert_eq!(socket_address("tcp://127.0.0.1:6000").unwrap(), (false, "tcp://127.0.0.1:6000".into()));
        for bad in ["tcp://*", "udp://x:1", "tcp://*:99999", "ipc:///tmp/x", ""] {
            assert!(socket_address(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn vllm_config_json() {
        let on = r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6001", "topic": "kv", "hwm": 5}"#;
        let config = KvEventsConfig::from_vllm_json(on).unwrap().unwrap();
        assert_eq!((config.endpoint.as_str(), config.topic.as_str()), ("tcp://*:6001", "kv"));
        assert_eq!(
            KvEventsConfig::from_vllm_json(r#"{"enable_kv_cache_events": true}"#).unwrap().unwrap().endpoint,
            DEFAULT_ENDPOINT
        );
        assert_eq!(KvEventsConfig::from_vllm_json(r#"{"endpoint": "tcp://*:1"}"#).unwrap(), None, "off unless enabled");
        assert_eq!(
            KvEventsConfig::from_vllm_json(r#"{"enable_kv_cache_events": true, "publisher": "null"}"#).unwrap(),
            None
        );
        for bad in [
            "[]",
            "{",
            r#"{"enable_kv_cache_events": "yes"}"#,
            r#"{"enable_kv_cache_events": true, "publisher": "kafka"}"#,
            r#"{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:1"}"#,
            r#"{"enable_kv_cache_events": true, "max_queue_size": 0}"#,
            r#"{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}"#,
        ] {
            assert!(KvEventsConfig::from_vllm_json(bad).is_err(), "{bad}");
        }
        assert!(kv_events_config(Some("tcp://*:1"), Some("{}")).is_err());
        assert_eq!(kv_events_config(None, None).unwrap(), None);
    }
}
