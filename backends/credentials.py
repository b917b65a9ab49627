"""The API keys the edge presents to its backends (SGLang's `--api-key`).

An SGLang server started with `--api-key KEY` answers 401 to every request without
`Authorization: Bearer KEY`, except `/health*`, `/metrics` and `OPTIONS`. The edge's key for a
backend is its own secret, never the client's: a client's `Authorization` header is not forwarded
(it authenticates the client to the edge, not the edge to a backend).

Keys live in files (a Kubernetes Secret mounted as a file, a file readable only by the edge's
user), read at start and again on each config reload (`edge.reload`): one file for the whole
fleet and, optionally, one per backend URL that overrides it (matched by the host and port the
URL names). A backend without either gets no `Authorization` header. Every holder shares one
`BackendCredentials`, which a reload updates in place (`replace_with`), so the calls made from
then on carry the new keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from backends.labels import check_url, parse_labels, shown

Header = tuple[bytes, bytes]


def read_key(path: str, setting: str) -> bytes:
    """The key in `path`: the file's text without surrounding whitespace (a trailing newline is
    common), printable ASCII with no spaces. Errors name `setting`, never the key."""
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{setting}: cannot read {path}: {exc.strerror}") from None
    key = text.strip()
    if not key:
        raise ValueError(f"{setting}: {path} is empty")
    if not all(0x21 <= b <= 0x7E for b in key):
        raise ValueError(f"{setting}: {path} must hold one key of printable ASCII, no spaces")
    return key


class BackendCredentials:
    """`Authorization: Bearer` headers per backend URL, with a fleet-wide fallback.

    A per-backend key is found by the host and port its URL names, however it is written
    (labels after `#`, a trailing `/`, the case of the host, `:80` or none)."""

    __slots__ = ("_fleet", "_by_address", "_found", "generation")

    def __init__(self, fleet: bytes | None = None, by_url: Mapping[str, bytes] | None = None):
        self._fleet: Header | None = _bearer(fleet) if fleet is not None else None
        self._by_address: dict[tuple[str, int], Header] = {}
        for url, key in (by_url or {}).items():
            address = _address(url)
            if address in self._by_address:
                raise ValueError(f"backend {shown(url)} has two keys (two spellings of its URL)")
            self._by_address[address] = _bearer(key)
        self._found: dict[str, Header | None] = {}
        """`header`'s answers by URL as given, so a request does not parse its URL."""
        self.generation = 0
        """Counts the `replace_with` calls that changed a key: a client made with `api_key`
        under an older generation carries an old key."""

    @classmethod
    def from_files(
        cls, fleet_file: str | None, files_by_url: Mapping[str, str]
    ) -> BackendCredentials:
        fleet = read_key(fleet_file, "proxy.backend_api_key_file") if fleet_file else None
        by_url: dict[str, bytes] = {}
        for url, path in files_by_url.items():
            setting = f"proxy.backend_api_key_files[{shown(url)!r}]"
            try:
                _address(url)
            except ValueError as exc:
                raise ValueError(f"{setting}: {exc}") from None
            by_url[url] = read_key(path, setting)
        return cls(fleet, by_url)

    def replace_with(self, other: BackendCredentials) -> bool:
        """Take `other`'s keys in place (a reload read the files again), so every holder of this
        object sends them from its next call; True when a key changed."""
        if other._fleet == self._fleet and other._by_address == self._by_address:
            return False
        self._fleet, self._by_address = other._fleet, dict(other._by_address)
        self._found = {}
        self.generation += 1
        return True

    def __bool__(self) -> bool:
        return self._fleet is not None or bool(self._by_address)

    def header(self, url: str) -> Header | None:
        """The `Authorization` header for the backend at `url`, or None."""
        if not self._by_address:
            return self._fleet
        try:
            return self._found[url]
        except KeyError:
            pass
        try:
            found = self._by_address.get(_address(url))
        except ValueError:
            found = None
        header = found if found is not None else self._fleet
        if len(self._found) >= _FOUND_MAX:  # discovery's churn: URLs come and go
            self._found.clear()
        self._found[url] = header
        return header

    def api_key(self, url: str) -> str | None:
        """The bare key for `url` (for `backends.sglang.SGLangClient`), or None."""
        header = self.header(url)
        return header[1][len(b"Bearer ") :].decode("ascii") if header is not None else None

    def with_auth(self, url: str, headers: list[Header]) -> list[Header]:
        """`headers` plus `url`'s `Authorization` (the same list when it has none)."""
        header = self.header(url)
        return headers if header is None else [*headers, header]


_FOUND_MAX = 4096


def _bearer(key: bytes) -> Header:
    return (b"authorization", b"Bearer " + key)


def _address(url: str) -> tuple[str, int]:
    return check_url(parse_labels(url)[0])[1]


__all__ = ["BackendCredentials", "Header", "read_key"]
