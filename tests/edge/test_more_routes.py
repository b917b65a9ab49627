"""Embeddings, rerank, (de)tokenize and a model's card through the edge, against stand-ins:
the same routing, limits and errors as chat; every unknown route in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import gzip
import json
from typing import Any

import pytest

from backends.sim import SimConfig, SimServer
from tests.edge.conftest import client, fast_config, run_edge

ROUTES: dict[str, dict[str, Any]] = {
    "/v1/embeddings": {"model": "default", "input": ["the cat sat", "the cat sat"]},
    "/v1/rerank": {"query": "cats", "documents": ["dogs bark", "cats purr", "cats"]},
    "/tokenize": {"model": "default", "prompt": "Hello edge"},
    "/detokenize": {"model": "default", "tokens": [1, 2, 3]},
}


def stand_in(name: str) -> SimServer:
    return SimServer(SimConfig(name=name, port=0, profile="instant"))


async def test_each_route_is_forwarded_and_answered_in_sglangs_shape() -> None:
    async with stand_in("a") as a, stand_in("b") as b:
        async with run_edge(fast_config([a.url, b.url])) as edge, client(edge) as http:
            answers = {path: await http.post(path, json=body) for path, body in ROUTES.items()}
            again = await http.post("/v1/embeddings", json=ROUTES["/v1/embeddings"])
            tokens = (await http.post("/tokenize", json=ROUTES["/tokenize"])).json()["tokens"]
            text = await http.post("/detokenize", json={"tokens": tokens})
            names = {b.name for b in edge.wiring.registry.backends}
    for path, r in answers.items():
        assert r.status_code == 200, (path, r.text)
        assert r.headers["x-quicedge-backend"] in names
        assert r.headers["x-request-id"]
    emb = answers["/v1/embeddings"].json()
    assert emb["object"] == "list" and [d["index"] for d in emb["data"]] == [0, 1]
    vectors = [d["embedding"] for d in emb["data"]]
    assert vectors[0] == vectors[1] and len(vectors[0]) == 64
    assert again.json()["data"][0]["embedding"] == vectors[0]  # deterministic, any backend
    assert emb["usage"]["prompt_tokens"] > 0
    ranked = answers["/v1/rerank"].json()
    assert [r["index"] for r in ranked][0] == 2  # "cats" is closest to "cats"
    assert ranked == sorted(ranked, key=lambda r: -r["score"])
    assert answers["/tokenize"].json()["count"] == len(tokens)
    assert text.json()["text"] == "Hello edge"
    # both backends served: the same routing as chat (round robin in these tests)
    assert a.api is not None and b.api is not None
    served = [s.api.requests for s in (a, b)]
    assert all(sum(c[p] for p in ROUTES) > 0 for c in served)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"model": "default"}, "input"),
        ("/v1/embeddings", {"input": "x", "stream": True}, "stream"),
        ("/v1/rerank", {"query": "q", "documents": "not a list"}, "documents"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": ["a"]}, "tokens"),
        ("/v1/embeddings", {"model": "no-such-model", "input": "x"}, "model"),
    ],
)
async def test_bad_bodies_get_openai_errors_from_the_edge(
    path: str, body: dict[str, Any], param: str
) -> None:
    async with stand_in("a") as a:
        async with run_edge(fast_config([a.url])) as edge, client(edge) as http:
            r = await http.post(path, json=body)
    assert r.status_code in (400, 404)
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert a.api is not None and a.api.requests[path] == 0  # never reached the backend


async def test_limits_and_methods_apply_to_the_new_routes() -> None:
    async with stand_in("a") as a:
        config = fast_config([a.url], max_body_bytes=1024)
        async with run_edge(config) as edge, client(edge) as http:
            big = await http.post("/v1/embeddings", json={"input": "x" * 4096})
            wrong_type = await http.post(
                "/v1/rerank", content=b"{}", headers={"content-type": "text/plain"}
            )
            get = await http.get("/tokenize")
            unknown = await http.post("/v1/audio/speech", json={})
    assert big.status_code == 413
    assert wrong_type.status_code == 415
    assert get.status_code == 405 and get.headers["allow"] == "POST"
    assert unknown.status_code == 404
    for r in (big, wrong_type, get, unknown):
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
        assert r.headers["x-request-id"]


async def test_model_cards_including_default() -> None:
    async with stand_in("a") as a:
        async with run_edge(fast_config([a.url])) as edge, client(edge) as http:
            listing = (await http.get("/v1/models")).json()
            served = listing["data"][0]["id"]
            card = await http.get(f"/v1/models/{served}")
            default = await http.get("/v1/models/default")
            chat = await http.post("/v1/chat/completions", json={
                "model": "default", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2})  # fmt: skip
            missing = await http.get("/v1/models/nope")
    assert card.status_code == 200 and card.json()["id"] == served
    assert chat.status_code == 200
    assert default.status_code == 200
    assert default.json()["id"] == "default" and default.json()["root"] == served
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def _nested(levels: int, inner: str = "1") -> str:
    return "[" * levels + inner + "]" * levels


CHAT_HI = '"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", '{"input_ids": ' + _nested(500) + "}"),  # the check recursed: a 500
        ("/detokenize", '{"tokens": ' + _nested(500) + "}"),
        # deeper than orjson re-encodes (254): the routing view's tools key, a 500
        ("/v1/chat/completions", "{" + CHAT_HI + ', "tools": [{"type": "function", '
         '"function": {"name": "f", "parameters": ' + _nested(300, "{}") + "}}]}"),
        # a body with its own rid is re-encoded with the edge's: a 500
        ("/v1/chat/completions", "{" + CHAT_HI + ', "rid": "r1", "x": ' + _nested(300) + "}"),
    ],
)  # fmt: skip
async def test_deeply_nested_bodies_are_a_400_not_an_internal_error(path: str, body: str) -> None:
    async with stand_in("a") as a:
        async with run_edge(fast_config([a.url])) as edge, client(edge) as http:
            r = await http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_json" and "nest" in error["message"]
    assert a.api is not None and a.api.requests[path] == 0


async def test_a_compressed_body_is_refused_as_such() -> None:
    """The edge reads and forwards bodies as they are: a gzip one was a 400 `invalid_json`
    ("str is not valid UTF-8"), which sent its client looking for a fault in its JSON."""
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    raw = json.dumps(chat).encode()

    def encoded(coding: str) -> dict[str, str]:
        return {"content-type": "application/json", "content-encoding": coding}

    async with stand_in("a") as a:
        async with run_edge(fast_config([a.url])) as edge, client(edge) as http:
            url = "/v1/chat/completions"
            gzipped = await http.post(url, content=gzip.compress(raw), headers=encoded("gzip"))
            identity = await http.post(url, content=raw, headers=encoded("identity"))
    assert gzipped.status_code == 415, gzipped.text
    error = gzipped.json()["error"]
    assert error["code"] == "unsupported_media_type" and "Content-Encoding" in error["message"]
    assert gzipped.headers["accept-encoding"] == "identity"
    assert identity.status_code == 200, identity.text
    assert a.api is not None and a.api.requests["/v1/chat/completions"] == 1


async def test_a_stream_is_read_again_after_an_event_too_large_to_scan() -> None:
    """/generate streams its text and, with `return_logprob`, its logprobs cumulatively: an
    event passes the 1 MiB the relay scans after some thousands of tokens. It is passed on
    unscanned, and the events after it are read again: before, nothing after it was, and the
    answer's usage was the last one before it (the tenant charged for a fraction of the
    tokens, the trace and metrics wrong)."""
    from tests.edge.conftest import Recorded, Reply, TinyUpstream, health_ok

    def event(tokens: int, pad: int = 0) -> bytes:
        meta = {"prompt_tokens": 3, "completion_tokens": tokens, "logprobs": "p" * pad}
        return b"data: " + json.dumps({"text": "x" * tokens, "meta_info": meta}).encode() + b"\n\n"

    big = event(2, pad=1_500_000)
    chunks = [event(1), *(big[i : i + 65536] for i in range(0, len(big), 65536))]
    chunks += [event(3), event(4), b"data: [DONE]\n\n"]

    def script(recorded: Recorded) -> Reply:
        return health_ok(recorded) or Reply(
            headers=[("content-type", "text/event-stream")], chunks=chunks
        )

    async with TinyUpstream(script) as up:
        async with run_edge(fast_config([up.url]), trace=True) as edge, client(edge) as http:
            r = await http.post("/generate", json={"text": "hi", "stream": True})
            assert edge.spans is not None
            for _ in range(200):  # the span ends just after the answer's last byte went out
                spans = {s.name: s for s in edge.spans.get_finished_spans()}
                if "quicedge.request" in spans:
                    break
                await asyncio.sleep(0.01)
    assert r.status_code == 200 and r.content == b"".join(chunks)
    attributes = spans["quicedge.request"].attributes
    assert attributes is not None and attributes["gen_ai.usage.output_tokens"] == 4


@pytest.mark.parametrize("listener", ["hypercorn", "h1"])
async def test_head_on_the_model_listing_answers_as_get_without_the_body(listener: str) -> None:
    """RFC 9110 §9.3.2: HEAD is GET without the content; uptime monitors send it by default.
    It was a 405, so a monitor on /v1/models saw the edge down."""
    async with stand_in("a") as a:
        async with run_edge(fast_config([a.url]), listener=listener) as edge, client(edge) as http:
            get = await http.get("/v1/models")
            head = await http.head("/v1/models")
            card = await http.head("/v1/models/" + get.json()["data"][0]["id"])
            missing = await http.head("/v1/models/nope")
            post = await http.post("/v1/models", json={})
            after = await http.get("/v1/models")  # the connection is still in step
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == "application/json"
    assert head.headers["content-length"] == get.headers["content-length"]
    assert card.status_code == 200 and card.content == b""
    assert missing.status_code == 404
    assert post.status_code == 405 and post.headers["allow"] == "GET, HEAD"
    assert after.status_code == 200 and after.json() == get.json()


async def test_rerank_says_whether_a_field_is_missing_or_invalid() -> None:
    """A `query` of the wrong type was "'query' is required" (`missing_field`), and absent
    `documents` were `invalid_value`."""
    async with stand_in("a") as a:
        async with run_edge(fast_config([a.url])) as edge, client(edge) as http:
            wrong = await http.post("/v1/rerank", json={"query": 5, "documents": ["a"]})
            absent = await http.post("/v1/rerank", json={"query": "q"})
    assert (wrong.status_code, absent.status_code) == (400, 400)
    assert wrong.json()["error"]["code"] == "invalid_value"
    assert wrong.json()["error"]["param"] == "query"
    assert "required" not in wrong.json()["error"]["message"]
    assert absent.json()["error"]["code"] == "missing_field"
    assert absent.json()["error"]["param"] == "documents"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"prompt": "Hello edge", "input": [[1], None]}),
        ("/detokenize", {"tokens": [1, 2, 3], "prompt": [[1], None]}),
        ("/detokenize", {"tokens": [1, 2, 3], "input": [[1], 5]}),
    ],
)
async def test_a_route_is_routed_by_its_own_field_not_another_routes(
    path: str, body: dict[str, Any]
) -> None:
    """The routing view read `input`, then `prompt`, then `tokens`, whatever the route: a
    /tokenize or /detokenize body whose own field was valid but which carried another route's
    field, unchecked, answered 500."""
    async with stand_in("a") as a:
        async with run_edge(fast_config([a.url])) as edge, client(edge) as http:
            r = await http.post(path, json=body)
    assert r.status_code == 200, r.text
