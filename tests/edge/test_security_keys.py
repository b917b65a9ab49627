"""A tenant's API key as an attacker on the internet or another tenant would hunt for it: sent
in every shape of `Authorization` a client may use, right and wrong, on answers that succeed and
that fail, it appears in no output of the edge (application log, access log, audit log,
/metrics, the admin's tenant pages, spans, the answers) and never reaches a backend, which gets
only the headers the edge means to send (no client `host`, cookie, `x-forwarded-*`, credential)."""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path
from typing import Any

import httpx

from edge.access_log import AccessLogConfig
from edge.admission.settings import AdmissionSettings, AnonymousSettings, TenantSettings
from edge.admission.tenants import key_digest
from edge.audit import AuditConfig
from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
    sse_reply,
)
from tests.edge.test_app_sim import metrics_text

KEY = "sk-CANARYzq8Xv1"
MARK = "CANARYzq8Xv"
"""What every key sent here holds: no output may."""
BASIC = base64.b64encode(f"user:{KEY}".encode()).decode()
CHAT = {"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
FAILS = {**CHAT, "messages": [{"role": "user", "content": "upstream-fails"}]}
JSON = {"content-type": "application/json"}
# (Authorization, body, status): 200s, a refused body, a backend's 500 and 401s of each shape
TRIES: list[tuple[str, Any, int]] = [
    (f"Bearer {KEY}", CHAT, 200),
    (f"bearer   {KEY}", {**CHAT, "stream": True}, 200),
    (f"BEARER {KEY}", b"{not json", 400),
    (f"Bearer {KEY}", FAILS, 500),
    (f"Bearer {KEY}x", CHAT, 401),
    (f"Bearer {KEY}, Bearer {KEY}2", CHAT, 401),
    (f"Bearer {KEY}{'A' * 6000}", CHAT, 401),
    (f"Token {KEY}", CHAT, 401),
    (f"Basic {BASIC}", CHAT, 401),
    (f"Bearer\t{KEY}", CHAT, 401),
    (KEY, CHAT, 401),
]
SPOOFED = {
    "x-forwarded-for": "10.9.9.9",
    "x-forwarded-host": "evil.example",
    "cookie": f"k={KEY}",
    "proxy-authorization": f"Bearer {KEY}",
    "x-api-key": KEY,
}
UPSTREAM_HEADERS = {"host", "content-length", "content-type", "x-request-id", "via",
                    "traceparent", "tracestate"}  # fmt: skip


class Everything(logging.Handler):
    """Every record of the edge's loggers, formatted, with its traceback (not the test's
    own client's)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.text: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(("httpx", "httpcore")):
            return
        self.text.append(self.format(record))
        if record.exc_info:
            self.text.append(logging.Formatter().formatException(record.exc_info))


def _answer(recorded: Recorded) -> Reply:
    reply = health_ok(recorded)
    if reply is not None:
        return reply
    if b"upstream-fails" in recorded.body:
        return Reply(status=500, chunks=[b"boom"], chunked=False)
    if b'"stream":true' in recorded.body.replace(b" ", b""):
        return sse_reply(["ok"])
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]}
    return Reply(chunks=[json.dumps(body).encode()], chunked=False,
                 headers=[("content-type", "application/json")])  # fmt: skip


async def _ask(http: httpx.AsyncClient, authorization: str, body: Any) -> httpx.Response:
    headers = {**SPOOFED, "authorization": authorization}
    if isinstance(body, bytes):
        return await http.post("/v1/chat/completions", content=body, headers={**headers, **JSON})
    return await http.post("/v1/chat/completions", json=body, headers=headers)


async def test_no_key_in_any_output_and_none_reaches_the_backend(tmp_path: Path) -> None:
    catch = Everything()
    root, access = logging.getLogger(), logging.getLogger("quicedge.access")
    old_level = root.level
    root.addHandler(catch)
    access.addHandler(catch)  # the access log does not propagate
    root.setLevel(logging.DEBUG)
    answers: list[str] = []
    audit_file = tmp_path / "audit.jsonl"
    try:
        async with TinyUpstream(_answer) as up:
            config = fast_config([up.url], expose_backend_names=False)
            config.admission = AdmissionSettings(
                anonymous=AnonymousSettings(enabled=False),
                tenants=[TenantSettings(name="acme", api_key_sha256=[key_digest(KEY)])],
            )
            audit = AuditConfig(path=str(audit_file))
            async with run_edge(config, trace=True, audit=audit,
                                access_log=AccessLogConfig()) as edge:  # fmt: skip
                async with client(edge) as http:
                    for authorization, body, status in TRIES:
                        r = await _ask(http, authorization, body)
                        assert r.status_code == status, (authorization[:30], r.text)
                        answers.append(repr(r.headers.raw) + r.text)
                    metrics = await metrics_text(edge)
                    async with httpx.AsyncClient(base_url=edge.admin_url) as admin:
                        for page in ("/tenants", "/tenants/acme"):
                            answers.append((await admin.get(page)).text)
                assert edge.spans is not None
                spans = [
                    json.dumps([dict(s.attributes or {}), s.status.description,
                                [dict(e.attributes or {}) for e in s.events]], default=str)
                    for s in edge.spans.get_finished_spans()
                ]  # fmt: skip
            sent = [x for x in up.requests if x.path == "/v1/chat/completions"]
    finally:
        root.removeHandler(catch)
        access.removeHandler(catch)
        root.setLevel(old_level)
    audit_text = audit_file.read_text()  # the edge is stopped: written whole
    logs = "\n".join(catch.text)
    # each output was there to scan: an access line per request, spans, audit records, metrics
    assert logs.count('"route":"/v1/chat/completions"') == len(TRIES)
    assert spans and audit_text and 'tenant="acme"' in metrics
    outputs = {"logs": logs, "audit": audit_text, "metrics": metrics, "spans": "\n".join(spans),
               "answers": "\n".join(answers)}  # fmt: skip
    for name, text in outputs.items():
        at = text.find(MARK)
        assert at < 0, (name, text[max(0, at - 300) : at + 100])
        assert BASIC[8:24] not in text, name
    assert len(sent) == 3  # the two 200s and the backend's 500; nothing refused went on
    for request in sent:
        assert MARK.encode() not in request.body
        assert set(request.headers) <= UPSTREAM_HEADERS, request.headers
        assert request.headers["host"] == f"127.0.0.1:{up.port}"
