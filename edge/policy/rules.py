"""Request policies: declarative rules from `[policy]`, compiled once, run once per request.

`RequestRules.check` takes the body the app already parsed and, in this order:

1. the tenant's model allow-list (`[[policy.tenant_models]]`): 403 `model_not_allowed`;
2. the tier's limits (`[[policy.tiers]]`): `max_tokens` (every length field the request sets:
   `max_tokens`, `max_completion_tokens`, `sampling_params.max_new_tokens`) and prompt length,
   400 `policy_limit`;
3. the pattern rules (`[[policy.rules]]`) on the folded prompt text (`normalize.fold`, matched
   case-insensitively): an `allow` match exempts the request from the `deny` rules; a `deny`
   match refuses it (403 `policy_violation`, naming the first matching deny rule in the file's
   order); `redact` rules replace their matches in the body.

Patterns are RE2 expressions (`google-re2`: linear time, no back-references or look-around), and
all rules are one RE2 set, so twenty rules cost one automaton pass over the prompt, with no
pattern able to backtrack.
The refusal names the rule, never the text that matched. The body is changed (and so must be
serialised again) only when something was redacted.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import MutableMapping, MutableSequence
from dataclasses import dataclass, field
from typing import Any

import re2

from edge.errors import ModelNotAllowed, PolicyLimit, PolicyRefused
from edge.policy.config import PolicyConfig, RuleConfig
from edge.policy.normalize import fold

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

Slot = tuple[MutableMapping[str, Any] | MutableSequence[Any], Any]
"""Where one piece of prompt text lives in the body: (container, key or index)."""


def text_slots(route: str, body: MutableMapping[str, Any]) -> list[Slot]:
    """Every prompt string of a validated body, in order, as places that can be rewritten."""
    slots: list[Slot] = []
    if route == CHAT:
        for message in body.get("messages") or ():
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, str):
                slots.append((message, "content"))
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        slots.append((part, "text"))
            if isinstance(message.get("reasoning_content"), str):  # thinking sent back, too
                slots.append((message, "reasoning_content"))
            calls = message.get("tool_calls")
            if calls and isinstance(calls, list):  # earlier calls' arguments: text sent too
                for call in calls:
                    function = call.get("function") if isinstance(call, dict) else None
                    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                        slots.append((function, "arguments"))
        return slots
    key = "prompt" if route == COMPLETIONS else "text"
    value = body.get(key)
    if isinstance(value, str):
        slots.append((body, key))
    elif isinstance(value, list):
        slots.extend((value, i) for i, item in enumerate(value) if isinstance(item, str))
    return slots


def _token_fields(body: MutableMapping[str, Any]) -> list[tuple[str, Any]]:
    """Each completion-length field the request sets, by name, with its value as sent."""
    # (plain statements, not a comprehension: this runs on every request of a limited tier)
    found: list[tuple[str, Any]] = []
    value = body.get("max_tokens")
    if value is not None:
        found.append(("max_tokens", value))
    value = body.get("max_completion_tokens")
    if value is not None:
        found.append(("max_completion_tokens", value))
    params = body.get("sampling_params")
    if isinstance(params, dict):
        value = params.get("max_new_tokens")
        if value is not None:
            found.append(("sampling_params.max_new_tokens", value))
    return found


def requested_tokens(body: MutableMapping[str, Any]) -> int | None:
    """The completion length the request asks for: the largest of the fields that carry one.

    Backends do not agree on which field wins (SGLang's chat route uses `max_completion_tokens`
    before `max_tokens`, `/generate` only `sampling_params.max_new_tokens`), so any one field
    could be the one obeyed; judging by the largest leaves no field to hide a length in."""
    asked: int | None = None
    for _, value in _token_fields(body):
        if type(value) is int and (asked is None or value > asked):
            asked = value
    return asked


_OPTIONS = re2.Options()
_OPTIONS.case_sensitive = False
_OPTIONS.log_errors = False


def check_pattern(pattern: str) -> str | None:
    """Why `pattern` is not an RE2 expression, or None when it is one."""
    try:
        re2.compile(pattern, _OPTIONS)
    except re2.error as exc:
        text = exc.args[0] if exc.args else exc
        return text.decode(errors="replace") if isinstance(text, bytes) else str(text)
    return None


def _alternation(rule: RuleConfig) -> str:
    return "|".join(f"(?:{re.escape(p) if rule.literal else p})" for p in rule.patterns)


@dataclass(slots=True)
class RuleVerdict:
    """What the rules decided about a request that was not refused."""

    fired: list[tuple[str, str]] = field(default_factory=list)
    """(rule id, outcome) of each rule that matched: `allow` or `redact`."""
    redacted: bool = False
    """The body was changed: it must be serialised again."""


class RequestRules:
    """The compiled request rules of one `PolicyConfig`.

    Every pattern rule is one member of an RE2 set, so one pass over the prompt tells which
    rules match anywhere in it (usually none, and then that pass is all the pattern work);
    only the `redact` rules that matched run again, to find and replace their matches."""

    def __init__(self, config: PolicyConfig) -> None:
        self._models = {t.tenant: tuple(t.models) for t in config.tenant_models}
        self._tiers = {t.tier: t for t in config.tiers}
        self._rules = list(config.rules)
        self._tenants = [frozenset(r.tenants) if r.tenants else None for r in self._rules]
        self._set: Any = None
        self._redactors: dict[int, Any] = {}
        if self._rules:
            self._set = re2.Set.SearchSet(_OPTIONS)
            for i, rule in enumerate(self._rules):
                try:
                    if self._set.Add(_alternation(rule)) != i:
                        raise re2.error("not added")
                    if rule.action == "redact":
                        self._redactors[i] = re2.compile(_alternation(rule), _OPTIONS)
                except re2.error as exc:
                    raise ValueError(f"policy.rules: rule {rule.id!r}: {exc}") from None
            self._set.Compile()
        self.has_patterns = bool(self._rules)

    def check(
        self,
        route: str,
        body: MutableMapping[str, Any],
        *,
        tenant: str,
        tier: str,
        slots: list[Slot],
    ) -> RuleVerdict:
        """Refuse (raises a `PolicyRefused`) or pass, redacting in `body` where rules say."""
        verdict = RuleVerdict()
        allowed = self._models.get(tenant)
        if allowed is not None:
            model = body.get("model", "default")  # none named: the backend's own, `default`
            name = model if isinstance(model, str) else ""
            if not any(fnmatch.fnmatchcase(name, glob) for glob in allowed):
                rule = f"models:{tenant}"
                raise ModelNotAllowed(
                    rule, f"the model is not allowed for this tenant (rule `{rule}`)", param="model"
                )
        limits = self._tiers.get(tier)
        if limits is not None:
            if limits.max_tokens is not None:
                self._check_tokens(body, tier, limits.max_tokens)
            if limits.max_prompt_chars is not None:
                size = sum(len(c[k]) for c, k in slots)
                if size > limits.max_prompt_chars:
                    rule = f"tier:{tier}:max_prompt_chars"
                    raise PolicyLimit(
                        rule,
                        f"the prompt has {size} characters, above this tier's limit of "
                        f"{limits.max_prompt_chars} (rule `{rule}`)",
                        param="messages" if route == CHAT else "prompt",
                    )
        if self._set is None or not slots:
            return verdict
        folded = [fold(c[k]) for c, k in slots]
        hits = self._set.Match("\n".join(folded))
        if not hits:
            return verdict
        rules, tenants = self._rules, self._tenants
        matched = sorted(i for i in hits if tenants[i] is None or tenant in tenants[i])
        exempt = next((i for i in matched if rules[i].action == "allow"), None)
        if exempt is not None:
            verdict.fired.append((rules[exempt].id, "allow"))
        else:
            deny = next((i for i in matched if rules[i].action == "deny"), None)
            if deny is not None:
                rule_id = rules[deny].id
                raise PolicyRefused(
                    rule_id,
                    f"the request was refused by policy rule `{rule_id}`",
                    param="messages" if route == CHAT else "prompt",
                )
        for i in matched:
            if rules[i].action == "redact" and self._redact_with(i, slots, folded):
                verdict.redacted = True
                verdict.fired.append((rules[i].id, "redact"))
        return verdict

    @staticmethod
    def _check_tokens(body: MutableMapping[str, Any], tier: str, limit: int) -> None:
        """Refuse a request any of whose length fields asks for more than `limit`, or is not a
        plain integer (a backend may read `"200"` or `200.0` as 200: SGLang's pydantic does)."""
        for name, value in _token_fields(body):
            if type(value) is int and value <= limit:
                continue
            rule = f"tier:{tier}:max_tokens"
            if type(value) is not int:
                raise PolicyLimit(
                    rule,
                    f"{name} must be an integer to be checked against this tier's limit of "
                    f"{limit} (rule `{rule}`)",
                    param=name,
                )
            raise PolicyLimit(
                rule,
                f"{name} {value} is above this tier's limit of {limit} (rule `{rule}`)",
                param=name,
            )

    def _redact_with(self, index: int, slots: list[Slot], folded: list[str]) -> bool:
        pattern, replacement = self._redactors[index], self._rules[index].replacement
        changed_any = False
        for i, (container, key) in enumerate(slots):
            original = container[key]
            # Offsets in the folded text are those of the original only when folding kept it
            # as it was; otherwise the folded text, redacted, replaces the original.
            source = original if folded[i] == original else folded[i]
            changed = pattern.sub(replacement.replace("\\", "\\\\"), source)
            if changed != source:
                container[key] = changed
                folded[i] = fold(changed)
                changed_any = True
        return changed_any


def apply_spans(slots: list[Slot], spans: list[tuple[int, int]], replacement: str) -> bool:
    """Replace byte spans of the joined prompt (`"\\n".join` of the slots, UTF-8) in place; True
    when anything changed. A span that cuts a character is widened to whole characters."""
    changed = False
    offset = 0
    for container, key in slots:
        raw = container[key].encode()
        start, end = offset, offset + len(raw)
        cuts = [
            (max(s, start) - start, min(e, end) - start) for s, e in spans if s < end and e > start
        ]
        if cuts:
            out, last = [], 0
            for s, e in sorted(cuts):
                if s < last:
                    s = last
                out.append(raw[last:s].decode("utf-8", "ignore"))
                out.append(replacement)
                last = max(last, e)
            out.append(raw[last:].decode("utf-8", "ignore"))
            container[key] = "".join(out)
            changed = True
        offset = end + 1  # the "\n" between slots
    return changed


__all__ = ["RequestRules", "RuleVerdict", "apply_spans", "requested_tokens", "text_slots"]
