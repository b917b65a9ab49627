"""`quicedge request` as a benchmarker drives it: request bodies of real prompt sizes."""

from __future__ import annotations

import json

import pytest

from bench.stub_app import WORDS
from certs import DevCertificates
from tests.bench.conftest import Servers, run_command


@pytest.mark.parametrize("transport", ["h3", "h2", "h1"])
async def test_a_body_over_one_frame_and_one_window_is_sent(
    servers: Servers, dev_certs: DevCertificates, transport: str
) -> None:
    """A 100 kB prompt: more than HTTP/2's default 16 KiB frame and 64 KiB window. Over h2 it
    went as one DATA frame and every such request failed with FrameTooLargeError."""
    port = servers.h3_port if transport == "h3" else servers.tls_port
    url = f"https://localhost:{port}/v1/chat/completions"
    body = json.dumps({"messages": [{"role": "user", "content": "x " * 50_000}]})
    done = await run_command(
        "bench.request", url, "--json", body, f"--{transport}",
        "--cacert", str(dev_certs.ca_cert), "--timeout", "10",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("".join(WORDS) + "\n")
    assert "status: 200" in done.stdout
