"""HELP texts say what is counted: a reload through the admin API counts among the config
reloads, as a SIGHUP or a polled change does."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.processes import sim_process, wait_ready
from tests.transport.conftest import ServeProcess


def test_the_config_reloads_help_names_the_admin_api_whose_reloads_it_counts(
    tmp_path: Path,
) -> None:
    with sim_process() as backend:
        config = tmp_path / "quicedge.toml"
        config.write_text(f'[proxy]\nbackends = ["{backend}"]\n')
        server = ServeProcess("--config", str(config))
        try:
            wait_ready(server.admin_port)
            admin = f"http://127.0.0.1:{server.admin_port}"
            config.write_text(f'[proxy]\nbackends = ["{backend}"]\nretry_budget = 0.5\n')
            assert httpx.post(f"{admin}/config/reload", timeout=30).status_code == 200
            text = httpx.get(f"{admin}/metrics", timeout=10).text
            families = text_string_to_metric_families(text)
            (family,) = [f for f in families if f.name == "quicedge_config_reloads"]
            applied = [s.value for s in family.samples if s.labels.get("outcome") == "applied"]
            assert applied == [1.0]
            assert "POST /config/reload" in family.documentation
        finally:
            assert server.stop() == 0, server.errors()
