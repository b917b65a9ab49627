"""qlog traces (`--qlog-dir`): one file per connection, written off the event loop, with its
events and the traces waiting for the writer bounded; over real sockets with aioquic clients."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from certs import ensure_dev_certificates
from tests.helpers import wait_until
from tests.transport.conftest import H3Factory
from tests.transport.h3client import h3_connect
from transport.demo import demo_app
from transport.qlog import BoundedTrace, QlogWriter, check_directory


def _traces(directory: Path) -> list[dict[str, Any]]:
    return list(_files(directory).values())


def _files(directory: Path) -> dict[str, dict[str, Any]]:
    """Each qlog file's name (without `.qlog`) and its document."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(directory.glob("*.qlog"))}


def _names(trace: dict[str, Any]) -> set[str]:
    return {event["name"] for event in trace["events"]}


async def test_each_connection_leaves_one_trace_of_what_it_did(
    h3_server: H3Factory, dev_certs: Any, tmp_path: Path
) -> None:
    outcomes: list[str] = []
    qlog = QlogWriter(tmp_path, outcome=outcomes.append)
    async with h3_server(app=demo_app, qlog=qlog) as server:
        for _ in range(2):
            async with h3_connect(server.port, dev_certs.ca_cert) as client:
                assert (await client.fetch("POST", "/x", body=b"hello")).status == 200
        await wait_until(lambda: outcomes == ["written", "written"])
    qlog.close()
    files = _files(tmp_path)
    documents = list(files.values())
    assert len(documents) == 2
    for document in documents:
        assert document["qlog_format"] == "JSON" and document["qlog_version"]
        (trace,) = document["traces"]
        assert trace["vantage_point"]["type"] == "server"
        assert trace["common_fields"]["quicedge_events_dropped"] == 0
        names = _names(trace)
        assert {"transport:packet_received", "transport:packet_sent"} <= names
        assert any(name.startswith("http:") for name in names)  # the HTTP/3 frames too
    odcids = {d["traces"][0]["common_fields"]["ODCID"] for d in documents}
    assert set(files) == odcids


async def test_a_long_connection_keeps_its_first_events(
    h3_server: H3Factory, dev_certs: Any, tmp_path: Path
) -> None:
    outcomes: list[str] = []
    qlog = QlogWriter(tmp_path, max_events=30, outcome=outcomes.append)
    async with h3_server(app=demo_app, qlog=qlog) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as client:
            for _ in range(5):
                assert (await client.fetch("POST", "/x", body=b"hello")).status == 200
        await wait_until(lambda: outcomes == ["written"])
    qlog.close()
    (document,) = _traces(tmp_path)
    (trace,) = document["traces"]
    assert len(trace["events"]) == 30
    assert trace["common_fields"]["quicedge_events_dropped"] > 0
    # The first events are the ones kept: the client's Initial is among them.
    assert any(
        e["name"] == "transport:packet_received" and e["data"]["header"]["packet_type"] == "initial"
        for e in trace["events"]
    )


def _trace(odcid: bytes) -> BoundedTrace:
    trace = BoundedTrace(is_client=False, odcid=odcid, max_events=10)
    trace.log_event(category="transport", event="packet_sent", data={})
    return trace


async def test_traces_past_the_writers_backlog_are_dropped(tmp_path: Path) -> None:
    """The writer's backlog is bounded: a stalled disk costs traces, not memory."""
    release = threading.Event()
    written: list[Path] = []

    def slow_write(path: Path, document: dict[str, Any]) -> None:
        release.wait(10)
        written.append(path)

    outcomes: list[str] = []
    qlog = QlogWriter(tmp_path, max_pending=2, outcome=outcomes.append, write=slow_write)
    for i in range(5):
        qlog.end_trace(_trace(bytes([i]) * 8))
    assert outcomes == ["dropped"] * 3  # at once, on the loop: nothing waits for the disk
    release.set()
    await wait_until(lambda: len(outcomes) == 5)
    assert sorted(outcomes) == ["dropped"] * 3 + ["written"] * 2
    assert [p.name for p in written] == [f"{'00' * 8}.qlog", f"{'01' * 8}.qlog"]
    qlog.end_trace(_trace(b"\x09" * 8))  # the backlog is free again
    await wait_until(lambda: len(outcomes) == 6)
    assert outcomes[-1] == "written"
    qlog.close()
    qlog.end_trace(_trace(b"\x0a" * 8))  # after close: dropped, not an error
    assert outcomes[-1] == "dropped"


async def test_a_failed_write_is_counted(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    outcomes: list[str] = []
    qlog = QlogWriter(gone, outcome=outcomes.append)
    gone.rmdir()
    qlog.end_trace(_trace(b"\x01" * 8))
    await wait_until(lambda: outcomes == ["failed"])
    qlog.close()


def test_the_directory_is_checked_up_front(tmp_path: Path) -> None:
    assert check_directory(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match="does not exist"):
        check_directory(str(tmp_path / "missing"))
    afile = tmp_path / "file"
    afile.write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        check_directory(str(afile))
    with pytest.raises(ValueError, match=">= 1"):
        QlogWriter(tmp_path, max_events=0)


async def test_serve_writes_traces_into_its_qlog_dir(serve_process: Any, tmp_path: Path) -> None:
    server = await asyncio.to_thread(serve_process, "--demo", "--qlog-dir", str(tmp_path))
    ca = ensure_dev_certificates().ca_cert  # what `--demo` serves
    async with h3_connect(server.h3_port, ca) as client:
        assert (await client.fetch("POST", "/x", body=b"hello")).status == 200
    written = 'quicedge_qlog_traces_total{outcome="written"}'
    await asyncio.to_thread(server.wait_metric, written, 1)
    (document,) = _traces(tmp_path)
    assert "transport:packet_received" in _names(document["traces"][0])


async def test_a_trace_keeps_no_credentials(
    h3_server: H3Factory, dev_certs: Any, tmp_path: Path
) -> None:
    """aioquic records every HEADERS frame's fields; a trace is a file on disk, and would hold
    every client's API key: the values of `authorization` and the like are masked."""
    outcomes: list[str] = []
    qlog = QlogWriter(tmp_path, outcome=outcomes.append)
    async with h3_server(app=demo_app, qlog=qlog) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as client:
            secret = [(b"authorization", b"Bearer sk-CANARY-qlog"), (b"cookie", b"s=CANARY2")]
            r = await client.fetch("POST", "/x", body=b"hello", headers=secret)
            assert r.status == 200
        await wait_until(lambda: outcomes == ["written"])
    qlog.close()
    text = json.dumps(list(_files(tmp_path).values()))
    assert '"authorization"' in text and '"cookie"' in text  # the fields are there
    assert "CANARY" not in text  # their values are not
