"""Run a workload against one or more client configurations and record every request.

Configurations compared in one run are interleaved request by request: session i is run under
every configuration (in an order that rotates with i) before session i+1, so that machine noise
and backend state drift hit all configurations alike. Arrivals are a Poisson process at `rate`
(exponential gaps, as bench_serving) or as fast as `concurrency` allows.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from bench.clients import Client, ClientError, ClientOptions, Target, TicketStore, make_client
from bench.stream import RequestResult
from bench.workloads import Conversation, Session, Turn, request_body


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One client configuration: `[NAME=]TRANSPORT[+0rtt][+reuse|+new][+stored][+cache][@URL]`
    on the command line. `+0rtt` implies a new connection per request (each one resumes) unless
    `+reuse` is given. `+stored` keeps chat sessions at the edge (`x-quicedge-conversation`: each
    turn sends only its new message); `+cache` asks for the response cache
    (`x-quicedge-cache: use`)."""

    name: str
    transport: str
    zero_rtt: bool = False
    new_connection_per_request: bool = True
    url: str | None = None  # None: the run's --url
    stored: bool = False
    cache: bool = False

    @classmethod
    def parse(cls, spec: str, *, new_connection: bool = False) -> BenchConfig:
        name, sep, rest = spec.partition("=")
        if not sep:
            name, rest = "", spec
        rest, at, url = rest.partition("@")
        transport, *flags = rest.split("+")
        unknown = [f for f in flags if f not in ("0rtt", "reuse", "new", "stored", "cache")]
        if transport not in ("h3", "h2", "h1") or unknown or {"reuse", "new"} <= set(flags):
            raise ClientError(
                f"bad configuration {spec!r}: expected "
                "[NAME=]h3|h2|h1[+0rtt][+reuse|+new][+stored][+cache][@URL]"
            )
        if at and not url:
            raise ClientError(f"bad configuration {spec!r}: empty URL after @")
        zero_rtt = "0rtt" in flags
        if zero_rtt and transport != "h3":
            raise ClientError(f"bad configuration {spec!r}: 0-RTT needs h3")
        return cls(
            name or rest,
            transport,
            zero_rtt=zero_rtt,
            new_connection_per_request="reuse" not in flags
            and (new_connection or zero_rtt or "new" in flags),
            url=url if at else None,
            stored="stored" in flags,
            cache="cache" in flags,
        )


@dataclass(frozen=True, slots=True)
class RunPlan:
    configs: tuple[BenchConfig, ...]
    url: str
    sessions: tuple[Session, ...]
    rate: float | None = None  # requests per second (Poisson); None: as fast as concurrency allows
    concurrency: int = 1
    duration: float | None = None  # stop starting new sessions after this many seconds
    warmup: int = 1  # unrecorded requests per configuration before the run
    seed: int = 1
    options: ClientOptions = field(default_factory=ClientOptions)
    # Where each configuration's requests really go (e.g. through a relay), by config name.
    targets: dict[str, Target] = field(default_factory=dict)
    workload: str = ""


class Progress:
    """A one-line progress bar on stderr (only when it is a terminal, unless forced)."""

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool | None = None):
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done = 0
        self.errors = 0
        self._last = 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.errors += 0 if ok else 1
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done == self.total):
            self._last = now
            width = 30
            filled = int(width * self.done / max(self.total, 1))
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r[{bar}] {self.done}/{self.total} errors={self.errors}")
            if self.done >= self.total:
                self.stream.write("\n")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and 0 < self.done < self.total:
            self.stream.write("\n")
            self.stream.flush()


def record(
    result: RequestResult,
    *,
    config: BenchConfig,
    index: int,
    turn: int,
    session: Session,
    started: float,
    url: str,
    request_bytes: int | None = None,
) -> dict[str, Any]:
    """The JSON line of one request. Times in milliseconds; `start_s` from the run's start."""

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000.0, 3)

    cached_fraction = None
    if result.prompt_tokens and result.cached_tokens is not None:
        cached_fraction = round(result.cached_tokens / result.prompt_tokens, 4)
    return {
        "config": config.name,
        "index": index,
        "turn": turn,
        "group": session.group,
        "session": session.key,
        "url": url,
        "transport": result.transport,
        "zero_rtt": config.zero_rtt,
        "new_connection": not result.reused_connection,
        "early_data": bool(result.early_data and result.early_data_accepted),
        "early_data_attempted": result.early_data,
        "status": result.status,
        "error": result.error,
        "start_s": round(result.start - started, 6),
        "connect_ms": ms(result.connect_s),
        "headers_ms": ms(result.headers_s),
        "ttft_ms": ms(result.ttft_s),
        "latency_ms": ms(result.latency_s),
        "itl_ms": [round(gap * 1000.0, 3) for gap in result.itl_s],
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": result.cached_tokens,
        "cached_fraction": cached_fraction,
        "backend": result.backend,
        "request_bytes": request_bytes,
        "cache": result.header("x-quicedge-cache"),
    }


class Runner:
    """Runs a `RunPlan`: warm-up, then every session under every configuration; each finished
    request goes to `on_record` as its JSON-able record."""

    def __init__(
        self,
        plan: RunPlan,
        *,
        on_record: Callable[[dict[str, Any]], None],
        progress: Progress | None = None,
    ) -> None:
        self.plan = plan
        self.on_record = on_record
        self.progress = progress
        self.clients: dict[str, Client] = {}
        self.tickets: dict[str, TicketStore] = {}
        self.started = 0.0
        self.ended = 0.0
        self.in_flight = 0
        self.peak_in_flight = 0  # the concurrency reached (below --concurrency when few sessions)

    def _target(self, config: BenchConfig) -> Target:
        if config.name in self.plan.targets:
            return self.plan.targets[config.name]
        return Target.parse(config.url or self.plan.url, server_name=self.plan.options.server_name)

    def _client(self, config: BenchConfig) -> Client:
        client = self.clients.get(config.name)
        if client is None:
            options = ClientOptions(
                cacert=self.plan.options.cacert,
                insecure=self.plan.options.insecure,
                server_name=self.plan.options.server_name,
                new_connection_per_request=config.new_connection_per_request,
                zero_rtt=config.zero_rtt,
                timeout=self.plan.options.timeout,
            )
            tickets = self.tickets.setdefault(config.name, TicketStore())
            client = make_client(config.transport, options, tickets=tickets)
            self.clients[config.name] = client
        return client

    async def _send(
        self,
        config: BenchConfig,
        conversation: Conversation,
        turn: Turn,
        session_key: str | None = None,
    ) -> tuple[RequestResult, int]:
        """Send one turn; returns the result and the request's bytes (body and headers)."""
        target = self._target(config)
        payload = request_body(target.path, conversation, turn)
        headers = [("content-type", "application/json")]
        if session_key:
            headers.append(("x-session-id", session_key))
        if config.cache:
            headers.append(("x-quicedge-cache", "use"))
        if config.stored:
            if not target.path.endswith("/chat/completions"):
                raise ClientError(f"{config.name}: +stored needs a /v1/chat/completions URL")
            # the edge holds the history: send only what it has not seen
            payload["messages"] = conversation.messages[conversation.stored :]
            headers.append(("x-quicedge-conversation", conversation.remote_id or "new"))
        body = json.dumps(payload).encode()
        size = len(body) + sum(len(k) + len(v) for k, v in headers)
        result = await self._client(config).request(
            target, method="POST", headers=headers, body=body
        )
        if config.stored and result.ok:
            conversation.remote_id = result.header("x-quicedge-conversation")
        return result, size

    async def _run_session(self, index: int, config: BenchConfig, salt: str) -> None:
        session = self.plan.sessions[index]
        conversation = Conversation(salt=salt)
        session_key = f"{salt.strip()}{session.key}" if session.key else None
        for number, turn in enumerate(session.turns):
            conversation.add_user(turn)
            result, size = await self._send(config, conversation, turn, session_key)
            self.on_record(
                record(
                    result,
                    config=config,
                    index=index,
                    turn=number,
                    session=session,
                    started=self.started,
                    url=config.url or self.plan.url,
                    request_bytes=size,
                )
            )
            if self.progress is not None:
                self.progress.update(result.ok)
            if not result.ok:
                break  # a later turn would build on an answer we do not have
            conversation.add_answer(result.text)
            conversation.stored = len(conversation.messages)

    async def warm_up(self) -> list[str]:
        """Unrecorded requests per configuration: open the path, fetch 0-RTT tickets (one per
        concurrent request, so every request can resume). Returns the errors seen."""
        errors = []
        turn = Turn("warm up", 4)
        for config in self.plan.configs:
            count = self.plan.warmup
            if config.zero_rtt:
                count = max(count, self.plan.concurrency)
            if count <= 0:
                continue

            async def one(config: BenchConfig = config) -> RequestResult:
                conversation = Conversation(salt="warmup ")
                conversation.add_user(turn)
                return (await self._send(config, conversation, turn))[0]

            results = await asyncio.gather(*(one() for _ in range(count)))
            errors += [f"{config.name}: {r.error or r.status}" for r in results if not r.ok]
        return errors

    def _jobs(self) -> list[tuple[int, BenchConfig]]:
        configs = self.plan.configs
        jobs = []
        for index in range(len(self.plan.sessions)):
            shift = index % len(configs)  # rotate so no configuration always goes first
            for config in configs[shift:] + configs[:shift]:
                jobs.append((index, config))
        return jobs

    async def run(self) -> None:
        salts = {
            config.name: (f"[{config.name}] " if len(self.plan.configs) > 1 else "")
            for config in self.plan.configs
        }
        rng = random.Random(self.plan.seed)
        gate = asyncio.Semaphore(self.plan.concurrency)
        tasks: list[asyncio.Task[None]] = []
        loop = asyncio.get_running_loop()
        self.started = time.perf_counter()
        deadline = None if self.plan.duration is None else loop.time() + self.plan.duration

        async def job(index: int, config: BenchConfig) -> None:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            try:
                await self._run_session(index, config, salts[config.name])
            finally:
                self.in_flight -= 1
                gate.release()

        next_at = loop.time()
        try:
            for index, config in self._jobs():
                if self.plan.rate is not None:
                    next_at += rng.expovariate(self.plan.rate)
                    delay = next_at - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                await gate.acquire()
                if deadline is not None and loop.time() >= deadline:
                    gate.release()
                    break
                tasks.append(asyncio.create_task(job(index, config)))
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            self.ended = time.perf_counter()

    async def aclose(self) -> None:
        for client in self.clients.values():
            await client.aclose()
        self.clients.clear()
