//! The engine's end of the KV-cache event stream: a bounded queue from the pool (inside the
//! step loop) to a publisher running elsewhere (the server's ZMQ publisher). The pool must
//! never wait on a subscriber, so a full queue drops the event and counts it.

use crate::kv::{KvEvent, KvEventSink};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc::{channel, error::TrySendError, Receiver, Sender};

/// Events queued for the publisher at most; beyond, new ones are dropped (and counted).
pub const KV_EVENT_QUEUE: usize = 100_000;

/// Hands the pool's events to a publisher without ever blocking. Cloning shares the queue
/// and the drop counter.
#[derive(Clone)]
pub struct KvEventSender {
    queue: Sender<KvEvent>,
    dropped: Arc<AtomicU64>,
}

impl std::fmt::Debug for KvEventSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventSender").field("dropped", &self.dropped()).finish_non_exhaustive()
    }
}

impl KvEventSender {
    /// A sender and the receiving end for the publisher, holding up to `capacity` events.
    pub fn channel(capacity: usize) -> (Self, Receiver<KvEvent>) {
        let (queue, events) = channel(capacity.max(1));
        (Self { queue, dropped: Arc::new(AtomicU64::new(0)) }, events)
    }

    /// Events dropped so far because the publisher lagged (or had stopped).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

impl KvEventSink for KvEventSender {
    fn emit(&self, event: KvEvent) {
        match self.queue.try_send(event) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Closed(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_drops_and_counts_instead_of_waiting() {
        let (sender, mut events) = KvEventSender::channel(2);
        for _ in 0..5 {
            sender.emit(KvEvent::AllBlocksCleared);
        }
        assert_eq!(sender.dropped(), 3);
        assert_eq!(events.try_recv().ok(), Some(KvEvent::AllBlocksCleared));
        drop(events);
        sender.emit(KvEvent::AllBlocksCleared);
        assert_eq!(sender.dropped(), 4, "a stopped publisher counts as lagging");
    }
}
