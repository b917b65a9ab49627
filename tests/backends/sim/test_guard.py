"""Guard mode: the stand-in answers chat completions as a Llama-Guard-style classifier (`safe`,
or `unsafe\\nS<n>` for the first configured pattern the conversation matches), its verdict
generated through the scheduler (prefix cache, timing model), from the CLI as in-process."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from backends.sim import SimConfig, get_profile
from backends.sim.cli import build_parser, config_from
from tests.backends.sim.conftest import MakeSim, stream_post

UNSAFE = ("S2=\\bweapons?\\b", "S9=self[- ]harm", "attack")


def chat(*contents: Any, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": c} for c in contents]
    return {"model": "llama-guard", "messages": messages, "max_tokens": 8, **extra}


async def answer(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize(
    ("contents", "verdict"),
    [
        (["plan a picnic"], "safe"),
        (["how do I build WEAPONS"], "unsafe\nS2"),
        (["thoughts of Self-Harm"], "unsafe\nS9"),
        (["an attack plan"], "unsafe\nS1"),  # no category named: S1
        (["weapon", "attack"], "unsafe\nS2"),  # the first pattern that matches decides
        (["fine", "then an attack"], "unsafe\nS1"),  # any message of the conversation
        ([[{"type": "text", "text": "a "}, {"type": "text", "text": "weapon"}]], "unsafe\nS2"),
        (["weaponry"], "safe"),  # the pattern, not a substring test
    ],
)
async def test_the_verdict_is_the_first_matching_pattern(
    make_sim: MakeSim, client: httpx.AsyncClient, contents: list[Any], verdict: str
) -> None:
    sim = await make_sim(guard=True, guard_unsafe=UNSAFE)
    body = await answer(client, sim.url, chat(*contents))
    (choice,) = body["choices"]
    assert choice["message"]["content"] == verdict
    assert choice["finish_reason"] == "stop"
    tokens = 1 if verdict == "safe" else 4  # safe | unsafe \n S n
    assert body["usage"]["completion_tokens"] == tokens + 1  # and the end-of-turn token


async def test_a_streamed_verdict_and_a_short_max_tokens(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    sim = await make_sim(guard=True, guard_unsafe=UNSAFE)
    response, events = await stream_post(
        client, f"{sim.url}/v1/chat/completions", chat("weapons", stream=True)
    )
    assert response.status_code == 200 and events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == "unsafe\nS2"
    cut = await answer(client, sim.url, chat("weapons", max_tokens=1))
    assert cut["choices"][0]["message"]["content"] == "unsafe"  # the first word still decides
    assert cut["choices"][0]["finish_reason"] == "length"


async def test_the_verdict_goes_through_the_scheduler_and_its_timing(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    profile = get_profile("h100-llama3-8b")
    sim = await make_sim(guard=True, guard_unsafe=UNSAFE, profile=profile.name,
                         enable_cache_report=True)  # fmt: skip
    prompt = "please check this conversation about a weapon " * 200
    start = time.perf_counter()
    first = await answer(client, sim.url, chat(prompt))
    elapsed = time.perf_counter() - start
    again = await answer(client, sim.url, chat(prompt))
    assert first["choices"][0]["message"]["content"] == "unsafe\nS2"
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 1000
    # A lower bound, which load cannot break: the prompt's prefill, then one decode step per
    # token after the first (the verdict's three and the end-of-turn).
    assert elapsed >= profile.predict_ttft(prompt_tokens) + 4 * profile.d0
    # The second ask of the same conversation finds its prefix in the radix cache.
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 16


async def test_other_routes_and_plain_mode_are_unchanged(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    guard = await make_sim(guard=True, guard_unsafe=UNSAFE)
    plain = await make_sim()
    text = {"model": "m", "prompt": "a weapon", "max_tokens": 4, "ignore_eos": True}
    completion = (await client.post(f"{guard.url}/v1/completions", json=text)).json()
    assert completion["choices"][0]["text"] not in ("safe", "unsafe\nS2")
    model = await answer(client, plain.url, chat("weapons"))
    assert not model["choices"][0]["message"]["content"].startswith(("safe", "unsafe"))


def test_bad_guard_settings_are_named() -> None:
    with pytest.raises(ValueError, match="not a regular expression"):
        SimConfig(guard=True, guard_unsafe=("S2=(unclosed",))
    with pytest.raises(ValueError, match="needs guard mode"):
        SimConfig(guard_unsafe=("x",))
    result = subprocess.run(
        [sys.executable, "-m", "backends.sim", "--guard", "--guard-unsafe", "(", "--port", "0"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2 and "guard_unsafe" in result.stderr


def test_the_cli_flags_make_a_guard() -> None:
    args = build_parser().parse_args(["--guard", "--guard-unsafe", "S3=a", "--guard-unsafe", "b"])
    config = config_from(args)
    assert config.guard and config.guard_unsafe == ("S3=a", "b")


def test_a_guard_process_answers_verdicts() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "backends.sim", "--host", "127.0.0.1", "--port", "0", "--guard",
         "--guard-unsafe", "S2=attack"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("ready http://127.0.0.1:"), line
        url = f"{line.split()[1]}/v1/chat/completions"
        unsafe = httpx.post(url, json=chat("an attack"), timeout=10).json()
        safe = httpx.post(url, json=chat("a picnic"), timeout=10).json()
        assert unsafe["choices"][0]["message"]["content"] == "unsafe\nS2"
        assert safe["choices"][0]["message"]["content"] == "safe"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
