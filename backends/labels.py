"""Backend labels: the isolation domain a backend URL names in its `#…` part.

`http://host:port#model=llama3@v2&hardware=h100&tiers=gold+silver` places a backend in a model
pool (and version), a hardware group and the tenant tiers it serves; the breakers, the pools and
the `ttft` policy all read the same labels.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

DEFAULT_GROUP = "default"
"""The hardware group (and breaker domain) of a backend no label or config places."""


def split_model_label(label: str) -> tuple[str, str | None]:
    """`llama-3-8b@v2` → (`llama-3-8b`, `v2`); a label without `@` names no version."""
    model, _, version = label.partition("@")
    return model, version or None


def model_label_of(model: str, version: str | None) -> str:
    """The `model` label of a model and version: `model@version`, or `model` alone when the
    version is unknown or SGLang's `default` (as `/get_model_info` reports it)."""
    return model if version is None or version == "default" else f"{model}@{version}"


def name_for(url: str) -> str:
    """A backend's default name: its `host:port`."""
    return urlsplit(url.partition("#")[0]).netloc


def shown(url: str) -> str:
    """`url` fit for a message or a log line: a `user:password@` in it (however the password
    is written) becomes `***@`."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    at = _userinfo_ends(rest)
    return url if at == -1 else f"{scheme}{sep}***@{rest[at + 1 :]}"


def credentials_refused(url: str) -> ValueError:
    """The error for a URL with credentials: it names the host, never the credentials."""
    rest = url.partition("://")[2] or url
    after = rest[_userinfo_ends(rest) + 1 :]
    host = re.split(r"[/?#&]", after, maxsplit=1)[0]
    return ValueError(
        f"backend at {host}: credentials in a backend URL (USER:PASSWORD@) are not accepted:"
        " they would show in metrics, logs and /backends; put the backend's key in a file"
        " named by proxy.backend_api_key_file or [proxy.backend_api_key_files]"
    )


def has_credentials(url: str) -> bool:
    """Whether `url` carries a `user:password@`, however the password is written (a `#`, `/`
    or `?` in it included): an `@` belongs to a label only after `model=` (`model=llama@v2`)."""
    return _userinfo_ends(url.partition("://")[2] or url) != -1


def _userinfo_ends(rest: str) -> int:
    """The index in `rest` (a URL after `://`) of the last `@` that is not a model label's,
    -1 if none."""
    found = -1
    at = rest.find("@")
    while at != -1:
        before = rest[:at]
        label = max(before.rfind("#"), before.rfind("&"))
        if label == -1 or not before[label + 1 :].startswith("model="):
            found = at
        at = rest.find("@", at + 1)
    return found


def check_url(url: str) -> tuple[str, tuple[str, int]]:
    """A backend URL without its labels, checked: the URL without trailing `/`, and the
    address it names (lower-case host, port), one for every spelling of the same backend.

    Raises ValueError saying what is wrong, never echoing a password: credentials in the URL
    are refused (they would name the backend on every metric, log line and `/backends`); a
    backend's key belongs in `proxy.backend_api_key_file(s)`."""
    trimmed = url.rstrip("/")
    parts = urlsplit(trimmed)
    what = f"backend URL {shown(url)!r}"
    if parts.scheme == "https":
        raise ValueError(
            f"{what}: https upstreams are not supported (the edge speaks plain HTTP/1.1 to its"
            " backends); use http://HOST:PORT on a private network"
        )
    if parts.scheme != "http" or not parts.netloc:
        raise ValueError(f"backend URL must be http://HOST:PORT, got {shown(url)!r}")
    if "@" in parts.netloc or has_credentials(url):
        raise credentials_refused(url)
    if parts.path:
        raise ValueError(f"backend URL must be http://HOST:PORT, no path, got {shown(url)!r}")
    if parts.query or "?" in trimmed:
        raise ValueError(f"backend URL must be http://HOST:PORT, no query, got {shown(url)!r}")
    if parts.netloc.count(":") > 1 and not parts.netloc.startswith("["):
        raise ValueError(f"{what}: an IPv6 address goes in brackets, http://[ADDRESS]:PORT")
    host = parts.hostname
    if not host:
        raise ValueError(f"backend URL must be http://HOST:PORT, got {shown(url)!r}")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0 or (port is None and parts.netloc.endswith(":")):
        raise ValueError(f"{what}: the port must be a number in 1..65535")
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        host = host.rstrip(".")
    return trimmed, (host, port or 80)


LABEL_KEYS = frozenset({"model", "hardware", "tiers"})
LABEL_TIERS = frozenset({"gold", "silver", "bronze"})


def parse_labels(url: str) -> tuple[str, dict[str, str]]:
    """Split `http://host:port#model=llama3-v2&hardware=h100&tiers=gold+silver` into the URL
    and its labels; a URL without `#` has none. Raises ValueError naming a bad label, or
    saying that the URL carries credentials (without showing them)."""
    if has_credentials(url):
        raise credentials_refused(url)
    base, _, fragment = url.partition("#")
    labels: dict[str, str] = {}
    for pair in filter(None, fragment.split("&")):
        key, eq, value = pair.partition("=")
        if key not in LABEL_KEYS or not eq or not value:
            raise ValueError(
                f"backend {shown(base)}: label {pair!r} is not one of model=, hardware=, tiers="
            )
        if key in labels:
            raise ValueError(f"backend {shown(base)}: label {key} is given twice")
        if key == "tiers":
            bad = sorted(set(value.split("+")) - LABEL_TIERS)
            if bad:
                raise ValueError(
                    f"backend {shown(base)}: tiers has {bad[0]!r}; use gold+silver+bronze"
                )
        labels[key] = value
    return base, labels
