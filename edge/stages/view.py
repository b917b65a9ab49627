"""View stage: what routing needs to know about a request, as a `RequestView`.

The text is the prompt as the backend will see it, so that prefix matching in the routing tree
lines up with the backend's radix cache: chat messages are rendered with role markers in order,
the way a chat template lays them out; token-id prompts become their ids joined by spaces.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from edge.routing.base import RequestView
from edge.stages.validate import (
    CHAT,
    COMPLETIONS,
    DETOKENIZE,
    EMBEDDINGS,
    GENERATE,
    RERANK,
    TOKENIZE,
)

_PROMPT_FIELD = {EMBEDDINGS: "input", TOKENIZE: "prompt", DETOKENIZE: "tokens"}
"""The field each of these routes takes its prompt from (`edge.stages.validate` checks it)."""

CHARS_PER_TOKEN = 4
"""Rough characters per token of English text for BPE tokenizers (OpenAI's rule of thumb)."""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones, in order
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def tools_header(tools: list[Any] | None) -> str:
    """The offered tools as the start of the prompt, where chat templates put their definitions:
    requests offering the same tools share that prefix (often thousands of tokens)."""
    if not tools:
        return ""
    return "<|tools|>\n" + orjson.dumps(tools).decode() + "\n"


def _message_text(m: dict[str, Any]) -> str:
    """A message's text, with its tool calls after it (a template renders them there)."""
    text = _content_text(m.get("content"))
    calls = m.get("tool_calls")
    if not calls or not isinstance(calls, list):
        return text
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            text += f"\n<|call|>{function.get('name')} {function.get('arguments')}"
    return text


def render_chat(messages: list[dict[str, Any]], tools: list[Any] | None = None) -> str:
    """Messages with role markers, after the offered tools, ending with the assistant marker a
    template adds to generate."""
    parts = [tools_header(tools)] if tools else []
    parts += [f"<|{m['role']}|>\n{_message_text(m)}\n" for m in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


def chat_prefix(
    messages: list[dict[str, Any]], chars: int, tools: list[Any] | None = None
) -> list[dict[str, Any]]:
    """The messages whose `render_chat` text covers its first `chars` characters: every message
    rendered whole within them, as it came, then the next one's content cut where they end
    (if they end inside its text; without its tool calls). Sent to a backend with the same
    `tools`, the list renders with the backend's own chat template to the same tokens as the
    conversation, up to the cut."""
    out: list[dict[str, Any]] = []
    pos = len(tools_header(tools)) if tools else 0
    for m in messages:
        head = len(m["role"]) + 5  # "<|role|>\n"
        text = _message_text(m)
        end = pos + head + len(text) + 1
        if end <= chars:
            out.append(m)
            pos = end
            continue
        if chars - pos > head:
            content = _content_text(m.get("content"))[: chars - pos - head]
            out.append({**{k: v for k, v in m.items() if k != "tool_calls"}, "content": content})
        break
    return out


def _batch_tokens(prompts: list[Any]) -> int:
    """The token ids of a batch of token-id prompts, every prompt's (nested batches too, which
    `/generate`'s `input_ids` lets through)."""
    return sum(_batch_tokens(p) if p and isinstance(p[0], list) else len(p) for p in prompts)


def _prompt_text(prompt: Any) -> tuple[str, int | None, int | None]:
    """(text, exact token count if the prompt is token ids, every prompt's tokens if it is a
    batch of token-id prompts) for a completions/generate prompt."""
    if isinstance(prompt, str):
        return prompt, None, None
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], int):
            return " ".join(map(str, prompt)), len(prompt), None
        if isinstance(prompt[0], str):
            return "\n".join(prompt), None, None
        if isinstance(prompt[0], list):
            # a batch of token-id prompts: route on the first, charge admission for them all
            return " ".join(map(str, prompt[0])), len(prompt[0]), _batch_tokens(prompt)
    return "", None, None


def build_view(route: str, body: Mapping[str, Any], session_header: str | None) -> RequestView:
    """The routing view of a validated body."""
    tokens: int | None
    batch: int | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    if route == CHAT:
        messages = body["messages"]
        offered = body.get("tools")
        tools = offered if isinstance(offered, list) and offered else None
        text, tokens = render_chat(messages, tools), None
    elif route == COMPLETIONS:
        text, tokens, batch = _prompt_text(body["prompt"])
    elif route == GENERATE:  # text, else input_ids
        source = body.get("text")
        text, tokens, batch = _prompt_text(source if source is not None else body.get("input_ids"))
    elif route == RERANK:
        text, tokens = "\n".join([body["query"], *body["documents"]]), None
    else:  # embeddings, tokenize, detokenize: the field the route's check read, no other
        text, tokens, batch = _prompt_text(body[_PROMPT_FIELD[route]])
    ids = tokens is not None  # token ids (the view's text is them in decimal)
    if tokens is None:
        tokens = len(text) // CHARS_PER_TOKEN + 1
    user = body.get("user")
    # OpenAI's `prompt_cache_key` names requests that share a prompt prefix: a session, for
    # routing, before the end-user id
    hint = body.get("prompt_cache_key")
    session = (session_header or (hint if isinstance(hint, str) and hint else None)
               or (user if isinstance(user, str) and user else None))  # fmt: skip
    model = body.get("model")
    n = body.get("n")
    view = RequestView(
        route=route,
        text=text,
        approx_tokens=tokens,
        session_key=session,
        model=model if isinstance(model, str) else None,
        messages=messages,
        tools=tools,
        prompt_start=len(tools_header(tools)) if tools else 0,
        choices=n if isinstance(n, int) and n > 1 else 1,
    )
    if batch is not None:  # set apart: the usual single prompt pays no keyword for it
        view.batch_tokens = batch
    if ids:
        view.token_ids = True
    return view
