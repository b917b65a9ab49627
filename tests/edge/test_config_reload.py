"""Reloading the config file while serving (edge/reload.py): a real `quicedge serve`, its
config file rewritten, then SIGHUP or the file poll; requests over real sockets before and after."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.sim import SimConfig, SimServer
from edge.audit import GENESIS, verify
from edge.reload import Reloader, differences
from edge.serve import build_parser, load_settings
from tests.deploy.processes import sim_process
from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
)
from tests.edge.state.helpers import ChatUpstream
from tests.edge.test_many_streams import stand_in  # noqa: F401  (the fixture)
from tests.helpers import free_port, wait_until
from tests.transport.conftest import ServeProcess

APPLIED = 'quicedge_config_reloads_total{outcome="applied"}'
REFUSED = 'quicedge_config_reloads_total{outcome="refused"}'
PENDING = "quicedge_config_restart_pending"
OK = "quicedge_config_last_reload_successful"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def tenants_toml(*names: str, rule: str | None = None, extra: str = "") -> str:
    """Anonymous requests refused, one tenant per name with the key `key-NAME`, and maybe a
    deny rule on the word `rule`."""
    text = f"{extra}\n[admission.anonymous]\nenabled = false\n"
    for name in names:
        text += f'[[tenants]]\nname = "{name}"\napi_key_sha256 = ["{digest("key-" + name)}"]\n'
    if rule is not None:
        text += f'[[policy.rules]]\nid = "no-{rule}"\npatterns = ["{rule}"]\n'
    return text


USAGE = {"include_usage": True}
LONG = {"stream": True, "max_tokens": 300, "ignore_eos": True, "stream_options": USAGE}
"""A streamed answer of 300 tokens exactly (the stand-in ends at a random length otherwise)."""


def completion_tokens(events: list[str]) -> int:
    """The usage chunk's count of a streamed answer read whole (its events, `[DONE]` last)."""
    assert events[-1] == "data: [DONE]"
    return int(json.loads(events[-2][len("data: ") :])["usage"]["completion_tokens"])


def body(text: str, **more: Any) -> dict[str, Any]:
    return {"model": "default", "max_tokens": 2,
            "messages": [{"role": "user", "content": text}], **more}  # fmt: skip


async def status(http: httpx.AsyncClient, key: str, text: str = "hello") -> int:
    response = await http.post(
        "/v1/chat/completions", json=body(text), headers={"authorization": f"Bearer {key}"}
    )
    return response.status_code


def serve(config: Path, *more: str) -> tuple[ServeProcess, str]:
    """`quicedge serve --config CONFIG MORE...` with a plain-HTTP listener; it and its URL."""
    port = free_port()
    proc = ServeProcess("--config", str(config), "--http", f"127.0.0.1:{port}", *more)
    return proc, f"http://127.0.0.1:{port}"


def audit_events(directory: Path, pattern: str) -> list[list[tuple[Any, ...]]]:
    """Per audit chain in `directory` (each verified from its first line): its records of
    things done to the edge, as (event, what, ...): an admin action and its target, a refused
    one's method and path, a reload's outcome and what it changed."""
    chains = []
    for chain in sorted(directory.glob(pattern)):
        checked = verify([str(chain)], start=GENESIS)
        assert checked.ok, checked.error
        lines = [json.loads(line) for line in chain.read_text().splitlines()]
        chains.append([_event(e) for e in lines if "event" in e])
    return chains


def _event(e: dict[str, Any]) -> tuple[Any, ...]:
    if e["event"] == "certificate_reload":
        return ("certificate_reload", e["outcome"])
    if e["event"] == "admin":
        return ("admin", e["action"], e["target"])
    if e["event"] == "admin_refused":
        return ("admin_refused", e["method"], e["path"])
    return ("config_reload", e["outcome"], tuple(e.get("changed") or ()))


def total(proc: ServeProcess, sample: str) -> float:
    """`sample` summed over the workers (several add a `worker` label to each sample)."""
    name, _, labels = sample.partition("{")
    want = [part for part in labels.rstrip("}").split(",") if part]
    found = 0.0
    for line in proc.metrics().splitlines():
        head, _, value = line.rpartition(" ")
        got_name, _, got_labels = head.partition("{")
        if got_name == name and all(w in got_labels.rstrip("}").split(",") for w in want):
            found += float(value)
    return found


async def wait_metric(proc: ServeProcess, sample: str, at_least: float) -> None:
    deadline = asyncio.get_running_loop().time() + 30
    while await asyncio.to_thread(total, proc, sample) < at_least:
        assert asyncio.get_running_loop().time() < deadline, f"{sample} stayed under {at_least}"
        await asyncio.sleep(0.1)


async def rewritten(
    proc: ServeProcess, config: Path, text: str, sample: str, at_least: float
) -> None:
    """Write `text` over the config file, send SIGHUP (the parent passes it to its workers),
    and wait until `sample` reaches `at_least`."""
    await asyncio.to_thread(config.write_text, text)
    proc.proc.send_signal(signal.SIGHUP)
    await wait_metric(proc, sample, at_least)


# -- what a reload compares ----------------------------------------------------------------------


def settings_of(tmp_path: Path, text: str, backend: str | None = "http://127.0.0.1:9") -> Any:
    path = tmp_path / "quicedge.toml"
    path.write_text(text)
    flags = ["--backend", backend] if backend is not None else []
    return load_settings(build_parser().parse_args(["--config", str(path), *flags]), {})


def test_tenants_throttle_breakers_and_policy_are_live_every_other_section_waits(
    tmp_path: Path,
) -> None:
    base = settings_of(tmp_path, tenants_toml("a"))
    assert differences(base, settings_of(tmp_path, tenants_toml("a"))) == ([], [])
    assert differences(base, settings_of(tmp_path, tenants_toml("a", "b"))) == (["tenants"], [])
    anonymous_on = tenants_toml("a").replace("enabled = false", "enabled = true")
    assert differences(base, settings_of(tmp_path, anonymous_on)) == (["admission.anonymous"], [])
    assert differences(base, settings_of(tmp_path, tenants_toml("a", rule="x"))) == (["policy"], [])
    pool = tenants_toml("a", extra="[proxy]\npool_max_connections = 8")
    assert differences(base, settings_of(tmp_path, pool)) == ([], ["proxy"])
    retries = tenants_toml("a", extra="[proxy]\nmax_retries = 0\nchunk_timeout = 5.0")
    assert differences(base, settings_of(tmp_path, retries)) == (["proxy.attempts"], [])
    throttle = tenants_toml("a", extra="[admission.throttle]\nmax_queue_depth = 4")
    assert differences(base, settings_of(tmp_path, throttle)) == (["admission.throttle"], [])
    redis = tenants_toml("a", extra="[admission.redis]\ntimeout_ms = 9.0")
    assert differences(base, settings_of(tmp_path, redis)) == ([], ["admission"])
    breakers = tenants_toml("a", extra="[breakers]\nerror_rate = 0.9")
    assert differences(base, settings_of(tmp_path, breakers)) == (["breakers"], [])
    cors_on = tenants_toml("a", extra='[cors]\norigins = ["https://a.example"]')
    assert differences(base, settings_of(tmp_path, cors_on)) == ([], ["cors"])  # off to on
    more = cors_on.replace('"https://a.example"', '"https://a.example", "https://b.example"')
    on = settings_of(tmp_path, cors_on)
    assert differences(on, settings_of(tmp_path, more)) == (["cors"], [])
    quiet = tenants_toml("a", extra="[access_log]\nenabled = false")
    assert differences(base, settings_of(tmp_path, quiet)) == (["access_log"], [])
    both = tenants_toml("b", extra="[state.cache]\nttl = 60.0")
    assert differences(base, settings_of(tmp_path, both)) == (["tenants"], ["state"])


def test_the_backend_list_is_live_a_kept_backends_labels_are_not(tmp_path: Path) -> None:
    one = '[proxy]\nbackends = ["http://10.0.0.1:30000#model=m@v1"]'
    two = '[proxy]\nbackends = ["http://10.0.0.1:30000/#model=m@v1", "http://10.0.0.2:30000"]'
    relabelled = '[proxy]\nbackends = ["http://10.0.0.1:30000#model=m@v2"]'
    base = settings_of(tmp_path, tenants_toml("a", extra=one), backend=None)
    grown = settings_of(tmp_path, tenants_toml("a", extra=two), backend=None)
    assert differences(base, grown) == (["proxy.backends"], [])
    moved = settings_of(tmp_path, tenants_toml("a", extra=relabelled), backend=None)
    assert differences(base, moved) == ([], ["proxy"])


def test_models_pools_aliases_and_rollouts_are_live_backend_labels_and_sharing_wait(
    tmp_path: Path,
) -> None:
    rollout = '[[models.rollouts]]\nmodel = "m"\nstable = "v1"\ncanary = "v2"\n'
    label = '[[models.backends]]\nurl = "http://10.0.0.1:30000"\nmodel = "m"\nversion = "v1"\n'
    base = settings_of(tmp_path, tenants_toml("a", extra=label + rollout))

    def changed(text: str) -> tuple[list[str], list[str]]:
        return differences(base, settings_of(tmp_path, tenants_toml("a", extra=text)))

    assert changed(label + rollout) == ([], [])
    assert changed(label + rollout.replace('"v2"', '"v3"')) == (["models"], [])
    assert changed(label) == (["models"], [])
    alias = '[[models.aliases]]\nname = "llama"\nmodel = "m"\n'
    assert changed(label + rollout + alias) == (["models"], [])
    assert changed('[models]\ndefault = "m"\n' + label + rollout) == (["models"], [])
    assert changed(label.replace('"v1"', '"v0"') + rollout) == ([], ["models"])
    shared = "[models]\nshare_stops = true\n" + label + rollout
    assert changed(shared) == ([], ["models"])


async def test_a_flood_of_reload_calls_costs_two_reloads_not_one_each(tmp_path: Path) -> None:
    """The first call's reload runs (its file read held here); the other nine share the one
    queued behind it, which reads the file once more."""
    running = settings_of(tmp_path, tenants_toml("a"))
    gate, reads = threading.Event(), []

    def load() -> Any:
        reads.append(1)
        assert gate.wait(10)
        return settings_of(tmp_path, tenants_toml("a"))

    async with TinyUpstream(ChatUpstream()) as up, run_edge(fast_config([up.url])) as edge:
        reloader = Reloader(load, running, edge.wiring)
        calls = [asyncio.ensure_future(reloader.reload_reported())]
        await wait_until(lambda: len(reads) == 1)  # it runs, reading the file
        calls += [asyncio.ensure_future(reloader.reload_reported()) for _ in range(9)]
        await asyncio.sleep(0.05)
        gate.set()
        reports = await asyncio.gather(*calls)
        await reloader.aclose()
    assert len(reads) == 2
    assert {r["outcome"] for r in reports} == {"unchanged"}


def file_loader(path: Path, backend: str) -> Any:
    """What `quicedge serve --config PATH --backend BACKEND` reads on each reload."""
    return lambda: load_settings(
        build_parser().parse_args(["--config", str(path), "--backend", backend]), {}
    )


async def test_a_number_that_is_not_finite_is_refused_and_the_running_settings_serve_on(
    tmp_path: Path,
) -> None:
    """TOML's `nan` passed `<= 0`: the reload was applied, then every request got 500."""
    path = tmp_path / "quicedge.toml"
    path.write_text("[proxy]\nchunk_timeout = 60\n")
    async with (
        TinyUpstream(ChatUpstream()) as up,
        run_edge(fast_config([up.url])) as edge,
        client(edge) as http,
    ):
        load = file_loader(path, up.url)
        reloader = Reloader(load, load(), edge.wiring)
        module = '[[policy.wasm]]\nid = "m"\npath = "m.wasm"\npoll_interval = nan\n'
        for text, error in [
            ("[proxy]\nchunk_timeout = nan\n", "proxy.chunk_timeout: expected a finite number"),
            ("[proxy]\nconnect_timeout = nan\n", "proxy.connect_timeout: expected a finite"),
            ("[proxy]\nfirst_byte_timeout = inf\n", "proxy.first_byte_timeout: expected a finite"),
            (module, "policy.wasm[0].poll_interval: expected a finite number, got nan"),
        ]:  # fmt: skip
            path.write_text(text)
            report = await reloader.reload_reported()
            assert report["outcome"] == "refused" and report["changed"] == []
            assert report["error"].startswith(error)
            for _ in range(2):
                assert (await http.post("/v1/chat/completions", json=body("hi"))).status_code == 200
        assert edge.wiring.proxy is not None
        assert edge.wiring.proxy.attempts.config.chunk_timeout == 10.0  # fast_config's, kept
        await reloader.aclose()


async def test_a_refused_reload_names_the_module_or_the_file_in_one_line(tmp_path: Path) -> None:
    """The raw errors were `[Errno 2] ...`, wasmtime's lines, a bare codec error: no setting."""
    path = tmp_path / "quicedge.toml"
    path.write_text("")
    missing, broken = tmp_path / "missing.wasm", tmp_path / "broken.wasm"
    broken.write_bytes(b"\0asm\x01\0\0\0\x01\xff")  # a section cut short
    async with (
        TinyUpstream(ChatUpstream()) as up,
        run_edge(fast_config([up.url])) as edge,
        client(edge) as http,
    ):
        load = file_loader(path, up.url)
        reloader = Reloader(load, load(), edge.wiring)
        errors = []
        for module in (missing, broken):
            path.write_text(f'[[policy.wasm]]\nid = "m"\npath = "{module}"\n')
            errors.append((await reloader.reload_reported())["error"])
        path.write_bytes(b"\xff[proxy]\n")
        errors.append((await reloader.reload_reported())["error"])
        assert errors[0] == f"policy.wasm 'm' ({missing}): No such file or directory"
        assert errors[1].startswith(f"policy.wasm 'm' ({broken}): ")
        assert errors[2] == f"--config {path}: not UTF-8 text (byte 0xff at offset 0)"
        assert all("\n" not in error for error in errors), errors
        refused = edge.registry.get_sample_value(
            "quicedge_config_reloads_total", {"outcome": "refused"}
        )
        assert refused == 3
        assert (await http.post("/v1/chat/completions", json=body("hi"))).status_code == 200
        await reloader.aclose()


# -- a running edge -------------------------------------------------------------------------------


async def test_sighup_applies_tenants_and_policy_and_keeps_them_on_a_broken_file(
    stand_in: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    config = tmp_path / "quicedge.toml"
    config.write_text(tenants_toml("one"))
    proc, url = serve(config, "--backend", stand_in, "--audit-log", str(tmp_path / "audit.jsonl"))
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            assert await status(http, "key-one") == 200
            assert await status(http, "key-two") == 401
            assert await status(http, "key-one", "forbidden words") == 200

            await rewritten(proc, config, tenants_toml("two", rule="forbidden"), APPLIED, 1)
            assert await status(http, "key-one") == 401  # a key taken out stops at once
            assert await status(http, "key-two") == 200
            assert await status(http, "key-two", "forbidden words") == 403
            assert total(proc, PENDING) == 0

            half_written = "[[tenants]\nname = "  # not TOML
            await rewritten(proc, config, half_written, REFUSED, 1)
            duplicate = tenants_toml("two") + '[[tenants]]\nname = "two"\n'
            await rewritten(proc, config, duplicate, REFUSED, 2)
            assert total(proc, OK) == 0
            assert await status(http, "key-two") == 200  # the running settings stayed
            assert await status(http, "key-two", "forbidden words") == 403
            assert await status(http, "key-one") == 401

            await rewritten(
                proc,
                config,
                tenants_toml("two", extra="[proxy]\npool_max_connections = 8"),
                PENDING,
                1,
            )
            assert total(proc, OK) == 1
            assert total(proc, APPLIED) == 2  # the rule went away: a live change too
            assert await status(http, "key-two", "forbidden words") == 200
    finally:
        assert proc.stop() == 0, proc.errors()
    reloads = [e for e in audit_events(tmp_path, "audit.jsonl")[0] if e[0] == "config_reload"]
    assert reloads == [
        ("config_reload", "applied", ("tenants", "policy")),
        ("config_reload", "refused", ()),
        ("config_reload", "refused", ()),
        ("config_reload", "applied", ("policy",)),
    ]
    errors = proc.errors()
    assert "config reload refused, the running settings stay: --config" in errors
    assert "tenants[1].name: 'two' is taken" in errors
    assert "config reload: [proxy] changed; that takes effect on a restart" in errors


async def test_a_changed_file_is_reloaded_without_a_signal_when_polled(
    stand_in: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    poll = "[proxy]\nconfig_poll_interval = 0.2"
    config = tmp_path / "quicedge.toml"
    config.write_text(tenants_toml("one", extra=poll))
    proc, url = serve(config, "--backend", stand_in)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            assert await status(http, "key-two") == 401
            config.write_text(tenants_toml("one", "two", extra=poll))
            await wait_metric(proc, APPLIED, 1)
            assert await status(http, "key-two") == 200
            assert await status(http, "key-one") == 200
    finally:
        assert proc.stop() == 0, proc.errors()


@pytest.fixture
def slow_stand_in() -> Iterator[str]:
    """A stand-in paced like a GPU: a 300-token answer takes a few seconds."""
    with sim_process("s1", "h100-llama3-8b") as url:
        yield url


async def test_an_answer_in_progress_finishes_after_its_tenant_is_removed(
    slow_stand_in: str, redis_url: str, tmp_path: Path
) -> None:
    """Its stream rule goes too: an answer keeps the gateway it started with."""
    config = tmp_path / "quicedge.toml"
    stream_rule = '\n[[policy.stream_rules]]\nid = "never"\npatterns = ["zzzqqq"]\n'
    slot = f'api_key_sha256 = ["{digest("key-one")}"]\nmax_concurrent = 2\n'
    one = tenants_toml("one").replace(f'api_key_sha256 = ["{digest("key-one")}"]\n', slot)
    assert "max_concurrent = 2" in one  # its slot is freed after the tenant is gone
    config.write_text(one + stream_rule)
    proc, url = serve(config, "--backend", slow_stand_in, "--workers", "2", "--redis", redis_url)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            request = body("tell a long story", **LONG)
            headers = {"authorization": "Bearer key-one"}
            async with http.stream(
                "POST", "/v1/chat/completions", json=request, headers=headers
            ) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                first = await anext(lines)
                assert first.startswith("data: ")
                await rewritten(
                    proc, config, tenants_toml("two"), APPLIED, 2
                )  # both workers' samples
                assert await status(http, "key-one") == 401
                events = [first] + [line async for line in lines if line]
            finish = json.loads(events[-3][len("data: ") :])["choices"][0]["finish_reason"]
            assert finish == "length"
            assert completion_tokens(events) == 300
            for _ in range(6):  # both workers answer new connections with the new tenants
                async with httpx.AsyncClient(base_url=url, timeout=30) as fresh:
                    assert await status(fresh, "key-two") == 200
                    assert await status(fresh, "key-one") == 401
    finally:
        assert proc.stop() == 0, proc.errors()


async def test_a_throttle_turned_on_refuses_past_its_depth_and_turned_off_serves_again(
    slow_stand_in: str, tmp_path: Path
) -> None:
    """One answer in flight on the only backend; a second request is served, refused once a
    reload caps the backend at one request with no room to wait, and served after the next."""
    config = tmp_path / "quicedge.toml"
    config.write_text("")
    proc, url = serve(config, "--backend", slow_stand_in)
    capped = '[admission.throttle]\nmax_queue_depth = 1\ndepth = "in_flight"\nqueue_size = 0\n'
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            request = body("tell a long story", **LONG)
            async with http.stream("POST", "/v1/chat/completions", json=request) as answer:
                lines = answer.aiter_lines()
                events = [await anext(lines)]
                assert (await http.post("/v1/chat/completions", json=body("hi"))).status_code == 200
                await rewritten(proc, config, capped, APPLIED, 1)
                refused = await http.post("/v1/chat/completions", json=body("hi"))
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "overloaded"
                assert "retry-after" in refused.headers
                await rewritten(proc, config, "", APPLIED, 2)
                assert (await http.post("/v1/chat/completions", json=body("hi"))).status_code == 200
                events += [line async for line in lines if line]
            assert completion_tokens(events) == 300  # the answer in flight was never touched
            assert total(proc, PENDING) == 0
    finally:
        assert proc.stop() == 0, proc.errors()


async def test_a_backend_added_serves_and_one_removed_drains_its_answer_first(
    tmp_path: Path,
) -> None:
    with sim_process("s1", "h100-llama3-8b") as first, sim_process("s2", "instant") as second:
        config = tmp_path / "quicedge.toml"
        head = '[proxy]\nexpose_backend_names = true\nbackends = ["{}"]\n'
        config.write_text(head.format(first))
        proc, url = serve(config)  # a --backend flag would pin the list over the file's
        try:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                request = body(
                    "tell a long story", stream=True, max_tokens=300, stream_options=USAGE
                )
                async with http.stream("POST", "/v1/chat/completions", json=request) as answer:
                    assert answer.headers["x-quicedge-backend"] == first.rpartition("/")[2]
                    lines = answer.aiter_lines()
                    events = [await anext(lines)]
                    await rewritten(proc, config, head.format(second), APPLIED, 1)
                    for _ in range(3):  # the new backend takes every new request at once
                        response = await http.post("/v1/chat/completions", json=body("hi"))
                        assert response.status_code == 200
                        assert response.headers["x-quicedge-backend"] == second.rpartition("/")[2]
                    events += [line async for line in lines if line]
                assert events[-1] == "data: [DONE]"  # the removed one finished its answer
                assert completion_tokens(events) == 300
                names = {b["name"] for b in (await http.get(admin(proc))).json()["backends"]}
                deadline = asyncio.get_running_loop().time() + 30
                while first.rpartition("/")[2] in names:  # gone once its answer ended
                    assert asyncio.get_running_loop().time() < deadline, names
                    await asyncio.sleep(0.1)
                    names = {b["name"] for b in (await http.get(admin(proc))).json()["backends"]}
                assert names == {second.rpartition("/")[2]}
        finally:
            assert proc.stop() == 0, proc.errors()


def admin(proc: ServeProcess) -> str:
    return f"http://127.0.0.1:{proc.admin_port}/backends"


async def test_a_rollout_restarts_by_the_admin_api_and_by_a_reload_and_a_reload_removes_it(
    redis_url: str, tmp_path: Path
) -> None:
    """Two workers, so the admin action and the signal must reach both."""
    version = ("--served-model-name", "m", "--model-version")
    with (
        sim_process("s1", "instant", *version, "v1") as v1,
        sim_process("s2", "instant", *version, "v2") as v2,
    ):
        stable, canary = v1.rpartition("/")[2], v2.rpartition("/")[2]
        head = f'[proxy]\nexpose_backend_names = true\nbackends = ["{v1}", "{v2}"]\n'
        labels = "".join(
            f'[[models.backends]]\nurl = "{url}"\nmodel = "m"\nversion = "{name}"\n'
            for url, name in ((v1, "v1"), (v2, "v2"))
        )
        rollout = '[[models.rollouts]]\nmodel = "m"\nstable = "v1"\ncanary = "v2"\nauto = false\n'
        alias = '[[models.aliases]]\nname = "llama"\nmodel = "m"\n'
        config = tmp_path / "quicedge.toml"
        config.write_text(head + labels + rollout + "steps = [1.0, 100.0]\n")
        proc, url = serve(config, "--workers", "2", "--redis", redis_url)
        admin_url = f"http://127.0.0.1:{proc.admin_port}"
        try:
            async with (
                httpx.AsyncClient(base_url=url, timeout=30) as http,
                httpx.AsyncClient(base_url=admin_url, timeout=30) as operator,
            ):

                async def served(model: str = "m", canary_header: str | None = None) -> set[str]:
                    headers = {"x-canary": canary_header} if canary_header is not None else {}
                    names = set()
                    for _ in range(6):  # new connections: both workers answer
                        async with httpx.AsyncClient(base_url=url, timeout=30) as fresh:
                            request = body("hi", model=model)
                            r = await fresh.post("/v1/chat/completions", json=request,
                                                 headers=headers)  # fmt: skip
                        assert r.status_code == 200, r.text
                        names.add(r.headers["x-quicedge-backend"])
                    return names

                assert await served(canary_header="1") == {canary}
                assert await served(canary_header="0") == {stable}
                back = await operator.post("/rollouts/m/rollback")
                assert back.headers["x-quicedge-workers"] == "2/2"
                assert await served(canary_header="1") == {stable}  # rolled back: stable only
                again = await operator.post("/rollouts/m/restart")
                assert again.status_code == 200 and again.headers["x-quicedge-workers"] == "2/2"
                state = again.json()
                assert (state["state"], state["percent"], state["step"]) == ("ramping", 1.0, 0)
                assert [h["action"] for h in state["history"]] == ["rollback", "restart"]
                assert await served(canary_header="1") == {canary}
                missing = await http.post("/v1/chat/completions", json=body("hi", model="llama"))
                assert missing.status_code == 404

                # A changed entry restarts at its (new) first step; the alias is served at once.
                await rewritten(
                    proc, config, head + labels + rollout + "steps = [100.0]\n" + alias, APPLIED, 2
                )  # both workers
                assert await served() == {canary}  # 100 %: every request without a header
                assert await served("llama") == {canary}
                listed = (await operator.get("/rollouts")).json()
                assert listed["aliases"] == {"llama": "m"}
                [restarted] = listed["rollouts"]
                assert restarted["history"][-1]["reason"] == "config reload: its entry changed"
                assert total(proc, 'quicedge_rollout_canary_percent{model="m"}') == 200
                assert total(proc, PENDING) == 0

                # Removed: no rollout to act on. A backend's label waits for a restart.
                relabelled = labels.replace(
                    'version = "v1"\n', 'version = "v1"\nhardware_group = "h200"\n'
                )
                await rewritten(proc, config, head + relabelled + alias, APPLIED, 4)
                assert (await operator.post("/rollouts/m/pause")).status_code == 404
                assert (await operator.get("/rollouts")).json()["rollouts"] == []
                assert total(proc, 'quicedge_rollout_canary_percent{model="m"}') == 0
                assert total(proc, PENDING) == 2
                assert (await served("llama", canary_header="1")) <= {stable, canary}
        finally:
            assert proc.stop() == 0, proc.errors()
    errors = proc.errors()
    assert "rollout m: restart at 100 % (config reload: its entry changed)" in errors
    assert "config reload: [models]: rollout m removed" in errors
    assert "config reload: [models] changed; that takes effect on a restart" in errors


async def test_a_breaker_opened_by_a_failing_backend_is_closed_by_a_reload_that_turns_them_off(
    tmp_path: Path,
) -> None:
    def failing(recorded: Recorded) -> Reply:
        return health_ok(recorded) or Reply(status=500, chunks=[b'{"error":"boom"}'], chunked=False)

    async with TinyUpstream(failing) as up:
        config = tmp_path / "quicedge.toml"
        head = "[proxy]\neject_after_failures = 1000\n"
        config.write_text(head + "[breakers]\nwindow = 4\nmin_requests = 2\nopen_for = 60.0\n")
        proc, url = serve(config, "--backend", up.url)
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                statuses = [
                    (await http.post("/v1/chat/completions", json=body("hi"))).status_code
                    for _ in range(3)
                ]
                assert statuses == [500, 500, 503]  # two failures open the domain's breaker
                opened = await http.post("/v1/chat/completions", json=body("hi"))
                assert opened.json()["error"]["code"] == "circuit_open"
                assert 59_000 < int(opened.headers["retry-after-ms"]) <= 60_000  # open_for
                await rewritten(proc, config, head + "[breakers]\nenabled = false\n", APPLIED, 1)
                again = await http.post("/v1/chat/completions", json=body("hi"))
                assert again.status_code == 500  # the backend is asked again
                assert total(proc, PENDING) == 0
        finally:
            assert proc.stop() == 0, proc.errors()


async def test_a_reload_lets_a_new_origin_in_while_cors_stays_on(
    stand_in: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    config = tmp_path / "quicedge.toml"
    cors = '[cors]\norigins = ["https://a.example"]\n'
    config.write_text(cors)
    proc, url = serve(config, "--backend", stand_in)
    preflight = {"access-control-request-method": "POST", "origin": "https://b.example"}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            refused = await http.options("/v1/chat/completions", headers=preflight)
            assert refused.status_code == 403
            both = cors.replace('"https://a.example"', '"https://a.example", "https://b.example"')
            await rewritten(proc, config, both, APPLIED, 1)
            allowed = await http.options("/v1/chat/completions", headers=preflight)
            assert allowed.status_code == 204
            assert allowed.headers["access-control-allow-origin"] == "https://b.example"
            answer = await http.post("/v1/chat/completions", json=body("hi"),
                                     headers={"origin": "https://b.example"})  # fmt: skip
            assert answer.headers["access-control-allow-origin"] == "https://b.example"
            await rewritten(proc, config, "", PENDING, 1)  # off: waits for a restart, says so
            still = await http.options("/v1/chat/completions", headers=preflight)
            assert still.status_code == 204
    finally:
        assert proc.stop() == 0, proc.errors()
    assert "config reload: [cors] changed; that takes effect on a restart" in proc.errors()


async def test_a_reload_turns_the_access_log_on_and_off(
    stand_in: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    config = tmp_path / "quicedge.toml"
    config.write_text("[access_log]\nenabled = false\n")
    proc, url = serve(config, "--backend", stand_in)
    marks = [f"reload-log-{i:032d}"[-32:] for i in range(3)]
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:

            async def ask(mark: str) -> None:
                r = await http.post("/v1/chat/completions", json=body("hi"),
                                    headers={"x-request-id": mark})  # fmt: skip
                assert r.status_code == 200 and r.headers["x-request-id"] == mark

            await ask(marks[0])
            await rewritten(proc, config, "[access_log]\nenabled = true\n", APPLIED, 1)
            await ask(marks[1])
            await wait_metric(proc, "quicedge_access_log_pending", 0)  # the families are back
            await rewritten(proc, config, "[access_log]\nenabled = false\n", APPLIED, 2)
            await ask(marks[2])
            assert "quicedge_access_log_pending" not in proc.metrics()
    finally:
        assert proc.stop() == 0, proc.errors()
    written = [json.loads(line) for line in proc.errors().splitlines() if line.startswith("{")]
    assert [line["request_id"] for line in written] == [marks[1]]


async def test_a_reload_gives_each_request_more_attempts(tmp_path: Path) -> None:
    """One backend of two says 503: without retries half the requests get it; a reload that
    allows two retries sends them to the other backend."""
    busy = Reply(status=503, chunks=[b'{"error":"busy"}'], chunked=False)

    def says_503(recorded: Recorded) -> Reply:
        return health_ok(recorded) or busy

    async with TinyUpstream(says_503) as bad, TinyUpstream(ChatUpstream()) as good:
        config = tmp_path / "quicedge.toml"
        head = '[proxy]\neject_after_failures = 1000\npolicy = "round_robin"\n'
        config.write_text(head + "max_retries = 0\n")
        proc, url = serve(config, "--backend", bad.url, "--backend", good.url)
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:

                async def statuses() -> list[int]:
                    return [
                        (await http.post("/v1/chat/completions", json=body("hi"))).status_code
                        for _ in range(4)
                    ]

                assert sorted(await statuses()) == [200, 200, 503, 503]
                await rewritten(proc, config, head + "max_retries = 2\n", APPLIED, 1)
                assert await statuses() == [200] * 4
                assert total(proc, PENDING) == 0
        finally:
            assert proc.stop() == 0, proc.errors()


async def test_the_admin_api_reloads_every_worker_and_says_what_the_reload_did(
    stand_in: str,  # noqa: F811
    redis_url: str,
    tmp_path: Path,
) -> None:
    config = tmp_path / "quicedge.toml"
    config.write_text(tenants_toml("one"))
    proc, url = serve(config, "--backend", stand_in, "--workers", "2", "--redis", redis_url)
    try:
        async with (
            httpx.AsyncClient(base_url=url, timeout=30) as http,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{proc.admin_port}", timeout=30) as op,
        ):
            assert await status(http, "key-two") == 401
            config.write_text(tenants_toml("one", "two", extra="[proxy]\npool_max_connections = 8"))
            applied = await op.post("/config/reload")
            assert applied.status_code == 200 and applied.headers["x-quicedge-workers"] == "2/2"
            assert applied.json() == {"outcome": "applied", "changed": ["tenants"],
                                      "restart_pending": ["proxy"], "error": None}  # fmt: skip
            assert total(proc, APPLIED) == 2  # both workers, before the answer
            for _ in range(4):  # new connections: either worker has the new tenant
                async with httpx.AsyncClient(base_url=url, timeout=30) as fresh:
                    assert await status(fresh, "key-two") == 200
            again = await op.post("/config/reload")
            assert again.json()["outcome"] == "unchanged"
            config.write_text("[[tenants]\nname = ")  # not TOML
            refused = await op.post("/config/reload")
            assert refused.status_code == 400 and refused.json()["outcome"] == "refused"
            assert "--config" in refused.json()["error"]
            assert refused.headers["x-quicedge-workers"] == "0/2"
            assert (await op.get("/config/reload")).status_code == 405
            assert await status(http, "key-two") == 200  # the running settings stayed
    finally:
        assert proc.stop() == 0, proc.errors()


async def test_the_admin_api_and_sighup_apply_a_rotated_backend_key(tmp_path: Path) -> None:
    """The backend's key rotated (SGLang restarted with `--api-key B`, the Secret rewritten):
    `POST /config/reload` reads the key file again and says so, requests pass with the new key;
    a key file emptied meanwhile refuses the reload (the key never in its answer) and the
    running key serves on; SIGHUP reads the next rotation."""
    async with SimServer(SimConfig(name="k", port=0, profile="instant", api_key="key-a")) as sim:
        key = tmp_path / "backend-key"
        key.write_text("key-a\n")
        config = tmp_path / "quicedge.toml"
        config.write_text(f'[proxy]\nbackend_api_key_file = "{key}"\n')
        proc, url = serve(config, "--backend", sim.url)
        try:
            async with (
                httpx.AsyncClient(base_url=url, timeout=30) as http,
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{proc.admin_port}", timeout=30) as op,
            ):
                chat = body("hi")
                assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
                assert sim.api is not None
                sim.api._auth = b"Bearer key-b"  # the backend now wants B
                assert (await http.post("/v1/chat/completions", json=chat)).status_code == 502
                await asyncio.to_thread(key.write_text, "key-b\n")
                applied = await op.post("/config/reload")
                assert applied.json() == {"outcome": "applied",
                                          "changed": ["proxy.backend_api_keys"],
                                          "restart_pending": [], "error": None}  # fmt: skip
                assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
                await asyncio.to_thread(key.write_text, "")
                refused = await op.post("/config/reload")
                assert refused.status_code == 400, refused.text
                assert refused.json()["error"] == f"proxy.backend_api_key_file: {key} is empty"
                assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
                sim.api._auth = b"Bearer key-c"
                await rewritten(proc, key, "key-c", APPLIED, 2)
                assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
                assert total(proc, REFUSED) == 1
        finally:
            assert proc.stop() == 0, proc.errors()
