"""Backend labels: the isolation domain a backend URL names in its `#…` part.

`http://host:port#model=llama3@v2&hardware=h100&tiers=gold+silver` places a backend in a model
pool (and version), a hardware group and the tenant tiers it serves; the breakers, the pools and
the `ttft` policy all read the same labels.
"""

from __future__ import annotations

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


LABEL_KEYS = frozenset({"model", "hardware", "tiers"})
LABEL_TIERS = frozenset({"gold", "silver", "bronze"})


def parse_labels(url: str) -> tuple[str, dict[str, str]]:
    """Split `http://host:port#model=llama3-v2&hardware=h100&tiers=gold+silver` into the URL
    and its labels; a URL without `#` has none. Raises ValueError naming a bad label."""
    base, _, fragment = url.partition("#")
    labels: dict[str, str] = {}
    for pair in filter(None, fragment.split("&")):
        key, eq, value = pair.partition("=")
        if key not in LABEL_KEYS or not eq or not value:
            raise ValueError(
                f"backend {base}: label {pair!r} is not one of model=, hardware=, tiers="
            )
        if key in labels:
            raise ValueError(f"backend {base}: label {key} is given twice")
        if key == "tiers":
            bad = sorted(set(value.split("+")) - LABEL_TIERS)
            if bad:
                raise ValueError(f"backend {base}: tiers has {bad[0]!r}; use gold+silver+bronze")
        labels[key] = value
    return base, labels
