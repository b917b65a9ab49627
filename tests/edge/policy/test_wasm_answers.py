"""WebAssembly policies' answers: an answer past the size or span-count limit, and redact spans
outside the prompt, are ABI failures (failing closed or open as configured, and counted);
overlapping spans give one marker, empty ones redact nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import wasmtime

from edge.errors import PolicyUnavailable
from edge.policy.config import PolicyConfig, WasmConfig
from edge.policy.gateway import PolicyGateway
from edge.policy.wasm import MAX_ANSWER_BYTES, MAX_SPANS

CHAT = "/v1/chat/completions"
PROMPT = "call me at bob@example.com"  # 26 bytes: "bob@example.com" is [11, 26)


def answering(tmp_path: Path, answer: bytes) -> str:
    """A module whose `check` answers `answer`, held in a data segment (no fuel spent on it)."""
    at = 65536
    pages = (at + len(answer)) // 65536 + 1
    data = "".join(f"\\{b:02x}" for b in answer)
    packed = (at << 32) | len(answer)
    wat = f"""(module (memory (export "memory") {pages})
      (data (i32.const {at}) "{data}")
      (func (export "alloc") (param i32) (result i32) (i32.const 1024))
      (func (export "check") (param i32 i32) (result i64) (i64.const {packed})))"""
    path = tmp_path / "answer.wasm"
    path.write_bytes(wasmtime.wat2wasm(wat))
    return str(path)


def redact(spans: list[list[int]]) -> bytes:
    return orjson.dumps({"action": "redact", "spans": spans})


def gateway(path: str, **wasm: Any) -> tuple[PolicyGateway, list[tuple[str, str]]]:
    failures: list[tuple[str, str]] = []
    config = PolicyConfig(wasm=[WasmConfig(id="mod", path=path, **wasm)])
    config.validate()
    gw = PolicyGateway(config, on_module_failure=lambda m, k: failures.append((m, k)))
    return gw, failures


def check(gw: PolicyGateway, body: dict[str, Any]) -> Any:
    return gw.check(CHAT, body, tenant="t", tier="pro", stream=False)


def chat(*texts: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": t} for t in texts]}


def refused_as_abi(tmp_path: Path, answer: bytes) -> None:
    """The answer fails closed (503, counted `abi`) and, configured open, lets the request
    through unchanged as `allow_on_error`."""
    path = answering(tmp_path, answer)
    gw, failures = gateway(path)
    with pytest.raises(PolicyUnavailable) as info:
        check(gw, chat(PROMPT))
    assert info.value.status == 503 and info.value.rule == "mod"
    assert failures == [("mod", "abi")]
    gw, failures = gateway(path, on_error="open")
    body = chat(PROMPT)
    outcome = check(gw, body)
    assert outcome.decision == "allow_on_error" and outcome.rules == ["mod"]
    assert body["messages"][0]["content"] == PROMPT
    assert failures == [("mod", "abi")]


def test_an_answer_longer_than_the_limit_is_an_abi_failure(tmp_path: Path) -> None:
    # well-formed, in memory, and each span valid: only its length is wrong
    count = MAX_ANSWER_BYTES // len(b"[11,26],") + 1
    answer = redact([[11, 26]] * count)
    assert len(answer) > MAX_ANSWER_BYTES
    refused_as_abi(tmp_path, answer)


def test_more_spans_than_the_limit_is_an_abi_failure(tmp_path: Path) -> None:
    answer = redact([[11, 26]] * (MAX_SPANS + 1))
    assert len(answer) <= MAX_ANSWER_BYTES  # under the size limit: the count refuses it
    refused_as_abi(tmp_path, answer)


def test_an_answer_at_the_limits_is_applied(tmp_path: Path) -> None:
    spans = [[2 * i, 2 * i + 1] for i in range(MAX_SPANS)]
    gw, failures = gateway(answering(tmp_path, redact(spans)))
    body = chat("ab" * MAX_SPANS)
    assert check(gw, body).decision == "redact"
    assert body["messages"][0]["content"] == "[REDACTED]b" * MAX_SPANS
    assert failures == []


@pytest.mark.parametrize(
    "spans",
    [[[40, 55]], [[11, 27]], [[11, 26], [26, 30]], [[-1, 3]], [[5, 3]]],
    ids=["past-the-end", "one-byte-over", "one-of-two", "negative", "reversed"],
)
def test_spans_outside_the_prompt_are_an_abi_failure(
    tmp_path: Path, spans: list[list[int]]
) -> None:
    refused_as_abi(tmp_path, redact(spans))


def test_span_offsets_are_bytes_of_the_prompt_as_the_module_read_it(tmp_path: Path) -> None:
    """Two messages are one prompt joined by "\\n"; "é" is two bytes: 4 + 1 + 5 = 10 bytes."""
    gw, failures = gateway(answering(tmp_path, redact([[5, 10]])))
    body = chat("name", "José")
    assert check(gw, body).decision == "redact"
    assert [m["content"] for m in body["messages"]] == ["name", "[REDACTED]"]
    gw, failures = gateway(answering(tmp_path, redact([[5, 11]])))
    with pytest.raises(PolicyUnavailable):
        check(gw, chat("name", "José"))
    assert failures == [("mod", "abi")]


@pytest.mark.parametrize(
    ("spans", "redacted"),
    [
        ([[11, 20], [13, 15]], "call me at [REDACTED]le.com"),
        ([[13, 26], [11, 20]], "call me at [REDACTED]"),
        ([[11, 15], [15, 26]], "call me at [REDACTED]"),
        ([[0, 4], [11, 26], [5, 5]], "[REDACTED] me at [REDACTED]"),
    ],
    ids=["nested", "overlapping-unsorted", "touching", "with-an-empty-one"],
)
def test_overlapping_spans_give_one_marker(
    tmp_path: Path, spans: list[list[int]], redacted: str
) -> None:
    gw, failures = gateway(answering(tmp_path, redact(spans)))
    body = chat(PROMPT)
    assert check(gw, body).decision == "redact"
    assert body["messages"][0]["content"] == redacted
    assert failures == []


def test_empty_spans_redact_nothing(tmp_path: Path) -> None:
    gw, failures = gateway(answering(tmp_path, redact([[5, 5], [26, 26]])))
    body = chat(PROMPT)
    outcome = check(gw, body)
    assert outcome.decision == "allow" and outcome.rules == [] and not outcome.redacted
    assert body["messages"][0]["content"] == PROMPT
    assert failures == []
