"""Agents through the `ttft` policy, against stand-ins that put the offered tools at the start of
the prompt as a chat template does: the routing view leads with the same tools, so each agent's
requests go where its tools' definitions are cached."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.routing.test_prewarm import sim_config, sims, words


def agent_tools(rng: random.Random, agent: int) -> list[dict[str, Any]]:
    """An agent's own tools, their descriptions long enough to be most of every prompt."""
    return [{"type": "function", "function": {
        "name": f"agent{agent}_tool{k}", "description": words(rng, 400),
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
        for k in range(3)]  # fmt: skip


async def test_each_agents_requests_go_where_its_tools_are_cached() -> None:
    rng = random.Random(11)
    agents = [agent_tools(rng, a) for a in range(6)]
    # a GPU's timing (prefill costs), so that requests sent together overlap and load counts
    profile = {"profile": "h100-llama3-8b"}
    async with sims(sim_config("b0", **profile), sim_config("b1", **profile)) as servers:
        config = fast_config([s.url for s in servers], policy="ttft")
        async with run_edge(config) as edge, client(edge) as http:

            async def ask(tools: list[dict[str, Any]]) -> dict[str, Any]:
                body = {"messages": [{"role": "user", "content": words(rng, 20)}],
                        "tools": tools, "tool_choice": "none", "max_tokens": 1}  # fmt: skip
                answer = await http.post("/v1/chat/completions", json=body)
                assert answer.status_code == 200, answer.text
                return dict(answer.json()["usage"])

            for tools in agents:  # each agent's first request, one at a time
                await ask(tools)
            prompt = cached = 0
            for _ in range(3):  # then every agent at once, three times
                for usage in await asyncio.gather(*(ask(tools) for tools in agents)):
                    prompt += usage["prompt_tokens"]
                    cached += (usage["prompt_tokens_details"] or {}).get("cached_tokens", 0)
    # Each later request found its agent's tools cached where it was sent: only its own short
    # question and the template's few tokens around it were new.
    assert cached > 0.9 * prompt, (cached, prompt)
