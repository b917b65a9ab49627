"""Request policies: declarative rules from `[policy]`, compiled once, run once per request.

`RequestRules.check` takes the body the app already parsed and, in this order:

1. the tenant's model allow-list (`[[policy.tenant_models]]`): 403 `model_not_allowed`;
2. the tier's limits (`[[policy.tiers]]`): `max_tokens` and prompt length, 400 `policy_limit`;
3. the pattern rules (`[[policy.rules]]`) on the folded prompt text (`normalize.fold`, matched
   case-insensitively): an `allow` match exempts the request from the `deny` rules; a `deny`
   match refuses it (403 `policy_violation`); `redact` rules replace their matches in the body.

All rules of one action are one compiled alternation, and patterns are RE2 expressions
(`google-re2`: linear time, no back-references or look-around), so twenty rules cost one
automaton pass over the prompt, with no pattern able to backtrack for long.
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
        return slots
    key = "prompt" if route == COMPLETIONS else "text"
    value = body.get(key)
    if isinstance(value, str):
        slots.append((body, key))
    elif isinstance(value, list):
        slots.extend((value, i) for i, item in enumerate(value) if isinstance(item, str))
    return slots


def requested_tokens(body: MutableMapping[str, Any]) -> int | None:
    """The completion length the request asks for, whichever field carries it."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    params = body.get("sampling_params")
    if isinstance(params, dict):
        value = params.get("max_new_tokens")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@dataclass(slots=True)
class _Group:
    """Rules of one action and one tenant scope, as one alternation (group `r<i>` is rule i)."""

    pattern: Any  # re2._Regexp
    rules: list[RuleConfig]
    tenants: frozenset[str] | None

    def applies(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants

    def rule_of(self, match: Any) -> RuleConfig:
        name = match.lastgroup
        return self.rules[int(name[1:])] if name else self.rules[0]


_OPTIONS = re2.Options()
_OPTIONS.case_sensitive = False
_OPTIONS.log_errors = False


def check_pattern(pattern: str) -> str | None:
    """Why `pattern` is not an RE2 expression, or None when it is one."""
    try:
        re2.compile(pattern, _OPTIONS)
    except re2.error as exc:
        return str(exc)
    return None


def _compile_groups(rules: list[RuleConfig], action: str) -> list[_Group]:
    scopes: dict[frozenset[str] | None, list[RuleConfig]] = {}
    for rule in rules:
        if rule.action == action:
            scope = frozenset(rule.tenants) if rule.tenants else None
            scopes.setdefault(scope, []).append(rule)
    groups = []
    for scope, members in scopes.items():
        parts = []
        for i, rule in enumerate(members):
            alts = "|".join(f"(?:{re.escape(p) if rule.literal else p})" for p in rule.patterns)
            parts.append(f"(?P<r{i}>{alts})")
        try:
            pattern = re2.compile("|".join(parts), _OPTIONS)
        except re2.error as exc:
            ids = ", ".join(r.id for r in members)
            raise ValueError(f"policy.rules: rules {ids} cannot be combined: {exc}") from None
        groups.append(_Group(pattern, members, scope))
    return groups


@dataclass(slots=True)
class RuleVerdict:
    """What the rules decided about a request that was not refused."""

    fired: list[tuple[str, str]] = field(default_factory=list)
    """(rule id, outcome) of each rule that matched: `allow` or `redact`."""
    redacted: bool = False
    """The body was changed: it must be serialised again."""


class RequestRules:
    """The compiled request rules of one `PolicyConfig`."""

    def __init__(self, config: PolicyConfig) -> None:
        self._models = {t.tenant: tuple(t.models) for t in config.tenant_models}
        self._tiers = {t.tier: t for t in config.tiers}
        self._allow = _compile_groups(config.rules, "allow")
        self._deny = _compile_groups(config.rules, "deny")
        self._redact = _compile_groups(config.rules, "redact")
        self.has_patterns = bool(self._allow or self._deny or self._redact)

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
            model = body.get("model")
            name = model if isinstance(model, str) else ""
            if not any(fnmatch.fnmatchcase(name, glob) for glob in allowed):
                rule = f"models:{tenant}"
                raise ModelNotAllowed(
                    rule, f"the model is not allowed for this tenant (rule `{rule}`)", param="model"
                )
        limits = self._tiers.get(tier)
        if limits is not None:
            asked = requested_tokens(body)
            if limits.max_tokens is not None and asked is not None and asked > limits.max_tokens:
                rule = f"tier:{tier}:max_tokens"
                raise PolicyLimit(
                    rule,
                    f"max_tokens {asked} is above this tier's limit of {limits.max_tokens} "
                    f"(rule `{rule}`)",
                    param="max_tokens",
                )
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
        if not self.has_patterns or not slots:
            return verdict
        folded = [fold(c[k]) for c, k in slots]
        joined = "\n".join(folded)
        exempt = False
        for group in self._allow:
            if group.applies(tenant):
                match = group.pattern.search(joined)
                if match is not None:
                    exempt = True
                    verdict.fired.append((group.rule_of(match).id, "allow"))
                    break
        if not exempt:
            for group in self._deny:
                if group.applies(tenant):
                    match = group.pattern.search(joined)
                    if match is not None:
                        rule = group.rule_of(match).id
                        raise PolicyRefused(
                            rule,
                            f"the request was refused by policy rule `{rule}`",
                            param="messages" if route == CHAT else "prompt",
                        )
        for group in self._redact:
            if group.applies(tenant) and group.pattern.search(joined) is not None:
                self._redact_with(group, slots, folded, verdict)
        return verdict

    @staticmethod
    def _redact_with(
        group: _Group, slots: list[Slot], folded: list[str], verdict: RuleVerdict
    ) -> None:
        fired: set[str] = set()

        def replace(match: Any) -> str:
            rule = group.rule_of(match)
            fired.add(rule.id)
            return rule.replacement

        for i, (container, key) in enumerate(slots):
            original = container[key]
            # Offsets in the folded text are those of the original only when folding kept it
            # as it was; otherwise the folded text, redacted, replaces the original.
            source = original if folded[i] == original else folded[i]
            changed = group.pattern.sub(replace, source)
            if changed != source:
                container[key] = changed
                folded[i] = fold(changed)
                verdict.redacted = True
        verdict.fired.extend((rule, "redact") for rule in sorted(fired))


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
