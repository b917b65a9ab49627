"""A stored stream of `n` > 1 from SGLang, which gives each choice's chunks an id of its own:
what a client that read the stream can read back, by the id it holds."""

from __future__ import annotations

import json

import pytest

from tests.edge.conftest import Recorded, Reply, TinyUpstream, fast_config, run_edge
from tests.edge.state.helpers import ChatUpstream, sdk_of, state, tenants
from tests.edge.state.test_stored_completions import ASK, kept_as


def own_ids(recorded: Recorded) -> Reply:
    """Two choices, each in chunks of its own id (SGLang's per-choice request ids); choice 1
    ends last, with the usage chunk."""
    steps = [(0, {"role": "assistant", "content": ""}, None), (1, {"role": "assistant"}, None),
             (0, {"content": "Io"}, None), (1, {"content": "Europa"}, None),
             (0, {}, "stop"), (1, {}, "stop")]  # fmt: skip

    def chunk(index: int, body: dict[str, object]) -> bytes:
        head = {"id": f"chatcmpl-choice{index}", "object": "chat.completion.chunk",
                "created": 1, "model": "m"}  # fmt: skip
        return b"data: " + json.dumps({**head, **body}).encode() + b"\n\n"

    chunks = [chunk(i, {"choices": [{"index": i, "delta": d, "finish_reason": f}]})
              for i, d, f in steps]  # fmt: skip
    chunks.append(chunk(1, {"choices": [], "usage": {"prompt_tokens": 3,
                                                     "completion_tokens": 4,
                                                     "total_tokens": 7}}))  # fmt: skip
    return Reply(headers=[("content-type", "text/event-stream")],
                 chunks=[*chunks, b"data: [DONE]\n\n"])  # fmt: skip


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_every_id_a_stream_of_several_choices_gave_reads_back_the_one_completion(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    upstream = ChatUpstream(lambda n, recorded: own_ids(recorded))
    stored = state(redis_url if store == "redis" else None, redis_prefix)
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=stored, admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                async with sdk.chat.completions.stream(
                    model="default", messages=ASK, n=2, store=True,  # type: ignore[arg-type]
                ) as stream:  # fmt: skip
                    async for _ in stream:
                        pass
                    final = await stream.get_final_completion()
                by_sdk = await kept_as(sdk, final.id)  # the id the SDK's helper gives
                assert [c.message.content for c in by_sdk.choices] == ["Io", "Europa"]
                assert by_sdk.id == final.id
                raw = await sdk.chat.completions.create(
                    model="default", messages=ASK, n=2, store=True, stream=True,  # type: ignore[arg-type]
                )  # fmt: skip
                ids = [c.id async for c in raw]
                assert set(ids) == {"chatcmpl-choice0", "chatcmpl-choice1"}
                for cid in (ids[0], ids[-1]):
                    kept = await kept_as(sdk, cid)
                    assert [c.message.content for c in kept.choices] == ["Io", "Europa"], cid
