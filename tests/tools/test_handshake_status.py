"""The handshake tools count a connection only when its request was answered 2xx: an error
answer (an overloaded or misconfigured server) ends the run loudly instead of being measured as
a handshake. Against the edge's own HTTP/3 listener serving an app that answers 503."""

from __future__ import annotations

from typing import Any

import pytest

from certs import DevCertificates
from tests.bench.servers import edge_h3
from tools import h3_handshake_cpu, h3_handshake_instructions, handshakes


async def overloaded(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 503, "headers": []})
    await send({"type": "http.response.body", "body": b"overloaded"})


async def test_handshakes_fails_on_an_error_answer(dev_certs: DevCertificates) -> None:
    async with edge_h3(dev_certs, app=overloaded) as server:
        with pytest.raises(handshakes.BadStatus, match="status 503, not 2xx") as raised:
            await handshakes._drive(server.port, dev_certs.ca_cert, resume=False,
                                    duration=0.2, concurrency=1)  # fmt: skip
    assert raised.value.status == 503


async def test_handshakes_counts_2xx_answers(dev_certs: DevCertificates) -> None:
    async with edge_h3(dev_certs) as server:
        done, _early = await handshakes._drive(server.port, dev_certs.ca_cert, resume=False,
                                               duration=0.1, concurrency=1)  # fmt: skip
    assert done >= 1


async def test_handshake_cpu_fails_on_an_error_answer(dev_certs: DevCertificates) -> None:
    async with edge_h3(dev_certs, app=overloaded) as server:
        with pytest.raises(handshakes.BadStatus, match="status 503"):
            await h3_handshake_cpu.drive(server.port, dev_certs.ca_cert, n=2, ticket=None)


async def test_handshake_instructions_fails_on_an_error_answer(
    dev_certs: DevCertificates,
) -> None:
    async with edge_h3(dev_certs, app=overloaded) as server:
        with pytest.raises(handshakes.BadStatus, match="status 503"):
            await h3_handshake_instructions.drive(server.port, dev_certs.ca_cert, n=2, ticket=None)


def test_an_error_answer_exits_non_zero_naming_the_status(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What `main` does with it (the serving processes themselves answer 2xx)."""

    def measured_an_error(*_: Any, **__: Any) -> Any:
        raise handshakes.BadStatus(503)

    monkeypatch.setattr(handshakes, "_measure", measured_an_error)
    assert handshakes.main(["--redis", "redis://127.0.0.1:9/0"]) == 1
    assert "status 503, not 2xx" in capsys.readouterr().err
    monkeypatch.setattr(h3_handshake_instructions, "count", measured_an_error)
    assert h3_handshake_instructions.main(["--kinds", "full"]) == 1
    assert "status 503, not 2xx" in capsys.readouterr().err
    monkeypatch.setattr(h3_handshake_cpu, "_first_ticket", measured_an_error)
    assert h3_handshake_cpu.main(["--connections", "1"]) == 1
    assert "status 503, not 2xx" in capsys.readouterr().err
