"""Corners of SGLang's wire contract that a proxy in front must read right: how a refused
streamed `/generate` and a request stopped by `/abort_request` come back.

SGLang (python/sglang/srt/entrypoints/http_server.py, `generate_request`) starts a streamed
`/generate` answer before the tokenizer manager validates the request, so a refusal is a 200 event
stream holding one `{"error": {"message"}}` event and `[DONE]`. An abort without a status code
(what `/abort_request` does: `FINISH_ABORT()`, "Aborted" / "Abort in waiting queue") is a
graceful finish, not an error: `finish_reason` "abort" on every route, streamed or whole
(tokenizer_manager.py `_handle_abort_finish_reason`; serving_chat.py `_generate_chat_stream`).
"""

from __future__ import annotations

import httpx

from tests.backends.sim.conftest import MakeSim, stream_post

LONG = "word " * 200


async def test_a_refused_streamed_generate_is_an_error_event_in_a_200_stream(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    sim = await make_sim(context_length=64)
    body = {"text": LONG, "stream": True}
    response, events = await stream_post(client, f"{sim.url}/generate", body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert len(events) == 2 and events[1] == "[DONE]"
    assert set(events[0]) == {"error"} and set(events[0]["error"]) == {"message"}
    assert "context length" in events[0]["error"]["message"]
    # a value the tokenizer manager refuses comes back the same way
    body = {"text": "hi", "stream": True, "sampling_params": {"temperature": -1}}
    response, events = await stream_post(client, f"{sim.url}/generate", body)
    assert response.status_code == 200 and "temperature" in events[0]["error"]["message"]
    # not streamed, it stays a 400 (`_create_error_response`)
    r = await client.post(f"{sim.url}/generate", json={"text": LONG})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
