"""docs/operations.md says what the code does: its metrics reference and its default ports."""

from __future__ import annotations

import re
from pathlib import Path

from tests.deploy.exported import reference_table
from transport.config import TransportConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def test_the_metrics_reference_is_the_registry() -> None:
    text = DOC.read_text()
    found = re.search(r"<!-- metrics:begin -->\n(.*?)<!-- metrics:end -->", text, re.S)
    assert found, "docs/operations.md has no metrics table markers"
    assert found.group(1) == reference_table(), (
        "the metrics reference differs from the code: python -m tests.deploy.exported"
    )


def test_the_ports_table_has_the_default_ports() -> None:
    text = DOC.read_text()
    defaults = TransportConfig()
    assert defaults.tcp is not None and defaults.admin is not None
    for port, protocol in ((defaults.h3[1], "UDP"), (defaults.tcp[1], "TCP"),
                           (defaults.admin[1], "TCP")):  # fmt: skip
        assert re.search(rf"^\| {port} \| \**{protocol}\** \|", text, re.M), port
