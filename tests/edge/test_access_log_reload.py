"""A reload that changes `[access_log]` starts a new log before the old one writes what it holds
(`Wiring.set_access_log`): both logs' handlers are on the `quicedge.access` logger meanwhile, and
each line must still be written once."""

from __future__ import annotations

import io
import json
import sys
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from edge.access_log import AccessLogConfig
from edge.wiring import build
from tests.edge.conftest import fast_config


class HeldStream(io.StringIO):
    """stderr whose first write waits until the test lets it go: the old log's writer is then
    busy while more lines queue behind it."""

    def __init__(self) -> None:
        super().__init__()
        self.writing = threading.Event()
        self.go = threading.Event()

    def write(self, text: str) -> int:
        if not self.writing.is_set():
            self.writing.set()
            assert self.go.wait(10)
        return super().write(text)


async def test_a_reload_of_the_access_log_writes_each_line_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stream = HeldStream()
    monkeypatch.setattr(sys, "stderr", stream)  # the default handler's stream, at its making
    wiring = await build(fast_config(["http://127.0.0.1:9"]), registry=CollectorRegistry(),
                         access_log=AccessLogConfig())  # fmt: skip
    old = wiring.access_log
    assert old is not None
    old.start()
    try:
        t0 = time.perf_counter()
        old.request(None, route="/a", method="GET", status=200, t_end=t0, t0=t0, request_id="a0")
        assert stream.writing.wait(10)  # the writer holds line a0 in its write
        for i in range(1, 4):  # these wait in the old log's queue
            old.request(None, route="/a", method="GET", status=200, t_end=t0, t0=t0,
                        request_id=f"a{i}")  # fmt: skip
        stream.go.set()
        await wiring.set_access_log(AccessLogConfig(sample_rate=0.5))  # starts new, stops old
        new = wiring.access_log
        assert new is not None
        new.request(None, route="/b", method="GET", status=500, t_end=t0, t0=t0, request_id="b0")
    finally:
        await wiring.aclose()
    ids = [json.loads(line)["request_id"] for line in stream.getvalue().splitlines()]
    assert ids == ["a0", "a1", "a2", "a3", "b0"], ids
