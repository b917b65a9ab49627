"""A `/v1/responses` answer the backend aborted (SGLang's finish `abort`: a restart,
`/abort_request`, a full KV pool) is `failed`, whole or streamed, not `completed`."""

from __future__ import annotations

import json
from typing import Any

from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
)


def chat(stream: bool) -> Any:
    def reply(recorded: Recorded) -> Reply:
        if stream:
            chunk = {"id": "c1", "object": "chat.completion.chunk", "model": "tiny-model",
                     "choices": [{"index": 0, "delta": {"content": "half"},
                                  "finish_reason": "abort"}]}  # fmt: skip
            chunks = [b"data: " + json.dumps(chunk).encode() + b"\n\n", b"data: [DONE]\n\n"]
            return health_ok(recorded) or Reply(
                headers=[("content-type", "text/event-stream")], chunks=chunks
            )
        body = {"id": "c1", "object": "chat.completion", "model": "tiny-model",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "half"},
                             "finish_reason": "abort"}]}  # fmt: skip
        return health_ok(recorded) or Reply(
            chunks=[json.dumps(body).encode()], chunked=False,
            headers=[("content-type", "application/json")],
        )  # fmt: skip

    return reply


async def test_an_aborted_whole_answer_is_failed() -> None:
    async with TinyUpstream(chat(stream=False)) as up:
        async with run_edge(fast_config([up.url])) as edge, client(edge) as http:
            response = await http.post("/v1/responses", json={"model": "tiny-model", "input": "hi"})
    obj = response.json()
    assert obj["status"] == "failed", obj
    assert obj["error"]["code"] == "server_error"


async def test_an_aborted_stream_ends_failed() -> None:
    async with TinyUpstream(chat(stream=True)) as up:
        async with run_edge(fast_config([up.url])) as edge, client(edge) as http:
            body = {"model": "tiny-model", "input": "hi", "stream": True}
            response = await http.post("/v1/responses", json=body)
    types = [json.loads(line[6:])["type"] for line in response.text.splitlines()
             if line.startswith("data: {")]  # fmt: skip
    assert types[-1] == "response.failed", types
