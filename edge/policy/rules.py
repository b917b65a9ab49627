"""Request policies: declarative rules from `[policy]`, compiled once, run once per request.

`RequestRules.check` takes the body the app already parsed and, in this order:

1. the tenant's model allow-list (`[[policy.tenant_models]]`): 403 `model_not_allowed`;
2. the tier's limits (`[[policy.tiers]]`): `max_tokens` (every length field the request sets:
   `max_tokens`, `max_completion_tokens`, `sampling_params.max_new_tokens`) and prompt length,
   400 `policy_limit`;
3. the pattern rules (`[[policy.rules]]`) on the folded prompt text (`normalize.fold`, matched
   case-insensitively; a message's text parts as chat templates render them, `_rendered`): an
   `allow` match exempts the request from the `deny` rules; a `deny` match refuses it (403
   `policy_violation`, naming the first matching deny rule in the file's order); `redact` rules
   replace their matches in the body.

Patterns are RE2 expressions (`google-re2`: linear time, no back-references or look-around), and
all rules are one RE2 set, so twenty rules cost one automaton pass over each text of the prompt
(each message and field is a text of its own), with no pattern able to backtrack.
The refusal names the rule, never the text that matched. The body is changed (and so must be
serialised again) only when something was redacted.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import MutableMapping, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import re2

from edge.errors import ModelNotAllowed, PolicyLimit, PolicyRefused
from edge.policy.config import PolicyConfig, RuleConfig
from edge.policy.normalize import fold

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"

_PROMPT_FIELD = {CHAT: "messages", GENERATE: "text"}
"""The field a refusal over the prompt names (`prompt` on the other routes)."""

Slot = tuple[MutableMapping[str, Any] | MutableSequence[Any], Any]
"""Where one piece of prompt text lives in the body: (container, key or index)."""


class Slots(list[Slot]):
    """A body's prompt strings (`text_slots`), and which runs of them are one message's text
    parts: a chat template renders those as one text, so a word split over two parts is
    whole in what the model reads."""

    groups: Sequence[tuple[int, int]] = ()
    """(first, end) slot indices of each message with more than one text part."""
    fields: Sequence[tuple[int, str]] = ()
    """(first, field) of the runs of slots, after the prompt's, that are texts of other fields
    the model reads (`tools`, `suffix`): a refusal names the field that matched."""


class _ArgumentsText(dict[str, Any]):
    """A tool call's `arguments` given as an object (SGLang takes `str | dict`), as the one
    text a chat template renders it as: its compact JSON, keys and all. A rewrite (a
    redaction) goes to the call too, as that text, which is a string of arguments a backend
    takes as well; a call nothing rewrote is forwarded as sent."""

    def __init__(self, function: MutableMapping[str, Any], arguments: Any) -> None:
        super().__init__(arguments=orjson.dumps(arguments).decode())
        self._function = function

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self._function[key] = value


def text_slots(route: str, body: MutableMapping[str, Any]) -> Slots:
    """Every prompt string of a validated body, in order, as places that can be rewritten."""
    slots = Slots()
    if route == CHAT:
        groups: list[tuple[int, int]] | None = None
        for message in body.get("messages") or ():
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, str):
                slots.append((message, "content"))
            elif isinstance(content, list):
                first = len(slots)
                thinking: list[Slot] = []
                for part in content:
                    if isinstance(part, dict):
                        if isinstance(part.get("text"), str):
                            slots.append((part, "text"))
                        elif isinstance(part.get("thinking"), str):  # SGLang's thinking parts
                            thinking.append((part, "thinking"))
                if len(slots) - first > 1:
                    groups = groups or []
                    groups.append((first, len(slots)))
                slots.extend(thinking)  # reasoning sent back: texts of their own
            if isinstance(message.get("reasoning_content"), str):  # thinking sent back, too
                slots.append((message, "reasoning_content"))
            if isinstance(message.get("name"), str):  # templates render a speaker's name
                slots.append((message, "name"))
            calls = message.get("tool_calls")
            if calls and isinstance(calls, list):  # earlier calls' arguments: text sent too
                for call in calls:
                    function = call.get("function") if isinstance(call, dict) else None
                    if not isinstance(function, dict):
                        continue
                    arguments = function.get("arguments")
                    if isinstance(arguments, str):
                        slots.append((function, "arguments"))
                    elif isinstance(arguments, (dict, list)):  # SGLang takes an object too
                        slots.append((_ArgumentsText(function, arguments), "arguments"))
        if groups:
            slots.groups = groups
        tools = body.get("tools")
        if isinstance(tools, list) and tools:
            first = len(slots)
            for tool in tools:
                if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
                    _strings_in(tool["function"], slots)
            if len(slots) > first:
                slots.fields = ((first, "tools"),)
        return slots
    key = "prompt" if route == COMPLETIONS else "text"
    value = body.get(key)
    if isinstance(value, str):
        slots.append((body, key))
    elif isinstance(value, list):
        slots.extend((value, i) for i, item in enumerate(value) if isinstance(item, str))
    if route == COMPLETIONS and isinstance(body.get("suffix"), str):
        slots.fields = ((len(slots), "suffix"),)
        slots.append((body, "suffix"))
    return slots


def _strings_in(value: MutableMapping[str, Any] | MutableSequence[Any], slots: Slots) -> None:
    """Every string value in a tool's definition (its name, its description, its parameters'
    descriptions, titles, enums, defaults), which chat templates render into the prompt. The
    body's nesting is bounded (`body.MAX_NESTING`), and so is this walk."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        if isinstance(item, str):
            slots.append((value, key))
        elif isinstance(item, (dict, list)):
            _strings_in(item, slots)


def _token_fields(body: MutableMapping[str, Any]) -> list[tuple[str, Any]]:
    """Each completion-length field the request sets, by name, with its value as sent."""
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


_COUNT_FIELDS = ("n", "best_of", "sampling_params.n")
"""Fields that multiply the answers of a request (SGLang's OpenAI routes read `n`, and
completions `best_of` where a backend implements it; `/generate` `sampling_params.n`): all
are counted whatever the route, as every length field is."""


def _answers(route: str, body: MutableMapping[str, Any], params: Any, tier: str, limit: int) -> int:
    """How many answers the request asks for: its largest choice count times its prompts
    (a `/generate` batch, a completions list of prompts). Raises a `PolicyLimit` for a count
    that is not a plain integer, or one with more answers than `limit` has tokens."""
    n, best_of = body.get("n"), body.get("best_of")
    per = params.get("n") if isinstance(params, dict) else None
    choices = 1
    if n is not None or best_of is not None or per is not None:
        rule = f"tier:{tier}:max_tokens"
        for name, value in zip(_COUNT_FIELDS, (n, best_of, per), strict=True):
            if value is None:
                continue
            if type(value) is not int:
                raise _not_an_integer(rule, name, limit)
            choices = max(choices, value)
    prompts = 1
    if route == GENERATE:
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, list):
            prompts = len(text)
        elif isinstance(ids, list) and ids and isinstance(ids[0], list):
            prompts = len(ids)
    elif route == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompts = len(prompt)
    answers = choices * max(prompts, 1)
    if answers > limit:
        rule = f"tier:{tier}:max_tokens"
        raise PolicyLimit(
            rule,
            f"{answers} answers (choices x prompts) leave less than one token each of this "
            f"tier's limit of {limit} (rule `{rule}`)",
            param="n" if prompts == 1 else _PROMPT_FIELD.get(route, "prompt"),
        )
    return answers


_OPTIONS = re2.Options()
_OPTIONS.case_sensitive = False
_OPTIONS.log_errors = False


_EMPTY_PROBES = ("", "a", " ", "a a", "\n", "a\na", " \n ")
"""Texts in which a pattern that can match the empty string does so: what an empty match
may still require is only an assertion (`^`, `$`, `\\b`, `\\B`, `\\A`, `\\z`, multi-line or not),
and these put every kind of edge next to a letter, a space, a line break and nothing."""


def check_pattern(pattern: str) -> str | None:
    """Why `pattern` cannot be a request rule's (not an RE2 expression, or able to match the
    empty string), or None when it can."""
    try:
        compiled = re2.compile(pattern, _OPTIONS)
    except re2.error as exc:
        text = exc.args[0] if exc.args else exc
        return text.decode(errors="replace") if isinstance(text, bytes) else str(text)
    # A match of nothing is a match in every prompt: a deny rule would refuse every request,
    # and a redact rule put its replacement between every two characters.
    for probe in _EMPTY_PROBES:
        if any(m.start() == m.end() for m in compiled.finditer(probe)):
            return "it can match the empty string, so it would match every prompt"
    return None


def _patterns(rule: RuleConfig) -> list[str]:
    return [re.escape(p) if rule.literal else p for p in rule.patterns]


def _alternation(rule: RuleConfig) -> str:
    return "|".join(f"(?:{p})" for p in _patterns(rule))


@dataclass(slots=True)
class RuleVerdict:
    """What the rules decided about a request that was not refused."""

    fired: list[tuple[str, str]] = field(default_factory=list)
    """(rule id, outcome) of each rule that matched: `allow` or `redact`."""
    redacted: bool = False
    """The body was changed: it must be serialised again."""
    capped: bool = False
    """The request set no length, and was given its tier's (the body must be serialised
    again)."""


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
        self._redactors: dict[int, list[Any]] = {}
        if self._rules:
            self._set = re2.Set.SearchSet(_OPTIONS)
            for i, rule in enumerate(self._rules):
                try:
                    if self._set.Add(_alternation(rule)) != i:
                        raise re2.error("not added")
                    if rule.action == "redact":  # each pattern on its own: `_spans`
                        self._redactors[i] = [re2.compile(p, _OPTIONS) for p in _patterns(rule)]
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
        slots: Slots,
    ) -> RuleVerdict:
        """Refuse (raises a `PolicyRefused`) or pass, redacting in `body` where rules say."""
        verdict = RuleVerdict()
        allowed = self._models.get(tenant)
        if allowed is not None:
            # none named: the backend's own, `default`; so is /generate's, whatever its body
            # names (SGLang does not read a `model` there, nor does routing)
            model = "default" if route == GENERATE else body.get("model", "default")
            name = model if isinstance(model, str) else ""
            if not any(fnmatch.fnmatchcase(name, glob) for glob in allowed):
                rule = f"models:{tenant}"
                raise ModelNotAllowed(
                    rule, f"the model is not allowed for this tenant (rule `{rule}`)", param="model"
                )
        limits = self._tiers.get(tier)
        if limits is not None:
            if limits.max_tokens is not None:
                verdict.capped = self._check_tokens(route, body, tier, limits.max_tokens)
            if limits.max_prompt_chars is not None:
                size = sum(len(c[k]) for c, k in slots)
                if size > limits.max_prompt_chars:
                    rule = f"tier:{tier}:max_prompt_chars"
                    raise PolicyLimit(
                        rule,
                        f"the prompt has {size} characters, above this tier's limit of "
                        f"{limits.max_prompt_chars} (rule `{rule}`)",
                        param=_PROMPT_FIELD.get(route, "prompt"),
                    )
        if self._set is None or not slots:
            return verdict
        folded = [fold(c[k]) for c, k in slots]
        groups = slots.groups
        # Each text on its own (docs/policy.md: separate texts): `^` and `$` hold at every
        # text's start and end, and no match runs from one message into the next, as it would
        # through a separator in one joined text (`\s`, `[^a]` match "\n").
        texts = _rendered(slots, folded, groups) if groups else folded
        match = self._set.Match
        if len(texts) == 1:
            hits = match(texts[0])
        else:
            hits = set()
            for text in texts:
                found = match(text)  # (None when nothing matched)
                if found:
                    hits.update(found)
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
                    param=self._field_of(deny, route, slots, texts),
                )
        redactors = [i for i in matched if rules[i].action == "redact"]
        if redactors:
            redacted = self._redact(redactors, slots, folded, groups)
            for i in redactors:
                if i in redacted:
                    verdict.redacted = True
                    verdict.fired.append((rules[i].id, "redact"))
        return verdict

    def _field_of(self, rule: int, route: str, slots: Slots, texts: list[str]) -> str:
        """The field a refusal names: the prompt's, unless `rule` matched only in the texts of
        another field (the last texts, one per slot, `Slots.fields`)."""
        prompt = _PROMPT_FIELD.get(route, "prompt")
        if not slots.fields:
            return prompt
        extra = len(slots) - slots.fields[0][0]
        found = [i for i, text in enumerate(texts) if rule in (self._set.Match(text) or ())]
        if not found or found[0] < len(texts) - extra:
            return prompt
        at = found[0] - (len(texts) - len(slots))  # the slot of that text
        return next(name for first, name in reversed(slots.fields) if at >= first)

    @staticmethod
    def _check_tokens(route: str, body: MutableMapping[str, Any], tier: str, limit: int) -> bool:
        """Refuse a request any of whose length fields asks for more than `limit`, or is not a
        plain integer (a backend may read `"200"` or `200.0` as 200: SGLang's pydantic does).
        A request that sets none of the fields its route reads is given `limit` there (True:
        the body changed): without one, a chat completion may run to the model's context
        length, and a length in a field the route ignores (`sampling_params.max_new_tokens`
        on the chat route, `max_tokens` on `/generate`) bounds nothing."""
        # The common case, every field absent or within the limit, in straight-line code: this
        # runs on every request of a limited tier. Only a refusal looks for the field to name.
        a, b = body.get("max_tokens"), body.get("max_completion_tokens")
        params = body.get("sampling_params")
        c = params.get("max_new_tokens") if isinstance(params, dict) else None
        # The limit holds the whole request: each answer it asks for (`n` choices, a batch's
        # prompts) is as long as the length fields say, so each may have its share only.
        answers = _answers(route, body, params, tier, limit)
        share = limit // answers if answers > 1 else limit
        if not (
            (a is None or (type(a) is int and a <= share))
            and (b is None or (type(b) is int and b <= share))
            and (c is None or (type(c) is int and c <= share))
        ):
            for name, value in _token_fields(body):
                if type(value) is int and value <= share:
                    continue
                rule = f"tier:{tier}:max_tokens"
                if type(value) is not int:
                    raise _not_an_integer(rule, name, limit)
                asked = f"{value}" if answers == 1 else f"{value} x {answers} answers"
                raise PolicyLimit(
                    rule,
                    f"{name} {asked} is above this tier's limit of {limit} (rule `{rule}`)",
                    param=name,
                )
        limit = share
        # The fields each route's backend reads: SGLang's chat route `max_completion_tokens`
        # or `max_tokens`, completions `max_tokens`, `/generate` only `max_new_tokens`.
        if route == GENERATE:
            if c is None:
                if not isinstance(params, dict):
                    params = body["sampling_params"] = {}
                params["max_new_tokens"] = limit
                return True
        elif route == CHAT:
            if a is None and b is None:
                body["max_tokens"] = limit
                return True
        elif route == COMPLETIONS and a is None:
            body["max_tokens"] = limit
            return True
        return False

    def _redact(
        self, indices: list[int], slots: Slots, folded: list[str], groups: Sequence[tuple[int, int]]
    ) -> set[int]:
        """Redact the matches of the redact rules `indices` in every text; the rules that had
        one. All the rules' matches are found in the same text, as sent, and a stretch that
        several cover is replaced once (`_spans`): one rule's replacement applied before
        another's search would leave the rest of a match it cut short in the clear, or take away
        what the other's pattern needs (`password: VALUE`, once `password` was replaced)."""
        redacted: set[int] = set()
        grouped = {j for first, end in groups for j in range(first, end)} if groups else ()
        for i, (container, key) in enumerate(slots):
            if i in grouped:
                continue  # redacted below, as the template renders the message
            original = container[key]
            # Offsets in the folded text are those of the original only when folding kept it
            # as it was; otherwise the folded text, redacted, replaces the original.
            source = original if folded[i] == original else folded[i]
            spans = self._spans(indices, source, redacted)
            if spans:
                container[key] = _replaced(source, spans)
                folded[i] = fold(container[key])
        for first, end in groups:
            _redact_parts(self, indices, slots, folded, first, end, redacted)
        return redacted

    def _spans(self, indices: list[int], text: str, redacted: set[int]) -> list[Span]:
        """The stretches of `text` to replace: every match of each pattern of the rules
        `indices` (a rule's patterns are searched each on its own: as one alternation, the first
        to match at a place would hide a longer one there), overlapping ones merged into one,
        with the replacement of the rule whose match starts first (the first of them in the
        file's order where two start together). Adds the rules that matched to `redacted`."""
        found = [
            (m.start(), i, m.end())
            for i in indices
            for pattern in self._redactors[i]
            for m in pattern.finditer(text)
            if m.end() > m.start()
        ]
        if not found:
            return []
        found.sort()
        merged: list[Span] = []
        for start, i, end in found:
            redacted.add(i)
            if merged and start < merged[-1][1]:
                if end > merged[-1][1]:
                    merged[-1] = (merged[-1][0], end, merged[-1][2])
            else:
                merged.append((start, end, self._rules[i].replacement))
        return merged


Span = tuple[int, int, str]
"""A stretch of a text to redact: (start, end, replacement)."""


def _replaced(text: str, spans: list[Span]) -> str:
    """`text` with each of the `spans` (sorted, disjoint) replaced."""
    out: list[str] = []
    last = 0
    for start, end, replacement in spans:
        out += (text[last:start], replacement)
        last = end
    out.append(text[last:])
    return "".join(out)


# The two ways a chat template renders one message's text parts: concatenated (templates that
# iterate over the parts, SGLang's "openai" content format, the stand-in), and joined by a space
# (SGLang's "string" content format). A match in either is one the model reads.
_PART_JOINS = ("", " ")


def _rendered(slots: Slots, folded: list[str], groups: Sequence[tuple[int, int]]) -> list[str]:
    """The folded texts to match, each message's text parts as each template renders them."""
    out: list[str] = []
    i = 0
    for first, end in groups:
        out += folded[i:first]
        raw = [c[k] for c, k in slots[first:end]]
        for sep in _PART_JOINS:
            # fold the rendered text, not each part: NFKC composes across a part's edge
            out.append(fold(sep.join(raw)))
        i = end
    out += folded[i:]
    return out


def _redact_parts(
    rules: RequestRules,
    indices: list[int],
    slots: Slots,
    folded: list[str],
    first: int,
    end: int,
    redacted: set[int],
) -> bool:
    """Redact the matches of the rules `indices` in the rendered text of the parts
    `slots[first:end]`, each cut in the part(s) it covers (a match over two parts: the
    replacement in the first, the rest of it removed from the second)."""
    changed = False
    for sep in _PART_JOINS:
        raw = [c[k] for c, k in slots[first:end]]
        sources = [r if f == r else f for r, f in zip(raw, folded[first:end], strict=True)]
        joined = sep.join(sources)
        if joined != fold(sep.join(raw)):
            # folding composed a character across a part's edge: offsets in the parts are not
            # those of the rendered text; the folded rendering, redacted, replaces the parts
            whole = fold(sep.join(raw))
            spans = rules._spans(indices, whole, redacted)
            if spans:
                texts = [_replaced(whole, spans)] + [""] * (end - first - 1)
                for j, text in enumerate(texts, first):
                    container, key = slots[j]
                    container[key] = text
                    folded[j] = fold(text)
                changed = True
            continue
        spans = rules._spans(indices, joined, redacted)
        if not spans:
            continue
        for j, cut in enumerate(_cut(sources, len(sep), spans), first):
            if cut is not None:
                container, key = slots[j]
                container[key] = cut
                folded[j] = fold(cut)
                changed = True
    return changed


def _cut(sources: list[str], gap: int, spans: list[Span]) -> list[str | None]:
    """Each of `sources` with the `spans` (sorted, disjoint offsets into the sources joined by
    `gap` characters) replaced, or None where no span touches it. A span's replacement goes into
    the first source it touches; the rest of the span is removed from the sources after it."""
    out: list[str | None] = []
    offset, placed = 0, -1
    for text in sources:
        end = offset + len(text)
        pieces: list[str] = []
        last = 0
        for n, (s, e, replacement) in enumerate(spans):
            if s >= end or e <= offset:
                continue
            a, b = max(s - offset, 0), min(e - offset, len(text))
            pieces.append(text[last:a])
            if n > placed:
                pieces.append(replacement)
                placed = n
            last = b
        out.append("".join(pieces) + text[last:] if pieces else None)
        offset = end + gap
    return out


def module_pieces(slots: Slots) -> list[int | str]:
    """The prompt a WebAssembly module reads, as pieces: a slot's index (its text) or text of
    the host's (the separators). The texts are joined by "\n", as the request rules match
    them: a message's text parts once concatenated and once joined by a space (`_PART_JOINS`),
    so a word split over two parts is whole in what the module reads, as in what the model
    reads; without such a message it is every text once."""
    pieces: list[int | str] = []

    def text(items: list[int | str]) -> None:
        if pieces:
            pieces.append("\n")
        pieces.extend(items)

    done = 0
    for first, end in slots.groups:
        for j in range(done, first):
            text([j])
        for sep in _PART_JOINS:
            items: list[int | str] = []
            for j in range(first, end):
                if sep and j > first:
                    items.append(sep)
                items.append(j)
            text(items)
        done = end
    for j in range(done, len(slots)):
        text([j])
    return pieces


def module_prompt(slots: Slots) -> str:
    """The `prompt` of the view a module reads (`module_pieces`)."""
    if not slots.groups:
        return "\n".join(c[k] for c, k in slots)
    return "".join(
        p if isinstance(p, str) else slots[p][0][slots[p][1]] for p in module_pieces(slots)
    )


def apply_spans(slots: Slots, spans: list[tuple[int, int]], replacement: str) -> bool:
    """Replace byte spans of the module's prompt (`module_prompt`, UTF-8) in place; True when
    anything changed. Each slot a span covers part of gets one `replacement` there (a slot read
    twice, a text part, gets one for the spans of both readings that overlap or touch); a span
    that cuts a character is widened to whole characters."""
    # One pass over the pieces and the spans in order: for each piece only the spans from the
    # first that ends past its start (every slot against every span took 0.23 s for 10,000
    # slots and a module's 1,024 spans).
    spans = sorted(spans)
    first, count = 0, len(spans)
    cuts: dict[int, list[tuple[int, int]]] = {}
    offset = 0
    for piece in module_pieces(slots):
        if isinstance(piece, str):
            offset += len(piece.encode())
            continue
        container, key = slots[piece]
        size = len(container[key].encode())
        start, end = offset, offset + size
        while first < count and spans[first][1] <= start:
            first += 1
        at = first
        while at < count and spans[at][0] < end:
            s, e = spans[at]
            if e > start:  # (spans that overlap may end before a later one starts)
                cuts.setdefault(piece, []).append((max(s, start) - start, min(e, end) - start))
            at += 1
        offset = end
    for piece, found in cuts.items():
        container, key = slots[piece]
        raw = container[key].encode()
        out: list[str] = []
        last = 0
        merged: list[list[int]] = []
        for s, e in sorted(found):
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        for s, e in merged:
            out.append(raw[last:s].decode("utf-8", "ignore"))
            out.append(replacement)
            last = e
        out.append(raw[last:].decode("utf-8", "ignore"))
        container[key] = "".join(out)
    return bool(cuts)


def _not_an_integer(rule: str, name: str, limit: int) -> PolicyLimit:
    return PolicyLimit(
        rule,
        f"{name} must be an integer to be checked against this tier's limit of {limit} "
        f"(rule `{rule}`)",
        param=name,
    )


__all__ = [
    "RequestRules",
    "RuleVerdict",
    "Slots",
    "apply_spans",
    "module_pieces",
    "module_prompt",
    "requested_tokens",
    "text_slots",
]
