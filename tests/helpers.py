"""Shared test helpers: free ports and waiting for listeners. Nothing here mocks the stack."""

from __future__ import annotations

import asyncio
import socket
import time


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port on 127.0.0.1 that was free a moment ago (TCP by default, SOCK_DGRAM for UDP)."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_udp_port() -> int:
    return free_port(socket.SOCK_DGRAM)


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
