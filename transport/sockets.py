"""Binding a listener's socket so that a failure says which listener: `quicedge serve` starts
up to four, and "Address already in use" alone does not say which address."""

from __future__ import annotations

import socket


def bind_naming(sock: socket.socket, host: str, port: int, kind: str) -> None:
    """Bind `sock`; an error names the address and the protocol (and the socket is closed)."""
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            exc.errno, f"cannot listen on {host}:{port} ({kind}): {exc.strerror}"
        ) from None


__all__ = ["bind_naming"]
