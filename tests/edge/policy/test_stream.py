"""Stream rules over SSE chunks: a match split anywhere across chunks is caught before any part
of it reaches the client; text that never nears a pattern passes at once and unchanged."""

from __future__ import annotations

import itertools
import json
import random
import time
from typing import Any

import pytest
import re2

from edge.policy.config import PolicyConfig
from edge.policy.stream import MAX_WINDOWS, WINDOWS_RULE, StreamGuard, StreamRules

SECRET = "BEGIN PRIVATE KEY"


def rules(**overrides: Any) -> StreamRules:
    values: dict[str, Any] = {
        "stream_rules": [
            {"id": "key-leak", "patterns": [SECRET], "literal": True},
            {"id": "card", "patterns": [r"\b4\d{3}([ -]?\d{4}){3}\b"]},
        ],
        "stream_hold": True,
    }
    values.update(overrides)
    built = StreamRules.from_config(PolicyConfig.from_mapping(values))
    assert built is not None
    return built


def chat_event(text: str) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
    chunk = {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def run(guard: StreamGuard, chunks: list[bytes]) -> tuple[bytes, list[bytes]]:
    """Everything the client gets, and what it got after each chunk."""
    outs = [guard.feed(c) for c in chunks]
    outs.append(guard.finish())
    return b"".join(outs), outs


def delta_text(stream: bytes) -> str:
    text = ""
    for event in stream.split(b"\n\n"):
        if event.startswith(b"data: {"):
            obj = json.loads(event[6:])
            text += obj["choices"][0].get("delta", {}).get("content") or ""
    return text


@pytest.mark.parametrize("split", range(1, len(SECRET)))
def test_a_match_split_at_any_point_is_caught_and_none_of_it_leaks(split: int) -> None:
    guard = rules().guard("/v1/chat/completions")
    chunks = [chat_event("Here you go: "), chat_event(SECRET[:split]),
              chat_event(SECRET[split:]), chat_event(" MIIE..."), b"data: [DONE]\n\n"]  # fmt: skip
    out, _ = run(guard, chunks)
    assert guard.cut == "key-leak"
    assert delta_text(out) == "Here you go: "  # nothing of the match reached the client
    events = out.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    final = json.loads(events[-3][6:])
    assert final["choices"][0]["finish_reason"] == "content_filter"
    assert final["id"] == "c1" and final["object"] == "chat.completion.chunk"


def call_event(arguments: str) -> bytes:
    call = {"index": 0, "function": {"arguments": arguments}}
    choice = {"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}
    chunk = {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


@pytest.mark.parametrize("split", [1, 6, len(SECRET) - 1])
def test_a_match_in_a_tool_calls_arguments_is_caught_too(split: int) -> None:
    guard = rules().guard("/v1/chat/completions")
    chunks = [chat_event(""), call_event('{"note":"'), call_event(SECRET[:split]),
              call_event(SECRET[split:]), call_event('"}'), b"data: [DONE]\n\n"]  # fmt: skip
    out, _ = run(guard, chunks)
    assert guard.cut == "key-leak"
    assert SECRET[:split].encode() not in out  # held: nothing of the match went out
    final = json.loads(out.split(b"\n\n")[-3][6:])
    assert final["choices"][0]["finish_reason"] == "content_filter"


def reasoning_event(text: str) -> bytes:
    choice = {"index": 0, "delta": {"reasoning_content": text, "content": None}}
    chunk = {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def test_a_match_in_a_reasoning_models_thinking_is_caught_too() -> None:
    guard = rules().guard("/v1/chat/completions")
    chunks = [reasoning_event("I could print "), reasoning_event("BEGIN PRIV"),
              reasoning_event("ATE KEY"), chat_event("no."), b"data: [DONE]\n\n"]  # fmt: skip
    out, _ = run(guard, chunks)
    assert guard.cut == "key-leak" and b"BEGIN PRIV" not in out


def test_a_match_split_inside_an_sse_event_and_across_tcp_reads() -> None:
    """Chunks are TCP reads, not events: an event may arrive in pieces."""
    guard = rules().guard("/v1/chat/completions")
    stream = (
        chat_event("ok ") + chat_event("begin priv") + chat_event("ate key") + b"data: [DONE]\n\n"
    )
    chunks = [stream[i : i + 7] for i in range(0, len(stream), 7)]
    out, _ = run(guard, chunks)
    assert guard.cut == "key-leak" and delta_text(out) == "ok "


def test_case_and_lookalikes_across_chunks() -> None:
    guard = rules().guard("/v1/chat/completions")
    out, _ = run(guard, [chat_event("bеgin"), chat_event(" ＰＲＩＶＡＴＥ"), chat_event(" kеy")])
    assert guard.cut == "key-leak" and delta_text(out) == ""


def test_regex_rule_across_chunks() -> None:
    guard = rules().guard("/v1/chat/completions")
    out, _ = run(guard, [chat_event("card 4111 1111"), chat_event(" 1111 1111 ok")])
    assert guard.cut == "card" and "4111" not in delta_text(out)


def test_text_far_from_any_pattern_passes_at_once_and_unchanged() -> None:
    guard = rules().guard("/v1/chat/completions")
    chunks = [chat_event(w) for w in ("The ", "quick ", "brown ", "fox.")] + [b"data: [DONE]\n\n"]
    out, outs = run(guard, chunks)
    assert outs[:-1] == chunks  # each chunk went out as it came, nothing held back
    assert out == b"".join(chunks) and guard.cut is None


def test_a_possible_start_is_held_then_released_when_it_does_not_match() -> None:
    guard = rules().guard("/v1/chat/completions")
    a, b, c = chat_event("we begin "), chat_event("private "), chat_event("lessons")
    assert guard.feed(a) == b""  # "begin " may start the secret: held
    assert guard.feed(b) == b""  # "begin private " still may
    assert guard.feed(c) == a + b + c  # "lessons": not the secret, all of it goes, in order
    assert guard.cut is None


def test_held_events_are_released_at_the_end_of_the_stream() -> None:
    guard = rules().guard("/v1/chat/completions")
    a = chat_event("to begin")
    assert guard.feed(a) == b""
    assert guard.feed(b"data: [DONE]\n\n") == b""  # after a held event, order is kept
    assert guard.finish() == a + b"data: [DONE]\n\n"


def test_completions_stream() -> None:
    guard = rules().guard("/v1/completions")

    def ev(t: str) -> bytes:
        return b"data: " + json.dumps({"id": "x", "choices": [{"text": t}]}).encode() + b"\n\n"

    out, _ = run(guard, [ev("a BEGIN PRIV"), ev("ATE KEY b")])
    assert guard.cut == "key-leak"
    final = json.loads(out.split(b"\n\n")[-3][6:])
    assert final["object"] == "text_completion"
    assert final["choices"][0]["finish_reason"] == "content_filter"


def test_generate_stream_with_cumulative_text() -> None:
    guard = rules().guard("/generate")

    def ev(t: str) -> bytes:
        return b"data: " + json.dumps({"text": t, "meta_info": {"id": "g"}}).encode() + b"\n\n"

    out, outs = run(guard, [ev("Sure. "), ev("Sure. BEGIN"), ev("Sure. BEGIN PRIVATE KEY")])
    assert outs[0] == ev("Sure. ") and guard.cut == "key-leak"
    final = json.loads(out.split(b"\n\n")[-3][6:])
    assert final["text"] == "Sure. "  # the text the client had, nothing of the match
    assert final["meta_info"]["finish_reason"]["type"] == "content_filter"


def test_a_match_longer_than_the_lookbehind_is_out_of_reach() -> None:
    guard = rules(stream_lookbehind=8).guard("/v1/chat/completions")
    out, _ = run(guard, [chat_event(c) for c in SECRET])
    assert guard.cut is None and delta_text(out) == SECRET  # documented limit


@pytest.mark.parametrize("split", [1, 5, 11, 16])
def test_by_default_nothing_is_held_and_the_completing_chunk_is_cut(split: int) -> None:
    guard = rules(stream_hold=False).guard("/v1/chat/completions")
    first, second = chat_event("x " + SECRET[:split]), chat_event(SECRET[split:] + " MIIE")
    assert guard.feed(first) == first  # at once: nothing waits for what may follow
    out = guard.feed(second)
    assert guard.cut == "key-leak"
    assert delta_text(out) == "" and out.endswith(b"data: [DONE]\n\n")
    assert guard.feed(chat_event("more")) == b"" and guard.finish() == b""


def test_by_default_every_chunk_passes_as_it_comes() -> None:
    guard = rules(stream_hold=False).guard("/v1/chat/completions")
    chunks = [chat_event(w) for w in ("to ", "begin ", "private ", "lessons")]
    assert [guard.feed(c) for c in chunks] == chunks


def test_no_stream_rules_builds_no_guard() -> None:
    assert StreamRules.from_config(PolicyConfig()) is None


def guard_for(patterns: list[str], *, hold: bool = True, route: str = "/v1/chat/completions",
              lookbehind: int = 256) -> StreamGuard:  # fmt: skip
    built = StreamRules.from_config(PolicyConfig.from_mapping({
        "stream_rules": [{"id": "r", "patterns": patterns}], "stream_hold": hold,
        "stream_lookbehind": lookbehind}))  # fmt: skip
    assert built is not None
    return built.guard(route)


@pytest.mark.parametrize("hold", [False, True])
def test_no_generated_text_makes_a_pattern_backtrack(hold: bool) -> None:
    """`(.*?,){11}ssn` over `1,1,1,...` took a backtracking engine seconds per chunk (doubling
    with each chunk), the edge's event loop frozen meanwhile; RE2 is linear in the window."""
    guard = guard_for(["(.*?,){11}ssn"], hold=hold)
    started = time.perf_counter()
    out, _ = run(guard, [chat_event("1,") for _ in range(24)])
    assert time.perf_counter() - started < 2  # microseconds now; ~20 s with backtracking
    assert guard.cut is None and delta_text(out) == "1," * 24
    guard = guard_for(["(.*?,){11}ssn"], hold=hold)
    run(guard, [*[chat_event("1,") for _ in range(24)], chat_event("s"), chat_event("sn")])
    assert guard.cut == "r"  # and it still matches


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [
        ("(?<=a)b", "invalid perl operator"),  # look-behind: `regex` had it, RE2 does not
        ("(a)\\1", "invalid escape sequence"),  # a back-reference
        ("a++", "bad repetition operator"),  # possessive
        ("x*", "can match the empty string"),  # would end every stream at its first token
        ("\\bkey|", "can match the empty string"),
    ],
)
def test_a_pattern_that_re2_cannot_take_is_refused_naming_the_rule(
    pattern: str, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem) as err:
        PolicyConfig.from_mapping({"stream_rules": [{"id": "leaky", "patterns": [pattern]}]})
    assert str(err.value).startswith("policy.stream_rules.patterns (leaky): ")


@pytest.mark.parametrize(
    ("pattern", "chunks", "held"),
    [
        # each chunk but the last could start a match: held; the last completes it
        ("AKIA[0-9A-Z]{16}", ["key AK", "IA1234", "567890ABCDEF"], 2),
        (r"\b4\d{3}([ -]?\d{4}){3}\b", ["card 4111", " 1111-1111", " 1111 ok"], 2),
        (r"(?-i)SECRET[a-z]+", ["a SEC", "RETx"], 1),
        (r"\pL+@corp\.example", ["mail bob", "@corp.exa", "mple"], 2),
        (r"[[:digit:]]{3}-[[:digit:]]{4}", ["call 555-", "0100"], 1),
        (r"\Qa.b\E+!", ["x a.", "bbb", "!"], 2),
    ],
)
def test_hold_mode_holds_exactly_the_possible_starts_of_an_re2_pattern(
    pattern: str, chunks: list[str], held: int
) -> None:
    guard = guard_for([pattern])
    outs = [guard.feed(chat_event(c)) for c in chunks]
    assert outs[:held] == [b""] * held and guard.cut == "r"
    assert delta_text(b"".join(outs)) == ""


@pytest.mark.parametrize(
    ("pattern", "text"),
    [
        (r"(?-i)SECRET[a-z]+", "a sec"),  # case-sensitive: lower case cannot start it
        ("AKIA[0-9A-Z]{16}", "AKIA12-"),  # the class rules the dash out
        (r"\bkey\b", "monkey"),  # no word boundary before `key`
        (r"[[:digit:]]{3}-[[:digit:]]{4}", "call 55a"),
    ],
)
def test_text_that_cannot_start_a_match_is_not_held(pattern: str, text: str) -> None:
    guard = guard_for([pattern])
    event = chat_event(text)
    assert guard.feed(event) == event


def test_the_prefix_expression_agrees_with_brute_force() -> None:
    """A text is held exactly when some continuation of it completes a match: checked against
    every continuation of up to 4 characters, for every text of up to 3 characters."""
    alphabet = "abc"
    texts = ["".join(p) for n in range(1, 4) for p in itertools.product(alphabet, repeat=n)]
    tails = [""] + ["".join(p) for n in range(1, 5) for p in itertools.product(alphabet, repeat=n)]
    for pattern in ["abc", "a(b|ca)c", "(ab)+c", "a[bc]{2,3}a", "(a|bb)c?a", "c(a*b){2}"]:
        whole = re2.compile(f"(?:{pattern})")
        config = {"stream_rules": [{"id": "r", "patterns": [pattern]}], "stream_hold": True}
        rules = StreamRules.from_config(PolicyConfig.from_mapping(config))
        assert rules is not None
        for text in texts:
            if whole.search(text):
                continue  # a match: not a question of holding
            possible = any(  # some non-empty suffix of the text, continued, is a match
                whole.fullmatch(text[start:] + tail) for start in range(len(text)) for tail in tails
            )
            assert rules.could_start(text.encode(), 0) is possible, (pattern, text)


def choice_event(index: int, **delta: Any) -> bytes:
    choice = {"index": index, "delta": delta, "finish_reason": delta.pop("finish", None)}
    chunk = {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def tool_event(call: int, arguments: str, choice: int = 0) -> bytes:
    calls = [{"index": call, "function": {"arguments": arguments}}]
    return choice_event(choice, tool_calls=calls)


def texts_by_choice(stream: bytes) -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in stream.split(b"\n\n"):
        if event.startswith(b"data: {"):
            for c in json.loads(event[6:])["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
    return texts


def finishes(stream: bytes) -> dict[int, str]:
    return {c["index"]: c["finish_reason"] for e in stream.split(b"\n\n")
            if e.startswith(b"data: {") for c in json.loads(e[6:])["choices"]
            if c.get("finish_reason")}  # fmt: skip


@pytest.mark.parametrize("hold", [True, False])
def test_interleaved_choices_each_have_their_own_window(hold: bool) -> None:
    """n=2: choice 1's tokens between choice 0's do not hide a match in choice 0."""
    guard = rules(stream_hold=hold).guard("/v1/chat/completions")
    chunks = [choice_event(0, content="Here: "), choice_event(1, content="Sure"),
              choice_event(0, content="BEGIN "), choice_event(1, content="!"),
              choice_event(0, content="PRIVATE "), choice_event(1, content=" ok"),
              choice_event(0, content="KEY"), choice_event(1, content=" more")]  # fmt: skip
    out, outs = run(guard, chunks)
    assert guard.cut == "key-leak"
    assert outs[-2:] == [b"", b""]  # after the cut, nothing
    texts = texts_by_choice(out)
    assert "KEY" not in texts[0] and " more" not in texts.get(1, "")
    if hold:  # from `BEGIN ` on, everything waited; none of the match reached the client
        assert texts == {0: "Here: ", 1: "Sure"}
    assert finishes(out) == {0: "content_filter", 1: "content_filter"}  # each choice ended


def test_interleaved_tool_calls_each_have_their_own_window() -> None:
    guard = rules().guard("/v1/chat/completions")
    chunks = [tool_event(0, '{"k":"BEGIN '), tool_event(1, "{}"), tool_event(0, "PRIVATE "),
              tool_event(1, "{"), tool_event(0, 'KEY"}')]  # fmt: skip
    out, _ = run(guard, chunks)
    assert guard.cut == "key-leak" and b"BEGIN" not in out


def test_the_same_tool_call_index_in_two_choices_is_two_windows() -> None:
    guard = rules().guard("/v1/chat/completions")
    chunks = [tool_event(0, "BEGIN ", choice=0), tool_event(0, "PRIVATE ", choice=1),
              tool_event(0, "KEY", choice=1)]  # fmt: skip
    run(guard, chunks)
    assert guard.cut is None  # choice 0 said `BEGIN `, choice 1 `PRIVATE KEY`: no match


def test_interleaved_completions_choices() -> None:
    guard = rules().guard("/v1/completions")

    def ev(index: int, text: str) -> bytes:
        return b"data: " + json.dumps({"id": "x", "choices": [{"index": index, "text": text}]}
                                      ).encode() + b"\n\n"  # fmt: skip

    out, _ = run(guard, [ev(0, "a BEGIN PRIV"), ev(1, "zzz"), ev(0, "ATE KEY b")])
    assert guard.cut == "key-leak"
    final = [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b'data: {"id":"x",')]
    assert {f["choices"][0]["index"] for f in final[-2:]} == {0, 1}


def test_interleaved_generate_indices_with_cumulative_text() -> None:
    guard = rules().guard("/generate")

    def ev(index: int, text: str) -> bytes:
        obj = {"text": text, "index": index, "meta_info": {"id": f"g{index}"}}
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    chunks = [ev(0, "Sure. "), ev(1, "No"), ev(0, "Sure. BEGIN "), ev(1, "No way"),
              ev(0, "Sure. BEGIN PRIVATE KEY")]  # fmt: skip
    out, outs = run(guard, chunks)
    assert outs[:2] == chunks[:2] and guard.cut == "key-leak"
    finals = [json.loads(e[6:]) for e in out.split(b"\n\n")[-4:-2]]
    assert {f["index"]: f["text"] for f in finals} == {0: "Sure. ", 1: "No"}
    assert all(f["meta_info"]["finish_reason"]["type"] == "content_filter" for f in finals)


def test_a_choice_that_ends_on_a_possible_start_releases_the_others() -> None:
    """Hold mode: choice 0 ends on `begin` (a possible start); its end decides it, so choice 1's
    tokens do not wait for the whole stream."""
    guard = rules().guard("/v1/chat/completions")
    a, b = choice_event(0, content="to begin"), choice_event(1, content="one")
    assert guard.feed(a) == b"" and guard.feed(b) == b""  # held: choice 0 may go on
    end = choice_event(0, finish="stop")
    assert guard.feed(end) == a + b + end  # it will not: all of it goes, in order
    c = choice_event(1, content=" two")
    assert guard.feed(c) == c and guard.cut is None


def test_windows_past_the_bound_drop_the_ones_that_cannot_start_a_match() -> None:
    guard = rules(stream_hold=False).guard("/v1/chat/completions")
    for index in range(MAX_WINDOWS * 2):
        event = choice_event(index, content="hello. ")
        assert guard.feed(event) == event
    assert guard.cut is None


@pytest.mark.parametrize("hold", [True, False])
def test_more_possible_starts_than_the_bound_cut_the_stream(hold: bool) -> None:
    """A client asks for more choices than the guard keeps windows, each ending on a possible
    start: dropping one could miss its match, so the stream is cut instead."""
    guard = rules(stream_hold=hold).guard("/v1/chat/completions")
    for index in range(MAX_WINDOWS):
        guard.feed(choice_event(index, content="BEGIN "))
        assert guard.cut is None
    out = guard.feed(choice_event(MAX_WINDOWS, content="BEGIN "))
    assert guard.cut == WINDOWS_RULE and out.endswith(b"data: [DONE]\n\n")
    assert b"BEGIN" not in out


def crlf(event: bytes, ending: bytes = b"\r\n\r\n") -> bytes:
    return event[: -len(b"\n\n")] + ending


@pytest.mark.parametrize("ending", [b"\r\n\r\n", b"\r\r", b"\n\r\n"])
def test_events_ended_by_any_sse_blank_line_pass_at_once(ending: bytes) -> None:
    """SSE lines may end in CRLF or CR (sse-starlette writes `\\r\\n\\r\\n`): each event goes out
    as it comes, as with `\\n\\n`, instead of waiting for the end of the stream."""
    guard = rules().guard("/v1/chat/completions")
    chunks = [crlf(chat_event(w), ending) for w in ("The ", "quick ", "fox.")]
    assert [guard.feed(c) for c in chunks] == chunks and guard.cut is None


@pytest.mark.parametrize("hold", [True, False])
@pytest.mark.parametrize("ending", [b"\r\n\r\n", b"\r\r"])
def test_a_match_split_across_crlf_events_is_caught(hold: bool, ending: bytes) -> None:
    guard = rules(stream_hold=hold).guard("/v1/chat/completions")
    chunks = [crlf(chat_event(t), ending) for t in ("ok ", "BEGIN PRIV", "ATE KEY", " MIIE")]
    out, _ = run(guard, chunks)
    assert guard.cut == "key-leak" and b"ATE KEY" not in out and b"MIIE" not in out
    assert out.endswith(b"data: [DONE]\n\n")


def test_crlf_events_split_across_tcp_reads_anywhere() -> None:
    guard = rules().guard("/v1/chat/completions")
    stream = b"".join(crlf(chat_event(t)) for t in ("ok ", "begin priv", "ate key"))
    out, _ = run(guard, [stream[i : i + 3] for i in range(0, len(stream), 3)])
    assert guard.cut == "key-leak" and b"priv" not in out


@pytest.mark.parametrize("hold", [True, False])
def test_a_last_event_without_its_blank_line_is_checked_at_the_end(hold: bool) -> None:
    """An upstream that ends the stream right after an event's line (no blank line, no
    `[DONE]`): `finish` checks that event like any other instead of releasing it."""
    guard = rules(stream_hold=hold).guard("/v1/chat/completions")
    first, last = chat_event("tok "), chat_event(SECRET)[:-1]  # one line end, not two
    assert guard.feed(first) == first and guard.feed(last) == b""
    out = guard.finish()
    assert guard.cut == "key-leak" and SECRET.encode() not in out
    assert out.endswith(b"data: [DONE]\n\n") and b"content_filter" in out


def test_a_last_event_without_its_blank_line_that_matches_nothing_goes_out() -> None:
    guard = rules().guard("/v1/chat/completions")
    held, last = chat_event("to begin"), chat_event(" lessons")[:-2]
    assert guard.feed(held) == b"" and guard.feed(last) == b""
    assert guard.finish() == held + last and guard.cut is None


def test_generate_streams_with_many_indices_keep_bounded_state() -> None:
    guard = rules(stream_hold=False).guard("/generate")
    for index in range(MAX_WINDOWS * 4):
        event = b"data: " + json.dumps({"text": "hello. ", "index": index}).encode() + b"\n\n"
        assert guard.feed(event) == event
    assert guard.cut is None
    state = (guard._windows, guard._seen, guard._released, guard._choices)
    assert all(len(part) <= MAX_WINDOWS + 1 for part in state)


@pytest.mark.parametrize("hold", [True, False])
def test_random_interleavings_chunkings_and_line_ends(hold: bool) -> None:
    """Random streams of up to 3 interleaved choices, cut into random TCP reads, with any SSE
    line end: the guard cuts exactly when some choice's text holds the match; otherwise the
    stream goes out byte for byte; in hold mode no part of a match reaches the client."""
    rnd = random.Random(7)
    secret = "abcab"
    config = {"stream_rules": [{"id": "s", "patterns": [secret], "literal": True}],
              "stream_hold": hold, "stream_lookbehind": 64}  # fmt: skip
    built = StreamRules.from_config(PolicyConfig.from_mapping(config))
    assert built is not None
    for _ in range(300):
        guard = built.guard("/v1/chat/completions")
        ending = rnd.choice([b"\n\n", b"\r\n\r\n", b"\r\r"])
        texts: dict[int, str] = {}
        stream = b""
        for _ in range(rnd.randint(1, 12)):
            index, word = rnd.randrange(3), rnd.choice(["a", "b", "c", "ab", "ca", "bca", " "])
            texts[index] = texts.get(index, "") + word
            stream += crlf(choice_event(index, content=word), ending)
        stream += b"data: [DONE]" + ending
        cuts = sorted(rnd.sample(range(1, len(stream)), rnd.randint(0, 10)))
        reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        out, _ = run(guard, reads)
        assert (guard.cut is not None) == any(secret in t for t in texts.values()), texts
        if guard.cut is None:
            assert out == stream
            continue
        got = texts_by_choice(out.replace(ending, b"\n\n"))
        for index, text in texts.items():
            if hold and secret in text:  # the client's text ends before the match starts
                assert len(got.get(index, "")) <= text.index(secret), (texts, got)
            assert secret not in got.get(index, "")


WORD_RULE: dict[str, Any] = {"stream_rules": [{"id": "word", "patterns": [r"\bkill\b"]}]}
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize("hold", [True, False])
@pytest.mark.parametrize("after", ["ing", "ed it", "\u200bing"])
def test_an_assertion_at_a_chunks_end_is_decided_by_the_text_after_it(
    hold: bool, after: str
) -> None:
    """`kill` + `ing`: the `\\b` after `kill` is not at the end of the text, only of a chunk;
    the next text decides it, as it would over the whole answer (the invisible character is
    folded away, so `ing` still follows `kill`)."""
    guard = rules(**WORD_RULE, stream_hold=hold).guard("/v1/chat/completions")
    chunks = [chat_event("stop "), chat_event("kill"), chat_event(after)]
    out, _ = run(guard, [*chunks, choice_event(0, finish="stop"), DONE])
    assert guard.cut is None and delta_text(out) == "stop kill" + after


@pytest.mark.parametrize("hold", [True, False])
@pytest.mark.parametrize("end", ["finish", "done", "eof", "space"])
def test_an_assertion_at_the_texts_end_matches_there(hold: bool, end: str) -> None:
    """The match is decided when the choice ends (its `finish_reason`), the stream does
    (`[DONE]`, or the upstream's end), or text that keeps it comes; held in hold mode."""
    guard = rules(**WORD_RULE, stream_hold=hold).guard("/v1/chat/completions")
    chunks = [chat_event("please "), chat_event("kill")]
    chunks += {"finish": [choice_event(0, finish="stop"), DONE], "done": [DONE], "eof": [],
               "space": [chat_event(" it"), DONE]}[end]  # fmt: skip
    out, _ = run(guard, chunks)
    assert guard.cut == "word"
    assert out.endswith(DONE) and out.count(b"[DONE]") == 1 and b"content_filter" in out
    assert delta_text(out) == ("please " if hold else "please kill")


def generate_event(text: str, index: int | None = None, finish: bool = False) -> bytes:
    obj: dict[str, Any] = {"text": text, "meta_info": {"id": "g"}}
    if index is not None:
        obj["index"] = index
    if finish:
        obj["meta_info"]["finish_reason"] = {"type": "stop"}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@pytest.mark.parametrize("hold", [True, False])
@pytest.mark.parametrize("coalesced", [False, True])
def test_generate_streams_of_disjoint_segments_are_watched_too(hold: bool, coalesced: bool) -> None:
    """SGLang's `--stream-output` makes `/generate` stream each new segment of text, not the
    text so far: a segment that does not extend the text seen is read as one, so the secret
    spread over segments is caught (and the final event adds no text)."""
    guard = rules(stream_hold=hold).guard("/generate")
    segments = [generate_event(t) for t in ("Sure, ", "here: ", "BEGIN PRIV", "ATE KEY", " x")]
    chunks = [b"".join(segments[:3]), *segments[3:]] if coalesced else segments
    out, _ = run(guard, [*chunks, b"data: [DONE]\n\n"])
    assert guard.cut == "key-leak" and b"ATE KEY" not in out
    final = json.loads(out.split(b"\n\n")[-3][6:])
    assert final["text"] == "" and final["meta_info"]["finish_reason"]["type"] == "content_filter"


def test_generate_segments_that_match_nothing_pass_whole() -> None:
    guard = rules(stream_hold=False).guard("/generate")
    chunks = [generate_event(t) for t in ("a", "ab", "x", "yz")] + [generate_event("", finish=True)]
    out, outs = run(guard, chunks)
    assert guard.cut is None and out == b"".join(chunks)


@pytest.mark.parametrize("hold", [True, False])
def test_an_assertion_at_the_texts_end_is_decided_by_a_finish_in_the_same_read(hold: bool) -> None:
    """The last text and the choice's finish arrive in one read: the finish decides the match
    there, before the finish reaches the client."""
    guard = rules(**WORD_RULE, stream_hold=hold).guard("/v1/chat/completions")
    last = chat_event("kill") + choice_event(0, finish="stop")
    out, _ = run(guard, [chat_event("please "), last, DONE])
    assert guard.cut == "word" and b'"stop"' not in out
    assert delta_text(out) == "please " and out.count(b"[DONE]") == 1
