"""`quicedge serve --check`: the whole start-up's checks and nothing started, through the real
command; and a broken or unusable policy module stops a real start with the same line."""

from __future__ import annotations

import socket
from pathlib import Path

from edge.admission.tenants import key_digest
from tests.edge.test_settings import quicedge, refused
from tests.helpers import free_port

MODULE = Path(__file__).parents[2] / "edge" / "policy" / "examples" / "deny_keyword.wasm"


def test_a_usable_config_is_described_and_nothing_listens(tmp_path: Path) -> None:
    config = tmp_path / "quicedge.toml"
    config.write_text(f"""
[[tenants]]
name = "acme"
api_key_sha256 = ["{key_digest("k")}"]

[[policy.wasm]]
id = "kw"
path = "{MODULE}"
""")
    with socket.socket() as held:  # `serve` could not bind it: --check must not try
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = quicedge(
            "serve", "--check", "--config", str(config), "--backend", "http://10.0.0.5:30000",
            "--tcp", f"127.0.0.1:{port}",
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    app = "proxy, routing ttft, backends http://10.0.0.5:30000; gateway 1 module"
    assert lines[0] == f"quicedge serve: app    {app}"
    assert lines[1] == "quicedge serve: tenants 1, anonymous on"
    assert lines[2].startswith("quicedge serve: tls    ") and " expires 20" in lines[2]
    assert lines[-1] == "quicedge serve: config OK (--check: nothing started)"


def test_a_broken_module_is_named_by_check_and_by_a_real_start(tmp_path: Path) -> None:
    not_wasm = tmp_path / "policy.wasm"
    not_wasm.write_text("not a module")
    config = tmp_path / "quicedge.toml"
    config.write_text(f'[[policy.wasm]]\nid = "kw"\npath = "{not_wasm}"\n')
    for extra in (["--check"], []):
        line = refused(
            quicedge("serve", *extra, "--config", str(config), "--backend", "http://10.0.0.5:1")
        )
        assert line == f"quicedge serve: policy.wasm 'kw' ({not_wasm}): expected `(`", line
    missing = tmp_path / "gone.wasm"
    config.write_text(f'[[policy.wasm]]\nid = "kw"\npath = "{missing}"\n')
    line = refused(quicedge("serve", "--check", "--config", str(config), "--backend", "http://a:1"))
    assert line == (
        f"quicedge serve: policy.wasm 'kw' ({missing}): [Errno 2] No such file or directory:"
        f" '{missing}'"
    )


def test_a_module_that_compiles_but_cannot_serve_is_named_by_check(tmp_path: Path) -> None:
    """Compiling is not enough: the module is instantiated with the ABI's checks, so one that
    imports a host function, lacks `check` or declares a second memory stops here (as it stops
    a real start: the same `check_modules`), and no request ever meets it."""
    head = """(module (memory (export "memory") 1)
      (func (export "alloc") (param i32) (result i32) (i32.const 1024))"""
    answers = '(func (export "check") (param i32 i32) (result i64) (i64.const 0))'
    unusable = [
        (
            head.replace("(module", '(module (import "env" "log" (func (param i32)))')
            + answers
            + ")",
            "the module imports `env.log` (func); the host provides no imports",
        ),
        (head + ")", "the module exports no function `check`"),
        (
            head + f"(memory $more 1) {answers})",
            "failed to parse WebAssembly module: multiple memories (at offset 0x1d)",
        ),
    ]
    config = tmp_path / "quicedge.toml"
    for i, (wat, error) in enumerate(unusable):
        path = tmp_path / f"m{i}.wat"
        path.write_text(wat)
        config.write_text(f'[[policy.wasm]]\nid = "kw"\npath = "{path}"\n')
        done = quicedge("serve", "--check", "--config", str(config), "--backend", "http://a:1")
        assert refused(done) == f"quicedge serve: policy.wasm 'kw' ({path}): {error}"


def test_a_bad_setting_fails_the_check_with_its_name(tmp_path: Path) -> None:
    config = tmp_path / "quicedge.toml"
    config.write_text("[proxy]\nmax_retries = -1\n")
    line = refused(quicedge("serve", "--check", "--config", str(config), "--backend", "http://a:1"))
    assert line == "quicedge serve: proxy: max_retries must be >= 0, got -1"


def test_an_audit_log_a_start_cannot_open_or_continue_fails_the_check(tmp_path: Path) -> None:
    """`--check` said OK to an audit log in a folder that does not exist, or one whose last
    line is not a record; a real start refused both only once it had listened, in a line that
    named no setting (`[Errno 2] ...: '.../audit.log.lock'`). Both now stop `--check` and a
    real start alike, before anything listens, with `audit.path` named."""
    missing = tmp_path / "no-such-folder" / "audit.log"
    broken = tmp_path / "audit.log"
    broken.write_text("not a record\n")
    cases = [
        (missing, f"quicedge serve: audit.path: {missing.parent} is not a folder"),
        (broken, f"quicedge serve: audit.path: {broken}: the last line is not an audit record"),
    ]
    for path, message in cases:
        for extra in (["--check"], ["--h3", "127.0.0.1:0", "--tcp", "127.0.0.1:0"]):
            done = quicedge(
                "serve", *extra, "--audit-log", str(path), "--backend", "http://10.0.0.5:1",
                "--admin", "127.0.0.1:0",
            )  # fmt: skip
            assert refused(done) == message


def test_a_redis_url_with_a_bad_port_fails_the_check_and_a_start_in_one_line() -> None:
    """`--redis redis://host:99999` passed `--check`; a real start died in its worker with a
    traceback (`Port out of range 0-65535`) when it made the ticket store."""
    url = "redis://:s3cret@127.0.0.1:99999/0"
    for extra in (["--check"], ["--h3", "127.0.0.1:0", "--tcp", "127.0.0.1:0"]):
        done = quicedge(
            "serve", *extra, "--redis", url, "--backend", "http://10.0.0.5:1",
            "--admin", "127.0.0.1:0",
        )  # fmt: skip
        line = refused(done)
        assert line == "quicedge serve: serve.redis: Port out of range 0-65535", line
    done = quicedge(
        "serve", "--check", "--fleet-view", "--fleet-view-redis", "redis://127.0.0.1:port/0",
        "--backend", "http://10.0.0.5:1",
    )  # fmt: skip
    line = refused(done)
    assert line == (
        "quicedge serve: fleet_view.redis: Port could not be cast to integer value as 'port'"
    ), line


def test_two_tcp_listeners_on_one_address_fail_the_check_and_a_start_in_one_line() -> None:
    """`--admin` (or `--http`) on the `--tcp` listener's address passed `--check`; a real
    start then stopped on `Address already in use`, which sends one looking for another
    process that holds the port."""
    port = free_port()
    cases = [
        (["--admin", f"127.0.0.1:{port}"], f"--admin 127.0.0.1:{port}"),
        (["--admin", "127.0.0.1:0", "--http", f"0.0.0.0:{port}"], f"--http 0.0.0.0:{port}"),
    ]
    for listeners, named in cases:
        for extra in (["--check"], []):
            done = quicedge(
                "serve", *extra, "--backend", "http://10.0.0.5:1", "--h3", "127.0.0.1:0",
                "--tcp", f"127.0.0.1:{port}", *listeners,
            )  # fmt: skip
            assert refused(done) == (
                f"quicedge serve: {named}: the address of --tcp; each TCP listener needs a"
                " port of its own"
            )
