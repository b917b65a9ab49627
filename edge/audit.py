"""The audit log: one hash-chained JSON line per request, written off the request path.

Each line is a JSON object with the request's facts (time, request id, tenant, route, model,
backend, transport, early data, policy decision and rule ids, token counts, TTFT, status) and two
chain members: `prev`, the previous line's hash, and `hash`, the SHA-256 (hex) of `prev` followed
by the line's canonical form (the object without `hash`, keys sorted, compact). Editing, removing
or reordering a line breaks the chain at that line; `quicedge audit verify FILE...` names it.

Prompts are never written unless `include_prompts` is on: the line carries `prompt_sha256`
(an HMAC-SHA256 with `hash_key` when one is set, so short prompts cannot be guessed by hashing).

Writes: `record` appends to a bounded queue (no I/O, no hashing); a background task wakes for
the first record after a quiet spell, waits `WRITE_INTERVAL` for more, and writes what is queued
as one batch in a thread (`asyncio.to_thread`). When the queue is full,
`when_full` decides: `drop` (the record is dropped and counted) or `refuse` (`admit` raises 503
`audit_backlog` for new requests until the queue has room; requests already admitted are still
recorded, the refusals' own records and events are dropped and counted). Rotation by size: the
file is renamed `PATH.N`, numbered above every rotated file there (archived ones included), and
a new one begun, whose first line's `prev` is the last hash of the old one.

With `otlp` on, each written line is also handed to `edge.audit_export`, which exports it as an
OpenTelemetry log record from the SDK's own thread (dropping, never waiting, when it falls
behind).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import contextvars
import fcntl
import functools
import gzip
import hashlib
import hmac
import logging
import os
import re
import sys
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

import orjson

from edge import settings
from edge.audit_export import AuditExport, check_otlp
from edge.errors import AuditBacklog
from edge.tracing import ATTRIBUTE_MAX, cut

if TYPE_CHECKING:
    from edge.exchange import Exchange

log = logging.getLogger(__name__)

RESPONSES = "/v1/responses"
GENESIS = "0" * 64
"""`prev` of the very first line of a log."""
MiB = 1024 * 1024
WRITE_INTERVAL = 0.05
"""Seconds the writer gathers records for before it writes them as one batch."""
QUEUE_BYTES = 256 * MiB
"""Characters of prompts the queue holds, at most: a record holds its prompt until the writer's
thread hashes (or writes) it, so `queue_size` records of long prompts could hold gigabytes while
the disk stalls. Past it the queue is full, as past `queue_size`."""
MAX_LINE_BYTES = 64 * MiB
"""The longest line a restarted writer reads back (its last one) and `verify` reads: far above
any record, whose longest part is the prompt (`include_prompts`) under `max_body_bytes`."""
_BLOCK = 64 * 1024
"""Bytes read at a time when reading a file back from its end."""

_admitted: contextvars.ContextVar[bool] = contextvars.ContextVar("audit_admitted", default=False)
"""Set by `AuditLog.admit` in the context of the request it lets in (`refuse`), read by
`record_exchange` in the same context: the request's record may then pass `queue_size`."""


@dataclass
class AuditConfig:
    """The audit log (`[audit]`). Off unless `path` is set."""

    path: str | None = None
    """The JSON-lines file; None: no audit log (default). `{pid}` in it is replaced by the
    process id, which gives each of `--workers N` its own chain (one writer per file: a second
    process that opens the same log is refused at start)."""
    max_bytes: int = 100 * MiB
    """Size past which the file is rotated (100 MiB)."""
    queue_size: int = 10_000
    """Records waiting to be written, at most (10000); the queue is also full at 256 MiB of
    their prompts (`QUEUE_BYTES`)."""
    when_full: Literal["drop", "refuse"] = "drop"
    """A full queue: `drop` the record and count it, or `refuse` new requests (503)."""
    include_prompts: bool = False
    """Write the prompt text itself (off: only its hash)."""
    hash_key: str | None = None
    """Key of the HMAC-SHA256 over prompts; None: plain SHA-256."""
    fsync: bool = False
    """fsync after each batch, and the log's folder after a batch that starts a file (the
    first, or a rotation's), whose name fsync of the file does not write (durable across a
    power loss; slower)."""
    otlp: bool = False
    """Also export each written line as an OpenTelemetry log record over OTLP/HTTP (off); the
    file stays the record of truth, the export may drop (counted) but never delays it."""
    otlp_endpoint: str | None = None
    """The collector's OTLP/HTTP logs URL (`http://collector:4318/v1/logs`); None (default):
    `OTEL_EXPORTER_OTLP_LOGS_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT` + `/v1/logs` (where
    the spans go), else `http://localhost:4318/v1/logs`."""
    otlp_queue_size: int = 2048
    """Records waiting for export, at most (2048); past that new ones are dropped and counted."""
    otlp_batch_delay: float = 1.0
    """Seconds between exports while fewer than a batch (512) are waiting (1 s)."""
    otlp_timeout: float = 10.0
    """Seconds one batch's export may take, retries included (10 s); then it is dropped and
    counted. At shutdown, what is queued gets this long to go out."""

    def validate(self) -> None:
        if self.max_bytes < 4096:
            raise ValueError("audit.max_bytes: must be >= 4096")
        if self.queue_size < 1:
            raise ValueError("audit.queue_size: must be >= 1")
        if self.otlp_queue_size < 1:
            raise ValueError("audit.otlp_queue_size: must be >= 1")
        if not self.otlp_batch_delay > 0:
            raise ValueError("audit.otlp_batch_delay: must be > 0")
        if not self.otlp_timeout > 0:
            raise ValueError("audit.otlp_timeout: must be > 0")
        if self.otlp:
            check_otlp()  # a missing `otlp` extra or a gRPC protocol: named at start

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> AuditConfig:
        """From an `[audit]`-style table (tests, in-process callers), validated."""
        config = settings.from_mapping(cls, values, "audit")
        config.validate()
        return config


AUDIT_FLAGS: dict[str, str | bool] = {
    "path": "--audit-log",
    "max_bytes": "--audit-max-bytes",
    "queue_size": "--audit-queue-size",
    "when_full": "--audit-when-full",
    "include_prompts": "--audit-prompts",
    "hash_key": "--audit-hash-key",
    "fsync": "--audit-fsync",
    "otlp": "--audit-otlp",
    "otlp_endpoint": "--audit-otlp-endpoint",
    "otlp_queue_size": "--audit-otlp-queue-size",
    "otlp_batch_delay": "--audit-otlp-batch-delay",
    "otlp_timeout": "--audit-otlp-timeout",
}
"""Flags of the `[audit]` settings (the field names alone would collide with others')."""


def canonical(record: Mapping[str, Any]) -> bytes:
    """The bytes a line's hash covers: the record without `hash`, keys sorted, compact JSON."""
    return orjson.dumps(
        {k: v for k, v in record.items() if k != "hash"}, option=orjson.OPT_SORT_KEYS
    )


def chain_hash(prev: str, record: Mapping[str, Any]) -> str:
    return hashlib.sha256(prev.encode() + canonical(record)).hexdigest()


class AuditLog:
    """The writer: `record` from the request path, one background task draining to the file."""

    def __init__(self, config: AuditConfig) -> None:
        assert config.path is not None
        self.config = config
        self.path = config.path.replace("{pid}", str(os.getpid()))
        self._lock: int | None = None
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._queued_chars = 0
        """Characters of the prompts of the queued records (bounded by `QUEUE_BYTES`)."""
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        """Set while nothing is queued or being written."""
        self._idle.set()
        self._closing = False
        self._closed = False
        """Set by `aclose`: nothing writes a record queued after it."""
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0
        self.written = 0
        self._prev = GENESIS
        self._rotated = 0
        """The number of the last file this writer rotated (`PATH.N`)."""
        self._cut_to: tuple[tuple[int, int], int] | None = None
        """(file, size): a failed write's part that could not be cut off the file at once."""
        self._key = config.hash_key.encode() if config.hash_key else None
        self.export = (
            AuditExport(
                endpoint=config.otlp_endpoint,
                queue_size=config.otlp_queue_size,
                batch_delay=config.otlp_batch_delay,
                timeout=config.otlp_timeout,
            )
            if config.otlp
            else None
        )
        """The OpenTelemetry copy of each written line (`otlp`); None when off."""

    @property
    def depth(self) -> int:
        return len(self._queue)

    def admit(self) -> None:
        """Refuse a new request while the queue is full (`when_full = "refuse"`)."""
        if self.config.when_full == "refuse":
            admitted = not self._full()
            _admitted.set(admitted)
            if not admitted:
                raise AuditBacklog("the audit log is behind; retry shortly")

    def record(self, entry: dict[str, Any], *, admitted: bool = False) -> bool:
        """Queue one record; False when it was dropped and counted: a full queue drops all
        but the records of requests `admit` let in (`refuse`), for which the queue may pass its
        size by the requests in flight. A refused request's own record is dropped, else each
        refusal would grow the queue it was refused for. After `aclose` every record is
        dropped and counted: no writer is left to write it."""
        if self._closed:
            self.dropped += 1
            return False
        if self._full() and not (admitted and self.config.when_full == "refuse"):
            self.dropped += 1
            return False
        prompt = entry.get("_prompt")
        if isinstance(prompt, str):
            self._queued_chars += len(prompt)
        self._queue.append(entry)
        if not self._wake.is_set():
            self._wake.set()
            self._idle.clear()
        return True

    def _full(self) -> bool:
        """`queue_size` records are queued, or `QUEUE_BYTES` of their prompts."""
        return len(self._queue) >= self.config.queue_size or self._queued_chars >= QUEUE_BYTES

    def record_event(self, event: str, **fields: Any) -> bool:
        """Queue the record of something done to the edge itself, not a request: a config
        reload, an admin action, a refused one (`event`), in the same chain. The backlog refusal
        (`when_full = "refuse"`) is for requests; a full queue drops an event (counted)."""
        return self.record({"ts": round(time.time(), 6), "event": event, **fields})

    def record_exchange(self, ex: Exchange, status: int) -> bool:
        """The record of one finished request (the prompt is hashed in the writer's thread)."""
        usage = ex.usage
        backend = ex.backend
        state = ex.state
        # the route the client called: a Responses request is forwarded as a chat completion
        route = RESPONSES if state is not None and state.builder is not None else ex.route
        entry: dict[str, Any] = {
            "ts": round(time.time(), 6),
            "request_id": ex.request_id,
            "tenant": ex.tenant,
            "route": route,
            "model": _model(ex),
            "backend": backend.name if backend is not None else None,
            "transport": ex.transport,
            "early_data": ex.early_data,
            "decision": ex.policy_decision,
            "rules": list(ex.policy_rules),
            "prompt_tokens": usage.prompt_tokens if usage is not None else None,
            "completion_tokens": usage.completion_tokens if usage is not None else None,
            "cached_tokens": usage.cached_tokens if usage is not None else None,
            "ttft_ms": round(ex.ttft * 1000, 3) if ex.ttft is not None else None,
            "status": status,
            "_prompt": ex.view.text if ex.view is not None else None,
        }
        return self.record(entry, admitted=self.config.when_full == "refuse" and _admitted.get())

    # -- the writer --------------------------------------------------------------------------

    async def start(self) -> None:
        """Take the log's lock (one writer per chain), read its last hash, start writing."""
        self._lock = os.open(self.path + ".lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            self._lock = None
            raise ValueError(
                f"audit.path: another process writes {self.path} (with --workers N, put "
                "{pid} in the path)"
            ) from None
        try:
            self._prev = await asyncio.to_thread(functools.partial(last_hash, repair=True),
                                                 self.path)  # fmt: skip
        except BaseException:
            os.close(self._lock)  # a log this writer cannot continue is left to the next one
            self._lock = None
            raise
        if self.export is not None:
            self.export.start()
        self._task = asyncio.get_running_loop().create_task(self._drain())

    async def aclose(self) -> None:
        """Write what is queued, then stop (one writer at a time: the chain has one end)."""
        if self._closed:
            return
        if self._task is not None:
            self._closing = True
            self._wake.set()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            self._closed = True  # set by the writer as it ends, unless it was cancelled
        else:
            self._closed = True  # a record from now on is counted as dropped
            if self._queue:
                await asyncio.to_thread(self._write, self._take())
        if self.export is not None:
            await asyncio.to_thread(self.export.close, self.config.otlp_timeout)
        if self._lock is not None:
            os.close(self._lock)  # and with it the lock
            self._lock = None

    async def flush(self) -> None:
        """Wait until everything queued so far is written (tests, shutdown)."""
        await self._idle.wait()

    def _take(self) -> list[dict[str, Any]]:
        queue = self._queue
        batch = list(queue)
        queue.clear()
        self._queued_chars = 0
        return batch

    async def _drain(self) -> None:
        while True:
            await self._wake.wait()
            if not self._closing:
                # Gather what this interval brings: a batch per record made the loop hand each
                # one to a thread, and then to the disk, on its own.
                await asyncio.sleep(WRITE_INTERVAL)
            batch = self._take()
            self._wake.clear()
            try:
                await asyncio.to_thread(self._write, batch)
            except Exception:  # a full disk must not kill the writer: the lines are counted
                log.exception("audit log: writing %d lines to %s failed", len(batch), self.path)
                self.dropped += len(batch)
            if not self._queue:
                self._idle.set()
                if self._closing:
                    self._closed = True  # with the check: no record slips in after the last
                    return
            else:
                self._wake.set()

    def _write(self, batch: list[dict[str, Any]]) -> None:
        """Serialise, chain and append a batch (in a thread); rotate past `max_bytes`."""
        lines = []
        prev = self._prev
        for entry in batch:
            prompt = entry.pop("_prompt", None)
            if prompt is not None:
                if self.config.include_prompts:
                    entry["prompt"] = prompt
                else:
                    entry["prompt_sha256"] = self._digest(prompt)
            line = self._chain(entry, prev)
            if len(line) > MAX_LINE_BYTES and prompt is not None and "prompt" in entry:
                # A line past the bound could not be read back at a restart, nor by `verify`:
                # the prompt gives way to its hash, and the line says so.
                for key in ("prompt", "prev", "hash"):
                    del entry[key]
                entry["prompt_sha256"] = self._digest(prompt)
                entry["prompt_omitted"] = "line_too_long"
                line = self._chain(entry, prev)
            prev = entry["hash"]
            lines.append(line)
        self._append(b"".join(lines))
        self._prev = prev
        self.written += len(batch)
        if self.export is not None:  # only lines the file holds: each copy names its line's hash
            self._export_batch(self.export, batch, lines)

    @staticmethod
    def _chain(entry: dict[str, Any], prev: str) -> bytes:
        """Link `entry` to `prev` (sets its `prev` and `hash`); its line, newline included."""
        entry["prev"] = prev
        entry["hash"] = chain_hash(prev, entry)
        return orjson.dumps(entry) + b"\n"

    @staticmethod
    def _export_batch(export: AuditExport, batch: list[dict[str, Any]], lines: list[bytes]) -> None:
        try:
            for entry, line in zip(batch, lines, strict=True):
                export.emit(entry, line[:-1].decode())
        except Exception:  # the copy must never cost the file its lines: they are written
            log.exception("audit log: exporting a batch as OpenTelemetry logs failed")

    def _digest(self, prompt: str) -> str:
        raw = prompt.encode("utf-8", "surrogatepass")
        if self._key is not None:
            return hmac.new(self._key, raw, hashlib.sha256).hexdigest()
        return hashlib.sha256(raw).hexdigest()

    def _append(self, data: bytes) -> None:
        """Append whole lines; rotate first past `max_bytes`. A write that fails part-way (a
        full disk) is cut back off, so that the file still ends with a whole line: the next
        batch would otherwise be glued onto the cut one, and `verify` stop there."""
        fd = self._open()
        try:
            size = os.fstat(fd).st_size
            if self._cut_to is not None and self._cut_to[0] == self._identity(fd):
                # the last failed write's part that could not be cut off then
                size = self._cut_to[1]
                os.ftruncate(fd, size)
                log.warning("audit log: cut the part of a failed write off %s", self.path)
            self._cut_to = None
            if size and size + len(data) > self.config.max_bytes:
                self._rotate()
                os.close(fd)
                fd = -1
                fd = self._open()
                size = 0
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if self.config.fsync:
                    os.fsync(fd)
                    if size == 0:  # a new file: its name (and a rotated one's) is the folder's
                        self._sync_folder()
            except BaseException:
                try:
                    os.ftruncate(fd, size)
                except OSError:  # tried again before the next write
                    self._cut_to = (self._identity(fd), size)
                raise
        finally:
            if fd >= 0:
                os.close(fd)

    def _sync_folder(self) -> None:
        """fsync the log's folder: a file's name is an entry there, which fsync of the file
        does not write (a power loss could take a new file, lines and all, or a rename)."""
        fd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    @staticmethod
    def _identity(fd: int) -> tuple[int, int]:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino

    def _rotate(self) -> None:
        """Rename the file `PATH.N`, N above every rotated file's number, an archived one's
        (`PATH.3.gz`) included, and above the last one this writer used: a reused number would
        put the newest lines where `ordered_files` looks for the oldest."""
        n = max([self._rotated, *(number for number, _ in _numbered(self.path))]) + 1
        os.replace(self.path, f"{self.path}.{n}")
        self._rotated = n


MODEL_MAX = ATTRIBUTE_MAX
"""Characters of the request's `model` a record keeps (256, as the access log and the span):
`/generate` serves any name, which only the body limit bounds."""


def _model(ex: Exchange) -> str | None:
    model = ex.view.model if ex.view is not None else None
    return cut(model, MODEL_MAX) if isinstance(model, str) else None


def last_hash(path: str, *, repair: bool = False) -> str:
    """The `hash` of the last line of the log at `path`, else of its newest rotated file that
    has a line: an archived one (`PATH.N.gz`, which logrotate's `compress` makes of a file it
    rotated away) included, since continuing from an older file would fork the chain. The
    rotated files are taken newest first by their first lines' `ts` (`_by_age`), not by number:
    the edge numbers the newest highest, logrotate numbers it `PATH.1`. A rotated file the edge
    cannot read (`PATH.N.zst`) numbered above the file the chain would go on from is a
    ValueError naming it: it may be the newest.

    Read only unless `repair` (the writer's start, which holds the log's lock): a file that
    ends inside a line then has that part cut off (a crash's) or its newline added; without
    `repair` the line before it is read, and the file left as it is, which may be a running
    writer's write in progress (`serve --check` beside the running edge)."""
    by_number: dict[int, list[str]] = {}
    for number, name in _numbered(path):
        by_number.setdefault(number, []).append(name)
    files: list[tuple[int, str]] = []
    unread: list[tuple[int, str]] = []
    """(number, why) of the rotated files whose age is not known: unreadable forms."""
    for number, names in by_number.items():
        try:
            files.append((number, _readable(names)))
        except ValueError as exc:
            unread.append((number, str(exc)))
    for number, name in [(sys.maxsize, path), *reversed(_by_age(files, unread))]:
        try:
            if name.endswith(".gz"):
                value = _last_gzip_line_hash(name)
            else:
                value = _last_line_hash(name, repair=repair)
        except FileNotFoundError:
            continue
        except OSError as exc:  # read past it, the chain would fork from an older line
            raise ValueError(f"audit.path: {name}: {exc.strerror or exc}") from None
        if value is not None:
            _check_unread(unread, number)
            return value
    _check_unread(unread, -1)
    return GENESIS


def _check_unread(unread: list[tuple[int, str]], number: int) -> None:
    """A ValueError for a rotated file not read whose number is above `number` (that of the
    file the chain goes on from): by the edge's numbering it is newer."""
    above = [why for n, why in sorted(unread, reverse=True) if n > number]
    if above:
        raise ValueError(above[0])


_FIRST_TS = re.compile(rb'\{"ts":\s*(-?[0-9][0-9.eE+-]*)\s*[,}]')
"""The start of every line the writer writes: its `ts` is the record's first key."""


def _first_ts(name: str) -> float | None:
    """The `ts` of a log file's first line, from its first bytes (a plain or a gzip file);
    None when it is empty or does not start as the writer's lines do. A ValueError when it
    cannot be read."""
    try:
        if name.endswith(".gz"):
            with gzip.open(name, "rb") as g:
                head = g.read(64)
        else:
            with open(name, "rb") as f:
                head = f.read(64)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"audit.path: {name}: not a whole gzip file ({exc})") from None
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"audit.path: {name}: {exc.strerror or exc}") from None
    found = _FIRST_TS.match(head)
    if found is None:
        return None
    try:
        return float(found.group(1))
    except ValueError:
        return None


def _by_age(
    files: Sequence[tuple[int, str]], unread: list[tuple[int, str]] | None = None
) -> list[tuple[int, str]]:
    """(number, name) of rotated files, oldest first: by their first lines' `ts`, then by
    number (the edge's own numbering, newest highest; logrotate's is the reverse, newest
    `PATH.1`). Files with no line to date come first. One whose start cannot be read goes to
    `unread` (its age is not known), or, without `unread`, is put by its number."""
    dated: list[tuple[bool, float, int, str]] = []
    for number, name in files:
        try:
            ts = _first_ts(name)
        except ValueError as exc:
            if unread is not None:
                unread.append((number, str(exc)))
                continue
            ts = None
        dated.append((ts is not None, ts or 0.0, number, name))
    return [(number, name) for _, _, number, name in sorted(dated)]


def _readable(names: list[str]) -> str:
    """Of the files numbered N (`PATH.N`, `PATH.N.gz`, `PATH.N.zst`, ...), the one to read the
    chain's last line from: the plain one, else the gzip one; a ValueError when neither is
    there (the chain's newest line is in a file not read here)."""
    for name in names:
        if name.rpartition(".")[2].isdigit():
            return name
    for name in names:
        if name.endswith(".gz"):
            return name
    raise ValueError(
        f"audit.path: {sorted(names)[0]} is the newest file of the chain and is archived in a "
        "form the edge does not read (plain or .gz): its last line is where the chain goes on; "
        "decompress it (or make it .gz) and start again"
    )


def _last_gzip_line_hash(name: str) -> str | None:
    """The `hash` of the last line of a gzip-compressed log file, read through (an archived
    file is read once, at start); None when it holds no line."""
    last = b""
    try:
        with gzip.open(name, "rb") as f:
            while line := f.readline(MAX_LINE_BYTES + 1):
                if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                    raise ValueError(f"{name}: a line is over {MAX_LINE_BYTES} bytes: not an "
                                     "audit log")  # fmt: skip
                last = line
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"audit.path: {name}: not a whole gzip file ({exc})") from None
    if not last.strip():
        return None
    try:
        value = orjson.loads(last).get("hash")
    except (orjson.JSONDecodeError, AttributeError):
        raise ValueError(f"{name}: the last line is not an audit record") from None
    return value if isinstance(value, str) else None


def _last_line_hash(name: str, *, repair: bool) -> str | None:
    """The `hash` of the file's last line; None when the file is empty. The line is found by
    reading back from the end in blocks, so its length does not matter up to `MAX_LINE_BYTES`
    (a prompt-bearing line is as long as its prompt). A file that ends inside a line is
    repaired (`repair`), or read up to the line before it."""
    with open(name, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return None
        f.seek(end - 1)
        if f.read(1) != b"\n":
            if repair:
                end = _end_the_last_line(f, name, end)
            else:
                start = _line_start(f, end, None)
                assert start is not None
                end = start
            if end == 0:
                return None
        end -= 1
        start = _line_start(f, end, MAX_LINE_BYTES)
        if start is None:
            raise ValueError(f"{name}: the last line is over {MAX_LINE_BYTES} bytes: not an audit "
                             "record")  # fmt: skip
        f.seek(start)
        line = f.read(end - start)
    try:
        value = orjson.loads(line).get("hash")
    except (orjson.JSONDecodeError, AttributeError):
        raise ValueError(f"{name}: the last line is not an audit record") from None
    return value if isinstance(value, str) else None


def _end_the_last_line(f: BinaryIO, name: str, end: int) -> int:
    """The file ends inside a line: a write cut short (a crash, or a full disk before writes
    were cut back). A whole record only lacks its newline, which is added; anything else is
    cut off, for the next line to start a line. The file's new size."""
    start = _line_start(f, end, None)
    assert start is not None
    if end - start <= MAX_LINE_BYTES:
        f.seek(start)
        try:
            record = orjson.loads(f.read(end - start))
        except orjson.JSONDecodeError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("hash"), str):
            with open(name, "ab") as out:
                out.write(b"\n")
            log.warning("audit log: %s: the last line lacked its newline; added it", name)
            return end + 1
    with open(name, "r+b") as out:
        out.truncate(start)
    log.warning(
        "audit log: %s ended with %d bytes of a line cut short (a failed write or a crash); "
        "cut them off, the chain goes on from the line before", name, end - start,
    )  # fmt: skip
    return start


def _line_start(f: BinaryIO, end: int, limit: int | None) -> int | None:
    """Where the line that ends at offset `end` begins: just after the newline before `end`, or
    0. Read back in blocks; None when no line start is found within `limit` bytes of `end`."""
    pos = end
    while pos > 0 and (limit is None or end - pos <= limit):
        step = min(_BLOCK, pos)
        f.seek(pos - step)
        cut = f.read(step).rfind(b"\n")
        if cut >= 0:
            start = pos - step + cut + 1
            return start if limit is None or end - start <= limit else None
        pos -= step
    return 0 if pos == 0 and (limit is None or end <= limit) else None


# -- verification ----------------------------------------------------------------------------


@dataclass(slots=True)
class VerifyResult:
    ok: bool
    lines: int
    """Lines checked (all of them when ok)."""
    error: str | None = None
    """Where and why the chain broke: `FILE:LINE: reason`."""
    last: str | None = None
    """The last hash checked: compare it with one kept elsewhere to catch a cut-off tail."""


def verify(
    paths: Sequence[str], *, start: str | None = None, max_line: int | None = None
) -> VerifyResult:
    """Check the chain through `paths` in order (oldest rotated file first). `start` is the
    `prev` the first line must carry (default: whatever it carries; GENESIS for a whole log).
    A line longer than `max_line` bytes (default `MAX_LINE_BYTES`) fails unread: a file of one
    endless line costs that much memory, not the file's size."""
    limit = MAX_LINE_BYTES if max_line is None else max_line
    prev = start
    count = 0
    for path in paths:
        with open(path, "rb") as f:
            number = 0
            while line := f.readline(limit + 1):
                number += 1
                where = f"{path}:{number}"
                if len(line) > limit and not line.endswith(b"\n"):
                    return VerifyResult(False, count, f"{where}: line over {limit} bytes", prev)
                try:
                    record = orjson.loads(line)
                except orjson.JSONDecodeError:
                    return VerifyResult(False, count, f"{where}: not JSON", prev)
                if not isinstance(record, dict) or not isinstance(record.get("hash"), str):
                    return VerifyResult(False, count, f"{where}: no hash", prev)
                if prev is not None and record.get("prev") != prev:
                    return VerifyResult(
                        False, count, f"{where}: prev does not match the line before it "
                        "(a line was removed, reordered or inserted)", prev,
                    )  # fmt: skip
                if not isinstance(record.get("prev"), str):
                    return VerifyResult(False, count, f"{where}: no prev", prev)
                if chain_hash(record["prev"], record) != record["hash"]:
                    return VerifyResult(False, count, f"{where}: hash mismatch (edited)", prev)
                if line.removesuffix(b"\n") != orjson.dumps(record):
                    # The hash covers the parsed record: a duplicated key, an escaped character
                    # or spacing changes what a reader or a search sees, not the hash.
                    return VerifyResult(False, count, f"{where}: not as written (edited)", prev)
                prev = record["hash"]
                count += 1
    return VerifyResult(True, count, None, prev)


def ordered_files(path: str) -> list[str]:
    """The rotated files `PATH.N` by number, then `PATH`: a rotated log's files, oldest first.
    Numbers an operator removed or archived (`PATH.1.gz`) are skipped."""
    rotated = rotated_files(path)
    return [*rotated, path] if os.path.exists(path) else rotated


def rotated_files(path: str) -> list[str]:
    """The files `PATH.N` (N a number): a log's rotated files, oldest first (`_by_age`: by
    their first lines' `ts`, then by number, so logrotate's numbering is read in order too)."""
    skip = len(os.path.basename(path)) + 1
    plain = [(n, name) for n, name in _numbered(path) if os.path.basename(name)[skip:].isdigit()]
    return [name for _, name in _by_age(plain)]


def _numbered(path: str) -> list[tuple[int, str]]:
    """(N, name) of each file named `PATH.N` or `PATH.N.SUFFIX` (one archived: `.gz`)."""
    folder, base = os.path.split(path)
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return []
    found = []
    for name in names:
        if name.startswith(base + "."):
            number = name[len(base) + 1 :].partition(".")[0]
            if number.isascii() and number.isdigit():
                found.append((int(number), os.path.join(folder, name)))
    return found


def _archived_gap(path: str, files: Sequence[str], error: str | None) -> str | None:
    """Where the chain breaks at a file's first line: the archived files (not read) numbered
    between the file read before it and it, which hold the lines that should come between."""
    number = {name: n for n, name in _numbered(path)}
    for i, name in enumerate(files):
        if error is not None and error.startswith(f"{name}:1: "):
            low = number.get(files[i - 1], 0) if i else 0
            high = number.get(name, sys.maxsize)  # PATH itself: after every numbered file
            read = {n for other, n in number.items() if other in files}
            skipped = sorted((n, other) for other, n in number.items()
                             if low < n < high and n not in read)  # fmt: skip
            if skipped:
                names = ", ".join(other for _, other in skipped)
                return (f"{names} (archived, not read) comes before it: decompress and "
                        "verify the files in order")  # fmt: skip
    return None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of bytes >= 1, got {text!r}")
    return value


def main(argv: Iterable[str] | None = None) -> int:
    """`quicedge audit verify FILE...`: 0 when the chain holds, 1 naming the first bad line, 2
    when it could not be checked (an unreadable file, no memory)."""
    parser = argparse.ArgumentParser(prog="quicedge audit", description="audit log tools")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "verify",
        help="check a log's hash chain",
        description="Check the hash chain of an audit log: each line's `prev` must be the hash "
        "of the line before it. Exit 0 when the chain holds (OK, the line count and the last "
        "hash), 1 naming the first line that breaks it (FAIL FILE:LINE: why), 2 when it could "
        "not be checked (an unreadable file).",
    )
    check.add_argument("files", nargs="+", help="log files, oldest first (or one PATH: its "
                       "rotated files PATH.N are checked before it, oldest first)")  # fmt: skip
    check.add_argument("--from-genesis", action="store_true",
                       help="the first line must be the log's first (prev = 0...0)")  # fmt: skip
    check.add_argument("--max-line-bytes", type=_positive, default=MAX_LINE_BYTES,
                       help="a longer line fails unread (default: 64 MiB, the writer's "
                       "bound)")  # fmt: skip
    args = parser.parse_args(list(argv) if argv is not None else None)
    files = args.files if len(args.files) > 1 else ordered_files(args.files[0]) or args.files
    try:
        result = verify(
            files, start=GENESIS if args.from_genesis else None, max_line=args.max_line_bytes
        )
    except OSError as exc:
        print(f"quicedge audit verify: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # exit 1 says the chain is broken; this says nothing was decided
        detail = f": {exc}" if str(exc) else ""
        print(f"quicedge audit verify: {type(exc).__name__}{detail}", file=sys.stderr)
        return 2
    if not result.ok:
        gap = _archived_gap(args.files[0], files, result.error) if len(args.files) == 1 else None
        print(f"FAIL {result.error}" + (f"; {gap}" if gap else ""))
        return 1
    print(f"OK {result.lines} lines in {len(files)} file(s); last hash {result.last}")
    return 0


__all__ = [
    "AUDIT_FLAGS",
    "AuditConfig",
    "AuditLog",
    "GENESIS",
    "VerifyResult",
    "canonical",
    "verify",
]
