"""One generation request as the scheduler sees it."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

from backends.sim.radix import Node
from backends.sim.textgen import TokenPlan


class State(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"  # admitted; (a chunk of) its prompt is being prefilled
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class SimRequest:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    plan: TokenPlan
    ignore_eos: bool = False
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    no_stop_trim: bool = False
    log_metrics: bool = True
    """False for internal requests (health checks), as SGLang does."""
    thinking: int = 0
    """Chat: the first tokens that are the model's thinking (`--reasoning-tokens`)."""

    state: State = State.WAITING
    output_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    """Prompt tokens found in the radix cache when the request was first scheduled."""
    computed: int = 0
    """Prompt tokens whose KV exists (cached prefix + prefilled so far)."""
    prefix_len: int = 0
    """Tokens covered by `node` (the locked radix path)."""
    node: Node | None = None
    own_tokens: int = 0
    """KV tokens this request holds outside the radix tree."""
    reserved_tokens: int = 0
    retractions: int = 0
    """Times the scheduler retracted this request (SGLang's `total_retractions`)."""
    """KV tokens set aside for the rest of its decoding."""
    created_at: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    _event: asyncio.Event | None = None
    _tail: str = ""

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def text(self) -> str:
        return "".join(self.pieces)

    # -- change notification (the HTTP handler waits on it) ------------------------------------

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()

    def share_event(self, event: asyncio.Event) -> None:
        """Signal changes on `event`, which other requests may share: waiting on one of them
        then wakes on any one's progress (an answer with several choices)."""
        self._event = event

    async def wait_change(self) -> None:
        """Wait until new output or the finish exists (returns at once if it already does)."""
        if self._event is None:
            self._event = asyncio.Event()
        await self._event.wait()
        self._event.clear()
