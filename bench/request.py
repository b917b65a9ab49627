"""`quicedge request`: send one streamed request, print the answer as it arrives, then its TTFT.

    quicedge request https://localhost:8443/v1/chat/completions \\
        --json '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}' \\
        --h3 --cacert certs/dev/ca.pem --ticket ~/.cache/quicedge.ticket

With `--ticket FILE` (HTTP/3 only) the session ticket the server sends is saved to FILE (mode
0600); the next call resumes with it and sends the request in 0-RTT early data. Each ticket is
used once, since quicedge accepts a ticket only once. The server's address token (NEW_TOKEN) is
saved beside it and presented on the next call, so that the server may send the whole answer
before the handshake completes.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
from pathlib import Path
from typing import Any, TextIO

from bench.clients import ClientError, ClientOptions, Target, TicketStore, make_client
from bench.loop import run
from bench.stream import RequestResult

OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quicedge request",
        description="Send one request (HTTP/3, HTTP/2 or HTTP/1.1); print the stream and TTFT.",
        epilog="ttft runs from just before the connection is opened (so it includes the "
        "handshake) to the first streamed event with generated text; total, to the last byte "
        '(docs/benchmarks.md, "Definitions"). Exit status: 0 for a 200 answer read to its end '
        "(a stream without generated text is a failure), 1 for any failure (its reason on the "
        "error: line), 2 for bad arguments, 130 after Ctrl-C.",
    )
    parser.add_argument("url", help="e.g. https://localhost:8443/v1/chat/completions")
    parser.add_argument("--json", dest="body", required=True, help="the request body (JSON)")
    group = parser.add_mutually_exclusive_group()
    for name, label in (("h3", "HTTP/3"), ("h2", "HTTP/2 over TLS"), ("h1", "HTTP/1.1")):
        group.add_argument(
            f"--{name}", dest="transport", action="store_const", const=name, help=f"use {label}"
        )
    parser.add_argument(
        "--ticket", type=Path, help="session ticket and address token file: save, then resume 0-RTT"
    )
    parser.add_argument("--cacert", help="CA certificate to verify the server with")
    parser.add_argument("--insecure", action="store_true", help="do not verify the certificate")
    parser.add_argument("--server-name", help="TLS name, when it differs from the URL host")
    parser.add_argument(
        "-H", "--header", action="append", default=[], metavar="NAME: VALUE",
        help="extra request header (repeatable)",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole call")
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    return parser


def prepare_body(text: str, path: str) -> dict[str, Any]:
    """The JSON body, with streaming turned on (and usage asked for on OpenAI routes)."""
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--json is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError("--json must be a JSON object")
    body.setdefault("stream", True)
    if body["stream"] and path.split("?")[0] in OPENAI_ROUTES:
        body.setdefault("stream_options", {"include_usage": True})
    return body


def cacert_problem(path: str) -> str | None:
    """Why `--cacert` cannot verify a server, or None. Tried before the first connection: a
    missing file ended HTTP/2 and HTTP/1.1 calls with a traceback and left an HTTP/3 one
    waiting out its timeout, and a file with no certificate failed the handshake as if the
    server had closed it."""
    try:
        ssl.create_default_context(cafile=path)
    except ssl.SSLError:
        return "not a PEM certificate file"
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def parse_header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"header must look like 'Name: value', got {text!r}")
    return name.strip().lower(), value.strip()


def summary(result: RequestResult) -> list[str]:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f} ms"

    if not result.early_data:
        early = "not used"
    elif result.early_data_accepted:
        early = "accepted (0-RTT)"
    else:
        early = "rejected (resent after the handshake)"
    lines = [
        f"status: {result.status if result.status is not None else '-'}",
        f"transport: {result.transport}",
        f"ttft: {ms(result.ttft_s)}",
        f"total: {ms(result.latency_s)}",
        f"early data: {early}",
        f"backend: {result.backend or '-'}",
    ]
    if result.prompt_tokens is not None:
        lines.append(f"prompt tokens: {result.prompt_tokens} (cached {result.cached_tokens or 0})")
    if result.error:
        lines.append(f"error: {result.error}")
    return lines


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        target = Target.parse(args.url, server_name=args.server_name)
        body = prepare_body(args.body, target.path)
        headers = [("content-type", "application/json")]
        headers += [parse_header(h) for h in args.header]
    except (ClientError, ValueError) as exc:
        parser.error(str(exc))
    transport = args.transport or ("h3" if target.scheme == "https" else "h1")
    if transport in ("h3", "h2") and target.scheme != "https":
        parser.error(f"--{transport} needs an https:// URL")
    if args.ticket is not None and transport != "h3":
        parser.error("--ticket needs HTTP/3 (--h3): 0-RTT is a QUIC feature here")
    if args.timeout <= 0:
        parser.error("--timeout must be > 0")
    problem = cacert_problem(args.cacert) if args.cacert else None
    if problem is not None:
        parser.error(f"--cacert {args.cacert}: {problem}")
    try:
        tickets = TicketStore(args.ticket) if args.ticket is not None else None
    except (OSError, ValueError) as exc:
        parser.error(f"cannot read ticket file: {exc}")
    if args.ticket is not None:  # tried now: saving it after the answer ended in a traceback
        existed = args.ticket.exists()
        try:
            os.close(os.open(args.ticket, os.O_WRONLY | os.O_CREAT, 0o600))
        except OSError as exc:
            parser.error(f"--ticket {args.ticket}: {exc.strerror}")
        if not existed:
            args.ticket.unlink(missing_ok=True)
    options = ClientOptions(
        cacert=args.cacert,
        insecure=args.insecure,
        server_name=args.server_name,
        zero_rtt=tickets is not None,
        timeout=args.timeout,
    )
    payload = json.dumps(body).encode()
    call = _call(transport, options, tickets, target, headers, payload, args.quiet)
    try:
        result = run(call)
    except KeyboardInterrupt:  # Ctrl-C: the connection is closed (asyncio.Runner cancels)
        sys.stdout.write("\n")
        sys.stdout.flush()
        print("quicedge request: interrupted", file=sys.stderr)
        return 130
    if tickets is not None:
        tickets.save()
    out: TextIO = sys.stdout
    if not args.quiet and result.text:
        out.write("\n")
    out.write("\n".join(summary(result)) + "\n")
    out.flush()
    return 0 if result.error is None and result.status == 200 else 1


async def _call(
    transport: str,
    options: ClientOptions,
    tickets: TicketStore | None,
    target: Target,
    headers: list[tuple[str, str]],
    body: bytes,
    quiet: bool,
) -> RequestResult:
    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    client = make_client(transport, options, tickets=tickets)
    try:
        return await client.request(
            target, method="POST", headers=headers, body=body, on_text=None if quiet else show
        )
    finally:
        await client.aclose()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
