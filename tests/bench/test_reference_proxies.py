"""`bench.reference_proxies`: the yardstick proxies' configurations and how they are started."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from bench import reference_proxies
from bench.edge_latency import build_parser
from bench.reference_proxies import caddy_config, nginx_config, reference


def test_caddy_flushes_every_response_as_it_arrives() -> None:
    config = caddy_config(8081, "http://127.0.0.1:31001")
    assert "http://127.0.0.1:8081 {" in config
    assert "reverse_proxy 127.0.0.1:31001 {" in config
    assert "flush_interval -1" in config  # no response buffering
    assert "admin off" in config and "auto_https off" in config


def test_nginx_is_one_process_with_keep_alive_and_no_buffering(tmp_path: Path) -> None:
    config = nginx_config(8082, "http://127.0.0.1:31001", tmp_path)
    for line in (
        "master_process off;", "worker_processes 1;", "listen 127.0.0.1:8082;",
        "server 127.0.0.1:31001; keepalive 64;", "proxy_http_version 1.1;",
        'proxy_set_header Connection "";', "proxy_buffering off;",
        "proxy_request_buffering off;", "tcp_nodelay on;",
        f"proxy_temp_path {tmp_path / 'proxy'};", f"pid {tmp_path / 'nginx.pid'};",
    ):  # fmt: skip
        assert line in config


def fake_binary(folder: Path, name: str) -> Path:
    path = folder / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_each_reference_runs_as_one_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    caddy, nginx = fake_binary(bin_dir, "caddy"), fake_binary(bin_dir, "nginx")
    monkeypatch.setenv("PATH", str(bin_dir))
    ref = reference("caddy", 9001, "http://127.0.0.1:31001", tmp_path / "caddy")
    assert ref.command[:2] == [str(caddy), "run"] and ref.env["GOMAXPROCS"] == "1"
    assert (tmp_path / "caddy" / "Caddyfile").read_text() == caddy_config(
        9001, "http://127.0.0.1:31001"
    )
    ref = reference("nginx", 9002, "http://127.0.0.1:31001", tmp_path / "nginx")
    assert ref.command[0] == str(nginx)
    assert "listen 127.0.0.1:9002;" in (tmp_path / "nginx" / "nginx.conf").read_text()


def test_a_missing_binary_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reference_proxies.shutil, "which", lambda *a, **kw: None)
    with pytest.raises(RuntimeError, match=r"caddy is not installed \(apt-get install caddy"):
        reference("caddy", 9001, "http://127.0.0.1:31001", tmp_path)
    assert not os.listdir(tmp_path)  # nothing written


def test_the_flag_takes_only_known_proxies() -> None:
    args = build_parser().parse_args(["--spawn", "--reference", "caddy", "--reference", "nginx"])
    assert args.reference == ["caddy", "nginx"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--spawn", "--reference", "haproxy"])
