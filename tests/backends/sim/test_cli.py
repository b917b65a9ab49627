"""`python -m backends.sim` as a process: the ready line, serving, clean exit, bad options."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import httpx
import zmq

from backends.kv_events import KvEventPublisher
from backends.sim.cli import build_parser, config_from

CMD = [sys.executable, "-m", "backends.sim", "--host", "127.0.0.1"]


def test_process_prints_ready_serves_and_exits_on_sigterm() -> None:
    proc = subprocess.Popen(
        [*CMD, "--port", "0", "--name", "b1", "--profile", "instant", "--enable-metrics"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("ready http://127.0.0.1:"), line
        url = line.split()[1]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        r = httpx.post(f"{url}/generate", json={"text": "hi"}, timeout=10)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] > 0
        assert "sglang:num_running_reqs" in httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=30)


def test_bad_options_exit_2_with_a_message() -> None:
    result = run("--profile", "nope")
    assert result.returncode == 2 and "invalid choice" in result.stderr
    result = run("--page-size", "0")
    assert result.returncode == 2 and "page_size" in result.stderr
    result = run("--natural-output-len", "a:b")
    assert result.returncode == 2 and "LO:HI" in result.stderr


def test_port_in_use_exits_1() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run("--port", str(port))
    assert result.returncode == 1 and "cannot listen" in result.stderr


def test_options_map_to_config() -> None:
    args = build_parser().parse_args(
        [
            "--max-running-requests",
            "16",
            "--max-total-tokens",
            "5000",
            "--page-size",
            "4",
            "--chunked-prefill-size",
            "1024",
            "--time-scale",
            "0.5",
            "--natural-output-len",
            "8:9",
            "--enable-cache-report",
            "--profile",
            "h200-llama3-8b",
        ]  # fmt: skip
    )
    config = config_from(args)
    assert config.max_running_requests == 16 and config.max_total_tokens == 5000
    assert config.page_size == 4 and config.chunked_prefill_size == 1024
    assert config.time_scale == 0.5 and config.natural_output_len == (8, 9)
    assert config.enable_cache_report and not config.enable_metrics
    assert config.profile == "h200-llama3-8b"


def test_process_on_the_asyncio_loop_serves() -> None:
    proc = subprocess.Popen(
        [*CMD, "--port", "0", "--name", "b2", "--profile", "instant", "--loop", "asyncio"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("ready http://127.0.0.1:"), line
        r = httpx.post(f"{line.split()[1]}/generate", json={"text": "hi"}, timeout=10)
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def test_unknown_loop_is_refused() -> None:
    result = run("--loop", "trio")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_an_unknown_log_level_is_a_usage_error_not_a_traceback() -> None:
    result = run("--log-level", "loud")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "argument --log-level: invalid choice: 'loud'" in result.stderr
    assert build_parser().parse_args(["--log-level", "INFO"]).log_level == "info"


def test_a_kv_events_endpoint_it_cannot_bind_is_one_line_not_a_traceback() -> None:
    """A second stand-in given the first's `--kv-events-config` endpoint (SGLang's default is
    `tcp://*:5557` for every server) ended with a ZMQ traceback."""
    first = KvEventPublisher("tcp://*:*")  # as the first stand-in's publisher, on a free port
    try:
        endpoint = first._socket.getsockopt_string(zmq.LAST_ENDPOINT).replace("[::]", "*")
        kv_events = f'{{"publisher": "zmq", "endpoint": "{endpoint}"}}'
        result = run("--port", "0", "--kv-events-config", kv_events)
    finally:
        first.close()
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        f"quicedge sim: --kv-events-config: Address already in use (addr='{endpoint}')"
    ]
