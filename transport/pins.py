"""The library versions whose internals the transport's overrides were written against."""

from __future__ import annotations

from importlib.metadata import version


def off_pin(distribution: str, tested_minor: str) -> str | None:
    """The installed version of `distribution` when it is not a `tested_minor` release (an
    override of its internals must then be checked again); None when it is one."""
    found = version(distribution)
    return None if found == tested_minor or found.startswith(tested_minor + ".") else found


__all__ = ["off_pin"]
