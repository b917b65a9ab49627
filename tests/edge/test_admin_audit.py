"""Every admin action taken is a line of the audit chain (`event: admin`), `/prewarm` too: it
is an action (a POST, behind the token) that sends the backends up to 8 MiB of text each."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from edge.admin import guard_actions
from edge.audit import AuditConfig
from edge.routing.prewarm import PrewarmConfig
from tests.edge.conftest import fast_config, h1_app, run_edge
from tests.edge.routing.test_prewarm import sim_config, sims


async def test_a_prewarm_is_recorded_in_the_audit_chain(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    async with sims(sim_config("b0"), sim_config("b1")) as servers:
        config = fast_config([s.url for s in servers], policy="ttft")
        prewarm = PrewarmConfig(enabled=True, restart_check_interval=None)
        one = servers[1].url.removeprefix("http://")
        async with (
            run_edge(config, prewarm=prewarm, audit=AuditConfig(path=str(path))) as edge,
            h1_app(guard_actions(edge.wiring.admin_app, None)) as admin,
            httpx.AsyncClient(base_url=admin) as http,
        ):
            answer = await http.post("/prewarm", json={"text": "hello there"})
            assert answer.status_code == 200, answer.text
            answer = await http.post("/prewarm", json={"text": "hello", "backends": [one] * 3})
            assert answer.status_code == 200, answer.text
            refused = await http.post("/prewarm", json={"text": ""})
            assert refused.status_code == 400
    events = [json.loads(line) for line in path.read_text().splitlines()]
    admin_events = [(e["action"], e["target"]) for e in events if e.get("event") == "admin"]
    assert admin_events == [("prewarm", "*"), ("prewarm", one)], events
