"""Kubernetes discovery against an API server that answers 200 with something that is not an
EndpointSliceList: a failed lookup (its backends kept), never an error out of the refresh."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from backends.discovery import Discovery, DiscoveryConfig, KubernetesSource
from backends.registry import BackendRegistry
from tests.edge.conftest import Recorded, Reply, TinyUpstream

GOOD = {
    "items": [
        {
            "ports": [{"name": "http", "port": 30000}],
            "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
        }
    ]
}


@pytest.mark.parametrize(
    "bad",
    [
        [],
        "not an object",
        {"items": [{"ports": [{"port": 30000}], "endpoints": [{"addresses": [5]}]}]},
        {"items": [{"ports": [{"port": 30000}], "endpoints": ["10.0.0.1"]}]},
        {"items": ["a slice"]},
    ],
)
async def test_a_malformed_slice_list_is_a_failed_lookup(tmp_path: Path, bad: Any) -> None:
    answer: dict[str, Any] = {"body": GOOD}

    def api(recorded: Recorded) -> Reply:
        return Reply(chunks=[json.dumps(answer["body"]).encode()], chunked=False)

    token = tmp_path / "token"
    token.write_text("t")
    async with TinyUpstream(api) as server:
        config = DiscoveryConfig.from_mapping(
            {"mode": "kubernetes", "names": ["inference/sglang"], "api_url": server.url,
             "token_file": str(token)}
        )  # fmt: skip
        discovery = Discovery(config, KubernetesSource(config))
        urls = await discovery.initial([])
        assert urls == ["http://127.0.0.1:30000"]
        registry = BackendRegistry(urls, pool=None)
        answer["body"] = bad
        await discovery.refresh(registry)  # raised before
        assert [b.url for b in registry.backends] == ["http://127.0.0.1:30000"]
        assert not registry.backends[0].draining
        found = discovery.metrics.lookups.labels("inference/sglang", "failed")._value.get()
        assert found == 1


async def test_a_slice_list_past_its_bound_is_cut_off_and_a_failed_lookup(tmp_path: Path) -> None:
    from backends.discovery import MAX_SLICES_BYTES

    block = b" " * (1024 * 1024)

    def api(recorded: Recorded) -> Reply:
        return Reply(chunks=[block] * (MAX_SLICES_BYTES // len(block) + 64))

    async with TinyUpstream(api) as server:
        config = DiscoveryConfig.from_mapping(
            {"mode": "kubernetes", "names": ["inference/sglang"], "api_url": server.url,
             "token_file": str(tmp_path / "none"), "timeout": 10.0}
        )  # fmt: skip
        assert await KubernetesSource(config).lookup() == {"inference/sglang": None}
        sent = sum(server.body_bytes_sent.values())
        assert sent < MAX_SLICES_BYTES + 32 * len(block)  # read no further (kernel buffers aside)
