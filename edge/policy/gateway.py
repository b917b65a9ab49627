"""The policy gateway: the request stage (rules, then WebAssembly modules) and the stream rules.

Built only when `[policy]` configures something (`PolicyGateway.from_config` returns None
otherwise), so an edge without policies runs exactly the code it ran before. `stage` runs once per
request on the body the app already parsed; it returns the bytes to forward: the original ones,
or the body serialised again when a rule or a module redacted something.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from edge.errors import PolicyRefused, PolicyUnavailable, StreamRefusal
from edge.policy.config import PolicyConfig
from edge.policy.rules import RequestRules, apply_spans, requested_tokens, text_slots
from edge.policy.stream import StreamRules, final_events
from edge.policy.wasm import ModuleFailed, WasmPolicy

if TYPE_CHECKING:
    from edge.exchange import Exchange

Counter = Callable[[str, str], None]
"""(rule or module id, outcome) -> None: a metric the gateway reports into."""

REDACTED = "[REDACTED]"
"""What replaces a span a module asked to redact."""


@dataclass(slots=True)
class PolicyOutcome:
    decision: str = "allow"
    """`allow`, `redact`, or `allow_on_error` (a failing module configured to fail open)."""
    rules: list[str] = field(default_factory=list)
    """Ids of the rules and modules that matched, in order."""
    redacted: bool = False


class PolicyGateway:
    """Request rules, WebAssembly modules and stream rules of one `PolicyConfig`."""

    def __init__(
        self,
        config: PolicyConfig,
        *,
        on_decision: Counter | None = None,
        on_module_failure: Counter | None = None,
    ) -> None:
        self.config = config
        self.rules = (
            RequestRules(config) if (config.rules or config.tenant_models or config.tiers) else None
        )
        self.modules = [WasmPolicy(c, on_failure=on_module_failure) for c in config.wasm]
        self.stream = StreamRules.from_config(config)
        self._count = on_decision or (lambda rule, outcome: None)
        self._reloads: set[asyncio.Task[bool]] = set()

    @classmethod
    def from_config(cls, config: PolicyConfig, **kwargs: Any) -> PolicyGateway | None:
        if not (config.request_enabled or config.stream_enabled):
            return None
        return cls(config, **kwargs)

    # -- the request stage -------------------------------------------------------------------

    def check(
        self,
        route: str,
        body: MutableMapping[str, Any],
        *,
        tenant: str,
        tier: str,
        stream: bool,
    ) -> PolicyOutcome:
        """Pass (maybe redacting in `body`) or raise the refusal the client gets."""
        outcome = PolicyOutcome()
        if self.rules is None and not self.modules:
            return outcome
        slots = text_slots(route, body)
        try:
            if self.rules is not None:
                verdict = self.rules.check(route, body, tenant=tenant, tier=tier, slots=slots)
                for rule, result in verdict.fired:
                    outcome.rules.append(rule)
                    self._count(rule, result)
                outcome.redacted = verdict.redacted
            view: bytes | None = None
            for module in self.modules:
                if view is None:
                    view = _view(route, body, tenant, tier, stream, slots)
                try:
                    answer = module.check(view)
                except ModuleFailed as exc:
                    if module.config.on_error == "closed":
                        raise PolicyUnavailable(
                            module.id, f"policy module `{module.id}` failed ({exc.kind})"
                        ) from None
                    outcome.decision = "allow_on_error"
                    outcome.rules.append(module.id)
                    self._count(module.id, "allow_on_error")
                    continue
                if answer.action == "deny":
                    reason = f": {answer.reason}" if answer.reason else ""
                    raise PolicyRefused(
                        module.id, f"the request was refused by policy module `{module.id}`{reason}"
                    )
                if answer.action == "redact" and answer.spans:
                    if apply_spans(slots, answer.spans, REDACTED):
                        outcome.redacted = True
                        outcome.rules.append(module.id)
                        self._count(module.id, "redact")
                        view = None  # the next module sees the redacted prompt
        except PolicyRefused as err:
            self._count(err.rule, "error" if isinstance(err, PolicyUnavailable) else "deny")
            if stream and self.config.stream_refusal == "sse" and err.status in (400, 403):
                model = body.get("model")
                events = final_events(route, None, model if isinstance(model, str) else None)
                raise StreamRefusal(err.rule, err.message, events) from None
            raise
        if outcome.redacted and outcome.decision == "allow":
            outcome.decision = "redact"
        if not outcome.rules:
            self._count("-", "allow")
        return outcome

    def stage(self, ex: Exchange, body: MutableMapping[str, Any], raw: bytes) -> bytes:
        """The request stage: check, note the outcome on the exchange and its span, ready the
        stream guard; the bytes to forward."""
        try:
            outcome = self.check(ex.route, body, tenant=ex.tenant, tier=ex.tier, stream=ex.stream)
        except PolicyRefused as err:
            ex.policy_decision = "deny" if not isinstance(err, PolicyUnavailable) else "error"
            ex.policy_rules = (err.rule,)
            if ex.trace is not None:
                ex.trace.set("quicedge.policy.decision", ex.policy_decision)
                ex.trace.set("quicedge.policy.rules", [err.rule])
            raise
        ex.policy_decision = outcome.decision
        ex.policy_rules = tuple(outcome.rules)
        if ex.trace is not None:
            ex.trace.set("quicedge.policy.decision", outcome.decision)
            ex.trace.set("quicedge.policy.rules", outcome.rules)
        if ex.stream and self.stream is not None:
            ex.stream_guard = self.stream.guard(ex.route)
        return orjson.dumps(body) if outcome.redacted else raw

    def filtered(self, ex: Exchange, rule: str) -> None:
        """A stream rule ended the answer: note it for the audit log, the span and the metric."""
        ex.policy_decision = "filtered"
        ex.policy_rules = (*ex.policy_rules, rule)
        self._count(rule, "filtered")
        if ex.trace is not None:
            ex.trace.set("quicedge.policy.decision", "filtered")
            ex.trace.set("quicedge.policy.rules", list(ex.policy_rules))

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        for module in self.modules:
            module.start()

    def reload(self) -> None:
        """Compile every module again, now."""
        for module in self.modules:
            module.reload()

    def reload_soon(self) -> None:
        """SIGHUP: compile every module again in a thread; each is swapped in when ready."""
        loop = asyncio.get_running_loop()
        for module in self.modules:
            task = loop.create_task(module.reload_async())
            self._reloads.add(task)
            task.add_done_callback(self._reloads.discard)

    async def aclose(self) -> None:
        for module in self.modules:
            await module.aclose()


def _view(
    route: str,
    body: MutableMapping[str, Any],
    tenant: str,
    tier: str,
    stream: bool,
    slots: list[Any],
) -> bytes:
    """The JSON a module reads (docs/policy.md, "The ABI")."""
    model = body.get("model")
    return orjson.dumps(
        {
            "route": route,
            "model": model if isinstance(model, str) else None,
            "tenant": tenant,
            "tier": tier,
            "stream": stream,
            "max_tokens": requested_tokens(body),
            "prompt": "\n".join(c[k] for c, k in slots),
        }
    )


__all__ = ["PolicyGateway", "PolicyOutcome"]
