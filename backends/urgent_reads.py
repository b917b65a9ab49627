"""Read the upstream sockets whose first token is due out of the event loop's turn.

At many streams in step, the requests that follow the streams' ends reach the edge together.
Each costs ~0.2 ms of Python before it reaches its backend, and the event loop polls no socket
while it works through them: a first token that came back meanwhile waits in the kernel until
the burst is over, several milliseconds at 32 streams. After every request it sends, unless
it read an upstream socket in the last half millisecond (`URGENT_AFTER`: a loop that polls that
often serves first tokens in its own order), the pool asks this set (one `epoll_wait` with a
zero timeout, about a microsecond when nothing is ready) and reads the ready sockets at once.
A first token then waits about half a millisecond and one request start at most, instead of
the whole burst.

A socket is *urgent* from its request's send until the relay has passed its first content
token on (or the response ends, or the connection closes), when its request has a head
callback (`UpstreamPool.request(on_head=...)`) that can relay what the read brings; a request
whose task would have to wake anyway gains nothing from an early read. The out-of-turn read and the
transport's own read take bytes off the same stream in one thread, and neither buffers, so the
protocol sees them in order; the transport's next read just finds nothing (EAGAIN) and waits.

Linux only (epoll); elsewhere `available` is False and nothing is read out of turn.
"""

from __future__ import annotations

import select
from collections.abc import Callable

_EPOLL = getattr(select, "epoll", None)


class UrgentReads:
    """An epoll set of urgent sockets, each with the callback that reads it."""

    available = _EPOLL is not None

    def __init__(self) -> None:
        if _EPOLL is None:
            raise RuntimeError("urgent reads need epoll (Linux)")
        self._epoll = _EPOLL()
        self._readers: dict[int, Callable[[], None]] = {}

    def __len__(self) -> int:
        return len(self._readers)

    def add(self, fd: int, read: Callable[[], None]) -> None:
        """Watch `fd`; `read` takes its bytes when `poll` finds it readable."""
        if fd in self._readers:
            # The same socket for its next request, or a new one on a reused descriptor number
            # (epoll forgets a closed one by itself): watch it afresh either way.
            self.discard(fd)
        try:
            self._epoll.register(fd, select.EPOLLIN)
        except OSError:
            return  # closed already: nothing to read out of turn
        self._readers[fd] = read

    def discard(self, fd: int) -> None:
        if self._readers.pop(fd, None) is not None:
            try:
                self._epoll.unregister(fd)
            except OSError:
                pass  # closed, and so already gone from the set

    def poll(self) -> None:
        """Read every urgent socket that has bytes waiting, now."""
        if not self._readers:
            return
        for fd, _ in self._epoll.poll(0):
            read = self._readers.get(fd)
            if read is not None:  # an earlier reader in this batch may have discarded it
                read()

    def close(self) -> None:
        self._readers.clear()
        self._epoll.close()
