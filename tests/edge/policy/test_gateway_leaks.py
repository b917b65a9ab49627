"""Ways around the stream rules and the request rules, each tried through a running edge."""

from __future__ import annotations

import json
from typing import Any

import httpx

from edge.policy.config import PolicyConfig
from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
)

POLICY: dict[str, Any] = {
    "stream_rules": [{"id": "key-leak", "patterns": ["BEGIN PRIVATE KEY"], "literal": True}],
}
SECRET = "here: -----BEGIN PRIVATE KEY-----\nMIIE"
SECRET_IDS = [1001, 1002, 1003, 1004, 1005, 1006]
"""The token ids of `SECRET`: a client holding them reads the text (`/detokenize`, or the
model's tokenizer)."""


def answering(answer: object) -> Any:
    def reply(recorded: Recorded) -> Reply:
        return health_ok(recorded) or Reply(
            chunks=[json.dumps(answer).encode()], chunked=False,
            headers=[("content-type", "application/json")],
        )  # fmt: skip

    return reply


async def ask(answer: object, path: str, body: dict[str, Any]) -> httpx.Response:
    async with TinyUpstream(answering(answer)) as up:
        config = PolicyConfig.from_mapping(POLICY)
        async with run_edge(fast_config([up.url]), policies=config) as edge:
            async with client(edge) as http:
                return await http.post(path, json=body)


async def test_a_filtered_generate_answer_keeps_none_of_its_token_ids() -> None:
    # SGLang's /generate answers with the generated text and its token ids (`output_ids`): an
    # answer emptied of its text must lose its ids too, or the client decodes the text back.
    answer = {
        "text": SECRET,
        "output_ids": SECRET_IDS,
        "meta_info": {"id": "g1", "finish_reason": {"type": "stop", "matched": 2},
                      "prompt_tokens": 3, "completion_tokens": 6},
    }  # fmt: skip
    response = await ask(answer, "/generate", {"text": "hi", "sampling_params": {}})
    assert response.status_code == 200, response.text
    obj = response.json()
    assert obj["text"] == "" and obj["meta_info"]["finish_reason"] == {"type": "content_filter"}
    assert obj["meta_info"]["completion_tokens"] == 6  # the usage is kept
    assert "output_ids" not in obj, obj


async def test_a_filtered_generate_batch_keeps_the_other_answers_ids() -> None:
    answers = [
        {"text": "fine", "output_ids": [7], "meta_info": {"id": "a", "finish_reason": None}},
        {"text": SECRET, "output_ids": SECRET_IDS, "meta_info": {"id": "b"}},
    ]
    response = await ask(answers, "/generate", {"text": ["hi", "ho"], "sampling_params": {}})
    assert response.status_code == 200, response.text
    first, second = response.json()
    assert first["output_ids"] == [7]
    assert second["text"] == "" and "output_ids" not in second, second
