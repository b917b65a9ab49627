"""The fleet's model list: `/v1/models` merged from healthy backends, and the unknown-model check.

Fetched at start and again when older than `ttl`; a request naming a model outside a known list
gets 404 `model_not_found` without touching a backend. While the list is unknown (no backend
answered), requests pass and the backend decides. A model the list names but no backend serves
now (a reload replaced the backends that served it) is looked up again too, at most once per
`ttl`; a change of backends (`expire`: a reload, a backend healthy again) makes the next look
fetch at once.

Each fetch also tells the pools what a backend serves: its model is the first card's id, its
version SGLang's `weight_version` from `/get_model_info`, unless `[[models.backends]]` or the
URL's labels set them; what a fetch learned, the next learns again (a backend restarted with
another model or new weights is routed as what it serves now).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from backends.credentials import BackendCredentials
from backends.pool import UpstreamPool
from backends.registry import Backend
from edge.errors import ModelNotFound

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
"""SGLang's `CompletionRequest.model` default: the served model, whatever its name."""


class ModelCatalog:
    def __init__(
        self,
        *,
        backends: Sequence[Backend],
        pool: UpstreamPool,
        ttl: float,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        credentials: BackendCredentials | None = None,
    ) -> None:
        self._backends = backends
        self._pool = pool
        self._ttl = ttl
        self._timeout = timeout
        self._clock = clock
        self._credentials = credentials or BackendCredentials()
        self._fetched_at = float("-inf")
        self._listing: dict[str, Any] = {"object": "list", "data": []}
        self.known: frozenset[str] | None = None
        """Model ids served by the fleet; None until a backend answered."""
        self._refreshing: asyncio.Task[None] | None = None
        self._generation = 0
        """Counts `expire` calls: a fetch that one overtook runs again."""
        self.pinned: set[str] = set()
        """Backend URLs whose model and version the config set: not discovered."""
        self._learned_models: set[str] = set()
        self._learned_versions: set[str] = set()
        """Backend URLs whose model (version) discovery set, not the config or the URL's
        labels: learned again on each fetch."""
        self.discover = True
        """Learn each backend's model and version from its answers."""
        self.configure: Callable[[], None] | None = None
        """Called before each fetch: applies `[[models.backends]]` (`ModelPools.apply_config`)."""
        self.on_relabel: Callable[[], None] | None = None
        """Called after a fetch that changed some backend's model, version or hardware group
        (`Breakers.relabel`: their domains follow)."""

    @property
    def stale(self) -> bool:
        return self._clock() - self._fetched_at > self._ttl

    def expire(self) -> None:
        """The backends changed (a reload added some, one is healthy again): the next check
        or listing fetches the models again, and a fetch in flight, which may have missed the
        new backends, runs once more."""
        self._fetched_at = float("-inf")
        self._generation += 1

    async def _fetch(self, backend: Backend) -> list[dict[str, Any]]:
        response = await self._pool.request(
            backend.url, "GET", "/v1/models", headers=self._credentials.with_auth(backend.url, []),
            body=b"",
            first_byte_timeout=self._timeout, chunk_timeout=self._timeout,
        )  # fmt: skip
        body = await response.read()
        if response.status != 200:
            raise ValueError(f"{backend.name} /v1/models answered {response.status}")
        data = json.loads(body).get("data")
        if not isinstance(data, list):
            raise ValueError(f"{backend.name} /v1/models has no data list")
        cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]
        if self.discover and backend.url not in self.pinned and cards:
            await self._learn(backend, cards[0]["id"])
        return cards

    async def _learn(self, backend: Backend, served: str) -> None:
        """Set what the config and the URL's labels leave open of `backend`'s model and version
        from what it serves now. What discovery learned is learned again on each fetch: a
        backend restarted with another model, or given new weights (a new `weight_version`),
        is routed as what it serves now, not as what it once served."""
        url = backend.url
        learn_model = backend.model is None or url in self._learned_models
        learn_version = backend.model_version is None or url in self._learned_versions
        model = served if learn_model else backend.model
        version = backend.model_version
        if learn_version:
            answered, learned = await self._version(backend)
            if answered or model != backend.model:  # a failed look keeps what was known
                version = learned
        if learn_model:
            self._learned_models.add(url)
        if learn_version and version is not None:
            self._learned_versions.add(url)
        if (model, version) != (backend.model, backend.model_version):
            backend.set_model(model, version)

    async def _version(self, backend: Backend) -> tuple[bool, str | None]:
        """Whether `/get_model_info` answered, and SGLang's `weight_version` in it (None when it
        has none)."""
        try:
            response = await self._pool.request(
                backend.url, "GET", "/get_model_info",
                headers=self._credentials.with_auth(backend.url, []), body=b"",
                first_byte_timeout=self._timeout, chunk_timeout=self._timeout,
            )  # fmt: skip
            body = await response.read()
            if response.status != 200:
                return False, None
            version = json.loads(body).get("weight_version")
        except Exception as exc:  # an older server without the route: no version
            log.info("model info from %s: %s", backend.name, exc)
            return False, None
        return True, version if isinstance(version, str) and version else None

    async def refresh(self) -> None:
        """Fetch from every healthy backend at once; concurrent callers share one fetch."""
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._refresh())
        task = self._refreshing
        try:
            await asyncio.shield(task)
        finally:
            if task.done():
                self._refreshing = None

    async def _refresh(self) -> None:
        generation = self._generation
        await self._refresh_once()
        if generation != self._generation:  # expired meanwhile: a new backend may be missing
            await self._refresh_once()

    async def _refresh_once(self) -> None:
        before = [(b.model, b.model_version, b.hw_group) for b in self._backends]
        if self.configure is not None:  # backends discovery added meanwhile get their config
            self.configure()
        healthy = [b for b in self._backends if b.healthy]
        results = await asyncio.gather(*(self._fetch(b) for b in healthy), return_exceptions=True)
        merged: dict[str, dict[str, Any]] = {}
        answered = False
        for backend, result in zip(healthy, results, strict=True):
            if isinstance(result, BaseException):
                log.info("models from %s: %s", backend.name, result)
                continue
            answered = True
            for card in result:
                merged.setdefault(card["id"], card)
        self._fetched_at = self._clock()
        after = [(b.model, b.model_version, b.hw_group) for b in self._backends]
        if after != before and self.on_relabel is not None:
            self.on_relabel()
        if answered:
            self._listing = {"object": "list", "data": list(merged.values())}
            self.known = frozenset(merged)

    async def listing(self) -> dict[str, Any]:
        """The merged `/v1/models` answer."""
        if self.stale:
            await self.refresh()
        return self._listing

    def card(self, model: str) -> dict[str, Any] | None:
        for card in self._listing["data"]:
            if card["id"] == model:
                return card
        return None

    async def check(self, model: str | None) -> None:
        """404 `model_not_found` for a model the fleet does not serve (when the list is known)."""
        if model is None or model == DEFAULT_MODEL:
            return
        known = self.known
        if known is not None and model in known and self._served(model):
            return  # the hot path: no await
        if self.stale:  # unknown, or no backend serves it now: look again (once per ttl)
            await self.refresh()
            known = self.known
        if known is not None and model not in known:
            raise ModelNotFound(
                f"The model `{model}` does not exist. Served: {', '.join(sorted(known))}",
                param="model",
            )

    def _served(self, model: str) -> bool:
        """Some backend is known to serve `model` (always, with discovery off: nothing to
        learn). Not so once a reload removed the backends the list learned it from."""
        return not self.discover or any(b.model == model for b in self._backends)
