"""Settings of the policy gateway: the TOML `[policy]` table and its arrays of tables.

```toml
[policy]
stream_lookbehind = 256

[[policy.rules]]
id = "no-secrets"
action = "deny"
patterns = ["api[_ -]?key", "password"]

[[policy.tenant_models]]
tenant = "free-co"
models = ["small-*"]

[[policy.tiers]]
tier = "bronze"
max_tokens = 512

[[policy.wasm]]
id = "deny-keyword"
path = "edge/policy/examples/deny_keyword.wasm"

[[policy.stream_rules]]
id = "no-leak"
patterns = ["BEGIN PRIVATE KEY"]
```

Everything is off by default: with no rules, no WASM module and no stream rule the gateway is
not built and a request pays nothing for it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from backends.labels import check_url
from edge import settings
from edge.stages.validate import GENERATION_ROUTES, WHOLE_ROUTES

INFERENCE_ROUTES = frozenset({*GENERATION_ROUTES, *WHOLE_ROUTES, "/v1/responses"})
"""The routes a client calls that the edge forwards (`edge.app.INFERENCE_ROUTES`): those
`policy.judge.routes` may name."""

KiB = 1024
MiB = 1024 * KiB


def _check_name(where: str, name: str) -> None:
    """A rule or module id, tenant or tier is named in a refusal's `x-quicedge-policy-rule`
    header (and in metrics and the audit log): one with a control character (a line break, a
    tab, NUL), an invisible or separator character a header cannot show, or a space at either
    end (which a header value loses) cannot be carried there, so the config is refused."""
    if not name.isprintable() or name != name.strip():
        raise ValueError(
            f"{where}: {name!r} cannot be named in the x-quicedge-policy-rule header: use"
            " printable characters, without control characters or spaces at either end"
        )


@dataclass
class RuleConfig:
    """One declarative rule over the prompt text (`[[policy.rules]]`)."""

    id: str = ""
    """Rule id: named in refusals, metrics and the audit log (required, unique)."""
    action: Literal["deny", "allow", "redact"] = "deny"
    """`deny` refuses a prompt that matches (403); `allow` exempts a matching prompt from every
    `deny` rule; `redact` replaces each match with `replacement` and forwards the request."""
    patterns: list[str] = field(default_factory=list)
    """Regular expressions (RE2 syntax), matched case-insensitively on the normalised
    prompt text (see docs/policy.md)."""
    literal: bool = False
    """Treat `patterns` as plain text instead of regular expressions."""
    tenants: list[str] = field(default_factory=list)
    """Tenants the rule applies to; empty: every tenant."""
    replacement: str = "[REDACTED]"
    """Text that replaces a match of a `redact` rule."""

    def validate(self) -> None:
        if not self.id:
            raise ValueError("policy.rules.id: every rule needs an id")
        _check_name("policy.rules.id", self.id)
        if not self.patterns:
            raise ValueError(f"policy.rules.patterns: rule {self.id!r} has no pattern")
        for pattern in self.patterns:
            _check_pattern(f"policy.rules.patterns ({self.id})", pattern, self.literal, re2=True)


@dataclass
class TenantModels:
    """Models one tenant may use (`[[policy.tenant_models]]`)."""

    tenant: str = ""
    """The tenant id (as admission names it; `anonymous` without an API key)."""
    models: list[str] = field(default_factory=list)
    """Allowed model ids; shell-style globs (`small-*`) are accepted."""

    def validate(self) -> None:
        if not self.tenant:
            raise ValueError("policy.tenant_models.tenant: required")
        _check_name("policy.tenant_models.tenant", self.tenant)


@dataclass
class TierLimits:
    """Request-size limits of one tier (`[[policy.tiers]]`)."""

    tier: str = ""
    """The tier name (as admission names it)."""
    max_tokens: int | None = None
    """Largest `max_tokens` / `max_completion_tokens` / `sampling_params.max_new_tokens` a
    request may ask for, times the answers it asks for (`n`, `best_of`, `sampling_params.n`,
    a batch's prompts); None: no limit."""
    max_prompt_chars: int | None = None
    """Longest prompt, in characters of its text; None: no limit."""

    def validate(self) -> None:
        if not self.tier:
            raise ValueError("policy.tiers.tier: required")
        _check_name("policy.tiers.tier", self.tier)
        for name in ("max_tokens", "max_prompt_chars"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"policy.tiers.{name}: must be >= 1, got {value}")


@dataclass
class WasmConfig:
    """One sandboxed policy module (`[[policy.wasm]]`)."""

    id: str = ""
    """Module id: named in refusals, metrics and the audit log (required)."""
    path: str = ""
    """The `.wasm` (or `.wat`) file; reloaded when it changes or on SIGHUP."""
    fuel: int = 10_000_000
    """Fuel per request (about one unit per WebAssembly instruction; 10 M): past it the call
    traps. A module that scans the prompt needs fuel in proportion to the largest prompt."""
    memory_bytes: int = 16 * MiB
    """Largest linear memory the module may have, bytes (16 MiB)."""
    on_error: Literal["closed", "open"] = "closed"
    """A module that traps, runs out of fuel or answers garbage: `closed` refuses the request
    (503 `policy_unavailable`), `open` lets it through. Either way it is counted."""
    poll_interval: float | None = 1.0
    """Seconds between checks of the file's modification time; None: reload on SIGHUP only."""

    def validate(self) -> None:
        if not self.id:
            raise ValueError("policy.wasm.id: required")
        _check_name("policy.wasm.id", self.id)
        _finite_numbers(self, "policy.wasm", self.id)
        if not self.path:
            raise ValueError(f"policy.wasm.path: module {self.id!r} needs a path")
        if self.fuel < 1000:
            raise ValueError(f"policy.wasm.fuel: must be >= 1000, got {self.fuel}")
        if self.memory_bytes < 64 * KiB:
            raise ValueError("policy.wasm.memory_bytes: must be >= 65536 (one page)")
        if self.poll_interval is not None and not self.poll_interval > 0:
            raise ValueError(
                f"policy.wasm.poll_interval ({self.id}): must be > 0, got {self.poll_interval!r}"
            )


@dataclass
class StreamRuleConfig:
    """A pattern watched for in the generated text (`[[policy.stream_rules]]`)."""

    id: str = ""
    """Rule id: named in the stream's end, metrics and the audit log (required)."""
    patterns: list[str] = field(default_factory=list)
    """Regular expressions (or plain text with `literal`), matched case-insensitively on the
    normalised generated text. A match must fit in `policy.stream_lookbehind` characters."""
    literal: bool = False
    """Treat `patterns` as plain text."""

    def validate(self) -> None:
        if not self.id:
            raise ValueError("policy.stream_rules.id: required")
        _check_name("policy.stream_rules.id", self.id)
        if not self.patterns:
            raise ValueError(f"policy.stream_rules.patterns: rule {self.id!r} has no pattern")
        for pattern in self.patterns:
            _check_pattern(f"policy.stream_rules.patterns ({self.id})", pattern, self.literal)


@dataclass
class JudgeConfig:
    """The guard model (`[policy.judge]`); off while `backends` is empty."""

    backends: list[str] = field(default_factory=list)
    """Base URLs of the guard servers (round robin); empty: no judge (default)."""
    model: str = "default"
    """The `model` sent to the guard."""
    mode: Literal["hold", "race"] = "hold"
    """`hold`: wait for the verdict before routing; `race`: forward at once, cancel on `unsafe`
    if the response has not started."""
    routes: list[str] = field(default_factory=list)
    """Routes judged; empty: every inference route."""
    timeout: float = 2.0
    """Seconds the guard has to answer (2)."""
    on_error: Literal["closed", "open"] = "open"
    """A guard that fails or times out: `closed` refuses (503 `policy_unavailable`), `open`
    lets the request through (default)."""
    max_prompt_chars: int = 16_000
    """Characters of prompt sent to the guard: the last ones (a longer prompt's start is cut,
    so no padding in front hides the newest text from it; 16000)."""

    def validate(self) -> None:
        _finite_numbers(self, "policy.judge")
        # checked as [proxy] backends are: a guard URL the pool cannot reach (https, a port out
        # of range, a path) failed every guard call, so each request went unjudged (`open`) or
        # was refused (`closed`) with no word at start
        checked: list[str] = []
        for url in self.backends:
            try:
                checked.append(check_url(url)[0])
            except ValueError as exc:
                raise ValueError(f"policy.judge.backends: {exc}") from None
        self.backends = checked
        # a route the edge does not serve (a typo: `/v1/chat/completion`) matched no request,
        # so the guard judged nothing while the operator thought it on
        for route in self.routes:
            if route not in INFERENCE_ROUTES:
                raise ValueError(
                    f"policy.judge.routes: {route!r} is not an inference route; choose from "
                    + ", ".join(sorted(INFERENCE_ROUTES))
                )
        if not self.timeout > 0:
            raise ValueError(f"policy.judge.timeout: must be > 0, got {self.timeout!r}")
        if self.max_prompt_chars < 1:
            raise ValueError("policy.judge.max_prompt_chars: must be >= 1")


@dataclass
class PolicyConfig:
    """The policy gateway (`[policy]`). Off unless something is configured."""

    rules: list[RuleConfig] = field(default_factory=list)
    """Declarative prompt rules, evaluated once per request."""
    tenant_models: list[TenantModels] = field(default_factory=list)
    """Per-tenant model allow-lists; a tenant not listed may use every model."""
    tiers: list[TierLimits] = field(default_factory=list)
    """Per-tier request-size limits; a tier not listed has none."""
    wasm: list[WasmConfig] = field(default_factory=list)
    """Sandboxed policy modules, run after the rules, in order."""
    stream_rules: list[StreamRuleConfig] = field(default_factory=list)
    """Patterns that end a streamed answer with `finish_reason: "content_filter"`."""
    stream_lookbehind: int = 256
    """Characters of generated text kept to catch a match split across chunks (256)."""
    stream_hold: bool = False
    """Hold back the events that may be the start of a match until it completes or fails, so no
    part of a match reaches the client; those tokens wait for the ones that decide. Off
    (default): nothing is held, and the stream is cut at the chunk that completes a match (the
    part of the match in earlier chunks has reached the client)."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The model-judged track (`[policy.judge]`); off while it names no backend."""
    stream_refusal: Literal["sse", "json"] = "sse"
    """How a refused streaming request is answered: `sse` (status 200, one chunk with
    `finish_reason: "content_filter"`, then `[DONE]`) or `json` (the 403 error)."""

    @property
    def request_enabled(self) -> bool:
        return bool(
            self.rules or self.tenant_models or self.tiers or self.wasm or self.judge.backends
        )

    @property
    def stream_enabled(self) -> bool:
        return bool(self.stream_rules)

    def validate(self) -> None:
        _finite_numbers(self, "policy")
        ids: set[str] = set()
        items: list[RuleConfig | WasmConfig | StreamRuleConfig] = [
            *self.rules,
            *self.wasm,
            *self.stream_rules,
        ]
        for item in items:
            item.validate()
            if item.id in ids:
                raise ValueError(f"policy: id {item.id!r} is used twice")
            ids.add(item.id)
        # A second table for the same tenant or tier would replace the first whole (its
        # models, or all its limits), silently: refused, so the file says what applies.
        tenants: set[str] = set()
        for models in self.tenant_models:
            models.validate()
            if models.tenant in tenants:
                raise ValueError(
                    f"policy.tenant_models: tenant {models.tenant!r} is listed twice; give it"
                    " one table with all its models"
                )
            tenants.add(models.tenant)
        tiers: set[str] = set()
        for tier in self.tiers:
            tier.validate()
            if tier.tier in tiers:
                raise ValueError(
                    f"policy.tiers: tier {tier.tier!r} is listed twice; give it one table with"
                    " all its limits"
                )
            tiers.add(tier.tier)
        self.judge.validate()
        if self.stream_lookbehind < 1:
            raise ValueError("policy.stream_lookbehind: must be >= 1")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> PolicyConfig:
        """From a `[policy]`-style table (tests, in-process callers), validated."""
        config = settings.from_mapping(cls, values, "policy")
        config.validate()
        return config


def _finite_numbers(config: Any, where: str, owner: str = "") -> None:
    """Refuse a NaN or infinite number in `config`'s own fields, naming the setting (and the
    module or rule `owner`): NaN passes every `<=` check (each comparison is False) and then
    breaks the timer or poller that takes it; an infinite time means nothing a large one does
    not."""
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            named = f"{where}.{f.name}" + (f" ({owner})" if owner else "")
            raise ValueError(f"{named}: must be a finite number, got {value!r}")


def _check_pattern(where: str, pattern: str, literal: bool, *, re2: bool = False) -> None:
    """Request and stream rules are both RE2 expressions (`google-re2`: linear time, so neither
    a prompt nor generated text can make one backtrack); a stream rule's must also match at least
    one character (`edge.policy.stream.check_pattern`)."""
    if not pattern:
        raise ValueError(f"{where}: an empty pattern matches everything")
    if literal:
        return
    if re2:
        from edge.policy.rules import check_pattern
    else:
        from edge.policy.stream import check_pattern
    problem = check_pattern(pattern)
    if problem is not None:
        raise ValueError(f"{where}: bad regular expression {pattern!r}: {problem}")


POLICY_FLAGS: dict[str, str | bool] = {"stream_refusal": "--policy-stream-refusal",
                                       "stream_lookbehind": "--policy-stream-lookbehind",
                                       "stream_hold": "--policy-stream-hold"}  # fmt: skip
"""Flags of the `[policy]` settings that have one (its rules and modules are TOML only)."""


__all__ = [
    "PolicyConfig",
    "RuleConfig",
    "StreamRuleConfig",
    "TenantModels",
    "TierLimits",
    "WasmConfig",
    "POLICY_FLAGS",
]
