"""Bench test fixtures: real servers on free ports, and running the bench commands as a user
would (a subprocess), so the servers keep running in the test's own event loop."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from certs import DevCertificates
from tests.bench.servers import edge_h3, edge_tcp

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Servers:
    tls_port: int  # TLS: h2 and http/1.1
    plain_port: int  # plain http/1.1
    h3_port: int  # HTTP/3 (UDP)


@pytest.fixture
async def servers(dev_certs: DevCertificates) -> AsyncIterator[Servers]:
    async with (
        edge_tcp(dev_certs) as tls,
        edge_tcp(None) as plain,
        edge_h3(dev_certs) as h3,
    ):
        yield Servers(tls.port, plain.port, h3.port)


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str


async def run_command(*args: str, timeout: float = 60.0) -> Completed:
    """`python -m <args>` from the repository root, awaited without blocking the loop."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        *args,
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return Completed(proc.returncode, out.decode(), err.decode())
