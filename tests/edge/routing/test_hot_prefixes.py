"""Hot-prefix tracking and the block hashes it counts by."""

from __future__ import annotations

import random

from edge.routing.hot_prefixes import HotPrefixes
from edge.routing.prefix_blocks import BlockHasher

WORDS = ["alpha ", "beta ", "gamma ", "delta ", "epsilon ", "zeta ", "eta ", "theta "]


def words(rng: random.Random, chars: int) -> str:
    out = ""
    while len(out) < chars:
        out += rng.choice(WORDS)
    return out[:chars]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_blocks_share_hashes_exactly_as_far_as_the_texts_share_blocks() -> None:
    hasher = BlockHasher(64)
    rng = random.Random(1)
    shared = words(rng, 64 * 3)
    a = hasher.blocks(shared + words(rng, 200)).hashes
    b = hasher.blocks(shared + words(rng, 200)).hashes
    assert len(a) == len(b) == (64 * 3 + 200) // 64
    assert a[:3] == b[:3]
    assert a[3] != b[3]
    # Non-ASCII text hashes by the same rule, and identically in a second hasher.
    text = "é" * 200
    assert BlockHasher(64).blocks(text).hashes == hasher.blocks(text).hashes
    assert len(hasher.blocks(text).hashes) == 3


def test_the_shared_system_prompt_is_the_hot_prefix_and_unique_tails_are_not() -> None:
    clock = Clock()
    hot = HotPrefixes(capacity=64, half_life_s=60, clock=clock)
    hasher = BlockHasher(64)
    rng = random.Random(2)
    system = words(rng, 64 * 4)
    for _ in range(20):
        hot.record("m", hasher.blocks(system + words(rng, 300)))
        clock.now += 0.1
    top = hot.top("m", 4, min_count=2)
    assert [p.text for p in top] == [system]  # the deepest shared block, once per lineage
    assert 19 < top[0].count <= 20
    assert hot.top("other", 4) == []


def test_counts_decay_with_the_half_life_and_lineages_rank_by_count() -> None:
    clock = Clock()
    hot = HotPrefixes(capacity=64, half_life_s=10, clock=clock)
    hasher = BlockHasher(64)
    rng = random.Random(3)
    first, second = words(rng, 128), words(rng, 192)
    for _ in range(8):
        hot.record(None, hasher.blocks(first + words(rng, 70)))
    clock.now += 10  # one half-life: 8 counts weigh 4
    for _ in range(6):
        hot.record(None, hasher.blocks(second + words(rng, 70)))
    top = hot.top(None, 5)
    assert [p.text for p in top] == [second, first]
    assert abs(top[1].count - 4.0) < 1e-6
    clock.now += 30
    assert [round(p.count, 3) for p in hot.top(None, 5, min_count=0.2)] == [0.75, 0.5]
    assert hot.top(None, 5, min_count=1) == []


def test_memory_stays_bounded_and_the_hot_prefix_survives_pruning() -> None:
    clock = Clock()
    hot = HotPrefixes(capacity=50, clock=clock)
    hasher = BlockHasher(32)
    rng = random.Random(4)
    system = words(rng, 64)
    for i in range(2000):
        text = (system if i % 4 == 0 else "") + words(rng, 32 * 6)
        hot.record("m", hasher.blocks(text))
        clock.now += 0.01
        assert len(hot) <= 2 * 50 + 8
    assert hot.top("m", 1)[0].text == system


def test_a_chat_prefix_is_the_conversation_cut_where_the_prefix_ends() -> None:
    from edge.stages.view import chat_prefix, render_chat

    system = {"role": "system", "content": "s" * 40, "name": "ops"}
    user = {"role": "user", "content": [{"type": "text", "text": "u" * 30}]}
    messages = [system, user, {"role": "assistant", "content": "a" * 50}]
    text = render_chat(messages)
    head = len("<|system|>\n")
    # Inside the first role marker: nothing; inside its content: the content cut there.
    assert chat_prefix(messages, head - 1) == []
    assert chat_prefix(messages, head + 10) == [{**system, "content": "s" * 10}]
    # A whole message goes as it came (content parts and other fields untouched).
    end_system = head + 40 + 1
    assert chat_prefix(messages, end_system) == [system]
    cut = chat_prefix(messages, end_system + len("<|user|>\n") + 7)
    assert cut == [system, {**user, "content": "u" * 7}]
    assert chat_prefix(messages, len(text)) == messages
    # Rendered again, the cut is the view's text up to the cut (and then its own ending).
    n = end_system + 20
    assert render_chat(chat_prefix(messages, n)).startswith(text[:n])


def test_a_chat_prefix_with_tools_counts_their_definitions_first() -> None:
    from edge.stages.view import chat_prefix, render_chat, tools_header

    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "u" * 20},
                {"role": "assistant", "content": "a" * 10, "tool_calls": [call]}]  # fmt: skip
    text = render_chat(messages, tools)
    start = len(tools_header(tools))
    assert chat_prefix(messages, start, tools) == []  # inside the definitions: no message yet
    assert chat_prefix(messages, start + len("<|user|>\n") + 5, tools) == [
        {"role": "user", "content": "u" * 5}]  # fmt: skip
    # A cut inside a message with tool calls keeps its text and leaves the calls out.
    inside = start + len("<|user|>\n") + 21 + len("<|assistant|>\n") + 4
    cut = {"role": "assistant", "content": "a" * 4}
    assert chat_prefix(messages, inside, tools) == [messages[0], cut]
    assert chat_prefix(messages, len(text), tools) == messages
    n = start + 30
    assert render_chat(chat_prefix(messages, n, tools), tools).startswith(text[:n])


def test_hot_chat_prefixes_keep_their_tools_for_the_warm_up() -> None:
    from edge.routing.prewarm import PrewarmService
    from edge.stages.view import render_chat

    hasher = BlockHasher(64)
    hot = HotPrefixes(clock=Clock())
    rng = random.Random(8)
    tools = [{"type": "function", "function": {"name": "search", "description": words(rng, 60),
                                               "parameters": {}}}]  # fmt: skip
    for _ in range(3):
        messages = [{"role": "user", "content": words(rng, 100)}]
        hot.record("m", hasher.blocks(render_chat(messages, tools)), messages, tools)
    top = hot.top("m", 1)[0]
    assert top.tools == tools and top.count == 3
    assert top.text.startswith("<|tools|>\n")  # the shared prefix is the definitions
    body = PrewarmService._chat_body(top, top.cut(len(top.text)) or [])
    assert body["tools"] == tools and body["model"] == "m"


def test_hot_chat_prefixes_carry_their_conversation_cut_at_the_prefix() -> None:
    from edge.stages.view import render_chat

    hasher = BlockHasher(64)
    hot = HotPrefixes(clock=Clock())
    rng = random.Random(7)
    shared = [{"role": "system", "content": words(rng, 150)}]
    for _ in range(3):
        messages = [*shared, {"role": "user", "content": words(rng, 100)}]
        hot.record("m", hasher.blocks(render_chat(messages)), messages)
    top = hot.top("m", 1)[0]
    assert top.count == 3 and len(top.text) == 128  # two whole blocks, inside the system prompt
    assert top.messages == [{"role": "system", "content": shared[0]["content"][: 128 - 11]}]
    assert top.cut(64) == [{"role": "system", "content": shared[0]["content"][: 64 - 11]}]
    plain = HotPrefixes(clock=Clock())
    for _ in range(2):
        plain.record(None, hasher.blocks("x" * 200))
    assert plain.top(None, 1)[0].messages is None


def test_entries_keep_only_the_hashed_part_of_a_long_prompt() -> None:
    """Only `max_blocks` blocks are hashed, so an entry needs no more of its request than that:
    many long prompts that each add one new entry must not keep every prompt alive."""
    import tracemalloc

    from edge.stages.view import render_chat

    hasher = BlockHasher(64, max_blocks=4)  # 256 characters hashed
    hot = HotPrefixes(capacity=256, clock=Clock())
    shared = "s" * 192  # three blocks every prompt shares; the fourth is its own
    tail = 256 * 1024
    tracemalloc.start()
    try:
        for i in range(100):  # each a fresh 256 KiB prompt (one new entry), dropped after
            own = f"{i:03d}" + "-" * 61  # where the fourth block starts, with or without a role
            text = shared + own + "t" * tail
            hot.record("m", hasher.blocks(text))
            messages = [{"role": "user", "content": shared + own + "t" * tail}]
            hot.record("chat", hasher.blocks(render_chat(messages)), messages)
        del text, messages
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept < 2 * 1024 * 1024, kept  # 200 prompts of 256 KiB: 50 MiB if each were kept
    top = hot.top("m", 1)[0]
    assert top.text == shared and top.count == 100
    chat = [p for p in hot.top("chat", 300, min_count=1.0) if len(p.text) == 256]
    assert len(chat) == 100 and all(len(p.messages[0]["content"]) == 256 - 9 for p in chat)


def test_an_entry_does_not_keep_a_requests_images_alive() -> None:
    """Images (content parts that are not text) are not in the text the blocks are hashed from,
    so the cut past the hashed blocks never saw them: each entry kept its request's images,
    up to 2 x `capacity` requests of `max_body_bytes` per model."""
    import tracemalloc

    from edge.stages.view import render_chat

    hasher = BlockHasher(64, max_blocks=4)
    hot = HotPrefixes(capacity=256, clock=Clock())
    tracemalloc.start()
    try:
        for i in range(60):  # each a fresh prompt (new entries) with a 1 MiB image, dropped after
            image = {
                "type": "image_url",
                "image_url": {"url": "data:image/png;base64," + f"{i:04d}" * (1 << 18)},
            }
            content = [{"type": "text", "text": f"{i:03d}" + "q" * 300}, image]
            messages = [{"role": "user", "content": content}]
            hot.record("m", hasher.blocks(render_chat(messages)), messages)
        del image, content, messages
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept < 4 * 1024 * 1024, kept  # 60 MiB if each entry kept its image
    # what a warm-up sends: the conversation's text, as parts, without the image
    entries = hot._models["m"].values()
    assert all(e.messages is not None for e in entries)
    parts = [part for e in entries for m in e.messages or () for part in m["content"]]
    assert parts and all(part == {"type": "text", "text": part["text"]} for part in parts)
