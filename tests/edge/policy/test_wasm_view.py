"""What a WebAssembly module reads, in the edge: the model the request is checked and routed
as (a `/generate` body's `model` is not it), the route the client called beside the one it is
forwarded as, and a message's text parts as chat templates render them, so a module sees what
the request rules see."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import wasmtime

from edge.errors import PolicyUnavailable
from tests.edge.conftest import Recorded, Reply, TinyUpstream, client, health_ok
from tests.edge.policy.test_policy_e2e import edge_with, inference, script

CHAT = "/v1/chat/completions"


def scanning(tmp_path: Path, needle: bytes, *, deny_if_found: bool) -> str:
    """A module that looks for `needle` (bytes, exactly) anywhere in the view it reads and
    denies when it finds it (`deny_if_found`) or when it does not (an allow-list)."""
    assert 0 < len(needle) <= 800
    data = "".join(f"\\{b:02x}" for b in needle)
    deny = (64, len(b'{"action":"deny","reason":"scan"}'))
    found, missing = (deny, (0, 18)) if deny_if_found else ((0, 18), deny)
    wat = f"""(module
  (memory (export "memory") 1)
  (data (i32.const 0) "{{\\"action\\":\\"allow\\"}}")
  (data (i32.const 64) "{{\\"action\\":\\"deny\\",\\"reason\\":\\"scan\\"}}")
  (data (i32.const 128) "{data}")
  (func (export "alloc") (param $len i32) (result i32)
    (local $need i32)
    (local.set $need (i32.shr_u (i32.add (i32.add (i32.const 1024) (local.get $len))
                                         (i32.const 65535)) (i32.const 16)))
    (if (i32.gt_u (local.get $need) (memory.size))
      (then (if (i32.eq (memory.grow (i32.sub (local.get $need) (memory.size))) (i32.const -1))
        (then unreachable))))
    (i32.const 1024))
  (func $at (param $p i32) (result i32)
    (local $i i32)
    (block $no
      (loop $next
        (br_if $no (i32.ne (i32.load8_u (i32.add (local.get $p) (local.get $i)))
                           (i32.load8_u (i32.add (i32.const 128) (local.get $i)))))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br_if $next (i32.lt_u (local.get $i) (i32.const {len(needle)}))))
      (return (i32.const 1)))
    (i32.const 0))
  (func (export "check") (param $ptr i32) (param $len i32) (result i64)
    (local $p i32) (local $end i32)
    (local.set $p (local.get $ptr))
    (local.set $end (i32.sub (i32.add (local.get $ptr) (local.get $len)) (i32.const {len(needle)})))
    (block $done
      (loop $scan
        (br_if $done (i32.gt_s (local.get $p) (local.get $end)))
        (if (call $at (local.get $p))
          (then (return (i64.const {(found[0] << 32) | found[1]}))))
        (local.set $p (i32.add (local.get $p) (i32.const 1)))
        (br $scan)))
    (i64.const {(missing[0] << 32) | missing[1]})))"""
    path = tmp_path / f"scan{abs(hash((needle, deny_if_found)))}.wasm"
    path.write_bytes(wasmtime.wat2wasm(wat))
    return str(path)


def modules(*paths: str) -> dict[str, Any]:
    return {"wasm": [{"id": f"mod{i}", "path": p} for i, p in enumerate(paths)]}


def generate_answer(recorded: Recorded) -> Reply:
    body = json.dumps({"text": "ok", "meta_info": {"id": "g"}}).encode()
    return health_ok(recorded) or Reply(chunks=[body], chunked=False)


async def test_a_module_allow_list_sees_the_model_a_generate_request_is_routed_to(
    tmp_path: Path,
) -> None:
    """`/generate` goes to the backends' own model whatever `model` its body names: a module
    that allows only `small-*` must not be passed by a body naming `small-1` there, as the
    request rules' own allow-list is not."""
    only_small = scanning(tmp_path, b'"model":"small-', deny_if_found=False)
    async with TinyUpstream(generate_answer) as up:
        async with edge_with(up.url, modules(only_small)) as edge, client(edge) as http:
            named = await http.post("/generate", json={"model": "small-1", "text": "hi"})
            unnamed = await http.post("/generate", json={"text": "hi"})
    assert named.status_code == 403, named.text
    assert named.headers["x-quicedge-policy-rule"] == "mod0"
    assert unnamed.status_code == 403
    assert inference(up) == []


async def test_a_module_reads_the_model_as_default_on_generate_and_when_none_is_named(
    tmp_path: Path,
) -> None:
    default = scanning(tmp_path, b'"model":"default"', deny_if_found=True)
    async with TinyUpstream(generate_answer) as up:
        async with edge_with(up.url, modules(default)) as edge, client(edge) as http:
            generate = await http.post("/generate", json={"model": "tiny-model", "text": "hi"})
    assert generate.status_code == 403, generate.text


async def test_a_module_reads_the_route_the_client_called(tmp_path: Path) -> None:
    """A `/v1/responses` request is forwarded as a chat completion: `route` keeps saying so
    (modules read it), and `client_route` names what the client called."""
    responses_only = scanning(tmp_path, b'"client_route":"/v1/responses"', deny_if_found=True)
    forwarded = scanning(tmp_path, b'"route":"/v1/chat/completions"', deny_if_found=False)
    async with TinyUpstream(script(["ok"])) as up:
        policy = modules(forwarded, responses_only)
        async with edge_with(up.url, policy) as edge, client(edge) as http:
            responses = await http.post("/v1/responses", json={"model": "tiny-model",
                                                               "input": "hi"})  # fmt: skip
            chat = await http.post(
                CHAT, json={"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}]}
            )
    assert responses.status_code == 403, responses.text
    assert responses.headers["x-quicedge-policy-rule"] == "mod1"
    assert chat.status_code == 200, chat.text


def parts(*texts: str) -> dict[str, Any]:
    content = [{"type": "text", "text": t} for t in texts]
    return {"model": "tiny-model", "messages": [{"role": "user", "content": content}]}


async def test_a_word_split_over_text_parts_is_whole_in_what_a_module_reads(
    tmp_path: Path,
) -> None:
    """A chat template renders a message's text parts concatenated (SGLang's `openai` content
    format) or joined by a space (`string`): the module reads both, as the request rules
    match both, so neither `"my pass" + "word"` nor `"api" + "key"` slips past it."""
    password = scanning(tmp_path, b"my password", deny_if_found=True)
    api_key = scanning(tmp_path, b"api key", deny_if_found=True)
    async with TinyUpstream(script(["ok"])) as up:
        async with edge_with(up.url, modules(password, api_key)) as edge, client(edge) as http:
            concatenated = await http.post(CHAT, json=parts("my pass", "word"))
            spaced = await http.post(CHAT, json=parts("api", "key"))
            clean = await http.post(CHAT, json=parts("hello", "there"))
    assert concatenated.status_code == 403, concatenated.text
    assert concatenated.headers["x-quicedge-policy-rule"] == "mod0"
    assert spaced.status_code == 403, spaced.text
    assert spaced.headers["x-quicedge-policy-rule"] == "mod1"
    assert clean.status_code == 200
    sent = [json.loads(r.body) for r in inference(up)]
    assert [m["messages"][0]["content"][0]["text"] for m in sent] == ["hello"]


def test_a_modules_spans_in_either_reading_of_text_parts_redact_the_parts(
    tmp_path: Path,
) -> None:
    """The prompt reads the parts `my pass` + `word` twice, `my password\\nmy pass word`; a
    span in either reading (or both) cuts the parts it covers, and a text after the message
    is where its offsets say (`ab\\na b\\ncall bob`: `bob` is [12, 15))."""
    from tests.edge.policy.test_wasm_answers import answering, gateway, redact

    for spans in ([[3, 11]], [[15, 24]], [[3, 11], [15, 24]]):
        gw, failures = gateway(answering(tmp_path, redact(spans)))
        body = parts("my pass", "word")
        assert gw.check(CHAT, body, tenant="t", tier="pro", stream=False).decision == "redact"
        texts = [p["text"] for p in body["messages"][0]["content"]]
        assert texts == ["my [REDACTED]", "[REDACTED]"], spans
        assert failures == []
    gw, failures = gateway(answering(tmp_path, redact([[12, 15]])))
    body = parts("a", "b")
    body["messages"].append({"role": "user", "content": "call bob"})
    assert gw.check(CHAT, body, tenant="t", tier="pro", stream=False).decision == "redact"
    assert [p["text"] for p in body["messages"][0]["content"]] == ["a", "b"]
    assert body["messages"][1]["content"] == "call [REDACTED]"
    gw, failures = gateway(answering(tmp_path, redact([[6, 7]])))  # past its 6 bytes: abi
    with pytest.raises(PolicyUnavailable):
        gw.check(CHAT, parts("a", "b"), tenant="t", tier="pro", stream=False)


async def test_a_module_is_told_when_the_model_reads_token_ids(tmp_path: Path) -> None:
    """Token ids are a prompt no rule can read (the edge has no tokenizer): SGLang's chat
    route reads `input_ids` instead of rendering the messages that were checked, and
    completions and `/generate` take ids as the prompt. `token_ids` says so, and a module
    that refuses them closes that way around the rules."""
    no_ids = scanning(tmp_path, b'"token_ids":true', deny_if_found=True)
    messages = [{"role": "user", "content": "hi"}]
    async with TinyUpstream(script(["ok"])) as up:
        async with edge_with(up.url, modules(no_ids)) as edge, client(edge) as http:
            chat_ids = await http.post(CHAT, json={"model": "tiny-model", "messages": messages,
                                                   "input_ids": [1, 2, 3]})  # fmt: skip
            ids = {"model": "tiny-model", "prompt": [1, 2]}
            prompt_ids = await http.post("/v1/completions", json=ids)
            generate_ids = await http.post("/generate", json={"input_ids": [1, 2]})
            text = await http.post(CHAT, json={"model": "tiny-model", "messages": messages})
    for refused in (chat_ids, prompt_ids, generate_ids):
        assert refused.status_code == 403, refused.text
    assert text.status_code == 200
