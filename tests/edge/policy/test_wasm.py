"""WebAssembly policies: the shipped example, and modules that trap, loop, eat memory or break
the ABI, each failing closed or open as configured and counted; modules that cannot serve
(imports, missing exports, more memory than allowed) are refused when loaded; reloads keep the
old module until the new one loads, and the poller survives any file."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import wasmtime

from edge.errors import PolicyRefused, PolicyUnavailable
from edge.policy.config import PolicyConfig, WasmConfig
from edge.policy.examples.build import build
from edge.policy.gateway import PolicyGateway
from edge.policy.wasm import MAX_TABLE_ELEMENTS, ModuleFailed, ModuleLoadError, WasmPolicy
from tests.helpers import wait_until

EXAMPLES = Path(__file__).parents[3] / "edge" / "policy" / "examples"
CHAT = "/v1/chat/completions"

# alloc hands out one buffer at 1024; each module differs only in `check`
HEAD = """(module (memory (export "memory") 1)
  (data (i32.const 0) "{\\"action\\":\\"allow\\"}")
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
"""
TRAPS = HEAD + '(func (export "check") (param i32 i32) (result i64) unreachable))'
LOOPS = (
    HEAD + '(func (export "check") (param i32 i32) (result i64) (loop $l (br $l)) (i64.const 0)))'
)
HUNGRY = (
    HEAD
    + """(func (export "check") (param i32 i32) (result i64)
    (drop (memory.grow (i32.const 1024)))            ;; 64 MiB more: refused by the limit
    (i32.store (i32.const 50000000) (i32.const 1))   ;; so this is out of bounds: a trap
    (i64.const 18)))"""
)
GROWS = (
    HEAD
    + """(func (export "check") (param i32 i32) (result i64)
    (drop (memory.grow (i32.const 1)))                          ;; a second page
    (memory.copy (i32.const 65536) (i32.const 0) (i32.const 18)) ;; the answer, moved into it
    (i64.const 281474976710674)))"""  # (65536 << 32) | 18
)
BIG_MEMORY = """(module (memory (export "memory") 1024)
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "check") (param i32 i32) (result i64) (i64.const 0)))"""
GARBAGE = """(module (memory (export "memory") 1)
  (data (i32.const 0) "not json")
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "check") (param i32 i32) (result i64) (i64.const 8)))"""
REDACT = """(module (memory (export "memory") 1)
  (data (i32.const 0) "{\\"action\\":\\"redact\\",\\"spans\\":[[6,11]]}")
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "check") (param i32 i32) (result i64) (i64.const 36)))"""


def module_file(tmp_path: Path, name: str, wat: str) -> str:
    path = tmp_path / f"{name}.wasm"
    path.write_bytes(wasmtime.wat2wasm(wat))
    return str(path)


def chat(text: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


def gateway(path: str, **wasm: Any) -> tuple[PolicyGateway, list[tuple[str, str]]]:
    failures: list[tuple[str, str]] = []
    config = PolicyConfig(wasm=[WasmConfig(id="mod", path=path, **wasm)])
    config.validate()
    gw = PolicyGateway(config, on_module_failure=lambda m, k: failures.append((m, k)))
    return gw, failures


def check(gw: PolicyGateway, text: str) -> Any:
    return gw.check(CHAT, chat(text), tenant="t", tier="pro", stream=False)


def test_prebuilt_example_matches_its_source() -> None:
    shipped = (EXAMPLES / "deny_keyword.wasm").read_bytes()
    built = wasmtime.wat2wasm((EXAMPLES / "deny_keyword.wat").read_text())
    assert shipped == built


def test_build_recipe_writes_the_module(tmp_path: Path) -> None:
    source = tmp_path / "m.wat"
    source.write_text((EXAMPLES / "deny_keyword.wat").read_text())
    assert build(source).read_bytes() == (EXAMPLES / "deny_keyword.wasm").read_bytes()


def test_example_module_denies_its_keyword_in_any_case() -> None:
    gw, failures = gateway(str(EXAMPLES / "deny_keyword.wasm"))
    assert check(gw, "a perfectly normal request").decision == "allow"
    for text in ("this is forbidden", "FORBIDDEN", "ForBiDdEn fruit"):
        with pytest.raises(PolicyRefused) as info:
            check(gw, text)
        assert info.value.rule == "mod" and info.value.status == 403
        assert "keyword" in info.value.message
    assert failures == []


def test_example_module_serves_many_requests_and_large_prompts() -> None:
    gw, failures = gateway(str(EXAMPLES / "deny_keyword.wasm"))
    for n in (10, 100_000, 10, 200_000):  # buffer grows, then is reused
        assert check(gw, "x" * n).decision == "allow"
    with pytest.raises(PolicyRefused):
        check(gw, "y" * 150_000 + "forbidden")
    assert failures == []


@pytest.mark.parametrize(
    ("wat", "kind"),
    [
        (TRAPS, "trap"),
        (LOOPS, "fuel"),
        (HUNGRY, "trap"),
        (GARBAGE, "abi"),
    ],  # fmt: skip
    ids=["traps", "loops", "memory-hungry", "garbage-answer"],
)
def test_failing_module_fails_closed_and_is_counted(tmp_path: Path, wat: str, kind: str) -> None:
    gw, failures = gateway(module_file(tmp_path, "bad", wat), fuel=100_000)
    for _ in range(2):  # and again on a fresh instance
        with pytest.raises(PolicyUnavailable) as info:
            check(gw, "hello")
        assert info.value.status == 503 and info.value.rule == "mod"
        assert json.loads(info.value.body())["error"]["code"] == "policy_unavailable"
    assert failures == [("mod", kind), ("mod", kind)]


def test_failing_module_fails_open_when_configured(tmp_path: Path) -> None:
    gw, failures = gateway(module_file(tmp_path, "loop", LOOPS), fuel=100_000, on_error="open")
    outcome = check(gw, "hello")
    assert outcome.decision == "allow_on_error" and outcome.rules == ["mod"]
    assert failures == [("mod", "fuel")]


def test_memory_limit_is_what_stops_the_hungry_module(tmp_path: Path) -> None:
    path = module_file(tmp_path, "hungry", HUNGRY)
    policy = WasmPolicy(WasmConfig(id="m", path=path, memory_bytes=128 * 1024 * 1024))
    # with room for the growth, the store succeeds and the module answers
    assert policy.check(b"{}").action == "allow"
    tight = WasmPolicy(WasmConfig(id="m", path=path, memory_bytes=16 * 1024 * 1024))
    with pytest.raises(ModuleFailed):
        tight.check(b"{}")


def test_an_answer_in_memory_grown_during_the_call_is_read(tmp_path: Path) -> None:
    """The host's view of the module's memory is taken once; a call that grows the memory and
    answers from the new part is still read, not refused as outside memory."""
    policy = WasmPolicy(WasmConfig(id="m", path=module_file(tmp_path, "grows", GROWS)))
    for _ in range(3):  # growing again on each call, the answer always in the second page
        assert policy.check(b"{}").action == "allow"


def test_redact_spans_rewrite_the_prompt(tmp_path: Path) -> None:
    gw, _ = gateway(module_file(tmp_path, "redact", REDACT))
    body = chat("hello world, all")
    outcome = gw.check(CHAT, body, tenant="t", tier="pro", stream=False)
    assert outcome.decision == "redact" and outcome.redacted
    assert body["messages"][0]["content"] == "hello [REDACTED], all"


def test_reload_swaps_the_module_and_keeps_the_old_on_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "live.wasm"
    path.write_bytes((EXAMPLES / "deny_keyword.wasm").read_bytes())
    gw, failures = gateway(str(path))
    with pytest.raises(PolicyRefused):
        check(gw, "forbidden")
    path.write_bytes(b"\0asm broken")
    gw.reload()
    with pytest.raises(PolicyRefused):  # the old module still runs
        check(gw, "forbidden")
    assert failures == [("mod", "load")]
    path.write_bytes(wasmtime.wat2wasm(HEAD + '(func (export "check") (param i32 i32) '
                                       "(result i64) (i64.const 18)))"))  # fmt: skip
    gw.reload()
    assert check(gw, "forbidden").decision == "allow"


async def test_changed_file_is_reloaded_by_the_poller(tmp_path: Path) -> None:
    path = tmp_path / "live.wasm"
    path.write_bytes(wasmtime.wat2wasm(HEAD + '(func (export "check") (param i32 i32) '
                                       "(result i64) (i64.const 18)))"))  # fmt: skip
    gw, _ = gateway(str(path), poll_interval=0.05)
    module = gw.modules[0]
    gw.start()
    try:
        assert check(gw, "forbidden").decision == "allow"
        fresh = tmp_path / "next.wasm"
        fresh.write_bytes((EXAMPLES / "deny_keyword.wasm").read_bytes())
        os.replace(fresh, path)  # how an operator should deploy: one atomic rename
        await wait_until(lambda: module.generation == 2, timeout=10)
        with pytest.raises(PolicyRefused):
            check(gw, "forbidden")
    finally:
        await gw.aclose()
    await asyncio.sleep(0)


async def test_sighup_reload_compiles_in_a_thread_and_swaps(tmp_path: Path) -> None:
    path = tmp_path / "live.wasm"
    path.write_bytes(wasmtime.wat2wasm(HEAD + '(func (export "check") (param i32 i32) '
                                       "(result i64) (i64.const 18)))"))  # fmt: skip
    gw, _ = gateway(str(path), poll_interval=None)
    assert check(gw, "forbidden").decision == "allow"
    path.write_bytes((EXAMPLES / "deny_keyword.wasm").read_bytes())
    gw.reload_soon()  # what Wiring.reload does on SIGHUP
    await wait_until(lambda: gw.modules[0].generation == 2, timeout=10)
    with pytest.raises(PolicyRefused):
        check(gw, "forbidden")


def test_the_direct_call_path_is_in_use() -> None:
    """The installed wasmtime exposes the C API calls `wasm.py` makes directly; without them it
    falls back to the bindings' own (slower) calls, which this test would flag."""
    from edge.policy import wasm

    assert wasm._UNCHECKED is not None


# -- loading: a module that cannot serve is refused when loaded, not on every request ----------

BODY = HEAD.removeprefix("(module ")
ANSWERS = '(func (export "check") (param i32 i32) (result i64) (i64.const 18))'
UNUSABLE = {
    "imports-a-function": (
        f'(module (import "env" "log" (func (param i32))) {BODY} {ANSWERS})',
        "the module imports `env.log` (func); the host provides no imports",
    ),
    "imports-its-memory": (
        '(module (import "env" "memory" (memory 1)) (export "memory" (memory 0))'
        ' (func (export "alloc") (param i32) (result i32) (i32.const 1024))'
        f" {ANSWERS})",
        "the module imports `env.memory` (memory); the host provides no imports",
    ),
    "no-check": (HEAD + ")", "the module exports no function `check`"),
    "check-is-a-global": (
        HEAD + '(global (export "check") i32 (i32.const 0)))',
        "the module exports no function `check`",
    ),
    "wrong-signature": (
        HEAD + '(func (export "check") (param i32) (result i32) (i32.const 0)))',
        "`check` has the wrong signature",
    ),
    "no-memory": (
        f'(module (func (export "alloc") (param i32) (result i32) (i32.const 0)) {ANSWERS})',
        "the module exports no `memory`",
    ),
    "start-traps": (
        HEAD + f"(func $s unreachable) (start $s) {ANSWERS})",
        "start trapped: error while executing at wasm backtrace: wasm trap: wasm `unreachable`"
        " instruction executed",
    ),
    "memory-too-big": (
        BIG_MEMORY,
        "cannot instantiate: memory minimum size of 1024 pages exceeds memory limits",
    ),
}


@pytest.mark.parametrize(("wat", "error"), UNUSABLE.values(), ids=UNUSABLE.keys())
def test_a_module_that_cannot_serve_is_refused_when_loaded(
    tmp_path: Path, wat: str, error: str
) -> None:
    config = WasmConfig(id="m", path=module_file(tmp_path, "unusable", wat))
    with pytest.raises(ModuleLoadError) as info:
        WasmPolicy(config)
    assert str(info.value) == error


def test_a_reload_to_a_module_that_cannot_serve_keeps_the_running_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "live.wasm"
    path.write_bytes((EXAMPLES / "deny_keyword.wasm").read_bytes())
    gw, failures = gateway(str(path))
    for name, (wat, error) in UNUSABLE.items():
        path.write_bytes(wasmtime.wat2wasm(wat))
        assert gw.modules[0].reload() is False, name
        with pytest.raises(PolicyRefused):  # the old module still answers
            check(gw, "forbidden")
        assert check(gw, "fine").decision == "allow"
        assert f"policy module mod: reload of {path} failed" in caplog.text
        assert error in caplog.text
    assert failures == [("mod", "load")] * len(UNUSABLE)
    assert gw.modules[0].generation == 1


# -- the file poller: any file is a counted load failure, and polling goes on ------------------


ALLOW_ALL = HEAD + ANSWERS + ")"
DENY_ALL = """(module (memory (export "memory") 1)
  (data (i32.const 0) "{\\"action\\":\\"deny\\",\\"reason\\":\\"v2\\"}")
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "check") (param i32 i32) (result i64) (i64.const 31)))"""


def wat_file(path: Path, source: bytes) -> None:
    """Put `source` at `path` the documented way: written beside it, renamed over it."""
    staged = path.with_suffix(".new")
    staged.write_bytes(source)
    os.replace(staged, path)


async def test_a_wat_file_that_is_not_utf8_is_a_load_failure_and_polling_goes_on(
    tmp_path: Path,
) -> None:
    path = tmp_path / "live.wat"
    wat_file(path, ALLOW_ALL.encode())
    gw, failures = gateway(str(path), poll_interval=0.05)
    module = gw.modules[0]
    gw.start()
    try:
        wat_file(path, b";; policy by M\xfcller\n" + DENY_ALL.encode())
        await wait_until(lambda: failures == [("mod", "load")], timeout=10)
        assert check(gw, "hello").decision == "allow"  # the running module stays
        assert module.generation == 1
        wat_file(path, DENY_ALL.encode())  # the poller is alive: the next good file loads
        await wait_until(lambda: module.generation == 2, timeout=10)
        with pytest.raises(PolicyRefused):
            check(gw, "hello")
    finally:
        await gw.aclose()  # raises nothing
    assert failures == [("mod", "load")]


def test_a_wat_file_that_is_not_utf8_is_named_at_load(tmp_path: Path) -> None:
    path = tmp_path / "m.wat"
    path.write_bytes(b";; M\xfcller\n" + ALLOW_ALL.encode())
    with pytest.raises(ModuleLoadError) as info:
        WasmPolicy(WasmConfig(id="m", path=str(path)))
    assert str(info.value) == "the .wat file is not UTF-8 text (byte 0xfc at offset 4)"


async def test_a_poll_that_fails_neither_stops_the_poller_nor_raises_from_aclose(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A poll that raises (here `os.stat` on a path with a NUL byte: ValueError) is logged; the
    next polls run, and closing the gateway (a config reload's swap, a shutdown that then
    closes the audit log) does not raise it again."""
    path = tmp_path / "live.wat"
    wat_file(path, ALLOW_ALL.encode())
    gw, _ = gateway(str(path), poll_interval=0.05)
    module = gw.modules[0]
    gw.start()
    try:
        module.config = replace(module.config, path=f"{path}\0")
        await wait_until(lambda: "polling" in caplog.text, timeout=10)
        module.config = replace(module.config, path=str(path))
        wat_file(path, DENY_ALL.encode())
        await wait_until(lambda: module.generation == 2, timeout=10)
    finally:
        await gw.aclose()
    with pytest.raises(PolicyRefused):
        check(gw, "hello")


# -- memory: `memory_bytes` bounds the module, not each of its memories -----------------------

ANOTHER_MEMORY = {
    "multi-memory": (
        HEAD + f"(memory $more 256 256) {ANSWERS})",
        "failed to parse WebAssembly module: multiple memories",
    ),
    "gc-heap": (
        HEAD + f"(type $bytes (array (mut i8))) {ANSWERS})",
        "failed to parse WebAssembly module: array indexed types not supported without the gc",
    ),
    "exceptions": (
        HEAD + f"(tag $oops) {ANSWERS})",
        "failed to parse WebAssembly module: exceptions proposal not enabled",
    ),
    "shared-memory": (
        '(module (memory (export "memory") 1 1 shared)'
        ' (func (export "alloc") (param i32) (result i32) (i32.const 1024))'
        f" {ANSWERS})",
        "failed to parse WebAssembly module: threads must be enabled for shared memories",
    ),
    "two-tables": (
        HEAD + f"(table 1 funcref) (table 1 funcref) {ANSWERS})",
        "cannot instantiate: resource limit exceeded: table count too high at 2",
    ),
    "a-huge-table": (
        HEAD + f"(table {MAX_TABLE_ELEMENTS + 1} funcref) {ANSWERS})",
        f"cannot instantiate: table minimum size of {MAX_TABLE_ELEMENTS + 1} elements exceeds"
        " table limits",
    ),
}


@pytest.mark.parametrize(("wat", "error"), ANOTHER_MEMORY.values(), ids=ANOTHER_MEMORY.keys())
def test_a_module_with_memory_beside_its_one_memory_is_refused(
    tmp_path: Path, wat: str, error: str
) -> None:
    """Each memory, table or heap would get its own limit: 65 memories of 16 MiB took an edge
    from 97 to 1066 MiB. Such a module does not load."""
    config = WasmConfig(id="m", path=module_file(tmp_path, "more", wat), memory_bytes=16 << 20)
    with pytest.raises(ModuleLoadError) as info:
        WasmPolicy(config)
    assert str(info.value).startswith(error), str(info.value)


def test_the_table_cannot_grow_past_its_limit(tmp_path: Path) -> None:
    """The module answers deny when `table.grow` succeeds; with the limit it gets -1."""
    wat = (
        HEAD
        + f"""(table 1 funcref)
      (data (i32.const 100) "{{\\"action\\":\\"deny\\"}}")
      (func (export "check") (param i32 i32) (result i64)
        (if (i32.eq (table.grow (ref.null func) (i32.const {MAX_TABLE_ELEMENTS})) (i32.const -1))
          (then (return (i64.const 18))))
        (i64.const {(100 << 32) | 17})))"""
    )
    policy = WasmPolicy(WasmConfig(id="m", path=module_file(tmp_path, "table", wat)))
    assert policy.check(b"{}").action == "allow"


async def test_a_file_renamed_over_with_the_same_time_and_size_is_reloaded(tmp_path: Path) -> None:
    """Reproducible builds and files from an image carry a fixed modification time, and a
    one-byte change keeps the size: the rename that deploys the new file still changes the
    inode, which the poller watches too (as the certificate's and the config's pollers do)."""
    allow = HEAD + '(func (export "check") (param i32 i32) (result i64) (i64.const 18)))'
    broken = allow.replace('\\"allow\\"', '\\"alloX\\"')  # an unknown action: fails closed
    path, fresh = tmp_path / "live.wasm", tmp_path / "next.wasm"
    path.write_bytes(wasmtime.wat2wasm(allow))
    fresh.write_bytes(wasmtime.wat2wasm(broken))
    assert path.stat().st_size == fresh.stat().st_size
    for file in (path, fresh):
        os.utime(file, ns=(1_700_000_000 * 10**9, 1_700_000_000 * 10**9))
    gw, _ = gateway(str(path), poll_interval=0.05)
    module = gw.modules[0]
    gw.start()
    try:
        assert check(gw, "hi").decision == "allow"
        os.replace(fresh, path)
        await wait_until(lambda: module.generation == 2, timeout=5)
        with pytest.raises(PolicyUnavailable):
            check(gw, "hi")
    finally:
        await gw.aclose()
