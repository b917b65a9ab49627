"""HTTP/2 request bodies whose flow-control credit goes back to the client as the app reads.

hypercorn 0.18 hands each DATA frame to its stream's app through a queue of 10 messages and
returns the frame's bytes to the client's windows at once. An app that reads its body late
therefore blocked the connection's read loop as soon as 10 frames waited: every other request
on the connection, a GET included, waited with it (1.8 s behind an app that began reading
2 s late). HTTP/2's own flow control is the bound meant for this (RFC 9113 §5.2).

`AppQueue` takes the place of hypercorn's queue: it never makes the read loop wait, and it
returns a body's bytes to the stream's window only as the app reads them, so what one stream
holds unread is bounded by that window (65,535 bytes, h2's default), whatever the app does.
Consecutive body pieces still waiting are joined into one message, so a client writing
one-byte DATA frames costs a byte each, not a message each. The connection's window is opened
to `max_concurrent_streams` stream windows (`connection_window`), so streams whose apps read
late cannot take the whole connection's credit from the others; what the stream had not read
when it closes goes back to the connection then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

Message = dict[str, Any]


class AppQueue(asyncio.Queue[Message]):
    """One stream's messages to its app, unbounded: the stream's flow-control window bounds
    its body bytes, and those go back to the client as the app reads them (`on_read`)."""

    on_read: Callable[[int], None]
    unread: int
    settled: bool

    def _put(self, item: Message) -> None:
        body = item.get("body")
        queue: Any = self._queue  # type: ignore[attr-defined]  # asyncio.Queue's deque
        if body and item.get("more_body") and queue:
            last = queue[-1]
            if last.get("more_body") and "body" in last:
                joined = last["body"]
                if not isinstance(joined, bytearray):
                    last["body"] = joined = bytearray(joined)
                joined += body
                self.unread += len(body)
                return
        if body:
            self.unread += len(body)
        queue.append(item)

    def _get(self) -> Message:
        queue: Any = self._queue  # type: ignore[attr-defined]
        item: Message = queue.popleft()
        body = item.get("body")
        if body:
            if isinstance(body, bytearray):
                item["body"] = bytes(body)
            if not self.settled:
                self.unread -= len(body)
                self.on_read(len(body))
        return item

    def settle(self) -> int:
        """The stream closed: the bytes its app never read, which no read will return now."""
        self.settled = True
        unread, self.unread = self.unread, 0
        return unread


def take_over(put: Callable[..., Any], on_read: Callable[[int], None]) -> AppQueue | None:
    """Make the queue behind hypercorn's `app_put` an `AppQueue` calling `on_read` with each
    body's size as the app reads it; None when `put` is not an `asyncio.Queue`'s (another
    hypercorn), which is then left as it is."""
    queue = getattr(put, "__self__", None)  # hypercorn 0.18 hands out `asyncio.Queue.put`
    if type(queue) is not asyncio.Queue or not queue.empty():
        return None
    queue.__class__ = AppQueue
    taken: AppQueue = queue  # type: ignore[assignment]  # its class was just made so
    taken._maxsize = 0  # type: ignore[attr-defined]  # unbounded: put never waits
    taken.on_read = on_read
    taken.unread = 0
    taken.settled = False
    return taken


def connection_window(stream_window: int, max_streams: int) -> int:
    """The connection's receive window: every stream's, so streams left unread cannot hold the
    others up (h2 starts it at one stream's)."""
    return stream_window * max(max_streams, 1)


__all__ = ["AppQueue", "connection_window", "take_over"]
