"""The error family: each class renders OpenAI's error JSON with its own status and code."""

from __future__ import annotations

import json

import pytest

from backends.errors import UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout
from edge import errors
from edge.app import _internal

CASES = [
    (errors.InvalidJSON, 400, "invalid_request_error", "invalid_json"),
    (errors.InvalidRequest, 400, "invalid_request_error", "invalid_request"),
    (errors.RouteNotFound, 404, "invalid_request_error", "not_found"),
    (errors.MethodNotAllowed, 405, "invalid_request_error", "method_not_allowed"),
    (errors.PayloadTooLarge, 413, "invalid_request_error", "payload_too_large"),
    (errors.UnsupportedMediaType, 415, "invalid_request_error", "unsupported_media_type"),
    (errors.ModelNotFound, 404, "invalid_request_error", "model_not_found"),
    (errors.TooEarly, 425, "invalid_request_error", "too_early"),
    (errors.TooManyRequests, 429, "rate_limit_error", "rate_limit_exceeded"),
    (errors.BadGateway, 502, "server_error", "bad_gateway"),
    (errors.NoHealthyBackend, 503, "server_error", "no_healthy_backend"),
    (errors.GatewayTimeout, 504, "server_error", "upstream_timeout"),
    (errors.InternalError, 500, "server_error", "internal_error"),
]


@pytest.mark.parametrize(("cls", "status", "type_", "code"), CASES)
def test_each_error_renders_openai_shape(
    cls: type[errors.EdgeError], status: int, type_: str, code: str
) -> None:
    err = cls("something went wrong", param="model")
    assert err.status == status
    assert json.loads(err.body()) == {
        "error": {"message": "something went wrong", "type": type_, "param": "model", "code": code}
    }
    headers = dict(err.headers())
    assert headers[b"content-type"] == b"application/json"
    assert int(headers[b"content-length"]) == len(err.body())


def test_code_can_be_overridden_per_instance() -> None:
    err = errors.InvalidRequest("missing messages", param="messages", code="missing_field")
    assert json.loads(err.body())["error"]["code"] == "missing_field"


def test_upstream_errors_map_once() -> None:
    assert isinstance(errors.from_upstream(UpstreamTimeout("slow")), errors.GatewayTimeout)
    assert isinstance(errors.from_upstream(UpstreamConnectError("refused")), errors.BadGateway)
    assert isinstance(errors.from_upstream(UpstreamProtocolError("reset")), errors.BadGateway)


def test_stream_error_event_is_sse_then_done() -> None:
    event = errors.stream_error_event(errors.BadGateway("backend died"))
    first, second, tail = event.split(b"\n\n")
    assert first.startswith(b"data: ")
    assert json.loads(first[6:])["error"]["code"] == "bad_gateway"
    assert second == b"data: [DONE]"
    assert tail == b""


def test_an_internal_failure_logs_the_clients_path_on_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The path is the client's, percent-decoded: `%0A` in it would start a forged log line."""
    with caplog.at_level("ERROR", logger="edge.app"):
        try:
            raise RuntimeError("a bug")
        except RuntimeError:
            err = _internal({"method": "GET", "path": "/v1/x\n2026-12-05 forged line"}, "rid-1")
    assert err.status == 500
    (record,) = caplog.records
    assert "\n" not in record.getMessage()
    assert "'/v1/x\\n2026-12-05 forged line'" in record.getMessage()
