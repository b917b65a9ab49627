"""`SimConfig`: the stand-in's options, mirroring SGLang's server arguments where they exist."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from backends.sim.guard import parse_rules
from backends.sim.profiles import Profile, get_profile

MiB = 1024 * 1024


@dataclass(slots=True)
class SimConfig:
    name: str = "sim"
    """Instance name (shows in /server_info and logs; not the model name)."""
    host: str = "127.0.0.1"
    port: int = 30000
    """TCP port; 0 picks a free one (see `SimServer.port`). SGLang's default is 30000."""
    profile: str = "instant"
    """Timing profile: h100-llama3-8b, h200-llama3-8b or instant (no simulated compute)."""
    time_scale: float = 1.0
    """Every simulated duration is multiplied by this (0.01 runs 100x faster)."""
    max_running_requests: int | None = None
    """Cap on requests in the running batch (`--max-running-requests`); None: the profile's."""
    max_total_tokens: int | None = None
    """KV pool size in tokens (`--max-total-tokens`, `--kv-tokens`); None: the profile's."""
    new_token_ratio: float | None = None
    """Share of a request's `max_new_tokens` reserved in the KV pool at admission, as SGLang's
    `new_token_ratio` estimate (0.7 at its start); running requests that then outgrow the pool
    are retracted and re-queued. None reserves all of it (nothing is ever retracted)."""
    page_size: int = 1
    max_prefill_tokens: int = 16384
    """New (uncached) tokens one prefill batch may take."""
    chunked_prefill_size: int = 8192
    """Longer prompts are prefilled in chunks of this many tokens, one chunk per batch."""
    enable_metrics: bool = False
    enable_cache_report: bool = False
    seed: int = 0
    served_model_name: str | None = None
    """Model name on the OpenAI routes; None: the profile's model path."""
    model_version: str = "default"
    """Reported as SGLang's `weight_version` (`/get_model_info`, answers' metadata)."""
    variant: Literal["none", "text", "long", "flat"] = "none"
    """A controlled change of the outputs, to stand in for another version of the model: `text`
    another text stream for the same prompt, `long` answers twice as long, `flat` logprobs
    whose mean top-1 probability is 0.08 lower (and whose entropy is higher)."""
    context_length: int | None = None
    disable_radix_cache: bool = False
    natural_output_len: tuple[int, int] = (64, 512)
    """Range of the answer length at which the model emits end-of-turn (unless ignore_eos)."""
    startup_delay: float = 0.0
    """Simulated warmup (scaled) during which /health answers 503."""
    timeout_keep_alive: float = 5.0
    """Idle keep-alive connections are closed after this many seconds (uvicorn in SGLang: 5)."""
    max_body_bytes: int = 32 * MiB
    """Request bodies above this get 413."""
    api_key: str | None = None
    """SGLang's `--api-key`: every request but `OPTIONS`, `/health*` and `/metrics` needs
    `Authorization: Bearer KEY`, else 401 `{"error": "Unauthorized"}`; None: open."""
    record_timings: int = 0
    """Keep the `perf_counter()` stamps of this many most recent generation requests, served
    at `/debug/timings` for benchmarks; 0: off."""
    guard: bool = False
    """Answer `/v1/chat/completions` as a Llama-Guard-style safety classifier: `safe`, or
    `unsafe\nS<n>` when the messages match a `guard_unsafe` pattern (backends/sim/guard.py)."""
    guard_unsafe: tuple[str, ...] = ()
    """Guard mode's patterns: `S<n>=REGEX` or `REGEX` (category S1), Python regular
    expressions searched case-insensitively in the messages' text; the first match decides."""
    reasoning_tokens: int = 0
    """Think this many tokens before answering, as a reasoning model behind SGLang's
    `--reasoning-parser`: chat answers carry them as `reasoning_content`, the rest as `content`
    (usage `reasoning_tokens`); 0: no thinking."""
    health_poll: float = 0.0
    """Seconds between the looks `/health` takes at its check generation, as SGLang's
    `health_generate` does (`await asyncio.sleep(1)` before each, so a real server's 200 takes
    at least 1 s: set 1.0 to see that); 0: the answer goes out as soon as the check is done."""
    kv_events_config: str | None = None
    """SGLang's `--kv-events-config` JSON, e.g. `{"publisher": "zmq", "endpoint":
    "tcp://*:5557"}`: publish the radix cache's changes as KV-cache events (`topic` too);
    None or publisher `null`: nothing is published."""

    def __post_init__(self) -> None:
        get_profile(self.profile)  # raises ValueError for an unknown name
        checks: list[tuple[bool, str]] = [
            (0 <= self.port <= 65535, "port must be in 0..65535"),
            (self.time_scale >= 0, "time_scale must be >= 0"),
            (self.page_size >= 1, "page_size must be >= 1"),
            (self.max_prefill_tokens >= 1, "max_prefill_tokens must be >= 1"),
            (self.chunked_prefill_size >= 1, "chunked_prefill_size must be >= 1"),
            (
                self.max_running_requests is None or self.max_running_requests >= 1,
                "max_running_requests must be >= 1",
            ),
            (
                self.max_total_tokens is None or self.max_total_tokens >= 2,
                "max_total_tokens must be >= 2",
            ),
            (
                self.context_length is None or self.context_length >= 2,
                "context_length must be >= 2",
            ),
            (
                1 <= self.natural_output_len[0] <= self.natural_output_len[1],
                "natural_output_len must be (lo, hi) with 1 <= lo <= hi",
            ),
            (self.startup_delay >= 0, "startup_delay must be >= 0"),
            (self.health_poll >= 0, "health_poll must be >= 0"),
            (
                self.new_token_ratio is None or 0 < self.new_token_ratio <= 1,
                "new_token_ratio must be in (0, 1]",
            ),
            (self.timeout_keep_alive > 0, "timeout_keep_alive must be > 0"),
            (self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024"),
            (self.record_timings >= 0, "record_timings must be >= 0"),
            (self.variant in ("none", "text", "long", "flat"), "variant: none|text|long|flat"),
            (bool(self.model_version), "model_version must not be empty"),
            (self.guard or not self.guard_unsafe, "guard_unsafe needs guard mode (--guard)"),
            (self.reasoning_tokens >= 0, "reasoning_tokens must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        parse_rules(self.guard_unsafe)  # raises ValueError naming a pattern that does not compile
        self.kv_events  # noqa: B018 (raises ValueError for a bad --kv-events-config)

    @property
    def kv_events(self) -> tuple[str, str] | None:
        """(endpoint, topic) of the KV-event publisher, or None when there is none."""
        if self.kv_events_config is None:
            return None
        try:
            raw = json.loads(self.kv_events_config)
        except ValueError as exc:
            raise ValueError(f"kv_events_config: not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("kv_events_config: expected a JSON object")
        publisher = raw.get("publisher", "null")
        if publisher == "null":
            return None
        if publisher != "zmq":
            raise ValueError(f"kv_events_config: unknown publisher {publisher!r} (zmq, null)")
        endpoint, topic = raw.get("endpoint", "tcp://*:5557"), raw.get("topic", "")
        if not isinstance(endpoint, str) or not isinstance(topic, str):
            raise ValueError("kv_events_config: endpoint and topic must be strings")
        return endpoint, topic

    @property
    def timing(self) -> Profile:
        return get_profile(self.profile)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.timing.model_path

    @property
    def effective_max_running_requests(self) -> int:
        return self.max_running_requests or self.timing.max_running_requests

    @property
    def effective_max_total_tokens(self) -> int:
        return self.max_total_tokens or self.timing.max_total_tokens

    @property
    def effective_context_length(self) -> int:
        return self.context_length or self.timing.context_length
