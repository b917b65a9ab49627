"""A per-backend key file is found for its backend whichever way the URL is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.credentials import BackendCredentials
from backends.sim import SimConfig, SimServer
from tests.edge.conftest import client, fast_config, run_edge

KEY = "sk-backend-one"
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_a_key_file_named_by_the_backend_url_with_its_labels_is_used(
    tmp_path: Path,
) -> None:
    key = tmp_path / "key"
    key.write_text(KEY)
    async with SimServer(SimConfig(name="k", port=0, profile="instant", api_key=KEY)) as sim:
        url = f"{sim.url}#hardware=h100"  # the --backend URL, copied as it is
        config = fast_config([url], backend_api_key_files={url: str(key)})
        async with run_edge(config) as edge, client(edge) as http:
            answer = await http.post("/v1/chat/completions", json=CHAT)
            assert answer.status_code == 200, answer.text
        assert sim.api is not None and sim.api.refused == {}


@pytest.mark.parametrize(
    "given",
    [
        "http://10.0.0.5:30000/",
        "http://10.0.0.5:30000#model=llama",
        "HTTP://10.0.0.5:30000",
        "http://Sglang-0.Internal:30000",
    ],
)
def test_a_key_is_found_under_another_spelling_of_the_url(given: str) -> None:
    host = "sglang-0.internal" if "nternal" in given else "10.0.0.5"
    keys = BackendCredentials(None, {given: b"k1"})
    assert keys.api_key(f"http://{host}:30000") == "k1"
    assert keys.api_key("http://10.0.0.6:30000") is None


def test_a_key_for_something_that_is_not_a_backend_url_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text(KEY)
    with pytest.raises(ValueError, match=r"proxy.backend_api_key_files\['10.0.0.5'\]"):
        BackendCredentials.from_files(None, {"10.0.0.5": str(key)})
