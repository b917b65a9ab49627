"""Shared pieces of the state tests: edges with a state config, chat streams, a scripted chat
upstream that records the prompts it got."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from openai import AsyncOpenAI

from edge.admission.settings import AdmissionSettings, TenantSettings
from edge.admission.tenants import key_digest
from edge.state.config import CacheConfig, ConversationConfig, StateConfig
from tests.edge.conftest import Recorded, Reply, health_ok

CHAT = "/v1/chat/completions"


def state(
    redis_url: str | None = None,
    prefix: str = "quicedge:",
    *,
    conversations: dict[str, Any] | None = None,
    cache: dict[str, Any] | None = None,
    timeout: float = 0.5,
) -> StateConfig:
    config = StateConfig(
        store="redis" if redis_url else "memory",
        redis_url=redis_url,
        redis_timeout=timeout,
        key_prefix=prefix,
        conversations=ConversationConfig.from_mapping(conversations or {}),
        cache=CacheConfig.from_mapping(cache or {}),
    )
    config.validate()
    return config


def tenants(*names: str) -> AdmissionSettings:
    """Tenants `names`, each with the API key `sk-NAME` (see `as_tenant`)."""
    return AdmissionSettings(
        tenants=[TenantSettings(name=n, api_key_sha256=[key_digest(f"sk-{n}")]) for n in names]
    )


def sdk_of(edge: Any, tenant: str = "alpha") -> AsyncOpenAI:
    """The official OpenAI SDK against `edge` as `tenant` of `tenants(...)`, retries off."""
    return AsyncOpenAI(base_url=edge.url + "/v1", api_key=f"sk-{tenant}", max_retries=0)


def as_tenant(name: str) -> dict[str, str]:
    """The headers of a request by tenant `name` of `tenants(...)`."""
    return {"authorization": f"Bearer sk-{name}"}


def chat_chunks(texts: Sequence[str], *, weight_version: str | None = None) -> list[bytes]:
    """An SGLang-like chat stream: role chunk, content chunks, finish chunk, [DONE]."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def sse(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    out = [sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
    out += [
        sse({**head, "choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]})
        for t in texts
    ]
    out.append(sse({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    out.append(b"data: [DONE]\n\n")
    return out


def chat_whole(text: str, *, weight_version: str | None = None) -> bytes:
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }  # fmt: skip
    if weight_version is not None:
        body["metadata"] = {"weight_version": weight_version}
    return json.dumps(body).encode()


class ChatUpstream:
    """A scripted chat backend: answers `reply_for(n)` to the n-th chat request (from 0), may hold
    a reply until `gate` is set; records every chat request it got."""

    def __init__(
        self,
        reply_for: Callable[[int, Recorded], Reply] | None = None,
        *,
        gate: asyncio.Event | None = None,
    ) -> None:
        self.reply_for = reply_for or (lambda n, r: default_reply(n, r))
        self.gate = gate
        self.chats: list[Recorded] = []
        self.arrived = asyncio.Event()

    async def __call__(self, recorded: Recorded) -> Reply:
        found = health_ok(recorded)
        if found is not None:
            return found
        n = len(self.chats)
        self.chats.append(recorded)
        self.arrived.set()
        if self.gate is not None:
            await self.gate.wait()
        return self.reply_for(n, recorded)

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.body) for r in self.chats]


def default_reply(n: int, recorded: Recorded) -> Reply:
    body = json.loads(recorded.body)
    if body.get("stream"):
        return Reply(
            headers=[("content-type", "text/event-stream")],
            chunks=chat_chunks([f"answer {n}", " done"]),
        )
    return Reply(
        headers=[("content-type", "application/json")],
        chunks=[chat_whole(f"answer {n} done")],
        chunked=False,
    )


def sse_events(content: bytes) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) of each SSE event."""
    out: list[tuple[str | None, Any]] = []
    for block in content.split(b"\n\n"):
        name, data = None, None
        for line in block.split(b"\n"):
            if line.startswith(b"event: "):
                name = line[7:].decode()
            elif line.startswith(b"data: "):
                raw = line[6:]
                data = raw.decode() if raw == b"[DONE]" else json.loads(raw)
        if name is not None or data is not None:
            out.append((name, data))
    return out


async def background_started(http: httpx.AsyncClient, body: dict[str, Any]) -> str:
    """Start a background stream (`body` with `background` and `stream` true), read its
    response's id from the first event, and leave it running: the id."""
    async with http.stream("POST", "/v1/responses", json=body) as asked:
        async for line in asked.aiter_lines():  # the id comes first; then it leaves
            if line.startswith("data: "):
                return str(json.loads(line[6:])["response"]["id"])
    raise AssertionError("the stream ended before its first event")
