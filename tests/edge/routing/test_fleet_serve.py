"""`quicedge serve --workers 2` with pre-warming and the shared view: two worker processes in
front of a stand-in find each other through Redis."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from tests.edge.test_many_streams import stand_in  # noqa: F401  (the fixture)
from tests.transport.conftest import ServeProcess


def backends_json(serve: ServeProcess) -> dict[str, object]:
    url = f"http://127.0.0.1:{serve.admin_port}/backends"
    with urllib.request.urlopen(url, timeout=10) as r:
        return dict(json.loads(r.read()))


def test_two_worker_processes_share_the_view_through_redis(
    stand_in: str,  # noqa: F811
    redis_url: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("QUICEDGE_BACKEND", stand_in)
    serve = ServeProcess(
        "--workers", "2", "--redis", redis_url, "--prewarm",
        "--fleet-view", "--fleet-view-key", redis_prefix + "fv", "--fleet-view-interval", "0.05",
        "--fleet-view-timeout", "5",  # a loaded test machine must not read as Redis down
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        seen: dict[str, object] = {}
        while time.monotonic() < deadline:  # each answer comes from either worker
            seen = backends_json(serve)
            view = seen.get("fleet_view")
            if isinstance(view, dict) and (view.get("peers") or 0) >= 1 and view.get("connected"):
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the workers never heard of each other: {seen}")
        prewarm = seen["prewarm"]
        assert isinstance(prewarm, dict) and "backends" in prewarm
    finally:
        assert serve.stop() == 0, serve.errors()
