"""One Redis pub/sub subscription kept alive, for the parts that share news between edges
(`edge.routing.fleet_view` loads, `edge.models.rollout_sync` stops, `edge.backend_holds`
drains).

`Subscription.run` subscribes, hands each message's payload to `on_message`, and when Redis
fails (gone, slow to subscribe) reports it to `on_error` and subscribes again `retry_after`
seconds later, until it is cancelled or `closing()` says so. Its client must have no socket
read timeout: a subscriber waits for messages as long as there are none.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any


class Subscription:
    def __init__(
        self,
        client: Any,
        channel: bytes | str,
        on_message: Callable[[bytes], None],
        *,
        on_error: Callable[[BaseException], None],
        subscribe_timeout: float,
        retry_after: float,
        idle_timeout: float = 60.0,
        closing: Callable[[], bool] = lambda: False,
        subscribed: asyncio.Event | None = None,
    ) -> None:
        self.client = client
        self.channel = channel
        self.on_message = on_message
        self.on_error = on_error
        self.subscribe_timeout = subscribe_timeout
        self.retry_after = retry_after
        self.idle_timeout = idle_timeout
        """Seconds one read of the connection waits for a message (then it reads again)."""
        self.closing = closing
        self.subscribed = subscribed if subscribed is not None else asyncio.Event()
        """Set while the channel is subscribed."""

    async def run(self) -> None:
        while not self.closing():
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                async with asyncio.timeout(self.subscribe_timeout):
                    await pubsub.subscribe(self.channel)
                self.subscribed.set()
                while not self.closing():
                    message = await pubsub.get_message(timeout=self.idle_timeout)
                    if message is not None and message.get("type") == "message":
                        self.on_message(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # gone: subscribe again shortly
                self.on_error(exc)
            finally:
                self.subscribed.clear()
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(self.retry_after)


__all__ = ["Subscription"]
