"""Embeddings, rerank and (de)tokenize, in SGLang's shapes, answered at once.

These routes run no simulated compute (the scheduler models generation, which is what TTFT
depends on); they give a proxy in front something real to forward and check:

- `/v1/embeddings`: a deterministic unit vector per input, the hashed bag of its tokens (so equal
  texts get equal vectors and texts sharing words point the same way).
- `/v1/rerank`: the cosine of each document's vector with the query's, best first (SGLang
  answers a JSON list of `{score, document, index, meta_info}`).
- `/tokenize`, `/detokenize`: the stand-in's tokenizer (`backends.sim.tokenizer`).
"""

from __future__ import annotations

import math
from typing import Any

from backends.sim.http import HttpRequest, Responder
from backends.sim.routes_base import RouteContext, dumps
from backends.sim.routes_openai import OpenAIRoutes
from backends.sim.wire import BadRequest, parse_json

EMBEDDING_DIM = 64


class EmbedRoutes(RouteContext):
    def _ids(self, value: Any) -> list[int]:
        if isinstance(value, str):
            return self.tokenizer.encode(value)
        if isinstance(value, list) and all(type(v) is int for v in value):
            return list(value)
        raise BadRequest("each input must be a string or a list of token ids")

    async def embeddings(self, request: HttpRequest, responder: Responder) -> None:
        OpenAIRoutes._require_json(request)
        body = parse_json(request.body)
        raw = body.get("input")
        if raw is None:
            raise BadRequest("'input' is required")
        single = isinstance(raw, str) or (
            isinstance(raw, list) and bool(raw) and all(type(v) is int for v in raw)
        )
        inputs = [raw] if single else raw
        if not isinstance(inputs, list) or not inputs:
            raise BadRequest("'input' must be a string, a list of strings or token ids")
        ids = [self._ids(value) for value in inputs]
        tokens = sum(len(i) for i in ids)
        answer = {
            "data": [
                {"embedding": embed(i), "index": n, "object": "embedding"}
                for n, i in enumerate(ids)
            ],
            "model": body.get("model") or self.config.model_name,
            "object": "list",
            "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens,
                      "prompt_tokens_details": None},
        }  # fmt: skip
        await responder.send(200, dumps(answer))

    async def rerank(self, request: HttpRequest, responder: Responder) -> None:
        OpenAIRoutes._require_json(request)
        body = parse_json(request.body)
        query, documents = body.get("query"), body.get("documents")
        if not isinstance(query, str):
            raise BadRequest("'query' must be a string")
        if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
            raise BadRequest("'documents' must be a list of strings")
        q = embed(self.tokenizer.encode(query))
        results = []
        for index, document in enumerate(documents):
            ids = self.tokenizer.encode(document)
            score = sum(a * b for a, b in zip(q, embed(ids), strict=True))
            item: dict[str, Any] = {"score": round(score, 6), "index": index,
                                    "meta_info": {"prompt_tokens": len(ids)}}  # fmt: skip
            if body.get("return_documents", True):
                item["document"] = document
            results.append(item)
        results.sort(key=lambda r: -r["score"])
        top_n = body.get("top_n")
        if isinstance(top_n, int) and top_n > 0:
            results = results[:top_n]
        await responder.send(200, dumps(results))

    async def tokenize(self, request: HttpRequest, responder: Responder) -> None:
        OpenAIRoutes._require_json(request)
        body = parse_json(request.body)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            tokens: Any = self.tokenizer.encode(prompt)
            count: Any = len(tokens)
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            tokens = [self.tokenizer.encode(p) for p in prompt]
            count = [len(t) for t in tokens]
        else:
            raise BadRequest("'prompt' must be a string or a list of strings")
        answer = {"tokens": tokens, "count": count,
                  "max_model_len": self.config.effective_context_length}  # fmt: skip
        await responder.send(200, dumps(answer))

    async def detokenize(self, request: HttpRequest, responder: Responder) -> None:
        OpenAIRoutes._require_json(request)
        body = parse_json(request.body)
        tokens = body.get("tokens")
        if isinstance(tokens, list) and all(type(t) is int for t in tokens):
            text: Any = self.tokenizer.decode(tokens)
        elif (
            isinstance(tokens, list)
            and tokens
            and all(isinstance(t, list) and all(type(i) is int for i in t) for t in tokens)
        ):
            text = [self.tokenizer.decode(t) for t in tokens]
        else:
            raise BadRequest("'tokens' must be a list of token ids")
        await responder.send(200, dumps({"text": text}))


def embed(ids: list[int]) -> list[float]:
    """The hashed bag of `ids` as a unit vector (all zeros but one for an empty input)."""
    vector = [0.0] * EMBEDDING_DIM
    for token in ids:
        mixed = (token * 2654435761) & 0xFFFFFFFF  # Knuth's multiplicative hash
        vector[mixed % EMBEDDING_DIM] += 1.0 if mixed & 0x10000 else -1.0
    norm = math.sqrt(sum(v * v for v in vector))
    if norm == 0:
        vector[0] = 1.0
        return vector
    return [round(v / norm, 6) for v in vector]
