"""Workloads: what the benchmark asks, as sessions of one or more turns.

- `gsp`: generated shared prefix, as `sglang.bench_serving --dataset-name generated-shared-prefix`:
  `groups` system prompts of `system_len` tokens, each followed by `prompts_per_group` questions of
  `question_len` tokens; prompt = f"{system}\\n\\n{question}"; shuffled unless `ordered`.
- `chat`: multi-turn sessions; each later turn resends the whole conversation (earlier prompts and
  the answers the server gave) plus a new user message, as a chat client does.
- `random`: independent prompts with lengths uniform in [len * range_ratio, len].
- `replay`: a JSONL file, one request per line: {"prompt": str} or {"messages": [...]}, optional
  "output_len" (or "max_tokens") and "session" (lines of one session become its turns, in order).

There is no tokenizer here: a "token" is one word from a fixed synthetic vocabulary, which the
stand-in (and most real tokenizers, within a small factor) count as about one token each.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKLOADS: tuple[str, ...] = ("gsp", "chat", "random", "replay")


class WorkloadError(ValueError):
    """Bad workload parameters or a bad replay file."""


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session. `prompt` is the new text; chat turns add it to the history."""

    prompt: str
    output_len: int
    messages: tuple[dict[str, str], ...] | None = None  # replay: explicit messages


@dataclass(frozen=True, slots=True)
class Session:
    """Requests sent one after the other (a multi-turn chat), or a single request."""

    turns: tuple[Turn, ...]
    group: int | None = None  # gsp: which shared prefix
    key: str | None = None  # sent as x-session-id, so the edge can keep a session together


@dataclass(frozen=True, slots=True)
class WorkloadParams:
    num: int = 16  # requests in total (sessions x turns for chat)
    seed: int = 1
    output_len: int = 32
    # gsp
    gsp_groups: int = 4
    gsp_prompts_per_group: int = 4
    gsp_system_len: int = 512
    gsp_question_len: int = 32
    gsp_ordered: bool = False
    # chat
    chat_turns: int = 3
    chat_system_len: int = 64
    chat_turn_len: int = 32
    # random
    random_input_len: int = 256
    random_range_ratio: float = 0.5
    # replay
    replay_file: Path | None = None

    def check(self) -> None:
        positive = {
            "num": self.num,
            "output_len": self.output_len,
            "gsp_groups": self.gsp_groups,
            "gsp_prompts_per_group": self.gsp_prompts_per_group,
            "gsp_question_len": self.gsp_question_len,
            "chat_turns": self.chat_turns,
            "chat_turn_len": self.chat_turn_len,
            "random_input_len": self.random_input_len,
        }
        for name, value in positive.items():
            if value < 1:
                raise WorkloadError(f"{name.replace('_', '-')} must be >= 1, got {value}")
        for name, value in {
            "gsp_system_len": self.gsp_system_len,
            "chat_system_len": self.chat_system_len,
        }.items():
            if value < 0:
                raise WorkloadError(f"{name.replace('_', '-')} must be >= 0, got {value}")
        if not 0.0 <= self.random_range_ratio <= 1.0:
            raise WorkloadError(
                f"random-range-ratio must be in [0, 1], got {self.random_range_ratio}"
            )


def _vocabulary(size: int = 4096) -> list[str]:
    """Pronounceable pseudo-words, the same on every machine."""
    rng = random.Random(0x5EED)
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    words: set[str] = set()
    while len(words) < size:
        syllables = rng.randint(1, 3)
        words.add("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(syllables)))
    return sorted(words)


VOCABULARY = _vocabulary()


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(count))


def make_workload(name: str, params: WorkloadParams) -> list[Session]:
    """The sessions of workload `name`; their turns add up to `params.num` requests."""
    params.check()
    rng = random.Random(params.seed)
    if name == "gsp":
        return _gsp(params, rng)
    if name == "chat":
        return _chat(params, rng)
    if name == "random":
        return _random(params, rng)
    if name == "replay":
        return _replay(params)
    raise WorkloadError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")


def _gsp(params: WorkloadParams, rng: random.Random) -> list[Session]:
    systems = [words(rng, params.gsp_system_len) for _ in range(params.gsp_groups)]
    sessions = [
        Session(
            (Turn(f"{system}\n\n{words(rng, params.gsp_question_len)}", params.output_len),),
            group=group,
        )
        for group, system in enumerate(systems)
        for _ in range(params.gsp_prompts_per_group)
    ]
    if not params.gsp_ordered:
        rng.shuffle(sessions)
    # --num takes a prefix of the set, or cycles through it again when larger.
    return [sessions[i % len(sessions)] for i in range(params.num)]


def _chat(params: WorkloadParams, rng: random.Random) -> list[Session]:
    sessions = []
    remaining = params.num
    index = 0
    while remaining > 0:
        turns = min(params.chat_turns, remaining)
        system = words(rng, params.chat_system_len)
        first = f"{system}\n\n{words(rng, params.chat_turn_len)}" if system else None
        prompts = [first or words(rng, params.chat_turn_len)]
        prompts += [words(rng, params.chat_turn_len) for _ in range(turns - 1)]
        sessions.append(
            Session(
                tuple(Turn(p, params.output_len) for p in prompts),
                key=f"chat-{params.seed}-{index}",
            )
        )
        remaining -= turns
        index += 1
    return sessions


def _random(params: WorkloadParams, rng: random.Random) -> list[Session]:
    low = max(1, int(params.random_input_len * params.random_range_ratio))
    return [
        Session((Turn(words(rng, rng.randint(low, params.random_input_len)), params.output_len),))
        for _ in range(params.num)
    ]


def _replay(params: WorkloadParams) -> list[Session]:
    path = params.replay_file
    if path is None:
        raise WorkloadError("the replay workload needs --replay-file FILE.jsonl")
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise WorkloadError(f"cannot read {path}: {exc}") from None
    order: list[str] = []
    by_session: dict[str, list[Turn]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            raise WorkloadError(f"{path}:{number}: not JSON") from None
        turn = _replay_turn(item, params.output_len, f"{path}:{number}")
        session = item.get("session")
        key = str(session) if session is not None else f"line-{number}"
        if key not in by_session:
            order.append(key)
            by_session[key] = []
        by_session[key].append(turn)
    if not order:
        raise WorkloadError(f"{path}: no requests")
    sessions = [
        Session(tuple(by_session[k]), key=k if not k.startswith("line-") else None) for k in order
    ]
    out: list[Session] = []
    total = 0
    while total < params.num:  # cycle through the file until --num requests
        for session in sessions:
            if total >= params.num:
                break
            turns = session.turns[: params.num - total]
            out.append(Session(turns, key=session.key))
            total += len(turns)
    return out


def _replay_turn(item: Any, default_output: int, where: str) -> Turn:
    if not isinstance(item, dict):
        raise WorkloadError(f"{where}: each line must be a JSON object")
    output = item.get("output_len", item.get("max_tokens", default_output))
    if not isinstance(output, int) or isinstance(output, bool) or output < 1:
        raise WorkloadError(f"{where}: output_len must be a positive integer")
    messages = item.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise WorkloadError(f"{where}: messages must be a list of {{role, content}} strings")
        text = "\n".join(m["content"] for m in messages)
        return Turn(
            text, output, tuple({"role": m["role"], "content": m["content"]} for m in messages)
        )
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise WorkloadError(f'{where}: needs a non-empty "prompt" string or "messages"')
    return Turn(prompt, output)


@dataclass
class Conversation:
    """The history of one chat session as the client keeps it."""

    # Put before the first prompt: configurations compared in one run each get their own salt,
    # so one's requests never warm the prefix cache for another's.
    salt: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    text: str = ""  # the same, flattened, for the completion routes
    remote_id: str | None = None
    """The edge's id for this conversation, when the edge keeps it (`+stored`)."""
    stored: int = 0
    """How many of `messages` the edge holds (sent before, or its own answers)."""

    def add_user(self, turn: Turn) -> None:
        prompt = f"{self.salt}{turn.prompt}" if not self.text else turn.prompt
        if turn.messages is not None:
            new = [dict(m) for m in turn.messages]
            if not self.text and new:
                new[0]["content"] = self.salt + new[0]["content"]
            self.messages.extend(new)
        else:
            self.messages.append({"role": "user", "content": prompt})
        self.text = f"{self.text}\n\n{prompt}" if self.text else prompt

    def add_answer(self, answer: str) -> None:
        self.messages.append({"role": "assistant", "content": answer})
        self.text += answer


def request_body(route: str, conversation: Conversation, turn: Turn) -> dict[str, Any]:
    """The JSON body for `route`, as bench_serving sends it (greedy, ignore_eos, streaming)."""
    if route.endswith("/chat/completions"):
        return {
            "model": "default",
            "messages": conversation.messages,
            "max_tokens": turn.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    if route.endswith("/completions"):
        return {
            "model": "default",
            "prompt": conversation.text,
            "max_tokens": turn.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    return {
        "text": conversation.text,
        "sampling_params": {
            "max_new_tokens": turn.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
        },
        "stream": True,
    }
