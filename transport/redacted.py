"""URLs as logs and error messages show them: without the credentials a Redis URL may carry
(`redis://:PASSWORD@host:6379/0`), which would otherwise land in every log line and pod log
that names the server. (Backend URLs have their own, `backends.labels.shown`, which knows
their `#model=NAME@VERSION` labels.)"""

from __future__ import annotations


def without_password(url: str) -> str:
    """`url` with its `user:password@` part, if any, as `***@`; the host, port, path and query
    as they were."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    ends = [i for i in (rest.find(mark) for mark in "/?#") if i >= 0]
    netloc = rest[: min(ends)] if ends else rest
    at = netloc.rfind("@")
    if at < 0:
        return url
    return f"{scheme}://***@{rest[at + 1 :]}"


__all__ = ["without_password"]
