"""Workloads, the SSE parser and the summary: pure functions, no sockets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.clients import ClientError
from bench.runner import BenchConfig
from bench.stream import RequestResult, StreamParser
from bench.summary import percentile, summarize
from bench.workloads import (
    Conversation,
    WorkloadError,
    WorkloadParams,
    make_workload,
    request_body,
)


def test_gsp_groups_share_their_system_prompt() -> None:
    params = WorkloadParams(
        num=12, gsp_groups=3, gsp_prompts_per_group=4, gsp_system_len=20, gsp_question_len=5
    )
    sessions = make_workload("gsp", params)
    assert len(sessions) == 12
    by_group: dict[int | None, set[str]] = {}
    for session in sessions:
        (turn,) = session.turns
        system, question = turn.prompt.split("\n\n")
        assert len(system.split()) == 20 and len(question.split()) == 5
        by_group.setdefault(session.group, set()).add(system)
    assert sorted(by_group) == [0, 1, 2]
    assert all(len(systems) == 1 for systems in by_group.values())
    assert [s.group for s in sessions] != sorted(s.group or 0 for s in sessions)  # shuffled
    assert make_workload("gsp", params) == sessions  # seeded


def test_chat_turns_add_up_and_build_a_conversation() -> None:
    sessions = make_workload("chat", WorkloadParams(num=7, chat_turns=3, chat_turn_len=4))
    assert [len(s.turns) for s in sessions] == [3, 3, 1]
    assert len({s.key for s in sessions}) == 3
    conversation = Conversation(salt="[x] ")
    conversation.add_user(sessions[0].turns[0])
    conversation.add_answer(" answer")
    conversation.add_user(sessions[0].turns[1])
    body = request_body("/v1/chat/completions", conversation, sessions[0].turns[1])
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["user", "assistant", "user"]
    assert body["messages"][0]["content"].startswith("[x] ")
    assert body["stream"] and body["ignore_eos"] and body["stream_options"]["include_usage"]
    native = request_body("/generate", conversation, sessions[0].turns[1])
    assert native["text"].startswith("[x] ") and " answer" in native["text"]
    assert native["sampling_params"]["max_new_tokens"] == sessions[0].turns[1].output_len


def test_random_lengths_stay_in_range() -> None:
    params = WorkloadParams(num=50, random_input_len=40, random_range_ratio=0.25)
    lengths = [len(s.turns[0].prompt.split()) for s in make_workload("random", params)]
    assert min(lengths) >= 10 and max(lengths) <= 40 and len(set(lengths)) > 5


def test_replay_reads_sessions_and_rejects_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text(
        json.dumps({"prompt": "a b", "session": "s1"}) + "\n\n"
        + json.dumps({"prompt": "c", "session": "s1", "max_tokens": 9}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
    )  # fmt: skip
    sessions = make_workload("replay", WorkloadParams(num=3, replay_file=path))
    assert [len(s.turns) for s in sessions] == [2, 1]
    assert sessions[0].turns[1].output_len == 9 and sessions[0].key == "s1"
    assert sessions[1].turns[0].messages == ({"role": "user", "content": "hi"},)
    for bad, message in [
        ("not json", "not JSON"),
        ("[1]", "JSON object"),
        ('{"prompt": ""}', "non-empty"),
        ('{"prompt": "x", "output_len": 0}', "positive integer"),
        ('{"messages": [{"role": "user"}]}', "messages must be"),
    ]:
        path.write_text(bad + "\n")
        with pytest.raises(WorkloadError, match=message):
            make_workload("replay", WorkloadParams(num=1, replay_file=path))
    with pytest.raises(WorkloadError, match="cannot read"):
        make_workload("replay", WorkloadParams(num=1, replay_file=tmp_path / "missing"))
    path.write_text("\n")
    with pytest.raises(WorkloadError, match="no requests"):
        make_workload("replay", WorkloadParams(num=1, replay_file=path))


def test_bad_workload_parameters() -> None:
    with pytest.raises(WorkloadError, match="unknown workload"):
        make_workload("sharegpt", WorkloadParams())
    with pytest.raises(WorkloadError, match="gsp-groups must be >= 1"):
        make_workload("gsp", WorkloadParams(gsp_groups=0))
    with pytest.raises(WorkloadError, match="random-range-ratio"):
        make_workload("random", WorkloadParams(random_range_ratio=2))


def _parse(chunks: list[bytes], *, stream: bool = True) -> RequestResult:
    result = RequestResult(transport="h1")
    parser = StreamParser(result, event_stream=stream)
    for i, chunk in enumerate(chunks):
        parser.feed(chunk, 0.1 * (i + 1))
    parser.finish(0.1 * (len(chunks) + 1))
    return result


def test_native_generate_stream_is_cumulative_and_itl_split_per_token() -> None:
    def event(text: str, tokens: int) -> bytes:
        meta = {"prompt_tokens": 10, "completion_tokens": tokens, "cached_tokens": 4}
        return b"data: " + json.dumps({"text": text, "meta_info": meta}).encode() + b"\n\n"

    result = _parse([event("He", 1), event("Hello", 3), b"data: [DONE]\n\n"])
    assert result.text == "Hello"
    assert result.ttft_s == pytest.approx(0.1)
    assert result.itl_s == pytest.approx([0.05, 0.05])  # 0.1 s for 2 tokens
    assert (result.prompt_tokens, result.cached_tokens, result.completion_tokens) == (10, 4, 3)


def test_sse_split_across_reads_and_crlf() -> None:
    data = b'data: {"choices":[{"delta":{"content":"ab"}}]}\r\n\r\ndata: [DONE]\r\n\r\n'
    result = _parse([data[:7], data[7:30], data[30:]])
    assert result.text == "ab" and result.ttft_s == pytest.approx(0.3)


def test_error_event_and_non_stream_body() -> None:
    assert _parse([b'data: {"error": {"message": "boom"}}\n\n']).error == "boom"
    assert _parse([b"data: {oops\n\n"]).error is not None
    body = {
        "choices": [{"message": {"role": "assistant", "content": "hi"}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": None},
    }
    result = _parse([json.dumps(body).encode()], stream=False)
    assert result.text == "hi" and result.cached_tokens == 0 and result.ttft_s == pytest.approx(0.2)


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 90) == pytest.approx(90)


def test_summary_counts_hits_errors_and_early_data() -> None:
    base = {
        "config": "a", "transport": "h3", "status": 200, "error": None, "itl_ms": [1.0, 3.0],
        "ttft_ms": 10.0, "latency_ms": 20.0, "prompt_tokens": 100, "cached_tokens": 50,
        "completion_tokens": 3, "backend": "b1", "early_data": True, "early_data_attempted": True,
    }  # fmt: skip
    failed = dict(base, status=None, error="timeout", ttft_ms=None, early_data=False)
    summary = summarize([base, dict(base, ttft_ms=30.0), failed], duration_s=2.0)["a"]
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["errors"] == {"timeout": 1}
    assert summary["ttft_ms"]["p50"] == pytest.approx(20.0)
    assert summary["cache_hit_rate"] == pytest.approx(0.5)
    assert summary["early_data_accepted"] == 2 and summary["early_data_attempted"] == 3
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["backends"] == {"b1": 2}


@pytest.mark.parametrize(
    ("spec", "new", "expected"),
    [
        ("h3+0rtt", False, BenchConfig("h3+0rtt", "h3", True, True)),
        ("h2", False, BenchConfig("h2", "h2", False, False)),
        ("h2", True, BenchConfig("h2", "h2", False, True)),
        (
            "fast=h3+reuse@https://e:1/x",
            True,
            BenchConfig("fast", "h3", False, False, "https://e:1/x"),
        ),
        ("h1+new", False, BenchConfig("h1+new", "h1", False, True)),
    ],
)
def test_config_specs(spec: str, new: bool, expected: BenchConfig) -> None:
    assert BenchConfig.parse(spec, new_connection=new) == expected


@pytest.mark.parametrize("spec", ["h4", "h2+0rtt", "h3+fast", "h3+new+reuse", "h3@"])
def test_bad_config_specs(spec: str) -> None:
    with pytest.raises(ClientError):
        BenchConfig.parse(spec)


class _Uncomparable(dict[str, object]):
    """A record that fails when compared with another: the summary must not compare records
    pairwise (a failed one against every completed one is quadratic: seconds at 10,000
    records, minutes at 100,000)."""

    def __eq__(self, other: object) -> bool:
        raise AssertionError("records compared pairwise")

    __hash__ = None  # type: ignore[assignment]


def test_summary_sorts_out_failures_without_comparing_records() -> None:
    base = {
        "config": "a", "transport": "h3", "status": 200, "error": None, "itl_ms": [],
        "ttft_ms": 10.0, "latency_ms": 20.0, "prompt_tokens": 1, "cached_tokens": 0,
        "completion_tokens": 1, "backend": "b1", "early_data": False,
        "early_data_attempted": False,
    }  # fmt: skip
    records = [_Uncomparable(base) for _ in range(3)]
    records.append(_Uncomparable(base, status=503, ttft_ms=None))
    summary = summarize(records, duration_s=1.0)["a"]
    assert (summary["completed"], summary["failed"]) == (3, 1)
    assert summary["errors"] == {"status 503": 1}
