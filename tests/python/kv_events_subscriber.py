"""A KV-cache event subscriber written against vLLM's published schema, for tests/kv_events.rs.

Connects a ZeroMQ SUB socket to ENDPOINT, prints READY once subscribed, and decodes every
message strictly with msgspec structs declared as vLLM declares them (array_like, tagged
events). When stdin closes it waits for the stream to go quiet, then prints every message as
one JSON document on stdout. A message that does not decode is an error (exit status 1).

    python3 kv_events_subscriber.py tcp://127.0.0.1:5557 [TOPIC]
"""

import json
import sys
import threading
import time

import msgspec
import zmq

# vLLM's block hash: an unsigned 64-bit integer, or (with integer hashes turned off) bytes.
ExternalBlockHash = int | bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def as_json(event):
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def main():
    endpoint = sys.argv[1]
    topic = sys.argv[2] if len(sys.argv) > 2 else ""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    # A subscription takes a moment to reach the publisher, which sends nothing to a
    # subscriber before it arrives (the server publishes nothing until the first request).
    time.sleep(2.0)
    print("READY", flush=True)

    stdin_closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stdin_closed.set()), daemon=True).start()

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    messages = []
    quiet_since = None
    while True:
        if sub.poll(100):
            frames = sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                print(f"malformed message: {len(frames)} frames", file=sys.stderr)
                return 1
            try:
                batch = decoder.decode(frames[2])
            except msgspec.DecodeError as e:
                print(f"undecodable payload {frames[2][:64].hex()}: {e}", file=sys.stderr)
                return 1
            messages.append(
                {
                    "topic": frames[0].decode(),
                    "seq": int.from_bytes(frames[1], "big"),
                    "ts": batch.ts,
                    "data_parallel_rank": batch.data_parallel_rank,
                    "events": [as_json(e) for e in batch.events],
                }
            )
            quiet_since = None
        elif stdin_closed.is_set():
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 1.0:
                break
    json.dump(messages, sys.stdout)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
