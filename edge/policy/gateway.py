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

from backends.pool import UpstreamPool
from edge.errors import PolicyRefused, PolicyUnavailable, StreamRefusal
from edge.policy.config import PolicyConfig
from edge.policy.judge import Judge
from edge.policy.rules import (
    COMPLETIONS,
    GENERATE,
    RequestRules,
    Slots,
    apply_spans,
    module_prompt,
    requested_tokens,
    text_slots,
)
from edge.policy.stream import StreamRules, final_events
from edge.policy.wasm import ModuleFailed, WasmPolicy
from edge.policy.whole_answer import filter_whole

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
    capped: bool = False
    """A request without a length was given its tier's `max_tokens` (serialised again)."""


class PolicyGateway:
    """Request rules, WebAssembly modules and stream rules of one `PolicyConfig`."""

    def __init__(
        self,
        config: PolicyConfig,
        *,
        on_decision: Counter | None = None,
        on_module_failure: Counter | None = None,
        pool: UpstreamPool | None = None,
        on_judge: Callable[[str, float], None] | None = None,
    ) -> None:
        self.config = config
        self.rules = (
            RequestRules(config) if (config.rules or config.tenant_models or config.tiers) else None
        )
        self.modules = [WasmPolicy(c, on_failure=on_module_failure) for c in config.wasm]
        self.stream = StreamRules.from_config(config)
        self._count = on_decision or (lambda rule, outcome: None)
        self._reloads: set[asyncio.Task[bool]] = set()
        self.judge = (
            Judge(config.judge, pool, observe=on_judge)
            if config.judge.backends and pool is not None
            else None
        )
        self._judging: set[asyncio.Task[Any]] = set()

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
        called: str | None = None,
    ) -> PolicyOutcome:
        """Pass (maybe redacting in `body`) or raise the refusal the client gets. `route` is
        the route the request is forwarded as, `called` the one its client called (when they
        differ: a Responses request is forwarded as a chat completion)."""
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
                outcome.capped = verdict.capped
            view: bytes | None = None
            for module in self.modules:
                if view is None:
                    view = _view(route, called or route, body, tenant, tier, stream, slots)
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
            outcome = self.check(
                ex.route,
                body,
                tenant=ex.tenant,
                tier=ex.tier,
                stream=ex.stream,
                called=client_route(ex),
            )
        except PolicyRefused as err:
            ex.policy_decision = "deny" if not isinstance(err, PolicyUnavailable) else "error"
            ex.policy_rules = (err.rule,)
            if ex.trace is not None:
                ex.trace.set("quicedge.policy.decision", ex.policy_decision)
                ex.trace.set("quicedge.policy.rules", [err.rule])
            raise _as_called(ex, err) from None
        ex.policy_decision = outcome.decision
        ex.policy_rules = tuple(outcome.rules)
        if ex.trace is not None:
            ex.trace.set("quicedge.policy.decision", outcome.decision)
            ex.trace.set("quicedge.policy.rules", outcome.rules)
        if ex.stream and self.stream is not None:
            ex.stream_guard = self.stream.guard(ex.route)
        return orjson.dumps(body) if outcome.redacted or outcome.capped else raw

    async def judge_stage(self, ex: Exchange) -> None:
        """The model-judged track (`edge.policy.judge`): `hold` waits for the verdict here;
        `race` asks in parallel and cancels the request if `unsafe` comes before its response
        has started (`ex.judge_refused`; the app turns that cancellation into the refusal)."""
        judge, view = self.judge, ex.view
        if judge is None or not judge.applies(client_route(ex)) or view is None:
            return
        prompt = view.text[view.prompt_start :]  # the messages, not the tools' definitions
        # A background answer runs in a task of its own, which a race could not cancel; no
        # client waits on its first token, so it waits for the verdict.
        background = ex.state is not None and ex.state.background
        if judge.config.mode == "hold" or background:
            self._judged(ex, await judge.ask(prompt))
            return
        request = asyncio.current_task()
        assert request is not None
        task = asyncio.get_running_loop().create_task(judge.ask(prompt))
        self._judging.add(task)
        task.add_done_callback(lambda t: self._raced(ex, request, t))

    def _raced(self, ex: Exchange, request: asyncio.Task[Any], task: asyncio.Task[Any]) -> None:
        self._judging.discard(task)
        if task.cancelled() or task.exception() is not None:
            return
        verdict = task.result()
        late = ex.started or ex.responded or request.done()
        if verdict == "unsafe" and not late:
            ex.judge_refused = True
            request.cancel()
        elif verdict == "error" and not late and self.config.judge.on_error == "closed":
            ex.judge_refused = True
            ex.policy_decision = "error"
            request.cancel()
        else:
            self._count("judge", f"{verdict}_late" if late else verdict)

    def _judged(self, ex: Exchange, verdict: str) -> None:
        try:
            if verdict == "unsafe":
                raise PolicyRefused("judge", "the request was refused by the guard model")
            if verdict == "error" and self.config.judge.on_error == "closed":
                raise PolicyUnavailable("judge", "the guard model did not answer")
        except PolicyRefused as err:
            ex.policy_decision = "error" if isinstance(err, PolicyUnavailable) else "deny"
            ex.policy_rules = (*ex.policy_rules, "judge")
            raise self._refusal(ex, err) from None
        self._count("judge", verdict)

    def judge_refusal(self, ex: Exchange) -> PolicyRefused:
        """The refusal a `race` cancellation becomes (called by the app)."""
        if ex.policy_decision == "error":
            err: PolicyRefused = PolicyUnavailable("judge", "the guard model did not answer")
        else:
            ex.policy_decision = "deny"
            err = PolicyRefused("judge", "the request was refused by the guard model")
        ex.policy_rules = (*ex.policy_rules, "judge")
        return self._refusal(ex, err)

    def _refusal(self, ex: Exchange, err: PolicyRefused) -> PolicyRefused:
        self._count("judge", "error" if isinstance(err, PolicyUnavailable) else "deny")
        if ex.trace is not None:
            ex.trace.set("quicedge.policy.decision", ex.policy_decision)
            ex.trace.set("quicedge.policy.rules", list(ex.policy_rules))
        if ex.stream and self.config.stream_refusal == "sse" and err.status in (400, 403):
            refusal = StreamRefusal(err.rule, err.message, final_events(ex.route, None, None))
            return _as_called(ex, refusal)
        return err

    def whole(self, ex: Exchange, body: bytes) -> bytes:
        """A 200 answer read whole, after the stream rules (`edge.policy.whole_answer`): a
        client that asks for it unstreamed gets no more past them than a stream would."""
        if self.stream is None:
            return body
        checked = filter_whole(self.stream, ex.route, body)
        if checked is None:
            return body
        body, rule = checked
        self.filtered(ex, rule)
        return body

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


RESPONSES = "/v1/responses"


def client_route(ex: Exchange) -> str:
    """The route the client called: a Responses request is forwarded as a chat completion
    (`ex.route` says so from then on), but `routes` settings and records name what was called."""
    state = ex.state
    return RESPONSES if state is not None and state.builder is not None else ex.route


_RESPONSES_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens"}
"""The chat fields a Responses request's are checked as, and the ones its client sent."""


def _as_called(ex: Exchange, err: PolicyRefused) -> PolicyRefused:
    """`err` in the route the client called. A Responses request is checked as the chat
    completion it is forwarded as: its refusal names the fields its client sent
    (`max_output_tokens`, not `max_tokens`), and a stream's is typed events, not chat chunks
    (the chunk and `[DONE]` go through its builder, as a stream rule's cut does)."""
    state = ex.state
    if state is None or state.builder is None:
        return err
    field = _RESPONSES_FIELDS.get(err.param or "")
    if field is not None:
        # a limit's message starts with the field it names; a rule's id, which a message
        # also holds, is left as it is (`no-messages` stays `no-messages`)
        if err.param and err.message.startswith(err.param + " "):
            err.message = field + err.message[len(err.param) :]
        err.param = field
    if isinstance(err, StreamRefusal):
        err.events = state.builder.feed(err.events)
    return err


def _view(
    route: str,
    called: str,
    body: MutableMapping[str, Any],
    tenant: str,
    tier: str,
    stream: bool,
    slots: Slots,
) -> bytes:
    """The JSON a module reads (docs/policy.md, "The ABI"). `model` is the model the request
    is checked and routed as, as the request rules' allow-list reads it: `default` when the
    body names none, and on `/generate` whatever its body names (routing does not read it
    there, nor does SGLang), so a module's own allow-list cannot be passed by naming an
    allowed model where it is not used."""
    model = body.get("model")
    if route == GENERATE or not isinstance(model, str):
        model = "default"
    return orjson.dumps(
        {
            "route": route,
            "client_route": called,
            "model": model,
            "tenant": tenant,
            "tier": tier,
            "stream": stream,
            "max_tokens": requested_tokens(body),
            "token_ids": _token_ids(route, body),
            "prompt": module_prompt(slots),
        }
    )


def _token_ids(route: str, body: MutableMapping[str, Any]) -> bool:
    """Whether the model reads a prompt given as token ids (or embeddings), which no rule can
    read (the edge has no tokenizer): SGLang's chat route takes `input_ids` in place of the
    rendered messages, completions a `prompt` of ids, `/generate` `input_ids` or
    `input_embeds`."""
    if route == GENERATE:
        return body.get("input_ids") is not None or body.get("input_embeds") is not None
    if route == COMPLETIONS:
        prompt = body.get("prompt")
        return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], str)
    return body.get("input_ids") is not None


__all__ = ["PolicyGateway", "PolicyOutcome", "client_route"]
