"""Chat requests with images: the routing view renders their text only, so requests that differ
in their images alone have the same text. The `ttft` policy must not take such a request for a
cache hit past its first image, nor take the backend's honest report (cached up to the image)
for an eviction. Views are built by the edge's own view stage from real request bodies; the
reports are what SGLang answers (it caches up to the first token that differs: the image's)."""

from __future__ import annotations

from typing import Any

from backends.registry import Backend
from edge.routing import Outcome
from edge.routing.ttft import TTFTPolicy
from edge.stages.validate import CHAT
from edge.stages.view import build_view

SYSTEM = "You describe pictures for a catalogue, precisely and briefly. " * 40  # ~2.5k chars
QUESTION = "What is in this picture? Name its objects, their colours and their places. " * 5
IMAGE_TOKENS = 576


def body(image: int) -> dict[str, Any]:
    return {
        "model": "vlm",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"https://img.example/{image}.png"}},
                {"type": "text", "text": QUESTION},
            ]},
        ],
    }  # fmt: skip


def test_requests_differing_in_their_images_are_no_evictions() -> None:
    backends = [Backend(name=f"b{i}", url=f"http://127.0.0.1:{9200 + i}") for i in range(2)]
    policy = TTFTPolicy()
    documents = [f"document {i}: " + "lorem ipsum dolor " * 200 for i in range(5)]
    home = backends[0]
    for doc in documents:  # what else the backend holds
        policy.tree.insert(doc, home.url)
    system_tokens = len(SYSTEM) // 4
    for image in range(20):
        view = build_view(CHAT, body(image), None)
        decision = policy.choose(view, [home])
        # cached, at most: the text before the image (the system prompt and its markers)
        assert decision.predicted_cached_tokens <= system_tokens + 16, decision
        # SGLang: the system prompt is cached after the first request, not the image or after
        cached = system_tokens if image else 0
        prompt_tokens = view.approx_tokens + IMAGE_TOKENS
        policy.observe(Outcome(backend=home, view=view, decision=decision, ttft_s=0.05,
                               prompt_tokens=prompt_tokens, cached_tokens=cached))  # fmt: skip
    assert policy.trims == 0
    for doc in documents:  # nothing else it holds was given up for these honest reports
        assert policy.tree.match(doc).chars.get(home.url) == len(doc)
