"""The audit log: hash-chained lines that `quicedge audit verify` checks (failing on an edited,
removed or reordered line), rotation that keeps the chain, a full queue's two behaviours, and a
burst through the edge written without a drop."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

import edge.audit as audit_module
from edge.audit import GENESIS, AuditConfig, AuditLog, ordered_files, verify
from edge.cli import main as cli
from edge.errors import AuditBacklog
from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
    sse_reply,
)
from tests.helpers import wait_until


def entry(i: int) -> dict[str, Any]:
    return {"request_id": f"r{i}", "status": 200, "tenant": "t", "_prompt": f"secret prompt {i}"}


async def write_log(path: Path, n: int, **config: Any) -> AuditLog:
    log = AuditLog(AuditConfig(path=str(path), **config))
    await log.start()
    for i in range(n):
        log.record(entry(i))
    await log.flush()
    await log.aclose()
    return log


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


async def test_lines_are_chained_and_hold_no_prompt(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await write_log(path, 5)
    records = [json.loads(line) for line in lines(path)]
    assert [r["request_id"] for r in records] == [f"r{i}" for i in range(5)]
    assert records[0]["prev"] == GENESIS
    assert all(b["prev"] == a["hash"] for a, b in zip(records, records[1:], strict=False))
    assert "secret prompt" not in path.read_text()
    assert all(len(r["prompt_sha256"]) == 64 for r in records)
    assert verify([str(path)], start=GENESIS).ok


async def test_records_of_one_interval_are_written_as_one_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records that arrive one by one, with the loop turning between them, still go to the
    writer's thread together: one hand-off and one write per interval, not per request."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(AuditConfig(path=str(path)))
    batches: list[int] = []
    write = log._write

    def counted(batch: list[dict[str, Any]]) -> None:
        batches.append(len(batch))
        write(batch)

    monkeypatch.setattr(log, "_write", counted)
    await log.start()
    for i in range(10):
        log.record(entry(i))
        await asyncio.sleep(0.002)  # time for the writer to take the queue and write it
    await log.flush()
    await log.aclose()
    assert sum(batches) == 10 and len(batches) <= 2, batches
    assert verify([str(path)], start=GENESIS).ok


async def test_prompts_only_when_the_operator_turns_them_on(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await write_log(path, 1, include_prompts=True)
    assert json.loads(path.read_text())["prompt"] == "secret prompt 0"


async def test_keyed_prompt_hash_differs_from_the_plain_one(tmp_path: Path) -> None:
    plain, keyed = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    await write_log(plain, 1)
    await write_log(keyed, 1, hash_key="k")
    assert (json.loads(plain.read_text())["prompt_sha256"]
            != json.loads(keyed.read_text())["prompt_sha256"])  # fmt: skip


def tamper(path: Path, how: str) -> int:
    """Tamper with the log; the 1-based line number verify must name."""
    text = lines(path)
    if how == "edited":
        record = json.loads(text[3])
        record["status"] = 500
        text[3] = json.dumps(record) + "\n"
        bad = 4
    elif how == "removed":
        del text[3]
        bad = 4  # the line after the gap
    elif how == "reordered":
        text[3], text[4] = text[4], text[3]
        bad = 4
    else:
        raise AssertionError(how)
    path.write_text("".join(text))
    return bad


def test_verify_help_describes_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli(["audit", "verify", "--help"])
    assert exited.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Check the hash chain of an audit log" in out
    assert "Exit 0 when the chain holds" in out


@pytest.mark.parametrize("how", ["edited", "removed", "reordered"])
async def test_verify_names_the_first_bad_line(
    tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "audit.jsonl"
    await write_log(path, 8)
    assert cli(["audit", "verify", str(path)]) == 0
    assert "OK 8 lines" in capsys.readouterr().out
    bad = tamper(path, how)
    assert cli(["audit", "verify", str(path)]) == 1
    assert f"FAIL {path}:{bad}:" in capsys.readouterr().out


async def test_removing_the_first_line_fails_from_genesis(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await write_log(path, 3)
    path.write_text("".join(lines(path)[1:]))
    assert verify([str(path)]).ok  # on its own, a tail of a log is consistent...
    result = verify([str(path)], start=GENESIS)  # ...but not the start of one
    assert not result.ok and result.error is not None and ":1:" in result.error


async def test_rotation_continues_the_chain_across_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(AuditConfig(path=str(path), max_bytes=4096))
    await log.start()
    for i in range(60):  # ~300 bytes a line, batches of ten: several files
        log.record(entry(i))
        if i % 10 == 9:
            await log.flush()
    await log.aclose()
    rotated = ordered_files(str(path))[:-1]
    assert len(rotated) >= 2
    first_of_new = json.loads(lines(path)[0])
    last_of_old = json.loads(lines(Path(f"{path}.{len(rotated)}"))[-1])
    assert first_of_new["prev"] == last_of_old["hash"]
    assert cli(["audit", "verify", "--from-genesis", str(path)]) == 0
    assert "OK 60 lines" in capsys.readouterr().out
    # the rotated files alone, in the wrong order, do not verify
    assert not verify([f"{path}.2", f"{path}.1"]).ok


async def test_a_restarted_writer_continues_the_chain(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await write_log(path, 3)
    await write_log(path, 3)
    result = verify([str(path)], start=GENESIS)
    assert result.ok and result.lines == 6


async def test_full_queue_drops_and_counts() -> None:
    log = AuditLog(AuditConfig(path="/nonexistent/never-written", queue_size=4))
    # not started: nothing drains, so the queue fills deterministically
    kept = [log.record(entry(i)) for i in range(10)]
    assert kept == [True] * 4 + [False] * 6
    assert log.dropped == 6 and log.depth == 4


async def test_full_queue_refuses_new_requests_when_configured() -> None:
    log = AuditLog(AuditConfig(path="/nonexistent/never-written", queue_size=2,
                               when_full="refuse"))  # fmt: skip
    log.admit()
    assert log.record(entry(0), admitted=True) and log.record(entry(1), admitted=True)
    with pytest.raises(AuditBacklog) as info:
        log.admit()
    assert info.value.status == 503 and info.value.payload()["error"]["code"] == "audit_backlog"
    assert log.record(entry(2), admitted=True)  # an admitted request is still recorded
    assert log.dropped == 0
    assert not log.record(entry(3))  # the refused one's own record, or an event, is not
    assert log.dropped == 1 and log.depth == 3


def test_bad_audit_config_is_named() -> None:
    with pytest.raises(ValueError, match="audit.when_full"):
        AuditConfig.from_mapping({"path": "x", "when_full": "panic"})
    with pytest.raises(ValueError, match="unknown setting"):
        AuditConfig.from_mapping({"file": "x"})


async def test_burst_through_the_edge_is_audited_without_a_drop(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    total, concurrency = 400, 32

    def answer(recorded: Recorded) -> Reply:
        return health_ok(recorded) or sse_reply(["a", "b"])

    async with TinyUpstream(answer) as up:
        cfg = fast_config([up.url], pool_max_connections=64)
        audit = AuditConfig(path=str(path), queue_size=256)
        async with run_edge(cfg, audit=audit) as edge, client(edge) as http:
            todo = iter(range(total))

            async def worker() -> None:
                for i in todo:
                    body = {"model": "tiny-model", "prompt": f"p{i}", "stream": True}
                    response = await http.post("/v1/completions", json=body,
                                               headers={"x-request-id": f"b{i}"})  # fmt: skip
                    assert response.status_code == 200

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            bad = await http.post("/v1/completions", content=b"{nope",
                                  headers={"content-type": "application/json"})  # fmt: skip
            assert bad.status_code == 400
            audit = edge.wiring.audit
            assert audit is not None
            await audit.flush()
            metrics = (await httpx.AsyncClient().get(f"{edge.admin_url}/metrics")).text
    assert audit.dropped == 0
    assert "quicedge_audit_dropped_total 0.0" in metrics
    records = [json.loads(line) for line in lines(path)]
    assert len(records) == total + 1
    assert {r["request_id"] for r in records[:-1] if r["status"] == 200} >= {
        f"b{i}" for i in range(total)
    }
    sample = next(r for r in records if r["status"] == 200)
    assert sample["transport"] == "h1" and sample["early_data"] is False
    assert sample["backend"] and sample["model"] == "tiny-model" and sample["ttft_ms"] > 0
    assert records[-1]["status"] == 400
    assert verify([str(path)], start=GENESIS).ok


async def test_one_writer_per_log(tmp_path: Path) -> None:
    path = str(tmp_path / "audit-{pid}.jsonl")
    first = AuditLog(AuditConfig(path=path))
    await first.start()
    try:
        assert first.path.endswith(f"audit-{os.getpid()}.jsonl")
        second = AuditLog(AuditConfig(path=path))
        with pytest.raises(ValueError, match="another process writes"):
            await second.start()
    finally:
        await first.aclose()
    third = AuditLog(AuditConfig(path=path))  # the lock went with the first writer
    await third.start()
    await third.aclose()


async def test_a_restart_reads_back_a_last_line_of_any_length(tmp_path: Path) -> None:
    """A prompt-bearing last line longer than the blocks read back from the end of the file
    (here ~300 KiB) is found whole: the restarted writer continues the chain from it."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(AuditConfig(path=str(path), include_prompts=True))
    await log.start()
    log.record({**entry(0), "_prompt": "lorem ipsum " * 25_000})
    await log.flush()
    await log.aclose()
    assert len(lines(path)[-1]) > 256 * 1024
    await write_log(path, 2)
    result = verify([str(path)], start=GENESIS)
    assert result.ok and result.lines == 3, result


async def test_a_prompt_past_the_line_bound_gives_way_to_its_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No line is written longer than what a restart and `verify` read back: a prompt that would
    make one is replaced by its hash, and the line says so."""
    monkeypatch.setattr(audit_module, "MAX_LINE_BYTES", 4096)
    path = tmp_path / "audit.jsonl"
    log = AuditLog(AuditConfig(path=str(path), include_prompts=True))
    await log.start()
    log.record({**entry(0), "_prompt": "x" * 10_000})
    log.record(entry(1))
    await log.flush()
    await log.aclose()
    first, second = (json.loads(line) for line in lines(path))
    assert "prompt" not in first and first["prompt_omitted"] == "line_too_long"
    assert first["prompt_sha256"] == hashlib.sha256(b"x" * 10_000).hexdigest()
    assert second["prompt"] == "secret prompt 1"
    await write_log(path, 1)  # reads the last line back
    assert verify([str(path)], start=GENESIS).ok


async def test_a_last_line_past_the_bound_is_named_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(audit_module, "MAX_LINE_BYTES", 4096)
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b'{"hash": "' + b"a" * 5000 + b'"}\n')
    with pytest.raises(ValueError, match=r"audit.jsonl: the last line is over 4096 bytes"):
        await write_log(path, 1)


FULL_DISK_WRITER = """
import asyncio, json, os, resource, sys
from edge.audit import AuditConfig, AuditLog

async def main(path: str) -> None:
    log = AuditLog(AuditConfig(path=path))
    await log.start()
    def batch(name: str, n: int) -> None:
        for i in range(n):
            log.record({"request_id": f"{name}{i}", "status": 200})
    batch("before", 3)
    await log.flush()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    # room for part of the next batch only: the write fails part-way, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 150, hard))
    batch("lost", 3)
    await log.flush()
    during = os.path.getsize(path)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    batch("after", 3)
    await log.flush()
    await log.aclose()
    print(json.dumps({"dropped": log.dropped, "written": log.written, "during": during}))

asyncio.run(main(sys.argv[1]))
"""


def test_a_write_that_fails_part_way_is_cut_back_to_a_whole_line(tmp_path: Path) -> None:
    """A full disk (here the file-size limit) fails a batch's write after part of it is in the
    file: the part is cut off, the batch is counted as dropped, and the lines written once the
    disk has room again continue the chain from the last whole line."""
    path = tmp_path / "audit.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK_WRITER, str(path)],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout)
    records = [json.loads(line) for line in lines(path)]
    assert counts["dropped"] == 3 and counts["written"] == 6
    assert counts["during"] == sum(len(line) for line in lines(path)[:3])  # whole lines only
    assert [r["request_id"] for r in records] == [f"before{i}" for i in range(3)] + [
        f"after{i}" for i in range(3)
    ]
    assert verify([str(path)], start=GENESIS).ok


async def test_a_write_whose_cut_failed_is_cut_before_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the cut itself fails, the next write makes it first."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(AuditConfig(path=str(path)))
    log._write([entry(0)])
    good = path.stat().st_size
    real_write, real_truncate = os.write, os.ftruncate

    def half_then_fail(fd: int, data: Any) -> int:
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(28, "No space left on device")

    def refuse(fd: int, size: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "write", half_then_fail)
    monkeypatch.setattr(os, "ftruncate", refuse)
    with pytest.raises(OSError):
        log._write([entry(1)])
    assert path.stat().st_size > good
    monkeypatch.setattr(os, "write", real_write)
    monkeypatch.setattr(os, "ftruncate", real_truncate)
    log._write([entry(2)])
    assert [json.loads(line)["request_id"] for line in lines(path)] == ["r0", "r2"]
    assert verify([str(path)], start=GENESIS).ok


async def test_a_restart_cuts_off_a_partial_last_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A log that ends inside a line (a crash during a write) is cut back to its last whole
    line at start, with a warning; the chain goes on from there."""
    path = tmp_path / "audit.jsonl"
    await write_log(path, 2)
    with path.open("ab") as f:
        f.write(b'{"ts": 1.5, "request_id": "cut sh')
    await write_log(path, 2)
    result = verify([str(path)], start=GENESIS)
    assert result.ok and result.lines == 4, result
    assert "cut them off" in caplog.text


async def test_a_restart_keeps_a_whole_last_record_without_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await write_log(path, 2)
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    await write_log(path, 1)
    result = verify([str(path)], start=GENESIS)
    assert result.ok and result.lines == 3, result


async def test_a_log_that_is_only_a_partial_line_starts_over(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b'{"ts": 1.5, "req')
    await write_log(path, 1)
    assert verify([str(path)], start=GENESIS).ok


async def test_refusals_do_not_grow_a_full_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`refuse` with the writer stalled (a hung disk): the 503 refusals' own records are dropped
    and counted, so the queue stays within its size plus the requests in flight however many
    are refused; a request admitted before the queue filled is recorded past its size."""
    path = tmp_path / "audit.jsonl"
    gate, arrived = asyncio.Event(), asyncio.Event()

    async def answer(recorded: Recorded) -> Reply:
        if b"held" in recorded.body:
            arrived.set()
            await asyncio.wait_for(gate.wait(), 30)
        return health_ok(recorded) or sse_reply(["a"])

    async with TinyUpstream(answer) as up:
        cfg = fast_config([up.url])
        audit_config = AuditConfig(path=str(path), queue_size=3, when_full="refuse")
        async with run_edge(cfg, audit=audit_config) as edge, client(edge) as http:
            audit = edge.wiring.audit
            assert audit is not None
            stalled, release = threading.Event(), threading.Event()
            write = audit._write

            def stalling(batch: list[dict[str, Any]]) -> None:
                stalled.set()
                release.wait(30)
                write(batch)

            monkeypatch.setattr(audit, "_write", stalling)

            async def send(prompt: str) -> int:
                body = {"model": "tiny-model", "prompt": prompt}
                return (await http.post("/v1/completions", json=body)).status_code

            try:
                assert await send("first") == 200
                assert await asyncio.to_thread(stalled.wait, 10)  # its batch is in the writer
                held = asyncio.ensure_future(send("held"))  # admitted now, answered later
                await asyncio.wait_for(arrived.wait(), 10)
                statuses = [await send(f"p{i}") for i in range(30)]
                assert statuses[:3] == [200] * 3 and statuses[3:] == [503] * 27
                assert audit.depth == 3 and audit.dropped == 27
                burst = await asyncio.gather(*(send(f"b{i}") for i in range(10)))
                assert set(burst) == {503} and audit.depth == 3 and audit.dropped == 37
                gate.set()
                assert await held == 200
                assert audit.depth == 4 and audit.dropped == 37
            finally:
                gate.set()
                release.set()
            await audit.flush()
    records = [json.loads(line) for line in lines(path)]
    assert [r["status"] for r in records] == [200] * 5
    assert verify([str(path)], start=GENESIS).ok


async def rotate(path: Path, first: int, n: int) -> None:
    log = AuditLog(AuditConfig(path=str(path), max_bytes=4096))
    await log.start()
    for i in range(first, first + n):  # ~300 bytes a line: a rotation every ~13 lines
        log._write([entry(i)])  # the writer's own step, a batch a line
    await log.aclose()


async def test_rotation_numbers_above_archived_and_removed_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The operator archives the oldest rotated file (gzip) and removes the next: the next
    rotation takes a number above every one there, and what remains still verifies in order."""
    path = tmp_path / "audit.jsonl"
    await rotate(path, 0, 40)
    assert [Path(name).name for name in ordered_files(str(path))] == [
        "audit.jsonl.1", "audit.jsonl.2", "audit.jsonl",
    ]  # fmt: skip
    archived = tmp_path / "audit.jsonl.1.gz"
    archived.write_bytes(gzip.compress((tmp_path / "audit.jsonl.1").read_bytes()))
    (tmp_path / "audit.jsonl.1").unlink()
    await rotate(path, 40, 30)
    assert not (tmp_path / "audit.jsonl.1").exists()
    (tmp_path / "audit.jsonl.2").unlink()  # the next oldest, removed
    names = [Path(name).name for name in ordered_files(str(path))]
    assert names == ["audit.jsonl.3", "audit.jsonl.4", "audit.jsonl"]
    assert cli(["audit", "verify", str(path)]) == 0
    assert "in 3 file(s)" in capsys.readouterr().out
    assert cli(["audit", "verify", "--from-genesis", str(path)]) == 1  # its start is gone
    assert f"FAIL {path}.3:1: prev does not match" in capsys.readouterr().out


def test_rotated_files_are_ordered_by_number(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    for name in ["audit.jsonl", "audit.jsonl.10", "audit.jsonl.9", "audit.jsonl.11.gz",
                 "audit.jsonl.x", "audit.jsonl.lock", "other.jsonl.1"]:  # fmt: skip
        (tmp_path / name).write_text("")
    names = [Path(name).name for name in ordered_files(str(path))]
    assert names == ["audit.jsonl.9", "audit.jsonl.10", "audit.jsonl"]


async def test_verify_fails_a_line_past_the_bound_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A line longer than any the writer writes is a FAIL naming it, read no further than the
    bound (a file of one endless line must not take the checker's memory)."""
    path = tmp_path / "audit.jsonl"
    await write_log(path, 3)
    text = lines(path)
    path.write_text(text[0] + "x" * 10_000 + "\n" + "".join(text[1:]))
    assert cli(["audit", "verify", "--max-line-bytes", "4096", str(path)]) == 1
    assert capsys.readouterr().out.strip() == f"FAIL {path}:2: line over 4096 bytes"
    monkeypatch.setattr(audit_module, "MAX_LINE_BYTES", 4096)  # the default bound
    result = verify([str(path)])
    assert not result.ok and result.lines == 1 and result.error == f"{path}:2: line over 4096 bytes"
    assert verify([str(path)], max_line=20_000).error == f"{path}:2: not JSON"
    # a last line without its newline, exactly at the bound, is read
    path.write_text("".join(text).rstrip("\n"))
    assert verify([str(path)], max_line=len(text[-1]) - 1).ok


def test_verify_bound_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli(["audit", "verify", "--max-line-bytes", "0", "x"])
    assert info.value.code == 2
    assert "--max-line-bytes: expected a whole number of bytes >= 1" in capsys.readouterr().err


OUT_OF_MEMORY_VERIFY = """
import resource, sys
from edge.audit import main

with open("/proc/self/statm") as f:
    pages = int(f.read().split()[0])
room = pages * resource.getpagesize() + 24 * 1024 * 1024
resource.setrlimit(resource.RLIMIT_AS, (room, resource.getrlimit(resource.RLIMIT_AS)[1]))
sys.exit(main(["verify", "--max-line-bytes", str(1 << 30), sys.argv[1]]))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux's /proc")
def test_verify_that_runs_out_of_memory_exits_2_with_one_line(tmp_path: Path) -> None:
    """Exit 1 says the chain is broken; a checker that could not finish (here: a bound raised
    far past the memory it has) says so in one line and exits 2, not with a traceback."""
    path = tmp_path / "audit.jsonl"
    with path.open("wb") as f:
        f.write(b"x" * (48 * 1024 * 1024))
    done = subprocess.run(
        [sys.executable, "-c", OUT_OF_MEMORY_VERIFY, str(path)],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == "" and done.stderr == "quicedge audit verify: MemoryError\n"


# Edits that leave the parsed record, and so its hash, as it was: a duplicated key whose first
# value is what a first-wins reader (or a text search) takes, an escaped character that hides
# the line from a search for its plain text, spacing, a CRLF line end.
BYTE_EDITS = {
    "duplicate key": (b'"status":200', b'"status":500,"status":200'),
    "escaped character": (b'"tenant":"t"', b'"tenant":"\\u0074"'),
    "spacing": (b'"status":200', b'"status": 200'),
    "line end": (b"}\n", b"}\r\n"),
}


@pytest.mark.parametrize("how", list(BYTE_EDITS))
async def test_verify_fails_a_line_edited_without_changing_its_parsed_record(
    tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hash covers the record's canonical form, so a line whose bytes were edited but
    parse to the same record kept its hash: verify must also find the line as the writer wrote
    it, or a line can be made to read differently (or hidden from a search) and still pass."""
    path = tmp_path / "audit.jsonl"
    await write_log(path, 4)
    old, new = BYTE_EDITS[how]
    text = path.read_bytes().splitlines(keepends=True)
    assert old in text[2]
    text[2] = text[2].replace(old, new, 1)
    path.write_bytes(b"".join(text))
    assert cli(["audit", "verify", str(path)]) == 1
    assert f"FAIL {path}:3: not as written (edited)" in capsys.readouterr().out


async def test_a_responses_request_is_recorded_under_its_own_route(tmp_path: Path) -> None:
    """The edge forwards a `/v1/responses` request as a chat completion; its line names the
    route the client called, as its metrics do."""
    path = tmp_path / "audit.jsonl"

    def answer(recorded: Recorded) -> Reply:
        return health_ok(recorded) or sse_reply(["a", "b"])

    async with TinyUpstream(answer) as up:
        async with (
            run_edge(fast_config([up.url]), audit=AuditConfig(path=str(path))) as edge,
            client(edge) as http,
        ):
            response = await http.post("/v1/responses", json={"model": "tiny-model", "input": "hi"},
                                       headers={"x-request-id": "resp-1"})  # fmt: skip
            assert response.status_code == 200, response.text
            assert edge.wiring.audit is not None
            await edge.wiring.audit.flush()
    (record,) = [json.loads(line) for line in lines(path)]
    assert record["request_id"] == "resp-1" and record["status"] == 200
    assert record["route"] == "/v1/responses"


async def test_a_record_after_the_close_is_counted_as_dropped(tmp_path: Path) -> None:
    """Nothing writes a record that comes after `aclose` (a request or an event that ends late
    in a shutdown): it is refused and counted, not left in a queue nobody drains."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(AuditConfig(path=str(path)))
    await log.start()
    assert log.record(entry(0))
    await log.aclose()
    assert not log.record(entry(1))
    assert not log.record_event("config_reload", outcome="applied")
    assert log.dropped == 2 and log.depth == 0
    assert [json.loads(line)["request_id"] for line in lines(path)] == ["r0"]


def gzip_away(name: Path) -> Path:
    """What logrotate's `compress` does to a rotated file: `NAME.gz`, the file itself gone."""
    archived = Path(f"{name}.gz")
    archived.write_bytes(gzip.compress(name.read_bytes()))
    name.unlink()
    return archived


async def test_a_restart_continues_from_the_newest_file_even_archived(tmp_path: Path) -> None:
    """The current file was rotated away and compressed (logrotate: rename, `compress`) before
    the edge wrote again: the restarted writer continues the chain from that newest file's last
    line, not from an older file's, which would fork the chain."""
    path = tmp_path / "audit.jsonl"
    await rotate(path, 0, 30)
    assert [Path(name).name for name in ordered_files(str(path))] == [
        "audit.jsonl.1", "audit.jsonl.2", "audit.jsonl",
    ]  # fmt: skip
    os.rename(path, f"{path}.3")
    last = json.loads(lines(Path(f"{path}.3"))[-1])["hash"]
    gzip_away(Path(f"{path}.3"))
    await rotate(path, 30, 2)
    assert json.loads(lines(path)[0])["prev"] == last
    # and with every file there (the archived one decompressed), the chain holds from its start
    (tmp_path / "audit.jsonl.3").write_bytes(gzip.decompress((tmp_path / "audit.jsonl.3.gz")
                                                             .read_bytes()))  # fmt: skip
    result = verify([f"{path}.1", f"{path}.2", f"{path}.3", str(path)], start=GENESIS)
    assert result.ok and result.lines == 32, result.error


async def test_verify_names_an_archived_file_it_skipped_where_the_chain_breaks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Given one PATH, `verify` reads the plain files only: a newer file archived leaves a gap
    in what it reads, and the FAIL names the archived file that fills it."""
    path = tmp_path / "audit.jsonl"
    await rotate(path, 0, 30)
    os.rename(path, f"{path}.3")
    gzip_away(Path(f"{path}.3"))
    await rotate(path, 30, 2)
    assert cli(["audit", "verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {path}:1: prev does not match" in out
    assert f"{path}.3.gz (archived, not read) comes before it" in out
    gzip_away(Path(f"{path}.1"))  # the oldest archived: what remains still verifies
    (tmp_path / "audit.jsonl.3").write_bytes(gzip.decompress((tmp_path / "audit.jsonl.3.gz")
                                                             .read_bytes()))  # fmt: skip
    assert cli(["audit", "verify", str(path)]) == 0


async def test_a_newest_file_archived_in_a_form_not_read_stops_the_start(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    await rotate(path, 0, 20)
    os.rename(path, f"{path}.3.zst")  # stands for any compression but gzip
    log = AuditLog(AuditConfig(path=str(path)))
    with pytest.raises(ValueError, match=r"audit.jsonl.3.zst is the newest file of the chain"):
        await log.start()
    await log.aclose()
    assert not path.exists()  # nothing written on a fork of the chain


async def test_what_waits_for_a_stalled_disk_is_bounded_in_bytes_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record holds its prompt until the writer hashes it: `queue_size` (10,000) records of
    8 MiB prompts held 80 GB while the disk stalled. Past `QUEUE_BYTES` of prompts waiting, a
    record is dropped and counted as for a full queue (scaled down here: 1 MiB, 128 KiB). The
    file is a FIFO nobody reads yet: the writer's open blocks, as on a hung disk."""
    monkeypatch.setattr(audit_module, "QUEUE_BYTES", 1024 * 1024, raising=False)
    path = tmp_path / "audit.jsonl"
    log = AuditLog(AuditConfig(path=str(path)))
    await log.start()
    os.mkfifo(path)
    try:
        kept = [log.record({**entry(i), "_prompt": "p" * 128 * 1024}) for i in range(1)]
        await wait_until(lambda: log.depth == 0)  # the writer took it, and is stuck in open
        kept += [log.record({**entry(i), "_prompt": "p" * 128 * 1024}) for i in range(1, 20)]
        assert kept == [True] * 9 + [False] * 11
        assert log.dropped == 11 and log.depth == 8
    finally:
        reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # let the stuck write through
        try:
            closing = asyncio.ensure_future(log.aclose())
            while not closing.done():
                with contextlib.suppress(BlockingIOError):
                    os.read(reader, 1 << 20)
                await asyncio.sleep(0.01)
            await closing
        finally:
            os.close(reader)
    assert log.written == 9


def test_serve_check_leaves_a_log_it_reads_as_it_is(tmp_path: Path) -> None:
    """`serve --check` beside the running edge reads the chain's last record; a file that ends
    inside a line there is the edge's write in progress, which the check must not cut off (the
    rest of the write would follow a cut line). Only a writer's start repairs the end."""
    path = tmp_path / "audit.jsonl"
    asyncio.run(write_log(path, 2))
    with path.open("ab") as f:
        f.write(b'{"ts": 1.5, "request_id": "being writ')
    before = path.read_bytes()
    args = ["serve", "--backend", "http://127.0.0.1:9", "--check", "--audit-log", str(path)]
    done = subprocess.run([sys.executable, "-m", "edge.cli", *args], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert path.read_bytes() == before
