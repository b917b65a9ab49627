"""The stand-in's model name, version and variants, and its logprobs in SGLang's shapes."""

from __future__ import annotations

import math
from typing import Any

import httpx

from backends.sim import SimConfig, SimServer
from backends.sim.cli import build_parser, config_from

CHAT = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 12,
        "temperature": 0}  # fmt: skip


def _config(**overrides: Any) -> SimConfig:
    return SimConfig(**{"port": 0, "profile": "instant", **overrides})


async def _post(server: SimServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        response = await http.post(path, json=body)
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result


def test_the_cli_takes_a_model_name_version_and_variant() -> None:
    args = build_parser().parse_args(
        ["--model-name", "m1", "--model-version", "v2", "--variant", "flat"]
    )
    config = config_from(args)
    assert (config.model_name, config.model_version, config.variant) == ("m1", "v2", "flat")


async def test_name_and_version_are_reported() -> None:
    async with SimServer(_config(served_model_name="m1", model_version="v7")) as server:
        async with httpx.AsyncClient(base_url=server.url) as http:
            models = (await http.get("/v1/models")).json()
            info = (await http.get("/get_model_info")).json()
        assert [m["id"] for m in models["data"]] == ["m1"]
        assert info["weight_version"] == "v7"
        answer = await _post(server, "/v1/chat/completions", {"model": "m1", **CHAT})
        assert answer["metadata"]["weight_version"] == "v7"


async def test_chat_logprobs_have_sglangs_shape_and_sum_below_one() -> None:
    async with SimServer(_config()) as server:
        body = {**CHAT, "logprobs": True, "top_logprobs": 3}
        answer = await _post(server, "/v1/chat/completions", body)
        content = answer["choices"][0]["logprobs"]["content"]
        assert len(content) == answer["usage"]["completion_tokens"]
        for entry in content:
            tops = entry["top_logprobs"]
            assert len(tops) == 3 and tops[0]["token"] == entry["token"]
            assert tops[0]["logprob"] == max(t["logprob"] for t in tops)
            assert sum(math.exp(t["logprob"]) for t in tops) <= 1.0 + 1e-9
        again = await _post(server, "/v1/chat/completions", body)
        assert again["choices"][0]["logprobs"] == answer["choices"][0]["logprobs"]
        plain = await _post(server, "/v1/chat/completions", CHAT)
        assert plain["choices"][0]["logprobs"] is None


async def test_completion_and_native_logprobs() -> None:
    async with SimServer(_config()) as server:
        completion = await _post(
            server, "/v1/completions", {"prompt": "Once", "max_tokens": 5, "logprobs": 2}
        )
        lp = completion["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
        native = await _post(
            server, "/generate",
            {"text": "Once", "sampling_params": {"max_new_tokens": 5}, "return_logprob": True,
             "top_logprobs_num": 2},
        )  # fmt: skip
        meta = native["meta_info"]
        assert len(meta["output_token_logprobs"]) == 5
        assert all(len(top) == 2 for top in meta["output_top_logprobs"])


async def _mean_top1(server: SimServer, prompts: int) -> float:
    total = 0.0
    for i in range(prompts):
        body = {"messages": [{"role": "user", "content": f"prompt {i}"}], "max_tokens": 4,
                "logprobs": True, "top_logprobs": 1}  # fmt: skip
        content = (await _post(server, "/v1/chat/completions", body))["choices"][0]["logprobs"]
        total += sum(math.exp(e["logprob"]) for e in content["content"]) / len(content["content"])
    return total / prompts


async def test_variants_change_the_outputs_as_they_say() -> None:
    async with (
        SimServer(_config()) as base,
        SimServer(_config(variant="text")) as text,
        SimServer(_config(variant="long", natural_output_len=(20, 20))) as long,
        SimServer(_config(variant="flat")) as flat,
    ):
        body = {**CHAT, "max_tokens": 100}
        a = await _post(base, "/v1/chat/completions", body)
        b = await _post(text, "/v1/chat/completions", body)
        assert a["choices"][0]["message"]["content"] != b["choices"][0]["message"]["content"]
        same = await _post(flat, "/v1/chat/completions", body)
        assert same["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
        answer = await _post(long, "/v1/chat/completions", body)
        assert answer["usage"]["completion_tokens"] == 40  # twice the natural 20, EOS counted
        shift = await _mean_top1(base, 60) - await _mean_top1(flat, 60)
        assert 0.04 < shift < 0.12  # 0.08 by construction, over 60 answers' own noise
