"""Processes the deployment tests run as a user would: stand-in backends and `quicedge serve`."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tests.helpers import free_port, wait_for_tcp


@contextmanager
def sim_process(name: str = "sim", profile: str = "instant", *extra: str) -> Iterator[str]:
    """`quicedge sim` in a child process on a free port (`extra`: more of its flags); yields
    its base URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "backends.sim", "--host", "127.0.0.1", "--port", str(port),
         "--name", name, "--profile", profile, "--enable-metrics", "--enable-cache-report",
         *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_tcp("127.0.0.1", port, timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def wait_ready(admin_port: int, timeout: float = 30.0) -> None:
    """Until the admin listener's `/ready` says a backend is healthy."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{admin_port}/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "edge never became ready"
        time.sleep(0.1)


def completion(base_url: str, *, stream: bool = False) -> int:
    """One completion on a fresh connection, read to its end; the status code. Streamed ones
    are the requests the TTFT histograms count."""
    body = {"model": "default", "prompt": "Hello", "max_tokens": 4, "stream": stream}
    with httpx.Client(base_url=base_url, timeout=30) as client:
        response = client.post("/v1/completions", json=body)
        assert not stream or response.text.rstrip().endswith("data: [DONE]")
        return response.status_code
