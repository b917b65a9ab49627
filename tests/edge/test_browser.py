"""A real browser: headless Chromium loads a page from another origin, which streams a chat
completion from the edge over HTTP/2 or HTTP/3 with `fetch` (a JSON body and an `Authorization`
header, so Chromium sends a CORS preflight first) and reports what it read back to its own
origin. For HTTP/3 Chromium is told to use QUIC for the edge's origin at once
(`--origin-to-force-quic-on`) and to accept the development certificate by its key's hash.

Skipped, with the reason, only where no Chromium is installed (Debian: `apt-get install
chromium`)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import shutil
import tempfile
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from backends.sim import SimConfig, SimServer
from certs.dev import DevCertificates
from edge.cors import CorsConfig
from tests.edge.conftest import fast_config
from tests.edge.tls_edge import tls_edge, with_client_keys
from transport.h1_server import H1Listener
from transport.h3_server import H3Server
from transport.tickets import MemoryTicketStore
from transport.tls import CertificateFiles, TlsMaterial

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)

PAGE = """<!doctype html><meta charset="utf-8"><script>
(async () => {
  const report = (obj) => fetch("/result", {method: "POST", body: JSON.stringify(obj)});
  try {
    const r = await fetch("EDGE/v1/chat/completions", {
      method: "POST",
      headers: {"Content-Type": "application/json", "Authorization": "Bearer page-key"},
      body: JSON.stringify({model: "default", stream: true, max_tokens: 24, ignore_eos: true,
                            messages: [{role: "user", content: "hello from a page"}]}),
    });
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let text = "", reads = 0;
    for (;;) {
      const {done, value} = await reader.read();
      if (done) break;
      reads += 1;
      text += decoder.decode(value, {stream: true});
    }
    const timing = performance.getEntriesByType("resource").find(e => e.name.includes("/v1/"));
    await report({status: r.status, requestId: r.headers.get("x-request-id"), reads, text,
                  protocol: timing ? timing.nextHopProtocol : null,
                  responseStart: timing ? timing.responseStart : null});
  } catch (e) {
    await report({error: String(e)});
  }
})();
</script>"""


class PageServer:
    """The page's origin: serves the page and takes its report."""

    def __init__(self, page: str) -> None:
        self.page = page.encode()
        self.report: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/result":
            if not self.report.done():
                self.report.set_result(json.loads(body))
            out, kind = b"ok", b"text/plain"
        else:
            out, kind = self.page, b"text/html"
        headers = [(b"content-type", kind), (b"content-length", b"%d" % len(out))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": out})


def spki_hash(cert_pem: bytes) -> str:
    """base64(SHA-256(SubjectPublicKeyInfo)), as `--ignore-certificate-errors-spki-list` wants."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    spki = cert.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium)")
@pytest.mark.parametrize("protocol", ["h2", "h3"])
async def test_a_page_on_another_origin_streams_through_the_edge(
    dev_certs: DevCertificates, protocol: str
) -> None:
    assert CHROMIUM is not None
    paced = SimConfig(name="b", port=0, profile="h100-llama3-8b", time_scale=0.1)
    page_listener: H1Listener | None = None
    async with SimServer(paced) as sim:
        # the page's origin is known once its listener is bound; CORS names it
        server = PageServer("")
        page_listener = H1Listener(server, host="127.0.0.1", port=0)
        origin = f"http://127.0.0.1:{page_listener.address[1]}"
        cors = CorsConfig(origins=[origin])
        config = with_client_keys(fast_config([sim.url]), "page-key")
        async with tls_edge(config, dev_certs, cors=cors) as edge:
            h3: H3Server | None = None
            # the development CA is not in Chromium's trust store: accept the leaf by its key
            pin = spki_hash(dev_certs.cert.read_bytes())
            flags = ["--ignore-certificate-errors", f"--ignore-certificate-errors-spki-list={pin}",
                     # the listeners are on 127.0.0.1; Chromium would try ::1 first
                     "--host-resolver-rules=MAP localhost 127.0.0.1"]  # fmt: skip
            url = edge.url
            if protocol == "h3":
                tls = TlsMaterial(CertificateFiles(dev_certs.cert, dev_certs.key))
                h3 = H3Server(edge.wiring.app, tls=tls, tickets=MemoryTicketStore())
                await h3.start("127.0.0.1", 0)
                url = f"https://localhost:{h3.port}"
                flags += ["--enable-quic", f"--origin-to-force-quic-on=localhost:{h3.port}"]
            server.page = PAGE.replace("EDGE", url).encode()
            await page_listener.start()
            profile = tempfile.mkdtemp(prefix="quicedge-chromium-")
            browser = await asyncio.create_subprocess_exec(
                CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
                "--no-first-run", f"--user-data-dir={profile}", *flags, origin + "/",
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            try:
                report = await asyncio.wait_for(server.report, timeout=90)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    browser.kill()
                await browser.wait()
                await page_listener.stop()
                if h3 is not None:
                    await h3.aclose()
                shutil.rmtree(profile, ignore_errors=True)
    assert "error" not in report, report
    assert report["status"] == 200
    assert report["requestId"]  # exposed by Access-Control-Expose-Headers
    assert report["protocol"] == protocol
    assert report["responseStart"] > 0  # Timing-Allow-Origin: the page sees real timings
    events = [e for e in report["text"].split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert len(events) > 10
