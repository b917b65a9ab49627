"""Validate stage: the fields each inference route needs, checked once, with the field named.

The backend validates everything else (sampling parameters...) and answers 400 itself; the edge
checks only what it needs to route and relay, so a broken request never reaches a backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from edge.errors import InvalidRequest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
EMBEDDINGS = "/v1/embeddings"
RERANK = "/v1/rerank"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"

GENERATION_ROUTES = frozenset({CHAT, COMPLETIONS, GENERATE})
"""Routes that generate tokens: they stream, carry the edge's `rid` and are aborted by it."""
WHOLE_ROUTES = frozenset({EMBEDDINGS, RERANK, TOKENIZE, DETOKENIZE})
"""Routes answered in one piece (no `stream`), forwarded as the client sent them."""


def _missing(field: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"'{field}' is required: {what}", param=field, code="missing_field")


def _invalid(field: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"'{field}' is invalid: {what}", param=field, code="invalid_value")


def _check_chat(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if messages is None:
        raise _missing("messages", "a non-empty list of {role, content} objects")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _invalid(f"messages[{i}]", "must be an object")
        if not isinstance(message.get("role"), str):
            raise _invalid(f"messages[{i}].role", "must be a string")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise _invalid(f"messages[{i}].content", "must be a string or a list of parts")


def _is_prompt(value: Any) -> bool:
    """A prompt is a string, token ids, or a list of either (OpenAI completions)."""
    if isinstance(value, str):
        return True
    if isinstance(value, list) and value:
        # All strings, all token ids, or all lists of token ids: a mix (`["a", 1]`) is neither
        # a batch of texts nor one of ids, and broke the routing view (a 500).
        return (
            all(isinstance(v, str) for v in value)
            or all(type(v) is int for v in value)
            or all(isinstance(v, list) and all(type(t) is int for t in v) for v in value)
        )
    return False


def _is_token_ids(value: Any) -> bool:
    """`input_ids`: a list of ints, or a batch of such lists."""
    if not isinstance(value, list) or not value:
        return False
    if isinstance(value[0], list):
        return all(_is_token_ids(v) for v in value)
    return all(type(v) is int for v in value)


def _check_completions(body: dict[str, Any]) -> None:
    if "prompt" not in body:
        raise _missing("prompt", "a string, a list of strings or token ids")
    if not _is_prompt(body["prompt"]):
        raise _invalid("prompt", "must be a string, a list of strings or token ids")


def _check_generate(body: dict[str, Any]) -> None:
    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None:
        raise _missing("text", "`text` or `input_ids` is needed")
    if text is not None and not _is_prompt(text):
        raise _invalid("text", "must be a string or a list of strings")
    if ids is not None and not _is_token_ids(ids):
        raise _invalid("input_ids", "must be a list of token ids")
    params = body.get("sampling_params")
    if params is not None and not isinstance(params, dict):
        raise _invalid("sampling_params", "must be an object")


MAX_EMBEDDING_INPUTS = 2048
"""Inputs one embeddings request's `input` batch (strings or token-id lists) may hold: OpenAI's
limit ("any array must be 2048 dimensions or less"); one input of token ids is not a batch.
Without it, two million one-character inputs under `max_body_bytes` were checked one by one
and joined into the routing text on the event loop (~70 ms past the JSON decode, every other
stream on the worker stalled meanwhile)."""


def _check_embeddings(body: dict[str, Any]) -> None:
    if "input" not in body:
        raise _missing("input", "a string, a list of strings or token ids")
    value = body["input"]
    # a batch of texts or of token-id lists; one input of token ids is a list of ints, as long
    # as the model takes (LangChain sends each text as its token ids, up to 8191 of them)
    if (
        isinstance(value, list)
        and len(value) > MAX_EMBEDDING_INPUTS
        and not isinstance(value[0], int)
    ):
        raise _invalid(
            "input", f"at most {MAX_EMBEDDING_INPUTS} items in one request, got {len(value)}"
        )
    if not _is_prompt(value):
        raise _invalid("input", "must be a string, a list of strings or token ids")


def _check_rerank(body: dict[str, Any]) -> None:
    if "query" not in body:
        raise _missing("query", "a string")
    if not isinstance(body["query"], str):
        raise _invalid("query", "must be a string")
    if "documents" not in body:
        raise _missing("documents", "a list of strings")
    documents = body["documents"]
    if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
        raise _invalid("documents", "must be a list of strings")


def _check_tokenize(body: dict[str, Any]) -> None:
    prompt = body.get("prompt")
    if prompt is None:
        raise _missing("prompt", "a string or a list of strings")
    if not (isinstance(prompt, str) or (
        isinstance(prompt, list) and all(isinstance(p, str) for p in prompt)
    )):  # fmt: skip
        raise _invalid("prompt", "must be a string or a list of strings")


def _check_detokenize(body: dict[str, Any]) -> None:
    if "tokens" not in body:
        raise _missing("tokens", "a list of token ids")
    if not _is_token_ids(body["tokens"]):
        raise _invalid("tokens", "must be a list of token ids")


VALIDATORS: dict[str, Callable[[dict[str, Any]], None]] = {
    CHAT: _check_chat,
    COMPLETIONS: _check_completions,
    GENERATE: _check_generate,
    EMBEDDINGS: _check_embeddings,
    RERANK: _check_rerank,
    TOKENIZE: _check_tokenize,
    DETOKENIZE: _check_detokenize,
}


def validate(route: str, body: dict[str, Any]) -> bool:
    """Check the route's required fields and the common ones; return whether it streams."""
    VALIDATORS[route](body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _invalid("stream", "must be true or false")
    if stream and route in WHOLE_ROUTES:
        raise _invalid("stream", f"{route} answers in one piece; leave stream unset or false")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _invalid("model", "must be a string")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, (str, list)):
        raise _invalid("rid", "must be a string")
    return stream
