"""SGLang's KV-cache events: the wire format as SGLang's own encoder writes it, malformed
messages, and the stand-in publishing its radix cache's changes on a real ZMQ socket."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from backends.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventError,
    decode_message,
)
from backends.sim import SimConfig, SimServer
from backends.sim.radix import RadixCache
from tests.helpers import free_port


# SGLang's event types as it declares them (msgspec structs, arrays led by their tag).
class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _Stored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class _Removed(_Event, tag="BlockRemoved"):
    block_hashes: list[int]


class _Cleared(_Event, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    attn_dp_rank: int | None = 3  # a later release's extra field: ignored


def test_a_batch_as_sglangs_encoder_writes_it_decodes() -> None:
    batch = _Batch(
        ts=1.5,
        events=[
            _Stored([11, 12], None, list(range(32)), 16, None),
            _Removed([11]),
            _Cleared(),
        ],
    )
    parts = [b"kv", (41).to_bytes(8, "big"), msgspec.msgpack.encode(batch)]
    seq, events = decode_message(parts)
    assert seq == 41
    assert events == [BlockStored((11, 12), None, 32, 16), BlockRemoved((11,)), AllBlocksCleared()]


@pytest.mark.parametrize(
    ("parts", "says"),
    [
        ([b"", b"\0" * 8], "three parts"),
        ([b"", b"\0" * 4, b"\x90"], "8-byte"),
        ([b"", b"\0" * 8, b"\xc1"], "not msgpack"),
        ([b"", b"\0" * 8, msgspec.msgpack.encode({"ts": 1})], "a batch is"),
        ([b"", b"\0" * 8, msgspec.msgpack.encode([1.0, [["BlockStored", [1]]]])], "5 fields"),
        ([b"", b"\0" * 8, msgspec.msgpack.encode([1.0, [["BlockRemoved", ["x"]]]])], "integers"),
        ([b"", b"\0" * 8, msgspec.msgpack.encode([1.0, [[7]]])], "led by its type"),
    ],
)
def test_a_malformed_message_is_refused_with_the_reason(parts: list[bytes], says: str) -> None:
    with pytest.raises(KvEventError, match=says):
        decode_message(parts)


def test_an_event_type_from_a_later_release_is_skipped() -> None:
    payload = msgspec.msgpack.encode([1.0, [["BlockMoved", [1]], ["AllBlocksCleared"]]])
    assert decode_message([b"", b"\0" * 8, payload])[1] == [AllBlocksCleared()]


def test_the_radix_cache_reports_stored_removed_and_cleared_pages() -> None:
    seen: list[list[object]] = []
    cache = RadixCache(page_size=2, events=seen.extend)
    cache.insert([1, 2, 3, 4, 5])  # two whole pages
    (stored,) = seen
    assert stored[0] == "BlockStored" and stored[2] is None and stored[4] == 2
    first, second = stored[1]  # type: ignore[misc]
    cache.insert([1, 2, 7, 8])  # splits after the first page: the new page chains to it
    assert seen[1][0] == "BlockStored" and seen[1][2] == first and seen[1][3] == [7, 8]
    third = seen[1][1][0]  # type: ignore[index]
    assert len({first, second, third}) == 3
    cache.evict(4)
    assert seen[2][0] == "BlockRemoved" and sorted(seen[2][1]) == sorted([second, third])  # type: ignore[arg-type]
    cache.reset()
    assert seen[3] == ["AllBlocksCleared"]


async def test_the_stand_in_publishes_its_cache_changes_on_a_zmq_socket() -> None:
    port = free_port()
    config = SimConfig(
        host="127.0.0.1", port=0, profile="instant",
        kv_events_config=f'{{"publisher": "zmq", "endpoint": "tcp://*:{port}", "topic": "kv"}}',
    )  # fmt: skip
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"kv")
    socket.connect(f"tcp://127.0.0.1:{port}")  # as the edge does; the stand-in binds
    try:
        async with SimServer(config) as sim, httpx.AsyncClient(timeout=10) as http:
            # PUB/SUB drops what is sent before the subscription reaches the publisher (ZMQ's
            # "slow joiner"): new prompts until one's events arrive.
            stored: list[BlockStored] = []
            async with asyncio.timeout(20):
                for i in range(1000):
                    text = f"prompt {i} one two three four five"
                    r = await http.post(f"{sim.url}/generate", json={"text": text})
                    assert r.status_code == 200
                    if await socket.poll(200):
                        seq, events = decode_message(await socket.recv_multipart())
                        stored = [e for e in events if isinstance(e, BlockStored)]
                        break
            assert stored and stored[0].block_size == 1 and stored[0].num_tokens > 0
            assert (await http.post(f"{sim.url}/flush_cache")).status_code == 200
            async with asyncio.timeout(10):
                while True:
                    later, events = decode_message(await socket.recv_multipart())
                    if AllBlocksCleared() in events:
                        break
            assert later > seq
    finally:
        socket.close(linger=0)
        context.term()


def test_a_bad_kv_events_config_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown publisher"):
        SimConfig(kv_events_config='{"publisher": "kafka"}')
    with pytest.raises(ValueError, match="not JSON"):
        SimConfig(kv_events_config="{publisher")
    assert SimConfig(kv_events_config='{"publisher": "null"}').kv_events is None
