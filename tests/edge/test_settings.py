"""The settings loader: every section's TOML, `QUICEDGE_*` variables and flags, and the one-line
errors `quicedge serve` gives for each mistake (its `main`, in this process: a subprocess per
mistake cost a second each; the real command, in a subprocess, where the process is the point)."""

from __future__ import annotations

import argparse
import fcntl
import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Literal

import pytest

from certs.dev import default_dir
from edge import settings
from edge.serve import main as serve_main
from edge.settings import Section, SettingsError

# -- the real command ----------------------------------------------------------------------------


def quicedge(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUICEDGE_")}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "edge.cli", *argv],
        capture_output=True,
        text=True,
        env=environ,
        timeout=60,
    )


def refused(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused start printed (and nothing else)."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert done.stdout == ""
    return lines[0]


@pytest.fixture
def serve_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., str]:
    """`serve_refused(*argv, env=...)`: `quicedge serve`'s `main` run here with only `env` for
    its `QUICEDGE_*` variables; the one line it printed as it refused to start (exit 2)."""

    def run(*argv: str, env: dict[str, str] | None = None) -> str:
        for name in [name for name in os.environ if name.startswith("QUICEDGE_")]:
            monkeypatch.delenv(name)
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        try:
            status = serve_main(list(argv))
        except SystemExit as exc:  # argparse's own refusals
            status = exc.code  # type: ignore[assignment]
        out, err = capsys.readouterr()
        return refused(subprocess.CompletedProcess(argv, status, out, err))

    return run


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[serve]\nworkers = "4"\n', "serve.workers: expected an integer, got '4'"),
        ("[serve]\nwrokers = 4\n", "[serve]: unknown setting 'wrokers' (did you mean 'workers'?)"),
        ("[srve]\nworkers = 1\n", "unknown table [srve] (did you mean [serve]?)"),
        ("[serve]\nworkers = 0\n", "serve.workers must be >= 1, got 0"),
        ("[serve]\nmax_concurrent_streams = 0\n", "max_concurrent_streams must be >= 1"),
        ('[serve]\nh3 = "localhost"\n', "serve.h3: expected HOST:PORT, got 'localhost'"),
        ('[serve]\nloop = "trio"\n', "serve.loop: expected one of auto, asyncio, uvloop"),
        ('[early_data]\ndefault = "maybe"\n', "early_data.default: expected one of accept"),
        ('[early_data]\nroutes = { "generate" = "accept" }\n', "a route is a path starting"),
        ("[proxy]\nmax_retries = 1.5\n", "proxy.max_retries: expected an integer, got 1.5"),
        (
            '[proxy]\nbackends = ["http://a:1"]\nmax_pending_answer_bytes = -1\n',
            "proxy: max_pending_answer_bytes must be >= 0",
        ),
        (
            '[proxy]\nbackends = ["http://a:1"]\nconnect_timeout = 0\n',
            "connect_timeout must be > 0",
        ),
        ('[proxy]\nbackends = ["http://a:1#colour=red"]\n', "proxy.backends: backend http://a:1"),
        ("[breakers]\nkv_warn = 0.9\nkv_open = 0.8\n", "breakers.kv_warn, kv_open: need"),
        (
            '[proxy]\nbackends = ["http://a:1#hardware=x", "http://a:1"]\n',
            "proxy: a backend URL is listed twice",
        ),
        (
            '[proxy]\nbackends = ["http://a:1"]\nmax_pending_body_bytes = 1000\n',
            "proxy: max_pending_body_bytes must be 0 (no cap) or at least max_body_bytes",
        ),
        ("[serve]\nrequest_head_timeout = 0\n", "request_head_timeout must be a finite"),
        ("[serve]\nmax_connections = -1\n", "serve.max_connections must be >= 0"),
        ("[serve]\nnew_connections_per_client = -1\n", "new_connections_per_client must be >= 0"),
        ("[serve]\nnew_connection_burst = 0\n", "serve.new_connection_burst must be >= 1"),
        (
            "[serve]\nmax_requests_per_connection = -1\n",
            "serve.max_requests_per_connection must be >= 0",
        ),
        ("serve = 3\n", "[serve] must be a table"),
        ("[serve\n", "--config"),
    ],
)
def test_a_config_file_mistake_is_one_line_and_exit_2(
    tmp_path: Path, toml: str, message: str, serve_refused: Callable[..., str]
) -> None:
    config = tmp_path / "edge.toml"
    config.write_text(toml)
    demo = [] if "[proxy]" in toml else ["--demo"]
    line = serve_refused(*demo, "--config", str(config))
    assert message in line and line.startswith("quicedge serve: ")


@pytest.mark.parametrize(
    ("env", "argv", "message"),
    [
        ({"QUICEDGE_WORKERS": "four"}, [], "$QUICEDGE_WORKERS: expected an integer, got 'four'"),
        ({"QUICEDGE_QUIC_RETRY": "maybe"}, [], "$QUICEDGE_QUIC_RETRY: expected true or false"),
        ({"QUICEDGE_EARLY_DATA": "often"}, [], "$QUICEDGE_EARLY_DATA: expected one of accept"),
        ({"QUICEDGE_DRAIN_TIMEOUT": "-1"}, [], "serve.drain_timeout must be >= 0"),
        ({"QUICEDGE_DRAIN_TIMEOUT": "nan"}, [], "$QUICEDGE_DRAIN_TIMEOUT: expected a finite"),
        ({}, ["--send-timeout", "inf"], "--send-timeout: expected a finite number, got 'inf'"),
        ({}, ["--workers", "x"], "--workers: expected an integer, got 'x'"),
        ({}, ["--early-data", "sometimes"], "--early-data: expected one of accept, defer, reject"),
        ({}, ["--loop", "trio"], "--loop: expected one of auto, asyncio, uvloop"),
        ({}, ["--h3", "off"], "--h3: cannot be off"),
        ({}, ["--wrkers", "2"], "unrecognized arguments: --wrkers 2"),
        ({}, ["--workers", "2"], "--workers 2 needs --redis URL"),
        ({"QUICEDGE_REDIS": "localhost:6379"}, [], "serve.redis: expected a redis://"),
        ({}, ["--policy", "fastest"], "proxy.policy: unknown routing policy 'fastest'"),
    ],
)
def test_a_flag_or_environment_mistake_is_one_line_and_exit_2(
    env: dict[str, str], argv: list[str], message: str, serve_refused: Callable[..., str]
) -> None:
    demo = [] if "proxy." in message else ["--demo"]
    if not demo:
        argv = [*argv, "--backend", "http://127.0.0.1:1"]
    line = serve_refused(*demo, *argv, env=env)
    assert message in line


def test_the_real_command_refuses_in_one_line_and_exit_2(tmp_path: Path) -> None:
    """The process itself: one line on stderr, nothing on stdout, status 2, from a file, a
    variable and a flag."""
    config = tmp_path / "edge.toml"
    config.write_text("[serve]\nwrokers = 4\n")
    line = refused(quicedge("serve", "--demo", "--config", str(config)))
    assert line == "quicedge serve: [serve]: unknown setting 'wrokers' (did you mean 'workers'?)"
    env = {"QUICEDGE_WORKERS": "four"}
    assert "expected an integer, got 'four'" in refused(quicedge("serve", "--demo", env=env))
    assert "unrecognized arguments: --wrkers" in refused(quicedge("serve", "--wrkers", "2"))


def test_the_proxy_needs_a_backend_unless_demo(serve_refused: Callable[..., str]) -> None:
    assert "at least one backend" in serve_refused()
    assert "backend URL must be" in serve_refused("--backend", "ftp://x")
    env = {"QUICEDGE_BACKEND": "http://127.0.0.1:1,ftp://y"}
    assert "got 'ftp://y'" in serve_refused(env=env)


def test_development_certificates_are_refused_off_loopback(
    serve_refused: Callable[..., str],
) -> None:
    line = serve_refused("--demo", "--h3", "0.0.0.0:4433")
    assert "0.0.0.0 is not a loopback address" in line
    assert "--cert and --key, or --dev-certs" in line
    # The admin and plain-HTTP listeners present no certificate: no refusal for them.
    line = serve_refused("--demo", "--admin", "0.0.0.0:0", "--workers", "0")
    assert "serve.workers must be >= 1" in line


def test_dev_certs_flag_allows_them_anywhere() -> None:
    from transport.config import TransportConfig

    with pytest.raises(ValueError, match="not a loopback address"):
        TransportConfig(tcp=("10.1.2.3", 8443)).validate()
    TransportConfig(tcp=("10.1.2.3", 8443), dev_certs=True).validate()
    TransportConfig(h3=("::1", 4433), tcp=("localhost", 8443)).validate()


def test_version() -> None:
    done = quicedge("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"quicedge {version('quicedge')}"


def test_a_proxy_that_cannot_be_imported_is_an_error_not_the_demo_app() -> None:
    script = (
        "import sys\n"
        "sys.modules['backends.pool'] = None\n"  # makes `import backends.pool` fail
        "from edge.cli import main\n"
        "sys.exit(main(['serve', '--backend', 'http://127.0.0.1:1']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "import of backends.pool halted" in done.stderr and "ready" not in done.stdout


# -- the loader on a section of every supported shape -------------------------------------------


@dataclass
class Tenant:
    name: str = ""
    """Tenant name, as logged."""
    tier: Literal["gold", "silver", "bronze"] = "bronze"
    api_key_sha256: list[str] = field(default_factory=list)
    requests_per_second: float = 1.0
    burst: int = 1
    max_concurrent: int | None = None

    def validate(self) -> None:
        if not self.name:
            raise ValueError("tenants.name: required")
        if self.burst < 1:
            raise ValueError(f"tenants.burst: must be >= 1, got {self.burst}")


@dataclass
class Window:
    seconds: float
    """Window length, s (no default: required)."""
    slack: float = 0.0
    """Window length, s."""


@dataclass
class Feature:
    enabled: bool = False
    """Turn the feature on."""
    rate: float = 0.5
    """Share of requests sampled, 0..1."""
    label: str | None = None
    """Label on the metrics; none: no label."""
    hosts: list[str] = field(default_factory=list)
    """Hosts it applies to."""
    mode: Literal["fast", "safe"] = "safe"
    """How it runs."""
    window: Window = field(default_factory=lambda: Window(1.0))
    paths: dict[str, int] = field(default_factory=dict)

    def validate(self) -> None:
        if not 0 <= self.rate <= 1:
            raise ValueError(f"feature.rate: must be in 0..1, got {self.rate}")


SECTIONS = [Section("feature", Feature), Section("tenants", list[Tenant])]


def load(toml: dict, environ: dict[str, str] | None = None, argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    settings.add_flags(parser, SECTIONS)
    flags = vars(parser.parse_args(argv or []))
    return settings.load(SECTIONS, toml=toml, environ=environ or {}, flags=flags).validate()


def test_every_shape_reads_from_toml() -> None:
    loaded = load(
        {
            "feature": {
                "enabled": True,
                "rate": 1,  # an int where a float is expected
                "label": "x",
                "hosts": ["a", "b"],
                "mode": "fast",
                "window": {"seconds": 3},
                "paths": {"/a": 1},
            },
            "tenants": [
                {"name": "acme", "tier": "gold", "api_key_sha256": ["ab" * 32], "burst": 5},
                {"name": "tiny", "requests_per_second": 0.5, "max_concurrent": 2},
            ],
        }
    )
    assert loaded["feature"] == Feature(True, 1.0, "x", ["a", "b"], "fast", Window(3.0), {"/a": 1})
    assert isinstance(loaded["feature"].rate, float)
    acme, tiny = loaded["tenants"]
    assert (acme.tier, acme.burst, acme.max_concurrent) == ("gold", 5, None)
    assert (tiny.tier, tiny.requests_per_second, tiny.max_concurrent) == ("bronze", 0.5, 2)
    assert load({})["tenants"] == [] and load({})["feature"] == Feature()


def test_flags_beat_environment_beat_toml() -> None:
    toml = {"feature": {"rate": 0.1, "hosts": ["t"], "label": "toml"}}
    env = {"QUICEDGE_RATE": "0.2", "QUICEDGE_HOSTS": "e1, e2", "QUICEDGE_LABEL": "none"}
    f = load(toml, env)["feature"]
    assert (f.rate, f.hosts, f.label) == (0.2, ["e1", "e2"], None)
    f = load(toml, env, ["--rate", "0.3", "--hosts", "f", "--enabled", "--mode", "fast"])["feature"]
    assert (f.rate, f.hosts, f.enabled, f.mode) == (0.3, ["f"], True, "fast")
    assert load(toml, {"QUICEDGE_ENABLED": "yes"})["feature"].enabled is True
    with pytest.raises(SettingsError, match="QUICEDGE_RATE: expected a finite number, got 'nan'"):
        load(toml, {"QUICEDGE_RATE": "nan"})


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ({"feature": {"rate": "high"}}, "feature.rate: expected a number, got 'high'"),
        ({"feature": {"rate": True}}, "feature.rate: expected a number, got True"),
        ({"feature": {"rate": 2}}, "feature.rate: must be in 0..1"),
        ({"feature": {"rate": math.nan}}, "feature.rate: expected a finite number, got nan"),
        ({"feature": {"rate": -math.inf}}, "feature.rate: expected a finite number, got -inf"),
        ({"feature": {"enabled": 1}}, "feature.enabled: expected true or false"),
        ({"feature": {"hosts": "a"}}, "feature.hosts: expected a list of strings"),
        ({"feature": {"hosts": ["a", 1]}}, "feature.hosts[1]: expected a string, got 1"),
        ({"feature": {"mode": "slow"}}, "feature.mode: expected one of fast, safe"),
        ({"feature": {"window": {"secs": 1}}}, "feature.window: unknown setting 'secs' (did"),
        ({"feature": {"window": {"slack": 1}}}, "feature.window.seconds: required (a number)"),
        ({"feature": {"enabeld": True}}, "did you mean 'enabled'?"),
        ({"tenants": {"name": "x"}}, "[[tenants]]: expected a list of tables"),
        ({"tenants": [{"name": "x", "tier": "platinum"}]}, "[[tenants]][0].tier: expected one"),
        ({"tenants": [{"name": "x"}, {"nme": "y"}]}, "[[tenants]][1]: unknown setting 'nme'"),
        ({"tenants": [{"name": "x", "burst": 0}]}, "tenants.burst: must be >= 1, got 0"),
        ({"tenants": [{"tier": "gold"}]}, "tenants.name: required"),
    ],
)
def test_each_mistake_names_its_setting(toml: dict, message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load(toml)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_help_comes_from_the_field_docstrings() -> None:
    parser = argparse.ArgumentParser()
    settings.add_flags(parser, SECTIONS)
    text = " ".join(parser.format_help().split())
    assert "--rate X Share of requests sampled, 0..1 (default: 0.5; $QUICEDGE_RATE)" in text
    assert "--mode {fast,safe} How it runs (default: safe; $QUICEDGE_MODE)" in text
    assert "--enabled, --no-enabled" in text
    assert "--window" not in text and "--paths" not in text  # TOML only


def test_an_app_that_cannot_start_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """Settings that pass but apps that cannot start (an audit log another process writes:
    `--check` reads the log but takes no lock) ended in a traceback."""
    log = tmp_path / "audit.jsonl"
    config = tmp_path / "quicedge.toml"
    config.write_text(f'[audit]\npath = "{log}"\n')
    with open(f"{log}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as the writer of a running edge holds it
        done = quicedge(
            "serve", "--config", str(config), "--backend", "http://127.0.0.1:1",
            "--h3", "127.0.0.1:0", "--tcp", "off", "--admin", "off",
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        f"quicedge serve: audit.path: another process writes {log}"
    ), done.stderr


def test_a_misspelt_variable_is_named_with_the_setting_it_is_close_to() -> None:
    """A misspelt TOML key is refused with the nearest name; a misspelt `QUICEDGE_*` variable
    was ignored without a word (four workers asked for, one started). It is named, with the
    variable meant, and the start goes on: the prefix is not the settings' alone."""
    env = {"QUICEDGE_WOKRERS": "4", "QUICEDGE_CERTS_DIR": str(default_dir())}
    done = quicedge("serve", "--check", "--backend", "http://10.0.0.5:1", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "quicedge serve: $QUICEDGE_WOKRERS is not a setting (did you mean $QUICEDGE_WORKERS?);"
        " ignored"
    ]
