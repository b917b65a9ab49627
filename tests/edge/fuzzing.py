"""What the generated-input tests share: an edge on a loop in a thread of its own, so that
`hypothesis` drives it from a plain test, and strategies for any JSON value."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
"""Derandomized: a run is the same every time, and a failure is shrunk to its smallest input."""


class EdgeThread:
    """What `serve` starts (a context that yields the edge's URL) on an event loop in a thread
    of its own, until the block ends."""

    def __init__(self, serve: Callable[[], AbstractAsyncContextManager[str]]) -> None:
        self.serve = serve
        self.loop = asyncio.new_event_loop()
        self.url = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def __enter__(self) -> EdgeThread:
        self._thread.start()
        if not self._ready.wait(30) or self._failed is not None:
            raise RuntimeError(f"the edge did not start: {self._failed!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _main(self) -> None:
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported by __enter__
            self._failed = exc
            self._ready.set()
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with self.serve() as url:
            self.url = url
            self._ready.set()
            await self._stop.wait()


_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
ANY = st.recursive(
    _SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
"""Any JSON value."""


def field(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's likely value, or any JSON value in its place."""
    return st.one_of(good, ANY)


# -- what a backend may send ---------------------------------------------------------------

TOOL_CALL = st.fixed_dictionaries(
    {},
    optional={
        "index": field(st.integers(0, 2)),
        "id": field(st.text(max_size=4)),
        "type": field(st.just("function")),
        "function": field(st.fixed_dictionaries(
            {}, optional={"name": field(st.text(max_size=4)),
                          "arguments": field(st.text(max_size=8))})),
    },
)  # fmt: skip
_DELTA = st.fixed_dictionaries(
    {},
    optional={
        "role": field(st.just("assistant")),
        "content": field(st.one_of(st.none(), st.text(max_size=8))),
        "reasoning_content": field(st.text(max_size=8)),
        "tool_calls": field(st.lists(TOOL_CALL, max_size=2)),
    },
)
_FINISH = st.sampled_from([None, "stop", "length", "tool_calls", "abort"])
_USAGE = st.fixed_dictionaries(
    {},
    optional={
        "prompt_tokens": field(st.integers(0, 100)),
        "completion_tokens": field(st.integers(0, 100)),
        "total_tokens": field(st.integers(0, 200)),
        "prompt_tokens_details": ANY,
        "reasoning_tokens": ANY,
    },
)
CHAT_CHUNK = st.fixed_dictionaries(
    {"id": field(st.just("chatcmpl-1")), "object": field(st.just("chat.completion.chunk")),
     "choices": field(st.lists(st.fixed_dictionaries(
         {"index": field(st.integers(0, 1)), "delta": field(_DELTA),
          "finish_reason": field(_FINISH)},
         optional={"logprobs": ANY, "matched_stop": ANY}), max_size=2))},
    optional={"usage": field(st.one_of(st.none(), _USAGE)), "model": ANY, "created": ANY,
              "metadata": ANY},
)  # fmt: skip
EVENT = st.one_of(
    CHAT_CHUNK.map(lambda c: b"data: " + json.dumps(c).encode() + b"\n\n"),
    ANY.map(lambda v: b"data: " + json.dumps(v).encode() + b"\n\n"),
    st.binary(max_size=20).map(lambda b: b"data: " + b + b"\n\n"),
    st.sampled_from([
        b"data: [DONE]\n\n", b": keep-alive\n\n", b"event: error\n", b"\n\n", b"data: {\n\n",
        b'data: {"error": {"message": "boom", "code": 400}}\n\n', b"data:{}\r\n\r\n",
    ]),
)  # fmt: skip
"""One event of a backend's stream: a chat chunk of any shape, any JSON, bytes, or oddities."""
WHOLE_ANSWER = st.fixed_dictionaries(
    {"id": field(st.just("chatcmpl-1")), "object": field(st.just("chat.completion")),
     "choices": field(st.lists(st.fixed_dictionaries(
         {"index": field(st.integers(0, 1)),
          "message": field(st.fixed_dictionaries(
              {"role": field(st.just("assistant")),
               "content": field(st.one_of(st.none(), st.text(max_size=10)))},
              optional={"tool_calls": field(st.lists(TOOL_CALL, max_size=2)),
                        "reasoning_content": field(st.text(max_size=6))})),
          "finish_reason": field(_FINISH)}), max_size=2))},
    optional={"usage": field(_USAGE), "model": ANY, "metadata": ANY},
)  # fmt: skip
"""A backend's whole chat answer, any JSON in any field."""


def split(body: bytes) -> st.SearchStrategy[list[bytes]]:
    """`body` in pieces cut anywhere, as reads bring it."""
    if len(body) < 2:
        return st.just([body] if body else [])
    cuts = st.sets(st.integers(1, len(body) - 1), max_size=6).map(sorted)
    return cuts.map(lambda c: [body[a:b] for a, b in zip([0, *c], [*c, len(body)], strict=True)])
