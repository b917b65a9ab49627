"""Backend discovery: which SGLang servers the registry holds, as the fleet changes.

Three modes (TOML `[discovery]`, `DiscoveryConfig`):

- `static`: the `--backend` list, fixed for the process's life (the default).
- `dns`: each name is `HOST:PORT` (its A and AAAA records) or `_service._proto.DOMAIN` (its SRV
  records, each target's A and AAAA with the record's port), resolved again every `interval`.
  A Kubernetes headless Service answers both with one address per ready pod.
- `kubernetes`: the EndpointSlices of a headless Service, listed from the API server with the
  pod's service account every `interval`; only endpoints whose `ready` condition holds count.

Each name may carry isolation labels after `#`, as a `--backend` URL does
(`_sglang._tcp.fleet#hardware=h100&tiers=gold+silver`, `inference/llama#model=llama-3-8b`): every
backend it finds gets them, so it lands in its model pool and breaker domain. An EndpointSlice
also carries its Service's labels (the EndpointSlice controller copies them), read as
`quicedge.io/model`, `quicedge.io/model-version`, `quicedge.io/hardware` and `quicedge.io/tiers`;
a label the name gives wins. A backend's labels are read when it joins the fleet.

A periodic list over plain HTTPS (h11, already a dependency) rather than the official client's
watch: the client is synchronous and large, a watch needs its own thread and reconnect logic,
and one small GET per interval (RBAC: `list` on `endpointslices`) feeds the same reconcile step
as DNS. A backend that appears is added with its health checks; one that disappears drains (no
new requests, those in flight finish, up to `drain_timeout`) and is removed. A lookup that
fails (timeout, server error) changes nothing: the fleet is not emptied by a DNS hiccup, while
an authoritative "no such name" or an empty slice does remove what it held.

Each name's lookups are counted by outcome (`quicedge_discovery_lookups_total`), and the
backends its last answer held are a gauge (`quicedge_discovery_backends`): a name whose
lookups fail keeps serving what it held, so the counter is what tells an operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Protocol
from urllib.parse import quote, urlsplit

import h11
from prometheus_client import CollectorRegistry, Counter, Gauge

from backends.labels import LABEL_TIERS, check_url, has_credentials, parse_labels, shown
from backends.registry import BackendRegistry

log = logging.getLogger(__name__)

Mode = Literal["static", "dns", "kubernetes"]
MODES: tuple[Mode, ...] = ("static", "dns", "kubernetes")
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
MAX_SLICES_BYTES = 32 * 1024 * 1024
"""The most of one EndpointSlice list read (a few KiB per hundred pods); more is a failed
lookup, not memory the edge gives away to whatever answers at `api_url`."""


@dataclass(slots=True)
class DiscoveryConfig:
    """The `[discovery]` table."""

    mode: Mode = "static"
    """`static` (the `--backend` list), `dns` or `kubernetes`. Default `static`."""
    names: list[str] = field(default_factory=list)
    """dns: `HOST:PORT` (A/AAAA) or `_service._proto.DOMAIN` (SRV). kubernetes: headless Service
    names, `NAME` or `NAMESPACE/NAME`. Each may end in `#model=..&hardware=..&tiers=..`, the
    labels of every backend it finds. Default empty (needed by dns and kubernetes)."""
    interval: float = 10.0
    """Seconds between two lookups. Default 10."""
    timeout: float = 2.0
    """Seconds one lookup (all names, asked at once; SRV then its targets' A and AAAA) may take
    before it counts as failed. Default 2."""
    drain_timeout: float = 30.0
    """Seconds a removed backend keeps its requests in flight before it is dropped. Default 30."""
    nameservers: list[str] = field(default_factory=list)
    """dns: `IP` or `IP:PORT` of the servers to ask (one port for all). Default empty: the
    system's resolv.conf."""
    port_name: str | None = None
    """kubernetes: the EndpointSlice port to use, by name. Default None: the first port."""
    namespace: str | None = None
    """kubernetes: namespace of names given without one. Default None: the pod's own."""
    api_url: str | None = None
    """kubernetes: API server base URL. Default None: https://$KUBERNETES_SERVICE_HOST:PORT."""
    token_file: str = f"{SERVICE_ACCOUNT}/token"
    """kubernetes: bearer token file. Default: the pod's service account token."""
    ca_file: str = f"{SERVICE_ACCOUNT}/ca.crt"
    """kubernetes: CA bundle of the API server. Default: the service account's."""

    def validate(self) -> DiscoveryConfig:
        if self.mode not in MODES:
            raise ValueError(f"discovery.mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.mode != "static" and not self.names:
            raise ValueError(f"discovery.names: mode {self.mode} needs at least one name")
        for name in ("interval", "timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"discovery.{name}: must be > 0, got {getattr(self, name)!r}")
        if self.drain_timeout < 0:
            raise ValueError(f"discovery.drain_timeout: must be >= 0, got {self.drain_timeout}")
        for name in self.names:
            split_name(name)  # raises with the name in the message
        if self.mode == "dns":
            for name in self.names:
                bare = split_name(name)[0]
                if not bare.startswith("_"):
                    _name(bare)
            ports = {_nameserver(server)[1] for server in self.nameservers}
            if len(ports) > 1:
                raise ValueError("discovery.nameservers: give every server the same port")
        return self

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> DiscoveryConfig:
        """From the TOML table, rejecting unknown keys and values of the wrong type."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"discovery: unknown setting(s) {', '.join(unknown)}")
        config = cls()
        for key, value in values.items():
            default = getattr(config, key)
            if key in ("names", "nameservers"):
                ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
                kind = "a list of strings"
            elif key in ("interval", "timeout", "drain_timeout"):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                kind = "a number"
            elif default is None:
                ok = value is None or isinstance(value, str)
                kind = "a string"
            else:
                ok = isinstance(value, str)
                kind = "a string"
            if not ok:
                raise ValueError(f"discovery.{key}: must be {kind}, got {value!r}")
            setattr(config, key, float(value) if kind == "a number" else value)
        return config.validate()


def _host_port(text: str) -> tuple[str, int] | None:
    parts = urlsplit(f"//{text}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or not port:  # none, or 0: nothing listens there
        return None
    return parts.hostname, port


def _name(text: str) -> tuple[str, int]:
    found = _host_port(text)
    if found is None:
        raise ValueError(f"discovery.names: {text!r} is not HOST:PORT or _service._proto.DOMAIN")
    return found


def split_name(name: str) -> tuple[str, dict[str, str]]:
    """A discovery name and the labels after its `#` (none without one)."""
    if has_credentials(name):
        raise ValueError(
            "discovery.names: a name must not carry credentials; put the backends' key in a"
            " file named by proxy.backend_api_key_file"
        )
    try:
        return parse_labels(name)
    except ValueError as exc:
        raise ValueError(f"discovery.names: {name!r}: {str(exc).partition(': ')[2]}") from None


def labelled(url: str, labels: Mapping[str, str]) -> str:
    """`url` with `labels` after `#`, as `backends.registry.parse_labels` reads them."""
    if not labels:
        return url
    return url + "#" + "&".join(f"{key}={labels[key]}" for key in sorted(labels))


LABEL_PREFIX = "quicedge.io/"
"""Kubernetes labels (on the Service, copied to its EndpointSlices) that carry a backend's."""


def slice_labels(item: Mapping[str, Any]) -> dict[str, str]:
    """The isolation labels an EndpointSlice's own labels give its endpoints.

    Kubernetes label values allow neither `@` nor `+`, so the version is a label of its own
    (`quicedge.io/model-version`), and tiers are separated by `.`, `-` or `_`
    (`quicedge.io/tiers: gold-silver`). An unknown tier drops that label (with a warning): a
    backend is not left out of the fleet for a typo."""
    metadata = item.get("metadata") or {}
    given: Mapping[str, Any] = metadata.get("labels") or {}
    labels: dict[str, str] = {}
    model = given.get(f"{LABEL_PREFIX}model")
    if model:
        version = given.get(f"{LABEL_PREFIX}model-version")
        labels["model"] = f"{model}@{version}" if version else str(model)
    hardware = given.get(f"{LABEL_PREFIX}hardware")
    if hardware:
        labels["hardware"] = str(hardware)
    tiers = given.get(f"{LABEL_PREFIX}tiers")
    if tiers:
        named = str(tiers).replace("-", ".").replace("_", ".").split(".")
        if set(named) <= LABEL_TIERS:
            labels["tiers"] = "+".join(named)
        else:
            _warn_once(
                f"EndpointSlice {metadata.get('name')}: {LABEL_PREFIX}tiers {tiers!r} names a "
                f"tier other than {', '.join(sorted(LABEL_TIERS))}; ignored"
            )
    return labels


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """A bad label is seen every interval: say so once per process."""
    if message not in _warned:
        _warned.add(message)
        log.warning("discovery: %s", message)


def _nameserver(text: str) -> tuple[str, int]:
    try:
        return str(ipaddress.ip_address(text)), 53
    except ValueError:
        pass
    found = _host_port(text)
    try:
        if found is None:
            raise ValueError
        return str(ipaddress.ip_address(found[0])), found[1]
    except ValueError:
        raise ValueError(f"discovery.nameservers: {text!r} is not IP or IP:PORT") from None


def backend_url(address: str, port: int) -> str:
    """`http://ADDRESS:PORT`, an IPv6 address in brackets."""
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


class Source(Protocol):
    partial: set[str]
    """The names whose last lookup answered in part: some queries failed, and what they
    answered before stands in for them."""

    async def lookup(self) -> dict[str, set[str] | None]:
        """Backend URLs by name; None for a name whose lookup failed (keep what it held)."""
        ...


FAMILIES = ("A", "AAAA")


class DnsSource:
    """A/AAAA and SRV lookups with dnspython's asyncio resolver.

    A name's lookup takes at most `timeout` in all: its SRV query, then A and AAAA of every
    target at once, each given what is left of the bound. What each (target, family) answered
    is kept per name: a family that fails (no answer in time, a server error) counts as
    answering what it did last time, so a resolver that drops AAAA queries does not keep the A
    records from serving, and a lost answer does not drain a backend. An SRV target that does
    not exist (NXDOMAIN) or has no address record is left out, with a warning, and the other
    targets stay."""

    def __init__(self, config: DiscoveryConfig) -> None:
        try:
            import dns.asyncresolver
        except ImportError:
            raise ValueError("discovery.mode dns needs `pip install quicedge[discovery]`") from None

        self.names = list(config.names)
        self.timeout = config.timeout
        self.resolver = dns.asyncresolver.Resolver(configure=not config.nameservers)
        if config.nameservers:
            servers = [_nameserver(s) for s in config.nameservers]
            self.resolver.nameservers = [host for host, _ in servers]
            self.resolver.port = servers[0][1]
        self.resolver.lifetime = config.timeout  # a query's; `_one` bounds a name's in all
        self.resolver.cache = None  # every lookup asks: the interval is the cache
        self._held: dict[str, dict[tuple[str, str], set[str]]] = {}
        """By name: the addresses each (target, family) last answered; only the targets of
        the name's last answer, so it stays as small as the fleet."""
        self.partial: set[str] = set()

    async def lookup(self) -> dict[str, set[str] | None]:
        results = await asyncio.gather(*(self._one(n) for n in self.names))
        return dict(zip(self.names, results, strict=True))

    async def _one(self, name: str) -> set[str] | None:
        import dns.exception
        import dns.resolver

        self.partial.discard(name)
        bare, labels = split_name(name)
        srv = bare.startswith("_")
        deadline = asyncio.get_running_loop().time() + self.timeout
        try:
            if srv:
                async with asyncio.timeout_at(deadline):
                    answer = await self.resolver.resolve(bare, "SRV")
                targets = [(r.target.to_text(omit_final_dot=True), int(r.port)) for r in answer]
            else:
                targets = [_name(bare)]
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            self._held[name] = {}
            return set()  # the name is authoritatively empty: its backends go
        except (TimeoutError, dns.exception.DNSException) as exc:
            why = str(exc) or f"no answer within {self.timeout:g} s"
            log.warning("discovery: lookup of %s failed (%s); keeping its backends", name, why)
            return None
        hosts = sorted({host for host, _ in targets})
        asked = await asyncio.gather(*(self._ask(host, deadline) for host in hosts))
        outcomes = [outcome for families in asked for outcome in families.values()]
        if not srv and all(isinstance(outcome, BaseException) for outcome in outcomes):
            why = "; ".join(str(outcome) or "no answer in time" for outcome in outcomes)
            log.warning("discovery: lookup of %s failed (%s); keeping its backends", name, why)
            return None  # what it answered before, a failed lookup's keep, not an answer
        before = self._held.get(name, {})
        held: dict[tuple[str, str], set[str]] = {}
        addresses: dict[str, set[str]] = {}
        unanswered: list[str] = []
        empty: list[str] = []
        for host, families in zip(hosts, asked, strict=True):
            found: set[str] = set()
            failures: list[str] = []
            for family, outcome in families.items():
                if isinstance(outcome, BaseException):  # what it held, if it answered before
                    self.partial.add(name)
                    kept = before.get((host, family))
                    if kept is None:
                        failures.append(f"{family}: {str(outcome) or 'no answer in time'}")
                        continue
                    outcome = kept
                held[(host, family)] = outcome
                found |= outcome
            addresses[host] = found
            if failures and not found:
                unanswered.append(f"{host} ({'; '.join(failures)})")
            elif not found:
                empty.append(host)
        urls = {
            labelled(backend_url(address, port), labels)
            for host, port in targets
            for address in addresses[host]
        }
        if unanswered and not urls:  # nothing to go on: not a reason to empty the name
            self.partial.discard(name)
            why = ", ".join(unanswered)
            log.warning("discovery: lookup of %s failed (%s); keeping its backends", name, why)
            return None
        self._held[name] = held
        if srv and (unanswered or empty):
            log.warning(
                "discovery: %s: left out SRV target(s) %s", name,
                ", ".join([*(f"{h}: no address record" for h in empty),
                           *(f"{h}: no answer" for h in unanswered)]),
            )  # fmt: skip
        return urls

    async def _ask(self, host: str, deadline: float) -> dict[str, set[str] | BaseException]:
        """`host`'s addresses by family, A and AAAA asked at once until `deadline`: a set
        (empty: no such record, or no such name) or the failure (TimeoutError when the
        deadline came first)."""
        import dns.resolver

        with contextlib.suppress(ValueError):
            return {"": {str(ipaddress.ip_address(host))}}
        queries = [asyncio.ensure_future(self.resolver.resolve(host, kind)) for kind in FAMILIES]
        try:
            left = max(0.0, deadline - asyncio.get_running_loop().time())
            await asyncio.wait(queries, timeout=left)
        finally:
            for query in queries:
                query.cancel()
            outcomes = await asyncio.gather(*queries, return_exceptions=True)
        found: dict[str, set[str] | BaseException] = {}
        for family, outcome in zip(FAMILIES, outcomes, strict=True):
            if isinstance(outcome, dns.resolver.NXDOMAIN):
                return dict.fromkeys(FAMILIES, set())  # no such name: no address of any family
            if isinstance(outcome, dns.resolver.NoAnswer):
                found[family] = set()
            elif isinstance(outcome, asyncio.CancelledError):
                found[family] = TimeoutError()
            elif isinstance(outcome, BaseException):
                found[family] = outcome
            else:
                found[family] = {r.address for r in outcome}
        return found


class KubernetesSource:
    """EndpointSlices of headless Services, listed from the API server."""

    def __init__(self, config: DiscoveryConfig) -> None:
        self.config = config
        self.partial: set[str] = set()  # a slice list answers whole or not at all
        self.namespace = config.namespace or _read(f"{SERVICE_ACCOUNT}/namespace") or "default"
        api = config.api_url
        if api is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ValueError(
                    "discovery.api_url: not in a cluster (no KUBERNETES_SERVICE_HOST); set it"
                )
            api = f"https://{backend_url(host, int(port)).removeprefix('http://')}"
        self.api = urlsplit(api)
        if self.api.scheme not in ("http", "https") or not self.api.hostname:
            raise ValueError(f"discovery.api_url: {api!r} is not an http(s) URL")
        self._ssl: ssl.SSLContext | None = None
        if self.api.scheme == "https":
            self._ssl = ssl.create_default_context(
                cafile=config.ca_file if os.path.exists(config.ca_file) else None
            )

    def _service(self, name: str) -> tuple[str, str]:
        namespace, _, service = name.rpartition("/")
        return namespace or self.namespace, service

    async def lookup(self) -> dict[str, set[str] | None]:
        results = await asyncio.gather(*(self._one(n) for n in self.config.names))
        return dict(zip(self.config.names, results, strict=True))

    async def _one(self, name: str) -> set[str] | None:
        bare, labels = split_name(name)
        namespace, service = self._service(bare)
        selector = quote(f"kubernetes.io/service-name={service}", safe="")
        path = (
            f"/apis/discovery.k8s.io/v1/namespaces/{quote(namespace)}/endpointslices"
            f"?labelSelector={selector}"
        )
        try:
            async with asyncio.timeout(self.config.timeout):
                status, body = await self._get(path)
            if status != 200:
                raise OSError(f"HTTP {status}: {body[:200]!r}")
            try:
                return ready_endpoints(json.loads(body), self.config.port_name, labels)
            except (AttributeError, TypeError, KeyError) as exc:  # 200, but not a slice list
                raise ValueError(f"not an EndpointSliceList ({exc!r})") from None
        except (OSError, TimeoutError, ValueError, h11.ProtocolError) as exc:
            log.warning("discovery: listing slices of %s failed (%s); keeping them", name, exc)
            return None

    async def _get(self, path: str) -> tuple[int, bytes]:
        host = self.api.hostname or ""
        port = self.api.port or (443 if self._ssl else 80)
        reader, writer = await asyncio.open_connection(
            host, port, ssl=self._ssl, server_hostname=host if self._ssl else None
        )
        try:
            conn = h11.Connection(h11.CLIENT)
            headers = [("host", self.api.netloc), ("accept", "application/json")]
            token = _read(self.config.token_file)
            if token:
                headers.append(("authorization", f"Bearer {token}"))
            writer.write(conn.send(h11.Request(method="GET", target=path, headers=headers)))
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()
            status, body = 0, bytearray()
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await reader.read(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > MAX_SLICES_BYTES:
                        raise ValueError(f"the answer is over {MAX_SLICES_BYTES} bytes")
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    return status, bytes(body)
        finally:
            writer.close()


def ready_endpoints(
    slices: Mapping[str, Any], port_name: str | None, labels: Mapping[str, str] | None = None
) -> set[str]:
    """Backend URLs of the ready endpoints in an `EndpointSliceList`, each with its slice's
    labels (`slice_labels`) overridden by `labels` (the name's) after `#`."""
    urls: set[str] = set()
    for item in slices.get("items") or []:
        found = {**slice_labels(item), **(labels or {})}
        ports = item.get("ports") or []
        chosen = [p for p in ports if port_name is None or p.get("name") == port_name]
        if not chosen or chosen[0].get("port") is None:
            continue
        port = int(chosen[0]["port"])
        for endpoint in item.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            if conditions.get("ready") is False:  # absent means ready (API docs)
                continue
            urls.update(
                labelled(backend_url(a, port), found) for a in endpoint.get("addresses") or []
            )
    return urls


def _trimmed(url: str) -> str:
    """A `--backend` URL without a trailing `/` before its labels, as the registry keeps it."""
    bare, hash_, fragment = url.partition("#")
    return bare.rstrip("/") + hash_ + fragment


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def make_source(config: DiscoveryConfig) -> Source | None:
    if config.mode == "dns":
        return DnsSource(config)
    if config.mode == "kubernetes":
        return KubernetesSource(config)
    return None


def apply_membership(
    registry: BackendRegistry,
    wanted: Mapping[str, str],
    drain_timeout: float,
    drains: set[asyncio.Task[None]],
) -> None:
    """Make the registry's backends `wanted` (bare URL → URL with its labels): add what is new,
    drain what is gone (each drain a task in `drains` until it ends)."""
    current = {b.url: b for b in registry.backends if not b.draining}
    for bare in sorted(wanted.keys() - current.keys()):
        try:
            registry.add(wanted[bare])
        except ValueError as exc:  # one URL it cannot take must not hold up the others
            _warn_once(f"{shown(bare)} is not added: {exc}")
    for url in sorted(current.keys() - wanted.keys()):
        task = asyncio.ensure_future(
            registry.remove(current[url].name, drain_timeout=drain_timeout)
        )
        drains.add(task)
        task.add_done_callback(drains.discard)


def wanted_urls(urls: Iterable[str]) -> dict[str, str]:
    """A `--backend` list as `apply_membership` wants it: bare URL → URL with its labels."""
    return {url.partition("#")[0]: url for url in map(_trimmed, urls)}


class DiscoveryMetrics:
    """Each name's lookups by outcome, and the backends its last answer held."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        kw: dict[str, Any] = {"registry": registry}
        self.lookups = Counter(
            "quicedge_discovery_lookups_total",
            "Backend discovery lookups by name and outcome (ok; partial: some queries failed "
            "and their last answers stand; failed: its backends kept)",
            ["name", "outcome"], **kw,
        )  # fmt: skip
        self.backends = Gauge(
            "quicedge_discovery_backends",
            "Backends the last answer for a discovery name held", ["name"], **kw,
        )  # fmt: skip

    def looked_up(self, name: str, urls: set[str] | None, partial: bool) -> None:
        outcome = "failed" if urls is None else "partial" if partial else "ok"
        self.lookups.labels(name, outcome).inc()
        if urls is not None:
            self.backends.labels(name).set(len(urls))


class Discovery:
    """Keeps the registry's backends equal to what the source finds, every `interval`."""

    def __init__(
        self, config: DiscoveryConfig, source: Source, metrics: DiscoveryMetrics | None = None
    ) -> None:
        self.config = config
        self.source = source
        self.metrics = metrics or DiscoveryMetrics(None)
        self._known: dict[str, set[str]] = {}
        self._task: asyncio.Task[None] | None = None
        self._drains: set[asyncio.Task[None]] = set()

    def _wanted(self) -> dict[str, str]:
        """Every backend wanted: its bare URL → the URL with its labels. A URL two names find
        takes the labels of the first (the `--backend` list, then the names in order), and one
        host and port found under two spellings (`[fd00::5]`, `[fd00:0::5]`) is the first's."""
        wanted: dict[str, str] = {}
        spelled: dict[tuple[str, int], str] = {}
        for urls in self._known.values():
            for url in sorted(urls):
                bare = url.partition("#")[0]
                try:
                    address = check_url(bare)[1]
                except ValueError as exc:
                    _warn_once(f"{exc}; left out")
                    continue
                first = spelled.setdefault(address, bare)
                if first != bare:
                    _warn_once(f"{bare} is {first} spelled another way; {first} is kept")
                    continue
                held = wanted.setdefault(bare, url)
                if held != url:
                    _warn_once(f"{bare} is found with labels {held!r} and {url!r}; the first hold")
        return wanted

    async def initial(self, static: list[str]) -> list[str]:
        """The backends to build the registry with: the `static` list (kept until a reload
        changes it) and the first lookup's URLs (a failed lookup gives none; the next interval
        tries again)."""
        self.set_static(static)
        await self._lookup()
        return sorted(self._wanted().values())

    def set_static(self, static: list[str]) -> None:
        """The `--backend` list (a reloaded config's); the next refresh applies it."""
        self._known[""] = {_trimmed(url) for url in static}

    async def _lookup(self) -> None:
        for name, urls in (await self.source.lookup()).items():
            self.metrics.looked_up(name, urls, name in self.source.partial)
            if urls is not None:
                self._known[name] = urls

    async def refresh(self, registry: BackendRegistry) -> None:
        """One lookup, then add what is new (with its labels) and drain what is gone."""
        await self._lookup()
        apply_membership(registry, self._wanted(), self.config.drain_timeout, self._drains)

    async def _run(self, registry: BackendRegistry) -> None:
        while True:
            await asyncio.sleep(self.config.interval)
            try:
                await self.refresh(registry)
            except Exception:  # a bug here must not stop discovery for the process's life
                log.exception("discovery: refresh failed")

    def start(self, registry: BackendRegistry) -> None:
        self._task = asyncio.ensure_future(self._run(registry))

    async def aclose(self) -> None:
        tasks = [t for t in (self._task, *self._drains) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None


__all__ = [
    "MODES",
    "Discovery",
    "DiscoveryConfig",
    "DiscoveryMetrics",
    "DnsSource",
    "KubernetesSource",
    "LABEL_PREFIX",
    "apply_membership",
    "backend_url",
    "labelled",
    "make_source",
    "ready_endpoints",
    "slice_labels",
    "split_name",
    "wanted_urls",
]
