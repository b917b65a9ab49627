"""The model-judged track: a guard model (any OpenAI-compatible pool, e.g. a safety classifier
served by SGLang) answers `safe` or `unsafe` for the prompt.

`[policy.judge]` names the guard backends and a mode:

- `hold`: the request waits for the verdict before it is routed; `unsafe` refuses it (403
  `policy_violation`, rule `judge`);
- `race`: the request is routed and forwarded at once, the judge asked in parallel; a verdict of
  `unsafe` that comes before the response has started cancels the request (the upstream request
  is aborted) and the client gets the refusal; a later verdict is only recorded (audit, metric).

The guard is asked with one non-streaming chat completion of the prompt text; its answer's first
word decides (`safe` / `unsafe`, as Llama Guard answers). A guard that fails or times out counts
as `error`, and fails open or closed as `on_error` says.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Literal

import orjson

from backends.errors import UpstreamError
from backends.pool import UpstreamPool
from edge.policy.config import JudgeConfig

Verdict = Literal["safe", "unsafe", "error"]

MAX_ANSWER_BYTES = 64 * 1024
"""The longest guard answer read (one of a few words is far shorter): a longer one is `error`,
so a guard gone wrong cannot make each request buffer its whole body."""


class Judge:
    """Asks the guard pool; `ask` never raises (a failure is the verdict `error`)."""

    def __init__(
        self,
        config: JudgeConfig,
        pool: UpstreamPool,
        *,
        observe: Callable[[str, float], None] | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self._next = itertools.cycle(config.backends)
        self._observe = observe
        self._routes = frozenset(config.routes)

    def applies(self, route: str) -> bool:
        return not self._routes or route in self._routes

    async def ask(self, prompt: str) -> Verdict:
        start = time.perf_counter()
        verdict: Verdict = "error"
        try:
            verdict = await asyncio.wait_for(self._ask(prompt), self.config.timeout)
        except (TimeoutError, UpstreamError, ValueError):
            verdict = "error"
        finally:
            if self._observe is not None:
                self._observe(verdict, time.perf_counter() - start)
        return verdict

    async def _ask(self, prompt: str) -> Verdict:
        body = orjson.dumps(
            {
                "model": self.config.model,
                # the newest text, at the end, is what a padded prompt would hide
                "messages": [{"role": "user", "content": prompt[-self.config.max_prompt_chars :]}],
                "max_tokens": 8,
                "temperature": 0,
                "stream": False,
            }
        )
        response = await self.pool.request(
            next(self._next), "POST", "/v1/chat/completions",
            headers=[(b"content-type", b"application/json")], body=body,
            first_byte_timeout=self.config.timeout, chunk_timeout=self.config.timeout,
        )  # fmt: skip
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in response:
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:  # not an answer of a few words: not read further
                    return "error"
                chunks.append(chunk)
        finally:
            await response.aclose()
        if response.status != 200:
            return "error"
        return verdict_of(b"".join(chunks))


def verdict_of(raw: bytes) -> Verdict:
    """`safe` / `unsafe` from a chat completion's first word; anything else is `error`."""
    try:
        obj = orjson.loads(raw)
        text = obj["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return "error"
    if not isinstance(text, str):
        return "error"
    words = text.strip().lower().split()
    first = words[0].strip(".,:;") if words else ""
    if first == "unsafe":
        return "unsafe"
    if first == "safe":
        return "safe"
    return "error"


__all__ = ["Judge", "Verdict", "verdict_of"]
