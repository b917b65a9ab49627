"""Stored responses and conversations, read back, changed and deleted by id (docs/state.md,
"Reading back and deleting"): the edge's own routes, answered from the conversation store,
never forwarded.

| route | answer |
| --- | --- |
| `GET /v1/responses/{id}` | the response object as it was answered (or a background one's now) |
| `POST /v1/responses/{id}/cancel` | stops a background response in progress |
| `GET /v1/responses/{id}/input_items` | what that turn sent, as a list of items |
| `DELETE /v1/responses/{id}` | forgets its conversation; a background one not stored, itself |
| `POST /v1/conversations` | a new conversation, its `items` first in every prompt |
| `GET /v1/conversations/{id}` | the conversation object |
| `POST /v1/conversations/{id}` | sets its `metadata` |
| `GET /v1/conversations/{id}/items` | every kept message, as a list of items |
| `POST /v1/conversations/{id}/items` | adds items, which lead the next turn |
| `GET /v1/conversations/{id}/items/{item_id}` | one item |
| `DELETE /v1/conversations/{id}/items/{item_id}` | takes that item out of it |
| `DELETE /v1/conversations/{id}` | forgets it |

Lists page as OpenAI's do: `order` (`desc`, the default, or `asc`), `limit` (1 to 100, 20) and
`after` (an item id), with `first_id`, `last_id` and `has_more`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qs

from edge.errors import ConversationNotFound, InvalidRequest
from edge.state.background import CANCELLED, DELETED, RUNNING, Record, RecordStore
from edge.state.conversations import (
    REMOVED,
    Conversations,
    History,
    conversation_name,
    parse_conversation_name,
    parse_response_id,
)
from edge.state.response_builder import ResponseBuilder
from edge.state.response_tools import call_item, calls_of, output_item
from edge.state.responses import check_known, check_metadata, conversation_items

MAX_LIMIT = 100
DEFAULT_LIMIT = 20


def _not_found(what: str, name: str, code: str) -> ConversationNotFound:
    return ConversationNotFound(f"{what} with id '{name[:80]}' not found.", code=code)


def _items(cid: str, place: str, message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A stored chat message as Responses API items: a `tool` message is a
    `function_call_output`, an assistant message with tool calls its text (when it has any)
    and a `function_call` per call, any other a `message`."""
    if message.get(REMOVED):
        return []
    if message.get("role") == "tool":
        return [output_item(dict(message), f"fco_{cid}{place}")]
    calls = calls_of(dict(message)) if message.get("role") == "assistant" else []
    out = [_item(cid, place, message)] if message.get("content") or not calls else []
    return out + [call_item(c, f"fc_{cid}{place}{k:02x}") for k, c in enumerate(calls)
                  if not c.get(REMOVED)]  # fmt: skip


def _item(cid: str, place: str, message: Mapping[str, Any]) -> dict[str, Any]:
    """A stored chat message as a Responses API `message` item."""
    role = message.get("role")
    kind = "output_text" if role == "assistant" else "input_text"
    content = message.get("content")
    parts: list[Any]
    if isinstance(content, str):
        parts = [{"type": kind, "text": content}]
    elif isinstance(content, list):  # chat content parts, in the Responses' terms
        parts = [_part(kind, p) for p in content]
    else:
        parts = []
    if kind == "output_text":
        parts = [
            {**p, "annotations": []} if isinstance(p, dict) and p.get("type") == kind else p
            for p in parts
        ]
    return {"type": "message", "id": f"msg_{cid}{place}", "status": "completed", "role": role,
            "content": parts}  # fmt: skip


def _part(kind: str, part: Any) -> Any:
    """A chat content part as a Responses one: text as `kind`, an image as `input_image`."""
    if not isinstance(part, dict):
        return part
    if part.get("type") == "text" and isinstance(part.get("text"), str):
        return {"type": kind, "text": part["text"]}
    image = part.get("image_url")
    if part.get("type") == "image_url" and isinstance(image, dict):
        return {"type": "input_image", "image_url": image.get("url"),
                "detail": image.get("detail", "auto")}  # fmt: skip
    return part


def _call_of(item_id: str, cid: str, place: str) -> int | None:
    """What `History.remove` takes out for the item `item_id` of the message at `place`: a
    `function_call`'s number in it, or None for its text (a message or an output item)."""
    if item_id.startswith("fc_"):
        return int(item_id[len(f"fc_{cid}{place}") :], 16)
    return None


def _canonical(item_id: str, cid: str, history: History) -> str:
    """The id the conversation lists an item under, for `item_id` or for the id a turn's
    response object gave that item (its reply's `message` and `function_call` items, numbered
    by the answer, not by place); `item_id` itself when it is neither."""
    start = 0
    for k, end in enumerate(history.turns):
        meta, place = history.meta[k], f"{history.first_kept + k:08x}{end - 1 - start:04x}"
        start = end
        if not meta.get("id"):  # a chat conversation's turn: no response object
            continue
        if item_id == meta["id"]:
            return f"msg_{cid}{place}"
        calls = meta.get("calls")
        if isinstance(calls, list) and item_id in calls:
            return f"fc_{cid}{place}{calls.index(item_id):02x}"
    return item_id


def _conversation(cid: str, history: History) -> dict[str, Any]:
    return {"id": conversation_name(cid), "object": "conversation",
            "created_at": history.created_at, "metadata": history.metadata}  # fmt: skip


def order_and_limit(args: Mapping[str, str], default_order: str) -> tuple[str, int]:
    """A list's `order` (`asc` or `desc`) and `limit` (1 to 100, 20); 400 naming a bad one."""
    order = args.get("order", default_order)
    if order not in ("asc", "desc"):
        raise InvalidRequest("'order' must be 'asc' or 'desc'", param="order")
    try:
        limit = int(args.get("limit", DEFAULT_LIMIT))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidRequest(f"'limit' must be an integer from 1 to {MAX_LIMIT}", param="limit")
    return order, limit


def page(
    items: list[dict[str, Any]], query: bytes, *, default_order: str = "desc"
) -> dict[str, Any]:
    """One page of `items` (oldest first) as the query asks; 400 naming a bad parameter."""
    args = {k: v[-1] for k, v in parse_qs(query.decode("latin-1")).items()}
    order, limit = order_and_limit(args, default_order)
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if "after" in args:
        ids = [item["id"] for item in ordered]
        if args["after"] not in ids:
            raise InvalidRequest(f"'after': no item {args['after'][:80]!r} here", param="after")
        start = ids.index(args["after"]) + 1
    data = ordered[start : start + limit]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": start + limit < len(ordered)}  # fmt: skip


class StoredObjects:
    """What `edge.app` answers on the stored objects' routes, for one tenant at a time; another
    tenant's ids, unknown, expired and malformed ones are all the same 404."""

    def __init__(
        self, conversations: Conversations | None, records: RecordStore | None = None
    ) -> None:
        self.conversations = conversations
        self.records = records
        """Background responses not stored (yet): running, cancelled or failed."""

    async def _record(self, tenant: str, rid: str) -> Record | None:
        """A background response's record as readers see it: one running whose heartbeat ran
        out (no edge generates it any longer) is `failed`; a deleted one is not there."""
        if self.records is None or not rid.startswith("resp_"):
            return None
        record = await self.records.get(tenant, rid)
        return None if record is None or record.status == DELETED else record.as_read()

    async def _history(self, tenant: str, name: str) -> tuple[str, History, int] | None:
        """(conversation, its history, the turn `name` names or 0) for a `resp_` or `conv_`
        id; None when there is nothing to show."""
        if self.conversations is None:
            return None
        with contextlib.suppress(ConversationNotFound):
            if name.startswith("resp_"):
                cid, turn = parse_response_id(name)
            else:
                cid, turn = parse_conversation_name(name), 0
            history = await self.conversations.history(tenant, cid)
            return None if history is None else (cid, history, turn)
        return None

    @staticmethod
    def _missing(name: str, response: bool) -> ConversationNotFound:
        if response:
            return _not_found("Response", name, "response_not_found")
        return _not_found("Conversation", name, "conversation_not_found")

    async def response(self, tenant: str, rid: str) -> dict[str, Any]:
        """`GET /v1/responses/{rid}`: the response object as it was answered."""
        found = await self._history(tenant, rid) if rid.startswith("resp_") else None
        reply = found[1].reply(found[2]) if found is not None else None
        if reply is None:
            record = await self._record(tenant, rid)
            if record is None:
                raise self._missing(rid, True)
            return ResponseBuilder.pending(rid, record.meta, record.error).response(record.status)
        message, meta = reply
        builder = ResponseBuilder.restored(rid, message, meta)
        return builder.response(meta.get("status") or "completed")

    async def cancel(self, tenant: str, rid: str) -> dict[str, Any]:
        """`POST /v1/responses/{rid}/cancel`: stop a background response still running (the
        worker generating it reads the record within `POLL_S`); the response object. One
        already cancelled or failed is given back as it is; a stored one is a 400."""
        found = await self._history(tenant, rid) if rid.startswith("resp_") else None
        if found is not None and found[1].reply(found[2]) is not None:
            raise InvalidRequest(
                "only a background response in progress can be cancelled; this one is stored",
                code="response_not_cancellable",
            )
        record = await self._record(tenant, rid)
        if record is None:
            raise self._missing(rid, True)
        assert self.records is not None
        if record.status == RUNNING:
            lease = record.lease
            record = Record(CANCELLED, record.meta)
            # not over a delete that came meanwhile: that response stays deleted
            if not await self.records.settle(tenant, rid, record):
                raise self._missing(rid, True)
            await self._stop_commit(tenant, rid, lease)
        return ResponseBuilder.pending(rid, record.meta, record.error).response(record.status)

    async def _stop_commit(self, tenant: str, rid: str, lease: str | None) -> None:
        """After a cancel was recorded: release the running turn's lease, so an answer that
        completes before its edge reads the cancel cannot store its turn (its commit needs the
        lease). One stored before that is what the response is: the cancel is a 400, as for
        any stored response, and the record just written goes."""
        conversations = self.conversations
        if lease is None or conversations is None:
            return
        cid, turn = parse_response_id(rid)
        with contextlib.suppress(ValueError):  # a lease token that is not hex: none to release
            await conversations.release_lease(tenant, cid, bytes.fromhex(lease))
        history = await conversations.history(tenant, cid)
        if history is not None and history.reply(turn) is not None:
            assert self.records is not None
            await self.records.delete(tenant, rid)
            raise InvalidRequest(
                "only a background response in progress can be cancelled; this one completed",
                code="response_not_cancellable",
            )

    async def input_items(self, tenant: str, rid: str, query: bytes) -> dict[str, Any]:
        """`GET /v1/responses/{rid}/input_items`: the messages that turn sent."""
        found = await self._history(tenant, rid) if rid.startswith("resp_") else None
        sent = found[1].turn_input(found[2]) if found is not None else None
        cid = found[0] if found is not None else rid[len("resp_") : len("resp_") + 24]
        if sent is None:  # a background response not stored (yet): its record has them
            record = await self._record(tenant, rid)
            if record is None:
                raise self._missing(rid, True)
            sent = [(str(place), dict(m)) for place, m in record.sent]
        return page([i for place, m in sent for i in _items(cid, place, m)], query)

    async def conversation(self, tenant: str, name: str) -> dict[str, Any]:
        """`GET /v1/conversations/{id}`: the conversation object."""
        found = await self._history(tenant, name) if name.startswith("conv_") else None
        if found is None:
            raise self._missing(name, False)
        return _conversation(found[0], found[1])

    async def conversation_items(self, tenant: str, name: str, query: bytes) -> dict[str, Any]:
        """`GET /v1/conversations/{id}/items`: every kept message, replies included."""
        found = await self._history(tenant, name) if name.startswith("conv_") else None
        if found is None:
            raise self._missing(name, False)
        items = [i for place, m in found[1].items() for i in _items(found[0], place, m)]
        return page(items, query)

    async def create(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        """`POST /v1/conversations`: a new conversation, with the body's `items` first in it;
        `responses.create(conversation=...)` then continues it."""
        items = conversation_items(body)
        conversations = self._conversations()
        metadata = body.get("metadata")
        metadata = {} if metadata is None else check_metadata(metadata)
        cid, history = await conversations.open(tenant, items, metadata)
        return _conversation(cid, history)

    def _conversations(self) -> Conversations:
        if self.conversations is None:
            raise InvalidRequest(
                "stored conversations are turned off on this edge", code="conversations_disabled"
            )
        return self.conversations

    async def _update(
        self, tenant: str, name: str, change: Callable[[History], None]
    ) -> tuple[str, History]:
        conversations = self._conversations()
        missing = self._missing(name, False)
        try:
            cid = parse_conversation_name(name)
        except ConversationNotFound:
            raise missing from None
        return cid, await conversations.update(tenant, cid, change, missing=missing)

    async def set_metadata(self, tenant: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """`POST /v1/conversations/{id}`: replace its `metadata`; the conversation object."""
        check_known(body, {"metadata"})
        metadata = check_metadata(body.get("metadata"))

        def change(history: History) -> None:
            history.metadata = metadata

        cid, history = await self._update(tenant, name, change)
        return _conversation(cid, history)

    async def add_items(self, tenant: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """`POST /v1/conversations/{id}/items`: items added after its latest turn, which the
        next turn's prompt carries (and keeps); the list of the items added."""
        if not body.get("items"):
            raise InvalidRequest("'items' must be a non-empty list", param="items",
                                 code="missing_field")  # fmt: skip
        added = conversation_items(body)
        first = 0

        def change(history: History) -> None:
            nonlocal first
            first = len(history.pending)
            history.pending.extend(added)

        cid, history = await self._update(tenant, name, change)
        place = f"{history.count + 1:08x}"
        items = [i for j, m in enumerate(added, first) for i in _items(cid, f"{place}{j:04x}", m)]
        return {"object": "list", "data": items, "first_id": items[0]["id"],
                "last_id": items[-1]["id"], "has_more": False}  # fmt: skip

    async def conversation_item(self, tenant: str, name: str, item: str) -> dict[str, Any]:
        """`GET /v1/conversations/{id}/items/{item_id}`: one item of it."""
        found = await self._history(tenant, name) if name.startswith("conv_") else None
        if found is None:
            raise self._missing(name, False)
        cid, history, _ = found
        wanted = _canonical(item, cid, history)
        for place, m in history.items():
            for each in _items(cid, place, m):
                if each["id"] == wanted:
                    return each
        raise _not_found("Item", item, "item_not_found")

    async def remove_item(self, tenant: str, name: str, item: str) -> dict[str, Any]:
        """`DELETE /v1/conversations/{id}/items/{item_id}`: take one item out of it, from later
        prompts and every list (the turn's response object too); the other items keep their
        ids. OpenAI's answer: the conversation object."""
        cid_of_name = name[len("conv_") :] if name.startswith("conv_") else ""

        def change(history: History) -> None:
            wanted = _canonical(item, cid_of_name, history)
            for place, m in history.items():
                for each in _items(cid_of_name, place, m):
                    if each["id"] == wanted:
                        history.remove(m, _call_of(wanted, cid_of_name, place))
                        return
            raise _not_found("Item", item, "item_not_found")

        cid, history = await self._update(tenant, name, change)
        return _conversation(cid, history)

    async def delete(self, tenant: str, name: str, *, response: bool) -> dict[str, Any]:
        """`DELETE /v1/responses/{id}` (`response`) or `/v1/conversations/{id}`: forget the
        conversation, every turn of it (a response's later turns were built on it); for a
        background response not stored (running, cancelled or failed), that response alone
        (`_delete_background`). OpenAI's deletion object."""
        if response:
            found = await self._history(tenant, name) if name.startswith("resp_") else None
            if found is None or found[1].reply(found[2]) is None:
                await self._delete_background(tenant, name)
                return {"id": name, "object": "response", "deleted": True}
        else:
            found = await self._history(tenant, name) if name.startswith("conv_") else None
        if found is None or self.conversations is None:
            raise self._missing(name, response)
        if not await self.conversations.delete(tenant, found[0]):
            raise self._missing(name, response)  # gone meanwhile (expired, another delete)
        kind = "response" if response else "conversation.deleted"
        return {"id": name, "object": kind, "deleted": True}

    async def _delete_background(self, tenant: str, rid: str) -> None:
        """Delete a background response that is not a stored turn: its record becomes the
        `TOMBSTONE` (every reader then finds nothing, the edge running it stops at its next
        poll as for a cancel, and its final record is not written over it), and its turn's
        lease is released, so an answer that completes meanwhile is not stored either. One
        stored just before the lease went is deleted as a stored response is: its
        conversation with it. 404 when there is no such response."""
        record = None
        if self.records is not None and rid.startswith("resp_"):
            record = await self.records.get(tenant, rid)
        if record is None or record.status == DELETED:
            raise self._missing(rid, True)
        assert self.records is not None
        await self.records.put(tenant, rid, Record(DELETED, {}))
        conversations = self.conversations
        if record.lease is None or conversations is None:
            return
        cid, turn = parse_response_id(rid)
        with contextlib.suppress(ValueError):  # a lease token that is not hex: none to release
            await conversations.release_lease(tenant, cid, bytes.fromhex(record.lease))
        # Its answer may have been stored before the lease went (the commit holds it): then
        # that stored turn goes as any stored response's does, with its conversation.
        history = await conversations.history(tenant, cid)
        if history is not None and history.reply(turn) is not None:
            await conversations.delete(tenant, cid)


__all__ = ["DEFAULT_LIMIT", "MAX_LIMIT", "StoredObjects", "order_and_limit", "page"]
