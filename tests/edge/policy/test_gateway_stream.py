"""How a cut stream ends each of its choices: a choice the client has seen finish keeps its
finish; only the others end with `content_filter`."""

from __future__ import annotations

import json

import pytest

from tests.edge.policy.test_stream import choice_event, finishes, rules, run


def events(stream: bytes) -> list[dict[str, object]]:
    return [json.loads(e[6:]) for e in stream.split(b"\n\n") if e.startswith(b"data: {")]


@pytest.mark.parametrize("hold", [True, False])
def test_a_choice_that_finished_before_the_cut_is_not_ended_again(hold: bool) -> None:
    guard = rules(stream_hold=hold).guard("/v1/chat/completions")
    chunks = [choice_event(1, content="fine"), choice_event(1, finish="stop"),
              choice_event(0, content="here: BEGIN PRIV"),
              choice_event(0, content="ATE KEY")]  # fmt: skip
    out, _ = run(guard, chunks)
    assert guard.cut == "key-leak"
    ends = [(c["index"], c["finish_reason"]) for e in events(out) for c in e["choices"]  # type: ignore[attr-defined]
            if c.get("finish_reason")]  # fmt: skip
    assert ends == [(1, "stop"), (0, "content_filter")], ends
    assert finishes(out) == {0: "content_filter", 1: "stop"}


def test_a_finished_choice_held_back_and_dropped_by_the_cut_is_ended() -> None:
    # hold mode: choice 1's finish waits behind choice 0's possible start; the cut drops it, so
    # the client never saw choice 1 finish, and the final events end it
    guard = rules(stream_hold=True).guard("/v1/chat/completions")
    chunks = [choice_event(0, content="here: BEGIN PRIV"), choice_event(1, content="fine"),
              choice_event(1, finish="stop"), choice_event(0, content="ATE KEY")]  # fmt: skip
    out, _ = run(guard, chunks)
    assert guard.cut == "key-leak"
    assert finishes(out) == {0: "content_filter", 1: "content_filter"}


def test_a_generate_index_that_finished_before_the_cut_is_not_sent_again() -> None:
    guard = rules(stream_hold=False).guard("/generate")

    def ev(index: int, text: str, finish: str | None = None) -> bytes:
        meta = {"id": "g", "finish_reason": {"type": finish} if finish else None}
        return (
            b"data: "
            + json.dumps({"index": index, "text": text, "meta_info": meta}).encode()
            + b"\n\n"
        )

    out, _ = run(guard, [ev(1, "fine"), ev(1, "fine.", "stop"), ev(0, "BEGIN PRIV"),
                         ev(0, "BEGIN PRIVATE KEY")])  # fmt: skip
    assert guard.cut == "key-leak"
    last = [(e["index"], e["meta_info"]["finish_reason"]) for e in events(out)]  # type: ignore[index]
    assert last[-1] == (0, {"type": "content_filter"}), last
    assert (1, {"type": "content_filter"}) not in last, last
