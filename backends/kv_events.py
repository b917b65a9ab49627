"""SGLang's KV-cache events on the wire (`--kv-events-config`): decoding, and a publisher.

SGLang (`python/sglang/srt/disaggregation/kv_events.py`, `ZmqEventPublisher`) publishes on a
ZMQ PUB socket, one three-part message per batch: the topic, a sequence number (8 bytes,
big-endian, from 0 when the server starts) and the batch in msgpack (msgspec, `array_like`):
`[ts, [event, ...]]`, each event an array led by its type's name:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id]
    ["BlockRemoved", block_hashes]
    ["AllBlocksCleared"]

Releases after the one read here append fields (a data-parallel rank on the batch, a `medium`
on events): fields are read by position and the rest is ignored. The edge consumes them in
`edge.routing.kv_events`; the stand-in publishes them with `KvEventPublisher`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec


class KvEventError(ValueError):
    """A message that is not a KV-event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    num_tokens: int
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared

_decode = msgspec.msgpack.Decoder().decode


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(h, int) for h in value):
        raise KvEventError("block_hashes: expected a list of integers")
    return tuple(value)


def _event(raw: Any) -> KvEvent | None:
    """One event; None for a type this edge does not know (a later release's)."""
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise KvEventError("an event is an array led by its type's name")
    kind = raw[0]
    if kind == "BlockStored":
        if len(raw) < 5:
            raise KvEventError("BlockStored: expected 5 fields at least")
        parent, tokens, size = raw[2], raw[3], raw[4]
        if (parent is not None and not isinstance(parent, int)) or not isinstance(tokens, list):
            raise KvEventError("BlockStored: bad parent_block_hash or token_ids")
        if not isinstance(size, int) or size < 1:
            raise KvEventError("BlockStored: block_size must be a positive integer")
        return BlockStored(_hashes(raw[1]), parent, len(tokens), size)
    if kind == "BlockRemoved":
        if len(raw) < 2:
            raise KvEventError("BlockRemoved: expected block_hashes")
        return BlockRemoved(_hashes(raw[1]))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_message(parts: Sequence[bytes]) -> tuple[int, list[KvEvent]]:
    """(sequence number, events) of one published message (`topic, seq, payload`)."""
    if len(parts) != 3 or len(parts[1]) != 8:
        raise KvEventError("expected three parts: topic, an 8-byte sequence number, payload")
    seq = int.from_bytes(parts[1], "big", signed=True)
    try:
        batch = _decode(parts[2])
    except msgspec.DecodeError as exc:
        raise KvEventError(f"payload is not msgpack: {exc}") from None
    except RecursionError:  # arrays in arrays past the decoder's depth: not a batch either
        raise KvEventError("payload is nested too deep") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise KvEventError("a batch is [ts, [event, ...], ...]")
    events = [e for e in map(_event, batch[1]) if e is not None]
    return seq, events


def encode_batch(events: Sequence[list[Any]], ts: float | None = None) -> bytes:
    """A batch as SGLang encodes it, from events in their wire form (`["BlockRemoved", [..]]`)."""
    return msgspec.msgpack.encode([time.time() if ts is None else ts, list(events)])


class KvEventPublisher:
    """A PUB socket that sends batches as SGLang's `ZmqEventPublisher` does (for the stand-in).

    Sends never block: past the high-water mark ZMQ drops, as SGLang's publisher does."""

    def __init__(self, endpoint: str, topic: str = "", hwm: int = 100_000) -> None:
        import zmq  # the stand-in needs pyzmq only when it publishes

        self._zmq = zmq
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._socket.set_hwm(hwm)
        self._socket.setsockopt(zmq.IPV6, 1)  # IPv4 and IPv6 addresses alike
        # SGLang's rule: a wildcard address binds, any other connects.
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._socket.bind(endpoint)
        else:
            self._socket.connect(endpoint)
        self._topic = topic.encode()
        self._seq = 0

    def publish(self, events: Sequence[list[Any]]) -> None:
        if not events:
            return
        parts = (self._topic, self._seq.to_bytes(8, "big"), encode_batch(events))
        self._seq += 1
        try:
            self._socket.send_multipart(parts, flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            pass  # no room (a slow subscriber): dropped, the sequence number shows the gap

    def close(self) -> None:
        self._socket.close(linger=0)


__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KvEvent",
    "KvEventError",
    "KvEventPublisher",
    "decode_message",
    "encode_batch",
]
