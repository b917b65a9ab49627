"""Generated requests against a real edge: whatever JSON a client sends to any route, the edge
answers it, never with a 500, and keeps serving.

The edge runs as `serve` runs it (our HTTP/1.1 listener, two `instant` stand-ins, stored
conversations and responses, the response cache, the policy gateway with rules and its
WebAssembly module), in a thread of its own (`tests.edge.fuzzing`). The bodies are mostly
well-formed requests with any JSON value in any field, the shapes where a validator that trusts
a type breaks.
"""

from __future__ import annotations

import contextlib
import json
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.policy.config import PolicyConfig
from tests.edge.conftest import fast_config, run_edge
from tests.edge.fuzzing import ANY, FUZZ, EdgeThread, field
from tests.edge.state.helpers import state
from tests.edge.test_app_sim import sim_config, sims

EXAMPLE = Path(__file__).parents[2] / "edge" / "policy" / "examples" / "deny_keyword.wasm"
POLICY = {
    "rules": [
        {"id": "no-secrets", "action": "deny", "patterns": [r"api[_ -]?key"]},
        {"id": "email", "action": "redact", "patterns": [r"[\w.+-]+@[\w-]+\.[\w.]+"]},
    ],
    "wasm": [{"id": "deny-keyword", "path": str(EXAMPLE)}],
    "stream_rules": [{"id": "leak", "patterns": ["BEGIN PRIVATE KEY"]}],
    "tiers": [{"tier": "bronze", "max_tokens": 4096, "max_prompt_chars": 20000}],
}


@contextlib.asynccontextmanager
async def edge_with_everything() -> AsyncIterator[str]:
    async with sims(sim_config("f1"), sim_config("f2")) as servers:
        config = fast_config(
            [s.url for s in servers],
            state=state(cache={"allow_tenants": ["*"], "routes": ["/v1/completions"]}),
        )
        policies = PolicyConfig.from_mapping(POLICY)
        async with run_edge(config, listener="h1", policies=policies) as edge:
            yield edge.url


@pytest.fixture(scope="module")
def edge_url() -> Iterator[str]:
    with EdgeThread(edge_with_everything) as edge:
        yield edge.url


@pytest.fixture(scope="module")
def http(edge_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=edge_url, timeout=20.0) as client:
        yield client


def answered(response: httpx.Response) -> None:
    """The edge answered: not a fault of its own, and an error is JSON in OpenAI's shape (the
    edge's) or SGLang's (a backend's, passed on)."""
    assert response.status_code != 500, response.text
    if response.status_code >= 400:
        body = response.json()
        assert "error" in body or body.get("object") == "error", body


_PART = st.fixed_dictionaries({
    "type": field(st.sampled_from(["text", "input_text", "output_text", "image_url", "refusal"])),
    "text": field(st.text(max_size=10)),
})  # fmt: skip
_CONTENT = st.one_of(st.text(max_size=20), st.lists(_PART, max_size=2))
_CALL = st.fixed_dictionaries({
    "id": field(st.text(max_size=4)),
    "type": field(st.just("function")),
    "function": field(st.fixed_dictionaries(
        {"name": field(st.text(max_size=4)), "arguments": field(st.text(max_size=12))}
    )),
})  # fmt: skip
_ROLE = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
MESSAGE = st.fixed_dictionaries(
    {"role": field(_ROLE), "content": field(_CONTENT)},
    optional={"tool_calls": field(st.lists(_CALL, max_size=2)), "tool_call_id": ANY,
              "name": ANY, "reasoning_content": field(st.text(max_size=8))},
)  # fmt: skip
_TOOL = st.fixed_dictionaries({
    "type": field(st.just("function")),
    "function": field(st.fixed_dictionaries({"name": field(st.text(max_size=6)),
                                             "parameters": ANY})),
    "name": ANY,
})  # fmt: skip
COMMON = {
    "model": field(st.sampled_from(["default", "quicedge/sim-instant", "unknown-model"])),
    "stream": field(st.booleans()),
    "max_tokens": field(st.integers(-2, 5000)),
    "max_completion_tokens": field(st.integers(-2, 8)),
    "n": field(st.integers(-1, 3)),
    "stream_options": field(st.fixed_dictionaries({"include_usage": ANY})),
    "tools": field(st.lists(_TOOL, max_size=2)),
    "tool_choice": ANY,
    "store": ANY,
    "metadata": ANY,
    "temperature": ANY,
    "rid": ANY,
    "logprobs": ANY,
    "response_format": ANY,
}
_ITEM = st.one_of(
    MESSAGE,
    st.fixed_dictionaries(
        {"type": field(st.sampled_from(["message", "function_call", "function_call_output"]))},
        optional={"role": field(_ROLE), "content": field(_CONTENT), "call_id": ANY,
                  "name": ANY, "arguments": ANY, "output": ANY, "id": ANY},
    ),
)  # fmt: skip
BODIES = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), st.fixed_dictionaries(
        {"messages": field(st.lists(MESSAGE, max_size=3))}, optional=COMMON)),
    st.tuples(st.just("/v1/completions"), st.fixed_dictionaries(
        {"prompt": field(st.one_of(st.text(max_size=20), st.lists(st.text(max_size=4),
                                                                   max_size=2)))},
        optional=COMMON)),
    st.tuples(st.just("/v1/responses"), st.fixed_dictionaries(
        {"input": field(st.one_of(st.text(max_size=20), st.lists(_ITEM, max_size=3)))},
        optional={**COMMON, "instructions": ANY, "max_output_tokens": ANY, "text": ANY,
                  "reasoning": ANY, "include": ANY, "top_logprobs": ANY, "truncation": ANY,
                  "previous_response_id": ANY, "conversation": ANY, "background": ANY})),
    st.tuples(st.just("/generate"), st.fixed_dictionaries(
        {}, optional={"text": field(st.text(max_size=12)),
                      "input_ids": field(st.lists(st.integers(-1, 10**6), max_size=3)),
                      "sampling_params": field(st.fixed_dictionaries(
                          {}, optional={"max_new_tokens": field(st.integers(-1, 5000))})),
                      "stream": ANY, "rid": ANY})),
    st.tuples(st.just("/v1/conversations"), st.fixed_dictionaries(
        {}, optional={"items": field(st.lists(_ITEM, max_size=2)), "metadata": ANY})),
    st.tuples(
        st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses",
                         "/v1/embeddings", "/v1/rerank", "/tokenize", "/detokenize",
                         "/v1/conversations"]),
        ANY,
    ),
)  # fmt: skip
"""(route, body): a route's request with any value in its fields, or any JSON at all."""


@FUZZ
@given(BODIES)
def test_any_body_on_any_route_is_answered_without_a_fault(
    http: httpx.Client, case: tuple[str, Any]
) -> None:
    route, body = case
    answered(
        http.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
    )


@pytest.fixture(scope="module")
def stored(http: httpx.Client) -> dict[str, str]:
    """The ids of a stored response, a conversation and a stored chat completion."""
    ids = {}
    for name, route, body in [
        ("response", "/v1/responses", {"input": "hi", "store": True}),
        ("conversation", "/v1/conversations", {"items": [{"role": "user", "content": "hi"}]}),
        ("chat", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hi"}], "store": True}),
    ]:  # fmt: skip
        response = http.post(route, json=body)
        assert response.status_code == 200, response.text
        ids[name] = response.json()["id"]
    return ids


_ID = st.one_of(
    st.sampled_from(["response", "conversation", "chat"]),  # a stored object's id (`stored`)
    st.text(max_size=12).map(lambda t: urllib.parse.quote(t, safe="") or "x"),
)
_QUERY = st.lists(
    st.tuples(
        st.sampled_from(["limit", "after", "before", "order", "stream", "starting_after",
                         "include", "include[]", "metadata", "model"]),
        st.one_of(st.text(max_size=8), st.sampled_from(["asc", "desc", "true", "-1", "9" * 25])),
    ),
    max_size=3,
).map(lambda q: "?" + urllib.parse.urlencode(q) if q else "")  # fmt: skip
_PATHS = st.sampled_from([
    ("GET", "/v1/responses/{a}{q}"), ("DELETE", "/v1/responses/{a}"),
    ("GET", "/v1/responses/{a}/input_items{q}"), ("POST", "/v1/responses/{a}/cancel"),
    ("GET", "/v1/conversations/{a}"), ("POST", "/v1/conversations/{a}"),
    ("DELETE", "/v1/conversations/{a}"), ("GET", "/v1/conversations/{a}/items{q}"),
    ("POST", "/v1/conversations/{a}/items{q}"), ("GET", "/v1/conversations/{a}/items/{b}"),
    ("DELETE", "/v1/conversations/{a}/items/{b}"), ("GET", "/v1/chat/completions/{a}"),
    ("POST", "/v1/chat/completions/{a}"), ("DELETE", "/v1/chat/completions/{a}"),
    ("GET", "/v1/chat/completions/{a}/messages{q}"), ("GET", "/v1/chat/completions{q}"),
    ("GET", "/v1/models/{a}"),
])  # fmt: skip
"""(method, path): `a` and `b` are ids, `q` a query string."""
_HEADERS = st.dictionaries(
    st.sampled_from(["authorization", "x-request-id", "x-quicedge-conversation", "traceparent",
                     "content-type"]),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30),
    max_size=2,
)  # fmt: skip
_REFERRING = st.fixed_dictionaries(
    {"input": field(st.lists(_ITEM, max_size=2))},
    optional={"previous_response_id": field(_ID), "conversation": field(_ID),
              "stream": st.booleans(), "store": ANY, "background": st.booleans()},
)  # fmt: skip


@FUZZ
@given(
    st.one_of(
        st.tuples(_PATHS, _ID, _ID, _QUERY, st.one_of(st.none(), ANY), _HEADERS),
        st.tuples(st.just(("POST", "/v1/responses")), st.just("x"), st.just("x"), st.just(""),
                  _REFERRING, _HEADERS),
    )
)  # fmt: skip
def test_stored_objects_any_id_query_or_header_is_answered_without_a_fault(
    http: httpx.Client, stored: dict[str, str], case: tuple[Any, ...]
) -> None:
    (method, pattern), first, second, query, body, headers = case
    path = pattern.format(a=stored.get(first, first), b=stored.get(second, second), q=query)
    if isinstance(body, dict):
        for key in ("previous_response_id", "conversation"):
            if isinstance(body.get(key), str):
                body[key] = stored.get(body[key], body[key])
    content = None if body is None else json.dumps(body)
    with contextlib.suppress(httpx.LocalProtocolError):  # a header httpx itself refuses
        answered(http.request(method, path, content=content, headers=headers))
