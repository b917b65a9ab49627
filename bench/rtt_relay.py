"""A user-space RTT emulator: UDP and TCP relays that delay each direction by RTT/2.

Kernel emulation (`tc netem`) needs privileges that benchmark machines often lack, so the bench
brings its own. Each direction is a `DelayLine`: items are stamped with a deadline on arrival and
released by one `loop.call_at` timer per direction (not a sleep per packet), in deadline order.

- UDP: per datagram; each client address gets its own upstream socket, so the server sees one
  peer per client, as without the relay. Optional jitter (which may reorder datagrams, as real
  networks do) and random loss.
- TCP: per read chunk, in order (a byte stream cannot reorder). The relay accepts at once, so to
  charge the TCP handshake its real round trip the first client bytes are held until one RTT after
  the accept: a client's first byte reaches the server 1.5 RTT after it called connect(), exactly
  as with a SYN/SYN-ACK round trip. Loss is not emulated on TCP (it would need retransmission).
"""

from __future__ import annotations

import asyncio
import errno
import heapq
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")

UDP_READ_SIZE = 65535
TCP_READ_SIZE = 65536
# Bytes a TCP direction may hold (delayed or unsent) before the relay stops reading that side.
TCP_BUFFER_LIMIT = 4 * 1024 * 1024
UDP_SESSION_IDLE_S = 120.0  # an upstream UDP socket with no traffic for this long is closed
# Timers fire a little late (0-1 ms under epoll, ~0.2 ms under select(): see bench.loop), so
# each line is armed and released this much early, which centres the error near zero.
TIMER_SLACK_S = 0.0002


class RelayError(ValueError):
    """A bad relay specification."""


@dataclass(frozen=True, slots=True)
class Link:
    """How one direction (or both, via `half`) is degraded."""

    rtt_ms: float = 0.0  # round-trip time added; each direction gets half
    jitter_ms: float = 0.0  # each one-way delay is RTT/2 ± jitter/2, uniform
    loss: float = 0.0  # probability of dropping each UDP datagram, per direction
    tcp_handshake: bool = True  # hold the first client bytes one RTT (see module doc)

    def __post_init__(self) -> None:
        if self.rtt_ms < 0:
            raise RelayError(f"RTT must be >= 0 ms, got {self.rtt_ms}")
        if self.jitter_ms < 0 or self.jitter_ms > self.rtt_ms:
            raise RelayError(f"jitter must be between 0 and the RTT, got {self.jitter_ms}")
        if not 0.0 <= self.loss < 1.0:
            raise RelayError(f"loss must be a probability in [0, 1), got {self.loss}")

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2000.0


@dataclass(frozen=True, slots=True)
class Forward:
    """One `LISTEN:TARGET` pair. LISTEN is `[HOST:]PORT` (host 127.0.0.1 by default)."""

    listen_host: str
    listen_port: int
    target_host: str
    target_port: int

    @classmethod
    def parse(cls, spec: str) -> Forward:
        parts = spec.rsplit(":", 3)
        if len(parts) == 3:
            parts = ["127.0.0.1", *parts]
        if len(parts) != 4 or not all(parts):
            raise RelayError(f"expected [LISTEN_HOST:]PORT:TARGET_HOST:TARGET_PORT, got {spec!r}")
        try:
            listen_port, target_port = int(parts[1]), int(parts[3])
        except ValueError:
            raise RelayError(f"ports must be numbers in {spec!r}") from None
        for port in (listen_port, target_port):
            if not 0 <= port <= 65535:
                raise RelayError(f"port out of range in {spec!r}")
        if target_port == 0:
            raise RelayError(f"target port must not be 0 in {spec!r}")
        return cls(parts[0], listen_port, parts[2], target_port)


@dataclass(slots=True)
class DirectionStats:
    items: int = 0
    bytes: int = 0
    dropped: int = 0


class DelayLine(Generic[T]):
    """Releases pushed items `delay` seconds after they arrive, through one timer."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        link: Link,
        rng: random.Random,
        deliver: Callable[[T], None],
        *,
        keep_order: bool,
    ) -> None:
        self._loop = loop
        self._delay = link.one_way_s
        self._jitter = link.jitter_ms / 2000.0
        self._rng = rng
        self._deliver = deliver
        self._keep_order = keep_order
        self._heap: list[tuple[float, int, T]] = []
        self._seq = 0
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self.pending_bytes = 0

    def push(self, item: T, *, size: int = 0, not_before: float = 0.0) -> None:
        now = self._loop.time()
        deadline = max(now, not_before) + self._delay
        if self._jitter:
            deadline = max(now, deadline + self._rng.uniform(-self._jitter, self._jitter))
        if self._keep_order:
            deadline = self._last = max(deadline, self._last)
        self._seq += 1
        self.pending_bytes += size
        heapq.heappush(self._heap, (deadline, self._seq, item))
        if self._heap[0][1] == self._seq:  # new head: re-arm for it
            self._arm()

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._heap:
            self._timer = self._loop.call_at(self._heap[0][0] - TIMER_SLACK_S, self._release)
        else:
            self._timer = None

    def _release(self) -> None:
        self._timer = None
        if self._closed:
            return
        due = self._loop.time() + TIMER_SLACK_S
        while self._heap and self._heap[0][0] <= due:
            _, _, item = heapq.heappop(self._heap)
            self._deliver(item)
        self._arm()

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        self._heap.clear()


class UdpRelay:
    """Relays datagrams between clients and one target, delaying each direction."""

    def __init__(self, forward: Forward, link: Link, *, seed: int | None = None) -> None:
        self.forward = forward
        self.link = link
        self._rng = random.Random(seed)
        self._sock: socket.socket | None = None
        self._sessions: dict[Any, _UdpSession] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self.upstream = DirectionStats()  # client -> target
        self.downstream = DirectionStats()  # target -> client
        self.port = forward.listen_port

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            self.forward.listen_host, self.forward.listen_port, type=socket.SOCK_DGRAM
        )
        family, _, _, _, addr = infos[0]
        target = await loop.getaddrinfo(
            self.forward.target_host, self.forward.target_port, type=socket.SOCK_DGRAM
        )
        self._target_family, self._target_addr = target[0][0], target[0][4]
        sock = socket.socket(family, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.bind(addr)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._to_client: DelayLine[tuple[bytes, Any]] = DelayLine(
            loop, self.link, self._rng, self._send_to_client, keep_order=True
        )
        loop.add_reader(sock.fileno(), self._on_client_readable)
        self._sweeper = loop.call_later(UDP_SESSION_IDLE_S, self._sweep)

    def _on_client_readable(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                data, addr = self._sock.recvfrom(UDP_READ_SIZE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # e.g. ICMP unreachable reported on the socket; not ours to handle
            session = self._sessions.get(addr)
            if session is None:
                session = _UdpSession(self, addr, loop)
                self._sessions[addr] = session
            session.last_seen = loop.time()
            self.upstream.items += 1
            self.upstream.bytes += len(data)
            if self.link.loss and self._rng.random() < self.link.loss:
                self.upstream.dropped += 1
                continue
            session.to_target.push(data)

    def _send_to_client(self, item: tuple[bytes, Any]) -> None:
        data, addr = item
        if self._sock is None:
            return
        try:
            self._sock.sendto(data, addr)
        except OSError:
            self.downstream.dropped += 1  # a full socket buffer is loss, as on a real link

    def from_target(self, data: bytes, addr: Any) -> None:
        self.downstream.items += 1
        self.downstream.bytes += len(data)
        if self.link.loss and self._rng.random() < self.link.loss:
            self.downstream.dropped += 1
            return
        self._to_client.push((data, addr))

    def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        cutoff = loop.time() - UDP_SESSION_IDLE_S
        for addr, session in list(self._sessions.items()):
            if session.last_seen < cutoff:
                session.close()
                del self._sessions[addr]
        self._sweeper = loop.call_later(UDP_SESSION_IDLE_S, self._sweep)

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for session in self._sessions.values():
            session.close()
        self._sessions.clear()
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._to_client.close()
            self._sock.close()
            self._sock = None


class _UdpSession:
    """The upstream socket for one client address."""

    def __init__(self, relay: UdpRelay, client: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.relay = relay
        self.client = client
        self.loop = loop
        self.last_seen = loop.time()
        self.sock = socket.socket(relay._target_family, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sock.connect(relay._target_addr)
        self.to_target: DelayLine[bytes] = DelayLine(
            loop, relay.link, relay._rng, self._send, keep_order=True
        )
        loop.add_reader(self.sock.fileno(), self._on_readable)

    def _send(self, data: bytes) -> None:
        try:
            self.sock.send(data)
        except OSError:
            self.relay.upstream.dropped += 1

    def _on_readable(self) -> None:
        while True:
            try:
                data = self.sock.recv(UDP_READ_SIZE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno == errno.ECONNREFUSED:
                    continue  # nothing listening at the target yet: the datagram is lost
                return
            self.last_seen = self.loop.time()
            self.relay.from_target(data, self.client)

    def close(self) -> None:
        self.to_target.close()
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()


_EOF = b""  # queued in a TCP delay line: pass the half-close on


class TcpRelay:
    """Relays TCP connections to one target, delaying each direction by RTT/2."""

    def __init__(self, forward: Forward, link: Link, *, seed: int | None = None) -> None:
        self.forward = forward
        self.link = link
        self._rng = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.upstream = DirectionStats()
        self.downstream = DirectionStats()
        self.connections = 0
        self.port = forward.listen_port

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, self.forward.listen_host, self.forward.listen_port
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        loop = asyncio.get_running_loop()
        accepted = loop.time()
        self.connections += 1
        _nodelay(writer)
        up_writer: asyncio.StreamWriter | None = None
        try:
            up_reader, up_writer = await asyncio.open_connection(
                self.forward.target_host, self.forward.target_port
            )
            self._writers.add(up_writer)
            _nodelay(up_writer)
            # The client's bytes can leave only after the emulated SYN/SYN-ACK round trip.
            hold = accepted + self.link.rtt_ms / 1000.0 if self.link.tcp_handshake else 0.0
            await asyncio.gather(
                self._pump(reader, up_writer, self.upstream, loop, not_before=hold),
                self._pump(up_reader, writer, self.downstream, loop, not_before=0.0),
            )
        except (OSError, asyncio.CancelledError):
            pass  # target unreachable, or the relay is stopping: just drop the connection
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    w.close()
                    self._writers.discard(w)
            self._tasks.discard(task)

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        stats: DirectionStats,
        loop: asyncio.AbstractEventLoop,
        *,
        not_before: float,
    ) -> None:
        done = loop.create_future()

        def deliver(data: bytes) -> None:
            line.pending_bytes -= len(data)
            if writer.is_closing():
                if not done.done():
                    done.set_result(None)
                return
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                if not done.done():
                    done.set_result(None)
            else:
                writer.write(data)

        line: DelayLine[bytes] = DelayLine(loop, self.link, self._rng, deliver, keep_order=True)
        try:
            while True:
                try:
                    data = await reader.read(TCP_READ_SIZE)
                except (ConnectionError, OSError):
                    data = _EOF
                line.push(data, size=len(data), not_before=not_before)
                if not data:
                    break
                stats.items += 1
                stats.bytes += len(data)
                transport = writer.transport
                while line.pending_bytes + transport.get_write_buffer_size() > TCP_BUFFER_LIMIT:
                    if writer.is_closing():
                        return
                    await asyncio.sleep(0.001)
            await done
        finally:
            line.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.close()  # ends both pumps of each connection
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=2.0)
            for task in pending:
                task.cancel()


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


@dataclass
class Relay:
    """Several UDP and TCP forwards sharing one link model; an async context manager."""

    link: Link
    udp: list[Forward] = field(default_factory=list)
    tcp: list[Forward] = field(default_factory=list)
    seed: int | None = None
    udp_relays: list[UdpRelay] = field(default_factory=list, init=False)
    tcp_relays: list[TcpRelay] = field(default_factory=list, init=False)

    async def start(self) -> None:
        rng = random.Random(self.seed)
        try:
            for forward in self.udp:
                udp = UdpRelay(forward, self.link, seed=rng.randrange(2**32))
                await udp.start()
                self.udp_relays.append(udp)
            for forward in self.tcp:
                tcp = TcpRelay(forward, self.link, seed=rng.randrange(2**32))
                await tcp.start()
                self.tcp_relays.append(tcp)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for relay in self.relays:
            await relay.stop()
        self.udp_relays.clear()
        self.tcp_relays.clear()

    @property
    def relays(self) -> list[UdpRelay | TcpRelay]:
        return [*self.udp_relays, *self.tcp_relays]

    def packets(self) -> int:
        """Items relayed so far, both directions (datagrams, or TCP read chunks)."""
        return sum(r.upstream.items + r.downstream.items for r in self.relays)

    async def __aenter__(self) -> Relay:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
