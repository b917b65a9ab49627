"""The API keys the edge presents to its backends (SGLang's `--api-key`).

An SGLang server started with `--api-key KEY` answers 401 to every request without
`Authorization: Bearer KEY`, except `/health*`, `/metrics` and `OPTIONS`. The edge's key for a
backend is its own secret, never the client's: a client's `Authorization` header is not forwarded
(it authenticates the client to the edge, not the edge to a backend).

Keys live in files (a Kubernetes Secret mounted as a file, a file readable only by the edge's
user), read once at start: one file for the whole fleet and, optionally, one per backend URL
that overrides it. A backend without either gets no `Authorization` header.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

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
    """`Authorization: Bearer` headers per backend URL, with a fleet-wide fallback."""

    __slots__ = ("_fleet", "_by_url")

    def __init__(self, fleet: bytes | None = None, by_url: Mapping[str, bytes] | None = None):
        self._fleet: Header | None = _bearer(fleet) if fleet is not None else None
        self._by_url: dict[str, Header] = {
            _normal(url): _bearer(key) for url, key in (by_url or {}).items()
        }

    @classmethod
    def from_files(
        cls, fleet_file: str | None, files_by_url: Mapping[str, str]
    ) -> BackendCredentials:
        fleet = read_key(fleet_file, "proxy.backend_api_key_file") if fleet_file else None
        by_url = {
            url: read_key(path, f"proxy.backend_api_key_files[{url!r}]")
            for url, path in files_by_url.items()
        }
        return cls(fleet, by_url)

    def __bool__(self) -> bool:
        return self._fleet is not None or bool(self._by_url)

    def header(self, url: str) -> Header | None:
        """The `Authorization` header for the backend at `url`, or None."""
        found = self._by_url.get(url)
        if found is None and self._by_url:
            found = self._by_url.get(_normal(url))
        return found if found is not None else self._fleet

    def api_key(self, url: str) -> str | None:
        """The bare key for `url` (for `backends.sglang.SGLangClient`), or None."""
        header = self.header(url)
        return header[1][len(b"Bearer ") :].decode("ascii") if header is not None else None

    def with_auth(self, url: str, headers: list[Header]) -> list[Header]:
        """`headers` plus `url`'s `Authorization` (the same list when it has none)."""
        header = self.header(url)
        return headers if header is None else [*headers, header]


def _bearer(key: bytes) -> Header:
    return (b"authorization", b"Bearer " + key)


def _normal(url: str) -> str:
    return url.rstrip("/")


__all__ = ["BackendCredentials", "Header", "read_key"]
