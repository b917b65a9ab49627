"""`quicedge serve --config` with a policy module and an audit log, as an operator runs it:
SIGHUP reloads the module, and the audit log it wrote verifies."""

from __future__ import annotations

import asyncio
import json
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import wasmtime

from certs import ensure_dev_certificates
from tests.edge.test_many_streams import stand_in  # noqa: F401  (the fixture)
from tests.transport.conftest import ServeProcess

EXAMPLE = Path(__file__).parents[3] / "edge" / "policy" / "examples" / "deny_keyword.wasm"
ALLOW_ALL = """(module (memory (export "memory") 1)
  (data (i32.const 0) "{\\"action\\":\\"allow\\"}")
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "check") (param i32 i32) (result i64) (i64.const 18)))"""


def body(text: str) -> dict[str, object]:
    return {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": text}]}


async def test_sighup_reloads_the_module_and_the_audit_log_verifies(
    stand_in: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    live = tmp_path / "policy.wasm"
    live.write_bytes(wasmtime.wat2wasm(ALLOW_ALL))
    audit = tmp_path / "audit.jsonl"
    config = tmp_path / "quicedge.toml"
    config.write_text(f"""
[[policy.wasm]]
id = "kw"
path = "{live}"
poll_interval = 3600.0   # this test reloads with SIGHUP only

[audit]
path = "{audit}"
""")
    serve = ServeProcess("--backend", stand_in, "--config", str(config))
    try:
        banner = next(line for line in serve.lines if line.startswith("quicedge serve: app"))
        assert banner.endswith(f"; gateway 1 module; audit log {audit}"), banner
        ctx = ssl.create_default_context(cafile=str(ensure_dev_certificates().ca_cert))
        url = f"https://localhost:{serve.tcp_port}/v1/chat/completions"
        sent = 0
        async with httpx.AsyncClient(verify=ctx, timeout=30) as client:
            sent += 1
            assert (await client.post(url, json=body("forbidden"))).status_code == 200
            live.write_bytes(EXAMPLE.read_bytes())
            serve.proc.send_signal(signal.SIGHUP)
            deadline = asyncio.get_running_loop().time() + 30
            while True:  # the reload compiles in a thread: wait for it, boundedly
                sent += 1
                status = (await client.post(url, json=body("forbidden"))).status_code
                if status == 403:
                    break
                assert status == 200
                assert asyncio.get_running_loop().time() < deadline, "not reloaded in 30 s"
                await asyncio.sleep(0.1)
            sent += 1
            assert (await client.post(url, json=body("hello"))).status_code == 200
    finally:
        assert serve.stop() == 0, serve.errors()
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "edge.cli", "audit", "verify", "--from-genesis", str(audit)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("OK ")
    # every request, refused or not, and what the SIGHUP reloaded: the certificate and the
    # (unchanged) config
    assert int(done.stdout.split()[1]) == sent + 2
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    assert sum("request_id" in line for line in lines) == sent
    events = [(line["event"], line["outcome"]) for line in lines if "event" in line]
    assert events == [("certificate_reload", "applied"), ("config_reload", "unchanged")]
