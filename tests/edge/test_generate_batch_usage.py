"""A batch of prompts on `/generate` is accounted for all its prompts: SGLang answers a whole
batch with a JSON list of outputs and streams each output with its prompt's `index`
(tokenizer_manager.py `_handle_batch_request`), so the answer's counts are the sum over the
prompts, not those of the last event. Against the stand-in, which answers batches so."""

from __future__ import annotations

import asyncio

import httpx

from backends.sim import SimServer
from edge.sse import SSEScanner, answer_of_body
from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.state.helpers import as_tenant, tenants
from tests.edge.test_app_sim import metrics_text, sim_config

PROMPTS = ["a b", "c d", "e f", "g h"]
SAMPLING = {"max_new_tokens": 10, "ignore_eos": True}


def completion_tokens(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith('quicedge_tenant_tokens_total{kind="completion",tenant="alpha"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_batch_is_charged_for_every_prompts_answer() -> None:
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], admission=tenants("alpha"))
        async with run_edge(config) as edge, client(edge) as http:
            charged = 0.0
            for stream in (False, True):
                body = {"text": PROMPTS, "sampling_params": SAMPLING, "stream": stream}
                r = await http.post("/generate", headers=as_tenant("alpha"), json=body)
                assert r.status_code == 200
                expected = charged + 10 * len(PROMPTS)
                for _ in range(200):  # the debit follows the answer's end
                    charged = completion_tokens(await metrics_text(edge))
                    if charged >= expected:
                        break
                    await asyncio.sleep(0.01)
                assert charged == expected, ("stream" if stream else "whole", charged)


async def test_the_scanner_sums_a_batchs_counts() -> None:
    async with SimServer(sim_config("b1")) as sim, httpx.AsyncClient() as http:
        body = {"text": PROMPTS, "sampling_params": SAMPLING}
        whole = (await http.post(f"{sim.url}/generate", json=body)).content
        usage, _ = answer_of_body(whole)
        assert usage.completion_tokens == 40 and usage.prompt_tokens is not None
        single = [
            answer_of_body(
                (await http.post(f"{sim.url}/generate", json={**body, "text": p})).content
            )[0]
            for p in PROMPTS
        ]
        assert usage.prompt_tokens == sum(u.prompt_tokens or 0 for u in single)
        scanner = SSEScanner.for_route("/generate")
        async with http.stream("POST", f"{sim.url}/generate", json={**body, "stream": True}) as r:
            async for chunk in r.aiter_raw():
                scanner.feed(chunk)
        streamed, _ = scanner.final()
        assert streamed.completion_tokens == 40
        assert streamed.prompt_tokens == usage.prompt_tokens
