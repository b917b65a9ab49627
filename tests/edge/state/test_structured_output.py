"""Structured output through `/v1/responses` (`text.format`): the official OpenAI SDK's
`responses.parse` against the edge and a stand-in that answers the JSON a schema asks for."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from backends.sim import SimServer
from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.state.helpers import sdk_of, tenants
from tests.edge.test_app_sim import sim_config


class Forecast(BaseModel):
    city: str
    days: int
    hourly: bool


async def test_a_json_schema_format_reaches_the_backend_and_the_sdk_parses_the_answer() -> None:
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], admission=tenants("alpha"))
        async with run_edge(config) as edge, client(edge) as http:
            sdk = sdk_of(edge)
            async with sdk:
                parsed = await sdk.responses.parse(
                    model="default", input="The forecast for Oslo?", text_format=Forecast
                )
                assert parsed.output_parsed == Forecast(city="sim", days=1, hourly=True)
                assert parsed.text.format.type == "json_schema"  # type: ignore[union-attr]
                streamed: list[str] = []
                async with sdk.responses.stream(
                    model="default", input="The forecast?", text_format=Forecast
                ) as stream:
                    async for event in stream:
                        if event.type == "response.output_text.delta":
                            streamed.append(event.delta)
                    final = await stream.get_final_response()
                assert final.output_parsed == Forecast(city="sim", days=1, hourly=True)
                assert len(streamed) > 1
            headers = {"authorization": "Bearer sk-alpha"}
            obj = await http.post("/v1/responses", headers=headers, json={
                "input": "x", "text": {"format": {"type": "json_object"}}})  # fmt: skip
            assert json.loads(obj.json()["output"][0]["content"][0]["text"]) == {}
            assert obj.json()["text"] == {"format": {"type": "json_object"}}
            for text, param in (({"format": {"type": "yaml"}}, "text.format.type"),
                                ({"format": {"type": "json_schema", "schema": {}}},
                                 "text.format.name"),
                                ({"verbosity": "low"}, "text.verbosity")):  # fmt: skip
                bad = await http.post("/v1/responses", headers=headers,
                                      json={"input": "x", "text": text})  # fmt: skip
                assert bad.status_code == 400 and bad.json()["error"]["param"] == param


async def test_logprobs_of_the_answer_through_the_sdk() -> None:
    """`include=["message.output_text.logprobs"]` and `top_logprobs`: each output token with its
    logprob and alternatives, whole and on every streamed delta."""
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                whole = await sdk.responses.create(
                    model="default", input="Hi", max_output_tokens=6, top_logprobs=2,
                    include=["message.output_text.logprobs"],
                )  # fmt: skip
                part = whole.output[0].content[0]  # type: ignore[union-attr]
                assert part.logprobs is not None and len(part.logprobs) == 6  # type: ignore[union-attr]
                assert "".join(t.token for t in part.logprobs) == whole.output_text  # type: ignore[union-attr]
                assert all(len(t.top_logprobs) == 2 for t in part.logprobs)  # type: ignore[union-attr]
                streamed: list[Any] = []
                text = ""
                # max_output_tokens ends it `incomplete`: read the events, not a final response
                async with sdk.responses.stream(
                    model="default", input="Hi", max_output_tokens=6,
                    include=["message.output_text.logprobs"],
                ) as stream:  # fmt: skip
                    async for event in stream:
                        if event.type == "response.output_text.delta":
                            streamed += event.logprobs
                            text += event.delta
                assert len(streamed) == 6 and "".join(t.token for t in streamed) == text
                plain = await sdk.responses.create(model="default", input="Hi", max_output_tokens=3)
                assert plain.output[0].content[0].logprobs is None  # type: ignore[union-attr]
