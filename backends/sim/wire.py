"""Request parsing and validation for the generation routes (SGLang's field names and defaults).

Everything here is pure: JSON in, `GenParams` out, or `BadRequest` with the message the client
sees. The route handlers turn `GenParams` into a scheduler request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from backends.sim.chat_template import TemplateError, render, with_tools
from backends.sim.structured import FormatError, structured_answer
from backends.sim.tokenizer import BOS_TOKEN, Tokenizer
from backends.sim.tools import ToolCall, ToolError, plan_call


class BadRequest(ValueError):
    """A client error; the message goes back in the JSON error body."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class GenParams:
    input_ids: list[int]
    max_new_tokens: int | None  # None: up to the context length
    stream: bool = False
    rid: str | None = None
    ignore_eos: bool = False
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    no_stop_trim: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    model: str | None = None
    logprobs: bool = False
    """Return each output token's logprob (chat `logprobs`, completions `logprobs` >= 0,
    native `return_logprob`)."""
    top_logprobs: int = 0
    """Alternatives per token (chat `top_logprobs`, completions `logprobs`, native
    `top_logprobs_num`)."""
    tool_call: ToolCall | None = None
    """Chat only: the function call the answer makes (its arguments are the generated text);
    None for a text answer."""
    structured: str | None = None
    """Chat only: the JSON a `response_format` asks for (`backends.sim.structured`), generated
    as the answer's text; None for free text."""
    thinking: bool = True
    """Chat only: whether a reasoning model (`--reasoning-tokens`) thinks before this answer."""
    n: int = 1
    """OpenAI routes: the choices per prompt (`n`)."""
    prompts: list[list[int]] = field(default_factory=list)
    """Completions: every prompt of a batched `prompt` (a list of several); empty for one
    prompt (`input_ids`)."""


_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _thinking(obj: Mapping[str, Any]) -> bool:
    """Whether the request lets a reasoning model think, as SGLang decides it: the template's
    `enable_thinking` / `thinking` when the request sets them, else `reasoning_effort` "none" is
    off. The effort is checked as SGLang checks it (a tier, or a number in [0, 0.99])."""
    effort = obj.get("reasoning_effort")
    if effort is not None and effort not in _EFFORTS:
        number = isinstance(effort, int | float) and not isinstance(effort, bool)
        if not number or not 0 <= effort <= 0.99:
            raise BadRequest("'reasoning_effort' must be one of " + ", ".join(_EFFORTS)
                             + " or a number from 0 to 0.99")  # fmt: skip
    kwargs = obj.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object")
    for key in ("enable_thinking", "thinking"):
        if kwargs and kwargs.get(key) is not None:
            return bool(kwargs[key])
    return effort != "none"


def parse_json(body: bytes) -> dict[str, Any]:
    if not body:
        raise BadRequest("the request body is empty; a JSON object is required")
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRequest("the request body must be a JSON object")
    return obj


def _int(obj: Mapping[str, Any], key: str, default: int | None, *, minimum: int) -> int | None:
    value = obj.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{key}' must be an integer")
    if value < minimum:
        raise BadRequest(f"'{key}' must be at least {minimum}")
    return value


def _bool(obj: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = obj.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be a boolean")
    return value


def _number(obj: Mapping[str, Any], key: str, *, lo: float, hi: float) -> None:
    value = obj.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"'{key}' must be a number")
    if not lo <= value <= hi:
        raise BadRequest(f"'{key}' must be between {lo} and {hi}")


def _stop(obj: Mapping[str, Any]) -> tuple[str, ...]:
    value = obj.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(s for s in value if s)
    raise BadRequest("'stop' must be a string or a list of strings")


def _stop_ids(obj: Mapping[str, Any]) -> frozenset[int]:
    value = obj.get("stop_token_ids")
    if value is None:
        return frozenset()
    if isinstance(value, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        return frozenset(value)
    raise BadRequest("'stop_token_ids' must be a list of integers")


def _rid(obj: Mapping[str, Any]) -> str | None:
    rid = obj.get("rid")
    if rid is None:
        return None
    if not isinstance(rid, str) or not rid:
        raise BadRequest("'rid' must be a non-empty string")
    return rid


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    ):
        raise BadRequest(f"'{name}' must be a list of non-negative integers")
    return value


def _sampling(obj: Mapping[str, Any]) -> None:
    _number(obj, "temperature", lo=0.0, hi=100.0)
    _number(obj, "top_p", lo=0.0, hi=1.0)
    _number(obj, "min_p", lo=0.0, hi=1.0)
    _number(obj, "frequency_penalty", lo=-2.0, hi=2.0)
    _number(obj, "presence_penalty", lo=-2.0, hi=2.0)
    top_k = obj.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise BadRequest("'top_k' must be an integer")


def _single(value: Any, name: str) -> Any:
    """The stand-in serves one prompt per request; a one-element batch is unwrapped."""
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        if len(value) != 1:
            raise BadRequest(
                f"batched '{name}' (a list of prompts) is not supported by the stand-in"
            )
        return value[0]
    return value


def parse_generate(obj: dict[str, Any], tokenizer: Tokenizer) -> GenParams:
    """POST /generate (GenerateReqInput)."""
    text, input_ids = obj.get("text"), obj.get("input_ids")
    if text is None and input_ids is None:
        raise BadRequest("Either text or input_ids should be provided.")
    if text is not None and input_ids is not None:
        raise BadRequest("Only one of text or input_ids should be provided.")
    if text is not None:
        text = _single(text, "text")
        if not isinstance(text, str):
            raise BadRequest("'text' must be a string")
        ids = tokenizer.encode(BOS_TOKEN + text)  # HF tokenizers add BOS to plain text
    else:
        ids = _token_ids(_single(input_ids, "input_ids"), "input_ids")
    sp = obj.get("sampling_params")
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest("'sampling_params' must be an object")
    _sampling(sp)
    if _int(sp, "n", 1, minimum=1) != 1:
        raise BadRequest("'n' > 1 is not supported by the stand-in")
    return GenParams(
        input_ids=ids,
        max_new_tokens=_int(sp, "max_new_tokens", 128, minimum=0),
        stream=_bool(obj, "stream"),
        rid=_rid(obj),
        ignore_eos=_bool(sp, "ignore_eos"),
        min_new_tokens=_int(sp, "min_new_tokens", 0, minimum=0) or 0,
        stop=_stop(sp),
        stop_token_ids=_stop_ids(sp),
        no_stop_trim=_bool(sp, "no_stop_trim"),
        logprobs=_bool(obj, "return_logprob"),
        top_logprobs=_int(obj, "top_logprobs_num", 0, minimum=0) or 0,
    )


def parse_generate_batch(obj: dict[str, Any], tokenizer: Tokenizer) -> list[GenParams] | None:
    """POST /generate with a batch of prompts (`text` a list of strings, `input_ids` a list of
    id lists): one `GenParams` per prompt, as SGLang's `GenerateReqInput` normalises it
    (`sampling_params` an object for all or a list of one per prompt; a `rid` string becomes
    `rid_0`, `rid_1`, ...; a list of rids names each prompt). None for a single prompt."""
    text, input_ids = obj.get("text"), obj.get("input_ids")
    prompts: list[dict[str, Any]]
    if text is not None and input_ids is None and isinstance(text, list):
        if not text or not all(isinstance(t, str) for t in text):
            raise BadRequest("'text' must be a string or a non-empty list of strings")
        prompts = [{"text": t} for t in text]
    elif (
        input_ids is not None
        and text is None
        and isinstance(input_ids, list)
        and (input_ids and isinstance(input_ids[0], list))
    ):
        prompts = [{"input_ids": _token_ids(ids, "input_ids")} for ids in input_ids]
    else:
        return None
    n = len(prompts)
    sp = obj.get("sampling_params")
    if sp is None or isinstance(sp, dict):
        sps = [sp] * n
    elif isinstance(sp, list) and len(sp) == n:
        sps = sp
    else:
        raise BadRequest("'sampling_params' must be an object or a list of one per prompt")
    rid = obj.get("rid")
    if rid is None:
        rids: list[Any] = [None] * n
    elif isinstance(rid, str) and rid:
        rids = [f"{rid}_{i}" for i in range(n)]
    elif isinstance(rid, list):
        if len(rid) != n:
            raise BadRequest(
                "The specified rids length mismatch with the batch_size for batch processing."
            )
        rids = rid
    else:
        raise BadRequest("The rid should be a string or a list of strings.")
    if len({r for r in rids if r is not None}) != sum(r is not None for r in rids):
        raise BadRequest(f"Duplicate request ID in the batch: {rids}")
    rest = {k: v for k, v in obj.items() if k not in ("text", "input_ids", "sampling_params",
                                                      "rid")}  # fmt: skip
    return [
        parse_generate({**rest, **prompt, "sampling_params": sp_i, "rid": rid_i}, tokenizer)
        for prompt, sp_i, rid_i in zip(prompts, sps, rids, strict=True)
    ]


def _openai_common(obj: dict[str, Any], params: GenParams) -> GenParams:
    _sampling(obj)
    params.n = _int(obj, "n", 1, minimum=1) or 1
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    params.model = model
    params.stream = _bool(obj, "stream")
    options = obj.get("stream_options")
    if options is not None:
        if not params.stream:
            raise BadRequest("Stream options can only be defined when `stream=True`.")
        if not isinstance(options, dict):
            raise BadRequest("'stream_options' must be an object")
        params.include_usage = _bool(options, "include_usage")
        params.continuous_usage_stats = _bool(options, "continuous_usage_stats")
    params.rid = _rid(obj)
    params.ignore_eos = _bool(obj, "ignore_eos")
    params.min_new_tokens = _int(obj, "min_tokens", 0, minimum=0) or 0
    params.stop = _stop(obj)
    params.stop_token_ids = _stop_ids(obj)
    params.no_stop_trim = _bool(obj, "no_stop_trim")
    return params


def parse_completion(obj: dict[str, Any], tokenizer: Tokenizer) -> GenParams:
    """POST /v1/completions (CompletionRequest): max_tokens defaults to 16."""
    if "prompt" not in obj or obj["prompt"] is None:
        raise BadRequest("Field required: 'prompt'")
    prompt = obj["prompt"]
    # A list of strings or of id lists is a batch: one prompt each (SGLang's GenerateReqInput).
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) \
        else [prompt]  # fmt: skip
    prompts: list[list[int]] = []
    for one in batch:
        if isinstance(one, str):
            prompts.append(tokenizer.encode(BOS_TOKEN + one))
        else:
            prompts.append(_token_ids(one, "prompt"))
    ids = prompts[0]
    if _bool(obj, "echo"):
        raise BadRequest("'echo' is not supported by the stand-in")
    max_tokens = _int(obj, "max_tokens", 16, minimum=0)
    if max_tokens == 0:  # SGLang's protocol.py `validate_max_tokens_positive`
        raise BadRequest("max_tokens must be positive")
    params = GenParams(input_ids=ids, max_new_tokens=max_tokens)
    if len(prompts) > 1:
        params.prompts = prompts
    # Legacy completions: `logprobs` is the number of alternatives (0..5), null for none.
    top = _int(obj, "logprobs", None, minimum=0)
    if top is not None:
        if top > 5:
            raise BadRequest("'logprobs' must be at most 5")
        params.logprobs, params.top_logprobs = True, top
    return _openai_common(obj, params)


def parse_chat(obj: dict[str, Any], tokenizer: Tokenizer) -> GenParams:
    """POST /v1/chat/completions: the template renders the messages; no max_tokens = no cap."""
    if "messages" not in obj:
        raise BadRequest("Field required: 'messages'")
    try:
        text = render(obj["messages"])
    except TemplateError as exc:
        raise BadRequest(str(exc)) from None
    try:
        call = plan_call(obj, obj["messages"])  # the tools are checked here
        structured = structured_answer(obj)
    except (ToolError, FormatError) as exc:
        raise BadRequest(str(exc)) from None
    if obj.get("tools"):  # their definitions lead the prompt, as a template puts them
        text = with_tools(text, obj["tools"])
    max_tokens = _int(obj, "max_completion_tokens", None, minimum=0)
    if max_tokens is None:
        max_tokens = _int(obj, "max_tokens", None, minimum=0)
    params = GenParams(input_ids=tokenizer.encode(text), max_new_tokens=max_tokens)
    params.tool_call, params.structured = call, structured
    params.thinking = _thinking(obj)
    params.logprobs = _bool(obj, "logprobs")
    top = _int(obj, "top_logprobs", 0, minimum=0) or 0
    if top > 20:
        raise BadRequest("'top_logprobs' must be at most 20")
    if top and not params.logprobs:
        raise BadRequest("'top_logprobs' requires 'logprobs' to be true")
    params.top_logprobs = top
    return _openai_common(obj, params)
