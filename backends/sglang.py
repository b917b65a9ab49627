"""What the proxy needs from an SGLang server: health, load, metrics, abort, models.

One small async client per backend, shared by the real SGLang server and the CPU stand-in
(`backends.sim`), which speak the same HTTP API. It keeps one HTTP/1.1 connection (h11 over
asyncio streams) and reopens it when the server has closed it: SGLang runs uvicorn with a
5 s keep-alive, so an idle connection is routinely gone by the next poll.

Launching a real server on a GPU host with the flags quicedge relies on:

    python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B-Instruct \\
        --host 0.0.0.0 --port 30000 --enable-metrics --enable-cache-report

`--enable-metrics` mounts `/metrics` (sglang:* gauges, counters, the TTFT histogram);
`--enable-cache-report` puts `usage.prompt_tokens_details.cached_tokens` in OpenAI responses,
which the cache-aware router learns from. `launch_command()` builds that argv.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import h11
from prometheus_client.parser import text_string_to_metric_families

MAX_RESPONSE_BYTES = 16 * 1024 * 1024
READ_SIZE = 64 * 1024


class SGLangError(Exception):
    """The server could not be reached, timed out, or answered something unusable."""


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    num_running_reqs: int
    num_waiting_reqs: int
    num_total_tokens: int  # KV tokens in use
    token_usage: float  # used / pool size, 0.0 when the server does not say
    max_total_tokens: int | None


def launch_command(
    model_path: str = "meta-llama/Llama-3.1-8B-Instruct",
    *,
    host: str = "0.0.0.0",
    port: int = 30000,
    extra: Sequence[str] = (),
) -> list[str]:
    """argv for a real SGLang server with the flags quicedge relies on."""
    return [
        "python", "-m", "sglang.launch_server", "--model-path", model_path,
        "--host", host, "--port", str(port), "--enable-metrics", "--enable-cache-report",
        *extra,
    ]  # fmt: skip


class SGLangClient:
    def __init__(self, base_url: str, *, timeout: float = 2.0, api_key: str | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected an http://host:port URL, got {base_url!r}")
        if timeout <= 0:
            raise ValueError("timeout must be > 0")
        self.base_url = base_url.rstrip("/")
        self._host = parts.hostname
        self._port = parts.port or 80
        self._authority = parts.netloc.encode("ascii")
        self._prefix = parts.path.rstrip("/")
        self._timeout = timeout
        # SGLang's `--api-key`: every route but /health* and /metrics wants it.
        self._auth = [(b"authorization", f"Bearer {api_key}".encode())] if api_key else []
        self._lock = asyncio.Lock()
        self.health_error: str | None = None
        """Why the last `health()` was False (None after a True one)."""
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._conn: h11.Connection | None = None

    def __repr__(self) -> str:
        state = "connected" if self._writer is not None else "idle"
        return f"SGLangClient({self.base_url!r}, {state})"

    # -- the API -------------------------------------------------------------------------------

    async def health(self) -> bool:
        """GET /health is 200: the server is up and its scheduler answers. Never raises; when
        False, `health_error` says why."""
        try:
            status, _ = await self._request("GET", "/health")
        except SGLangError as exc:
            self.health_error = str(exc)
            return False
        self.health_error = None if status == 200 else f"/health answered {status}"
        return status == 200

    async def loads(self) -> LoadSnapshot:
        """GET /v1/loads; older servers: GET /get_load (list form, or {"load": n})."""
        status, body = await self._request("GET", "/v1/loads")
        if status == 404:
            status, body = await self._request("GET", "/get_load")
        if status != 200:
            raise SGLangError(f"{self.base_url}: load query answered {status}")
        return parse_loads(_json(body, self.base_url))

    async def metrics(self) -> dict[str, float]:
        """GET /metrics, sglang:* samples as {'name{label="v",...}': value}."""
        status, body = await self._request("GET", "/metrics")
        if status != 200:
            raise SGLangError(f"{self.base_url}: /metrics answered {status} (--enable-metrics?)")
        return parse_metrics(body.decode("utf-8", "replace"))

    async def abort(self, rid: str) -> bool:
        """POST /abort_request {"rid": rid}. SGLang answers 200 whether or not rid was known."""
        status, _ = await self._request("POST", "/abort_request", {"rid": rid})
        return status == 200

    async def models(self) -> dict[str, Any]:
        status, body = await self._request("GET", "/v1/models")
        if status != 200:
            raise SGLangError(f"{self.base_url}: /v1/models answered {status}")
        out = _json(body, self.base_url)
        if not isinstance(out, dict):
            raise SGLangError(f"{self.base_url}: /v1/models is not a JSON object")
        return out

    async def model_info(self) -> dict[str, Any]:
        """GET /get_model_info: `model_path`, `weight_version` and the model's kind."""
        status, body = await self._request("GET", "/get_model_info")
        if status != 200:
            raise SGLangError(f"{self.base_url}: /get_model_info answered {status}")
        out = _json(body, self.base_url)
        if not isinstance(out, dict):
            raise SGLangError(f"{self.base_url}: /get_model_info is not a JSON object")
        return out

    async def aclose(self) -> None:
        async with self._lock:
            self._drop()

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- HTTP/1.1 on one kept connection -------------------------------------------------------

    async def _request(
        self, method: str, path: str, payload: Any | None = None
    ) -> tuple[int, bytes]:
        body = b"" if payload is None else json.dumps(payload).encode()
        async with self._lock:
            for attempt in range(2):
                reused = self._writer is not None
                try:
                    async with asyncio.timeout(self._timeout):
                        return await self._exchange(method, path, body)
                except TimeoutError:
                    self._drop()
                    raise SGLangError(
                        f"{self.base_url}{path}: no answer within {self._timeout}s"
                    ) from None
                except (OSError, EOFError, asyncio.IncompleteReadError, h11.ProtocolError) as exc:
                    self._drop()
                    # A kept connection the server closed while idle: retry once on a new one.
                    if reused and attempt == 0:
                        continue
                    raise SGLangError(f"{self.base_url}{path}: {exc!r}") from exc
        raise AssertionError("unreachable")

    async def _exchange(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self._host, self._port)
            self._conn = h11.Connection(h11.CLIENT)
        assert self._reader is not None and self._conn is not None
        conn, reader, writer = self._conn, self._reader, self._writer
        headers = [(b"host", self._authority), (b"accept", b"*/*"), *self._auth]
        if method != "GET":
            headers += [(b"content-type", b"application/json"),
                        (b"content-length", b"%d" % len(body))]  # fmt: skip
        out = conn.send(h11.Request(method=method, target=self._prefix + path, headers=headers))
        if body:
            out += conn.send(h11.Data(data=body))
        out += conn.send(h11.EndOfMessage())
        writer.write(out)
        await writer.drain()
        status = 0
        chunks = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(READ_SIZE)
                if not data and conn.their_state is h11.SEND_RESPONSE:
                    raise EOFError("connection closed before the response")
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                chunks += event.data
                if len(chunks) > MAX_RESPONSE_BYTES:
                    raise SGLangError(f"{self.base_url}{path}: response over {MAX_RESPONSE_BYTES}")
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise EOFError("connection closed mid-response")
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        else:
            self._drop()
        return status, bytes(chunks)

    def _drop(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
        self._conn = None


def _json(body: bytes, where: str) -> Any:
    try:
        return json.loads(body)
    except ValueError as exc:
        raise SGLangError(f"{where}: invalid JSON ({exc})") from None


def _int(entry: dict[str, Any], *keys: str) -> int:
    for key in keys:
        value = entry.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return int(value)
    return 0


def parse_loads(obj: Any) -> LoadSnapshot:
    """Accepts the /v1/loads object, the /get_load list, or the oldest {"load": n}.

    With several DP ranks the counts are summed and token usage is the pooled ratio.
    """
    if isinstance(obj, dict) and isinstance(obj.get("loads"), list):
        ranks = obj["loads"]
    elif isinstance(obj, list):
        ranks = obj
    elif isinstance(obj, dict) and isinstance(obj.get("load"), int):
        return LoadSnapshot(obj["load"], 0, 0, 0.0, None)
    else:
        raise SGLangError(f"unrecognised load payload: {str(obj)[:200]}")
    if not ranks or not all(isinstance(r, dict) for r in ranks):
        raise SGLangError("load payload has no per-rank entries")
    running = waiting = used = 0
    capacity: int | None = 0
    usage_sum = 0.0
    for rank in ranks:
        rank_waiting = _int(rank, "num_waiting_reqs")
        if "num_running_reqs" in rank:
            rank_running = _int(rank, "num_running_reqs")
        else:  # legacy: num_reqs = running + waiting
            rank_running = max(0, _int(rank, "num_reqs") - rank_waiting)
        running += rank_running
        waiting += rank_waiting
        used += _int(rank, "num_used_tokens", "num_total_tokens", "num_tokens")
        cap = _int(rank, "max_total_num_tokens")
        capacity = None if capacity is None or cap == 0 else capacity + cap
        usage = rank.get("token_usage")
        usage_sum += float(usage) if isinstance(usage, int | float) else 0.0
    if capacity:
        token_usage = used / capacity
    else:
        token_usage = usage_sum / len(ranks)
    if not math.isfinite(token_usage):
        token_usage = 0.0
    return LoadSnapshot(running, waiting, used, token_usage, capacity or None)


def parse_metrics(text: str) -> dict[str, float]:
    """sglang:* samples of a Prometheus text exposition, keyed as they are written."""
    out: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise SGLangError(f"unparseable /metrics: {exc}") from None
    for family in families:
        for sample in family.samples:
            if not sample.name.startswith("sglang:"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out
