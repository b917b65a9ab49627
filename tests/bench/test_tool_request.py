"""`quicedge request` as a benchmarker drives it: request bodies of real prompt sizes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

import pytest

from bench.stub_app import WORDS
from certs import DevCertificates
from tests.bench.conftest import REPO, Servers, run_command
from tests.bench.servers import edge_h3, edge_tcp

CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}]})


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


async def _html_503(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A proxy's error page: not JSON, no OpenAI "error" object."""
    if scope["type"] != "http":
        return
    await receive()
    headers = [(b"content-type", b"text/html")]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": b"<html>\n upstream overloaded </html>"})


async def _sglang_400(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """SGLang's error shape: the message at the top level, not under "error"."""
    if scope["type"] != "http":
        return
    await receive()
    body = {"object": "error", "message": "context too long", "type": "BadRequestError"}
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


@pytest.mark.parametrize(
    ("app", "shown"),
    [
        (_html_503, "HTTP 503: <html> upstream overloaded </html>"),
        (_sglang_400, "context too long"),
    ],
)
@pytest.mark.parametrize("transport", ["h3", "h1"])
async def test_an_error_answer_shows_its_body(
    dev_certs: DevCertificates, transport: str, app: Any, shown: str
) -> None:
    """An error status printed only `status: 503`: the answer's body, the reason, was dropped."""
    server_cm = edge_h3(dev_certs, app) if transport == "h3" else edge_tcp(dev_certs, app)
    async with server_cm as server:
        url = f"https://localhost:{server.port}/v1/chat/completions"
        done = await run_command(
            "bench.request", url, "--json", CHAT, f"--{transport}",
            "--cacert", str(dev_certs.ca_cert), "--timeout", "10",
        )  # fmt: skip
    assert done.returncode == 1
    error = [line for line in done.stdout.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and shown in error[0], done.stdout


async def _no_text(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A 200 event stream with the role chunk and [DONE] but no generated text."""
    if scope["type"] != "http":
        return
    await receive()
    headers = [(b"content-type", b"text/event-stream")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    body = b"data: " + json.dumps(role).encode() + b"\n\ndata: [DONE]\n\n"
    await send({"type": "http.response.body", "body": body})


async def test_a_stream_without_generated_text_says_why_it_failed(
    dev_certs: DevCertificates,
) -> None:
    """It exited 1 with `status: 200` and no error line; `quicedge bench` listed it among the
    errors as "status 200"."""
    async with edge_tcp(dev_certs, _no_text) as server:
        url = f"https://localhost:{server.port}/v1/chat/completions"
        done = await run_command(
            "bench.request", url, "--json", CHAT, "--h1",
            "--cacert", str(dev_certs.ca_cert), "--timeout", "10",
        )  # fmt: skip
    assert done.returncode == 1
    assert "error: the stream carried no generated text" in done.stdout, done.stdout


def _stalls(release: asyncio.Event) -> Any:
    """One word of the answer, then nothing until `release`: a stuck generation."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        chunk = {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}
        body = b"data: " + json.dumps(chunk).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await release.wait()

    return app


async def test_ctrl_c_ends_the_request_without_a_traceback(dev_certs: DevCertificates) -> None:
    """Ctrl-C on a stuck answer printed a traceback; it ends with a line saying so, exit 130."""
    release = asyncio.Event()
    async with edge_tcp(dev_certs, _stalls(release)) as server:
        url = f"https://localhost:{server.port}/v1/chat/completions"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.request", url, "--json", CHAT, "--h1",
            "--cacert", str(dev_certs.ca_cert), cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            assert await asyncio.wait_for(proc.stdout.readexactly(2), 20) == b"Hi"
            proc.send_signal(signal.SIGINT)
            _, stderr = await asyncio.wait_for(proc.communicate(), 20)
        finally:
            release.set()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 130, stderr.decode()
    assert b"Traceback" not in stderr and b"interrupted" in stderr
