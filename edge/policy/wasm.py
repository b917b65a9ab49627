"""Sandboxed policies: WebAssembly modules run with wasmtime under a fuel and a memory budget.

The ABI (docs/policy.md has the full text): the module exports `memory`, `alloc(len: i32) -> i32`
and `check(ptr: i32, len: i32) -> i64`. The host writes the request view as UTF-8 JSON into the
buffer `alloc` returned and calls `check`, which returns `(out_ptr << 32) | out_len`: a UTF-8 JSON
answer in the module's memory, `{"action": "allow"}`, `{"action": "deny", "reason": "..."}` or
`{"action": "redact", "spans": [[start, end], ...]}` (byte offsets into the view's `prompt`).

One instance serves request after request (instantiating costs ~150 us; a call 5-7 us, 55-110 us
on a cold CPU cache); a buffer from `alloc` is reused for any later input that fits. An instance
that traps, runs out of fuel, or answers something that is not the ABI's is dropped, the failure
is counted, and the request is refused or let through as the module's `on_error` says; the next
request gets a fresh one.

Loading compiles the file and instantiates it once with the ABI's checks (no imports; the three
exports with their signatures; within the memory limits), at start and on every reload: a module
that cannot answer is refused there, not on each request. The engine refuses the proposals that
give a module memory beside its one linear memory (multi-memory, GC, exceptions, threads), and a
store allows one memory and one table, so `memory_bytes` bounds the module. An answer is at most
`MAX_ANSWER_BYTES` long with at most `MAX_SPANS` spans, each within the prompt: reading it runs
on the event loop, outside the fuel.

Hot reload: `reload()` (SIGHUP) or a changed file (its inode, modification time or size, polled
in a background task) loads the file again, in a thread, and swaps the new module and its first
instance in one assignment. A check runs start to end without awaiting, so a request in
progress finishes on the module it began with; a file that fails to load, whatever the reason,
leaves the running module in place and is counted (`kind="load"`); the poller goes on.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import wasmtime

from edge.policy.config import WasmConfig

log = logging.getLogger(__name__)

Failure = Literal["trap", "fuel", "memory", "abi", "load"]
"""Why a module call failed (a metric label)."""

try:  # wasmtime's C API, called directly: no per-call type lookups or wrapper frames
    from wasmtime import _bindings as _wb

    _UNCHECKED: Any = _wb.dll["wasmtime_func_call_unchecked"]
    _UNCHECKED.restype = ctypes.c_void_p
    _UNCHECKED.argtypes = _wb._wasmtime_func_call_unchecked.argtypes
    _DATA: Any = _wb.dll["wasmtime_memory_data"]
    _DATA.restype = ctypes.c_void_p
    _DATA.argtypes = _wb._wasmtime_memory_data.argtypes
    _SIZE: Any = _wb.dll["wasmtime_memory_data_size"]
    _SIZE.restype = ctypes.c_size_t
    _SIZE.argtypes = _wb._wasmtime_memory_data_size.argtypes
    _FUEL: Any = _wb.dll["wasmtime_context_set_fuel"]
    _FUEL.restype = ctypes.c_void_p
    _FUEL.argtypes = _wb._wasmtime_context_set_fuel.argtypes
    _RAW: Any = _wb.wasmtime_val_raw_t
    _TRAP_PTR: Any = ctypes.POINTER(_wb.wasm_trap_t)
    _ERROR_PTR: Any = ctypes.POINTER(_wb.wasmtime_error_t)
except (ImportError, AttributeError, TypeError):  # pragma: no cover - other wasmtime versions
    _UNCHECKED = None


class ModuleFailed(Exception):
    """The module could not give an answer (trapped, ran out of fuel, broke the ABI)."""

    def __init__(self, kind: Failure, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


@dataclass(slots=True)
class WasmAnswer:
    action: Literal["allow", "deny", "redact"]
    reason: str = ""
    spans: list[tuple[int, int]] | None = None


MAX_ANSWER_BYTES = 64 * 1024
"""The longest answer the host reads: a longer one is an ABI failure. Reading, parsing and
applying an answer runs on the event loop, outside the module's fuel, so its size is bounded
here (1024 spans take about 20 KiB)."""

MAX_SPANS = 1024
"""The most spans one `redact` answer may give: more is an ABI failure."""

MAX_TABLE_ELEMENTS = 1 << 17
"""The most elements of the module's one table (1 MiB at 8 bytes each): tables, like linear
memories, are host memory that `memory_bytes` does not count."""


class ModuleLoadError(ValueError):
    """A module file that cannot serve: it does not compile, imports what the host does not
    provide, lacks the ABI's exports, or does not instantiate within its limits."""


_MEMORY_VIEW: Any = ctypes.pythonapi.PyMemoryView_FromMemory
_MEMORY_VIEW.restype = ctypes.py_object
_MEMORY_VIEW.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_WRITE = 0x200


def _engine() -> wasmtime.Engine:
    config = wasmtime.Config()
    config.consume_fuel = True
    # A linear memory then stays where it was created (growth past the reservation, 4 GiB, fails
    # instead of moving it, far above any `memory_bytes`), so one view of it serves every call.
    config.memory_may_move = False
    # Each of these gives a module memory beside its one linear memory, which is all that
    # `memory_bytes` limits: more linear memories, a GC heap (the GC proposal; exception objects
    # live there too), shared memories (threads). A module that uses one does not compile.
    config.wasm_multi_memory = False
    config.wasm_gc = False
    config.wasm_exceptions = False
    config.wasm_threads = False
    return wasmtime.Engine(config)


class _Instance:
    """One live instance of a compiled module, and the buffer it lent for input."""

    __slots__ = (
        "_alloc",
        "_args",
        "_buf",
        "_cap",
        "_check",
        "_ctx",
        "_memory",
        "_memref",
        "_trap",
        "_view",
        "store",
    )

    def __init__(self, engine: wasmtime.Engine, module: wasmtime.Module, memory_bytes: int) -> None:
        store = wasmtime.Store(engine)
        # One memory and one table, each bounded: the store's limits are per memory and per
        # table, so the count is what keeps the module's total within them.
        store.set_limits(
            memory_size=memory_bytes,
            memories=1,
            tables=1,
            table_elements=MAX_TABLE_ELEMENTS,
            instances=1,
        )
        store.set_fuel(1_000_000)  # enough for a start function; reset before each check
        try:
            instance = wasmtime.Instance(store, module, [])
        except wasmtime.Trap as exc:
            raise ModuleFailed("trap", f"start trapped: {exc}") from None
        except wasmtime.WasmtimeError as exc:
            kind: Failure = "memory" if "memory" in str(exc) else "load"
            raise ModuleFailed(kind, f"cannot instantiate: {exc}") from None
        exports = instance.exports(store)
        memory, alloc, check = (exports.get(n) for n in ("memory", "alloc", "check"))
        if not isinstance(memory, wasmtime.Memory):
            raise ModuleFailed("abi", "the module exports no `memory`")
        i32, i64 = wasmtime.ValType.i32(), wasmtime.ValType.i64()
        for func, name, params, results in (
            (alloc, "alloc", [i32], [i32]),
            (check, "check", [i32, i32], [i64]),
        ):
            if not isinstance(func, wasmtime.Func):
                raise ModuleFailed("abi", f"the module exports no function `{name}`")
            ty = func.type(store)
            if list(ty.params) != params or list(ty.results) != results:
                raise ModuleFailed("abi", f"`{name}` has the wrong signature")
        assert isinstance(alloc, wasmtime.Func) and isinstance(check, wasmtime.Func)
        self.store = store
        self._memory = memory
        self._alloc = alloc
        self._check = check
        self._buf = 0
        self._cap = 0
        if _UNCHECKED is not None:
            self._ctx = store._context()
            self._memref = ctypes.byref(memory._memory)
            self._args = (_RAW * 2)()
            self._trap = _TRAP_PTR()
        self._view = self._map()

    def call(self, data: bytes, fuel: int) -> bytes:
        """The module's answer to `data` (raises ModuleFailed)."""
        if _UNCHECKED is None:
            self.store.set_fuel(fuel)
        else:
            error = _FUEL(self._ctx, fuel)
            if error:
                raise ModuleFailed("trap", _error_text(error))
        n = len(data)
        if n > self._cap:
            ptr = self._invoke(self._alloc, n)
            self._buf, self._cap = ptr & 0xFFFFFFFF, n
        buf, view = self._buf, self._view
        if buf + n > len(view):
            view = self._view = self._map()  # memory only grows during a call, and never moves
            if buf + n > len(view):
                raise ModuleFailed("abi", "`alloc` returned a buffer outside memory")
        view[buf : buf + n] = data
        packed = self._invoke(self._check, buf, n)
        out_ptr, out_len = (packed >> 32) & 0xFFFFFFFF, packed & 0xFFFFFFFF
        if out_len > MAX_ANSWER_BYTES:
            raise ModuleFailed(
                "abi", f"the answer is {out_len} bytes, above the limit of {MAX_ANSWER_BYTES}"
            )
        if out_ptr + out_len > len(view):
            view = self._view = self._map()
        if out_ptr + out_len > len(view) or out_len == 0:
            raise ModuleFailed("abi", "`check` answered outside memory")
        return bytes(view[out_ptr : out_ptr + out_len])

    def _map(self) -> memoryview:
        """The linear memory as it is now, as a writable view: reads and writes through it cost
        no foreign call (one costs ~1 us, and up to ~20 us when the CPU's caches are cold)."""
        if _UNCHECKED is not None:
            base, size = _DATA(self._ctx, self._memref), _SIZE(self._ctx, self._memref)
        else:
            store, memory = self.store, self._memory
            base, size = ctypes.addressof(memory.data_ptr(store).contents), memory.data_len(store)
        if not size:
            return memoryview(bytearray())
        view: memoryview = _MEMORY_VIEW(base, size, _PYBUF_WRITE)
        return view

    def _invoke(self, func: wasmtime.Func, *params: int) -> int:
        if _UNCHECKED is None:
            try:
                result = func(self.store, *params)
            except wasmtime.Trap as exc:
                raise _trap_failure(str(exc)) from None
            except wasmtime.WasmtimeError as exc:
                raise ModuleFailed("trap", str(exc)) from None
            return int(result)
        args, trap = self._args, self._trap
        args[0].i64 = 0
        args[1].i64 = 0
        for i, value in enumerate(params):
            args[i].i32 = value
        # the signature was checked at instantiation, which is what makes the unchecked call safe
        error = _UNCHECKED(self._ctx, ctypes.byref(func._func), args, 2, ctypes.byref(trap))
        if error:
            raise ModuleFailed("trap", _error_text(error))
        if trap:
            message = str(wasmtime.Trap._from_ptr(trap))
            self._trap = _TRAP_PTR()
            raise _trap_failure(message)
        return int(args[0].i64)


def _error_text(address: int) -> str:
    return str(wasmtime.WasmtimeError._from_ptr(ctypes.cast(address, _ERROR_PTR)))


def _trap_failure(message: str) -> ModuleFailed:
    return ModuleFailed("fuel" if "fuel" in message else "trap", message.splitlines()[0])


class WasmPolicy:
    """One configured module: load, run, reload."""

    def __init__(
        self,
        config: WasmConfig,
        *,
        on_failure: Callable[[str, str], None] | None = None,
    ) -> None:
        self.config = config
        self.id = config.id
        self.engine = _engine()
        self._on_failure = on_failure
        self._stamp = _stamp(config.path)
        module, instance = self._load()  # OSError or ModuleLoadError: this module cannot serve
        self._module: wasmtime.Module = module
        self._instance: _Instance | None = instance
        self._poller: asyncio.Task[None] | None = None
        self.generation = 1
        """Counts successful loads: a test or an operator can see that a reload happened."""

    def _load(self) -> tuple[wasmtime.Module, _Instance]:
        """Compile the file and instantiate it once with the ABI's checks, as a request would:
        a module that compiles but cannot answer is refused here, not on every request."""
        path = self.config.path
        try:
            if path.endswith(".wat"):
                with open(path, "rb") as f:
                    data = f.read()
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ModuleLoadError(
                        f"the .wat file is not UTF-8 text (byte {data[exc.start]:#04x} at offset"
                        f" {exc.start})"
                    ) from None
                module = wasmtime.Module(self.engine, text)
            else:
                module = wasmtime.Module.from_file(self.engine, path)
        except wasmtime.WasmtimeError as exc:
            raise ModuleLoadError(_summary(str(exc))) from None
        imports = module.imports
        if imports:  # the host provides none: name the first, not just instantiation's count
            first = imports[0]
            kind = type(first.type).__name__.removesuffix("Type").lower()
            raise ModuleLoadError(
                f"the module imports `{first.module}.{first.name}` ({kind}); the host provides"
                " no imports"
            )
        try:
            instance = _Instance(self.engine, module, self.config.memory_bytes)
        except ModuleFailed as exc:
            raise ModuleLoadError(_summary(str(exc))) from None
        return module, instance

    def check(self, view: bytes) -> WasmAnswer:
        """The module's verdict on the JSON request view (raises ModuleFailed, counted)."""
        module = self._module  # the one a reload may replace; this call keeps its own
        instance = self._instance
        try:
            if instance is None:
                instance = self._instance = _Instance(self.engine, module, self.config.memory_bytes)
            answer = _parse_answer(instance.call(view, self.config.fuel), view)
        except ModuleFailed as exc:
            if self._instance is instance:
                self._instance = None  # its memory may be in any state now
            if self._on_failure is not None:
                self._on_failure(self.id, exc.kind)
            raise
        return answer

    def reload(self) -> bool:
        """Load the file again now; True when the new module is in place."""
        try:
            loaded = self._load()
        except Exception as exc:  # whatever the file is, the running module stays
            self._load_failed(exc)
            return False
        self._swap(*loaded)
        return True

    async def reload_async(self) -> bool:
        """`reload`, with the loading in a thread (compiling may take milliseconds)."""
        try:
            loaded = await asyncio.to_thread(self._load)
        except Exception as exc:  # whatever the file is, the running module stays
            self._load_failed(exc)
            return False
        self._swap(*loaded)
        return True

    def _load_failed(self, exc: Exception) -> None:
        detail = _summary(str(exc)) or type(exc).__name__
        log.warning(
            "policy module %s: reload of %s failed, the running module stays: %s",
            self.id,
            self.config.path,
            detail,
        )
        if self._on_failure is not None:
            self._on_failure(self.id, "load")

    def _swap(self, module: wasmtime.Module, instance: _Instance) -> None:
        self._module, self._instance = module, instance
        self.generation += 1
        log.info("policy module %s: loaded %s", self.id, self.config.path)

    def start(self) -> None:
        """Watch the file for changes (when `poll_interval` is set)."""
        if self.config.poll_interval is not None and self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def aclose(self) -> None:
        """Stop the poller. Never raises what the poller met: a shutdown or a swap of the
        gateway must go on to close what comes after it (the audit log)."""
        poller, self._poller = self._poller, None
        if poller is None:
            return
        poller.cancel()
        try:
            await poller
        except asyncio.CancelledError:
            pass
        except Exception:  # pragma: no cover - `_poll` catches everything itself
            log.exception("policy module %s: the file poller had failed", self.id)

    async def _poll(self) -> None:
        interval = self.config.poll_interval
        assert interval is not None
        while True:
            await asyncio.sleep(interval)
            try:
                stamp = _stamp(self.config.path)
                if stamp != self._stamp and stamp is not None:
                    self._stamp = stamp
                    await self.reload_async()
            except Exception:  # a poller that dies would stop every later reload, silently
                log.exception("policy module %s: polling %s failed", self.id, self.config.path)


def _stamp(path: str) -> tuple[int, int, int] | None:
    """What tells that the file changed: its inode (a rename over it, the way to deploy, makes a
    new one even when the new file has the old one's time and size, as reproducible builds
    and files from an image can), modification time and size."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


_ALLOW = b'{"action":"allow"}'
"""The answer of almost every call, spelled as the ABI's text spells it: recognised without a
JSON parse (~12 us on a cold CPU cache)."""


def _parse_answer(raw: bytes, view: bytes) -> WasmAnswer:
    if raw == _ALLOW:
        return WasmAnswer("allow")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ModuleFailed("abi", "the answer is not JSON") from None
    action = obj.get("action") if isinstance(obj, dict) else None
    if action == "allow":
        return WasmAnswer("allow")
    if action == "deny":
        reason = obj.get("reason")
        return WasmAnswer("deny", reason[:200] if isinstance(reason, str) else "")
    if action == "redact":
        return WasmAnswer("redact", spans=_spans(obj.get("spans"), view))
    raise ModuleFailed("abi", f"unknown action {action!r}")


def _spans(spans: object, view: bytes) -> list[tuple[int, int]]:
    """A redact answer's spans, checked against the prompt the module read, sorted, with
    overlapping or touching ones merged (one marker each) and empty ones dropped (they redact
    nothing)."""
    if not isinstance(spans, list):
        raise ModuleFailed("abi", "redact spans must be [[start, end], ...]")
    if len(spans) > MAX_SPANS:
        raise ModuleFailed("abi", f"{len(spans)} redact spans, above the limit of {MAX_SPANS}")
    if not all(
        isinstance(s, list)
        and len(s) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in s)
        for s in spans
    ):
        raise ModuleFailed("abi", "redact spans must be [[start, end], ...]")
    # The offsets are into the prompt as the module read it: the view's, parsed again only
    # here (a redact answer is rare; the view is at most the request body).
    try:
        parsed = orjson.loads(view) if spans else None
    except orjson.JSONDecodeError:
        parsed = None
    prompt = parsed.get("prompt") if isinstance(parsed, dict) else None
    size = len(prompt.encode()) if isinstance(prompt, str) else 0
    merged: list[tuple[int, int]] = []
    for start, end in sorted((s[0], s[1]) for s in spans):
        if not 0 <= start <= end <= size:
            raise ModuleFailed(
                "abi", f"redact span [{start}, {end}] is not within the prompt's {size} bytes"
            )
        if start == end:
            continue
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _summary(text: str) -> str:
    """wasmtime's error text on one line: its first line, and the first cause when it has
    one (`failed to parse WebAssembly module: multiple memories (at offset 0xa)`)."""
    lines = [line.strip() for line in text.splitlines()]
    first = next((line for line in lines if line), "")
    if "Caused by:" in lines:
        cause = next((line for line in lines[lines.index("Caused by:") + 1 :] if line), "")
        if cause:
            return f"{first.rstrip(':')}: {cause.removeprefix('0: ')}"
    return first


__all__ = [
    "MAX_ANSWER_BYTES",
    "MAX_SPANS",
    "MAX_TABLE_ELEMENTS",
    "ModuleFailed",
    "ModuleLoadError",
    "WasmAnswer",
    "WasmPolicy",
]
