"""Structured output on `/v1/chat/completions` (`response_format`): the stand-in answers the JSON
a schema describes, generated through the scheduler; the official SDK's `parse` reads it into a
pydantic model. Real SimServers over real sockets."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from backends.sim import SimServer
from tests.backends.sim.conftest import stream_post

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}  # fmt: skip
FORMAT = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}}
ANSWER = {"city": "sim", "days": 1, "unit": "celsius"}


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Forecast?"}], **extra}


async def test_a_json_schema_is_answered_with_json_that_fits_it(
    sim: SimServer, client: httpx.AsyncClient
) -> None:
    whole = await client.post(f"{sim.url}/v1/chat/completions", json=chat(response_format=FORMAT))
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert json.loads(choice["message"]["content"]) == ANSWER
    assert choice["finish_reason"] == "stop"
    _, events = await stream_post(client, f"{sim.url}/v1/chat/completions",
                                  chat(response_format=FORMAT, stream=True))  # fmt: skip
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices"))  # fmt: skip
    assert json.loads(text) == ANSWER
    obj = await client.post(f"{sim.url}/v1/chat/completions",
                            json=chat(response_format={"type": "json_object"}))  # fmt: skip
    assert obj.json()["choices"][0]["message"]["content"] == "{}"
    url = f"{sim.url}/v1/chat/completions"
    plain = await client.post(url, json=chat(response_format={"type": "text"}, max_tokens=4))
    free = await client.post(url, json=chat(max_tokens=4))
    assert plain.json()["choices"][0]["message"] == free.json()["choices"][0]["message"]


async def test_max_tokens_cuts_the_json(sim: SimServer, client: httpx.AsyncClient) -> None:
    cut = await client.post(f"{sim.url}/v1/chat/completions",
                            json=chat(response_format=FORMAT, max_tokens=2))  # fmt: skip
    choice = cut.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert json.dumps(ANSWER, separators=(",", ":")).startswith(choice["message"]["content"])


@pytest.mark.parametrize(
    ("fmt", "named"),
    [
        ("json", "'response_format' must be an object"),
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema must"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "f", "schema": []}}, "json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "f", "schema": {"properties": {"a": 1}}}},
         "schema.properties"),
    ],
)  # fmt: skip
async def test_a_malformed_response_format_is_a_400_naming_it(
    sim: SimServer, client: httpx.AsyncClient, fmt: Any, named: str
) -> None:
    response = await client.post(f"{sim.url}/v1/chat/completions", json=chat(response_format=fmt))
    assert response.status_code == 400
    assert named in response.text


class Forecast(BaseModel):
    city: str
    days: int
    hourly: bool


async def test_the_sdk_parses_the_answer_into_its_model(sim: SimServer) -> None:
    async with openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="sim", max_retries=0) as sdk:
        parsed = await sdk.chat.completions.parse(
            model="m", messages=[{"role": "user", "content": "Forecast?"}],
            response_format=Forecast,
        )  # fmt: skip
    assert parsed.choices[0].message.parsed == Forecast(city="sim", days=1, hourly=True)
