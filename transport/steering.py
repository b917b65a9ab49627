"""Every datagram of a QUIC connection reaches the worker that holds it (`--workers N`).

Workers share the UDP port with SO_REUSEPORT, and the kernel picks a socket by a hash of the
client's address and port. A client whose address or port changes mid-connection (a NAT that
rebinds, a phone that moves from Wi-Fi to cellular, RFC 9000 §9) then lands on another worker,
which has no state for the connection: the connection stalls until its idle timeout, and a
stateless reset from that worker is one the client does not recognise.

The connection ID says where a connection lives instead, as QUIC load balancers do
(draft-ietf-quic-load-balancers): each worker's connection IDs carry its index in their first
byte, as `index + workers * r` for a random `r`, so the byte taken modulo `workers` gives the
index, yet varies from ID to ID and tells an observer little. The parent process binds one
socket per worker, in worker order, so that the reuseport group holds worker `i`'s socket at
index `i`, and attaches a classic BPF program to the group (SO_ATTACH_REUSEPORT_CBPF, Linux
4.5+) that returns the first byte of the destination connection ID modulo `workers`:

- a short header: the ID starts at byte 1 (the listener's IDs, ours);
- a long header: byte 6 (after the first byte, the version and the ID's length). For a client's
  first Initial and its 0-RTT packets that is the random ID the client chose, the same in each of
  them, so they all reach one worker, which answers with an ID of its own; the client's
  Handshake and later packets carry that ID.

A datagram too short to hold the byte reaches worker 0, which drops it as aioquic would.
"""

from __future__ import annotations

import ctypes
import secrets
import socket
import struct

SO_ATTACH_REUSEPORT_CBPF = 51
"""Linux's socket option number (include/uapi/asm-generic/socket.h)."""
MAX_WORKERS = 255
"""Workers one byte of a connection ID can name."""

# Classic BPF opcodes (include/uapi/linux/filter.h).
_LDB_ABS = 0x30  # BPF_LD | BPF_B | BPF_ABS: A = packet[k]
_JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K: A & k ? jt : jf
_JA = 0x05  # BPF_JMP | BPF_JA: skip k
_MOD = 0x94  # BPF_ALU | BPF_MOD | BPF_K: A %= k
_RET_A = 0x16  # BPF_RET | BPF_A: return A
_RET_K = 0x06  # BPF_RET | BPF_K: return k
_INSTRUCTION = struct.Struct("HBBI")

SHORT_HEADER_CID_OFFSET = 1
LONG_HEADER_CID_OFFSET = 6


def program(workers: int) -> list[tuple[int, int, int, int]]:
    """The steering program for `workers` sockets: (code, jt, jf, k) per instruction."""
    _check(workers)
    return [
        (_LDB_ABS, 0, 0, 0),  # the first byte: header form in its top bit
        (_JSET, 2, 0, 0x80),  # long header: on to the long header's ID
        (_LDB_ABS, 0, 0, SHORT_HEADER_CID_OFFSET),
        (_JA, 0, 0, 1),
        (_LDB_ABS, 0, 0, LONG_HEADER_CID_OFFSET),
        (_MOD, 0, 0, workers),
        (_RET_A, 0, 0, 0),
    ]


def worker_for(datagram: bytes, workers: int) -> int:
    """What `program(workers)` returns for `datagram` (the kernel's choice, for tests and docs)."""
    offset = LONG_HEADER_CID_OFFSET if datagram[:1] and datagram[0] & 0x80 else 1
    return datagram[offset] % workers if len(datagram) > offset else 0


def attach(sock: socket.socket, workers: int) -> None:
    """Attach the steering program to `sock`'s reuseport group."""
    _load(sock, program(workers))


def _load(sock: socket.socket, instructions: list[tuple[int, int, int, int]]) -> None:
    raw = b"".join(_INSTRUCTION.pack(*i) for i in instructions)
    buffer = ctypes.create_string_buffer(raw, len(raw))
    # struct sock_fprog { unsigned short len; struct sock_filter *filter; }: the kernel copies
    # the instructions during the call, so the buffer only has to outlive it.
    fprog = struct.pack("HL", len(instructions), ctypes.addressof(buffer))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)


def spread_by_address(sock: socket.socket) -> None:
    """Replace the group's program with one that names no socket, so that the kernel goes back
    to its hash of the client's address (every kernel that has the option does that)."""
    _load(sock, [(_RET_K, 0, 0, 0xFFFFFFFF)])


def bind_group(host: str, port: int, workers: int) -> list[socket.socket]:
    """One UDP socket per worker on `host:port` (0: a free port, the same for all), bound in
    worker order, with the steering program attached; OSError where the kernel refuses."""
    _check(workers)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(workers):
            sock = socket.socket(family, socket.SOCK_DGRAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
        attach(sockets[0], workers)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class WorkerConnectionIds:
    """Connection IDs whose first byte names worker `index` of `workers`."""

    def __init__(self, index: int, workers: int) -> None:
        _check(workers)
        if not 0 <= index < workers:
            raise ValueError(f"worker index {index} is not below {workers}")
        self.index = index
        self.workers = workers
        self._spread = 256 // workers
        """How many first bytes name each worker (r in index + workers * r)."""

    def new(self, length: int) -> bytes:
        """A new connection ID of `length` bytes (at least 1) for this worker."""
        first = self.index + self.workers * secrets.randbelow(self._spread)
        return bytes([first]) + secrets.token_bytes(length - 1)


def _check(workers: int) -> None:
    if not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"steering needs 1 to {MAX_WORKERS} workers, got {workers}")
