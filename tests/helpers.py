"""Shared test helpers: free ports and waiting for listeners. Nothing here mocks the stack."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import BinaryIO

import redis

from bench.children import free_port


def child_output(file: BinaryIO) -> str:
    """What a child process has written so far to `file`, its stdout or stderr. Read at an
    offset, not after a seek: the child writes at the offset it shares with this open file,
    and a seek back to 0 would make its next line overwrite the first."""
    fd = file.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def free_udp_port() -> int:
    return free_port(socket.SOCK_DGRAM)


def restartable_port() -> int:
    """A free TCP port below the kernel's range for outgoing connections: a server stopped on
    it can start there again (Redis coming back at its address), because no client socket of
    this or another process is given it in between. `free_port`'s, which draws from there and
    never gives one port twice in a process (nor the same as another test runner's)."""
    return free_port()


def wait_for_tcp(host: str, port: int, timeout: float = 10.0) -> None:
    """Block until something accepts TCP connections on host:port."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s") from None
            time.sleep(0.02)


async def async_wait_for_tcp(host: str, port: int, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection(host, port)
            writer.close()
            await writer.wait_closed()
            return
        except OSError:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s") from None
            await asyncio.sleep(0.02)


class RedisServer:
    """A redis-server of our own on a free loopback port; stopping it tests Redis going away."""

    def __init__(self, port: int | None = None, *, password: str | None = None) -> None:
        """Start one on `port` (None: a free one, `restartable_port`; the old port restarts a
        stopped server); with `password`, clients must give it (`requirepass`)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "no redis-server: run `make test`, or install redis-server, "
                "or set QUICEDGE_TEST_REDIS_URL"
            )
        self.port = port or restartable_port()
        auth = f":{password}@" if password is not None else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        more = ["--requirepass", password] if password is not None else []
        # its files (a replica's full sync writes an RDB whatever `--save` says) in a directory
        # of its own, not the directory the tests run in
        self.dir = tempfile.mkdtemp(prefix="quicedge-redis-")
        self.proc = subprocess.Popen(
            [
                binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                *more,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, password=password)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)
            finally:
                client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


async def wait_until(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    """Poll `predicate` on the running loop until it is true; AssertionError after `timeout`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def settled(read: Callable[[], int], *, quiet: float = 0.5, timeout: float = 20.0) -> int:
    """Wait until `read()` is above 0 and has not changed for `quiet` seconds; return it.

    For a count that grows and then must stop (bytes sent against backpressure). A stall on a
    loaded machine can make it look settled early, but only below where it would stop, so an
    upper bound checked on the result cannot fail from it. AssertionError after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    value, since = read(), loop.time()
    while value <= 0 or loop.time() - since < quiet:
        if loop.time() > deadline:
            raise AssertionError(f"still changing after {timeout}s: {value}")
        await asyncio.sleep(0.05)
        now = read()
        if now != value:
            value, since = now, loop.time()
    return value
