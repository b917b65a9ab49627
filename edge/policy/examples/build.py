"""Build the example modules: each `.wat` here becomes the `.wasm` beside it.

    python -m edge.policy.examples.build

(`wat2wasm deny_keyword.wat -o deny_keyword.wasm` from Debian's `wabt` makes the same module.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import wasmtime

HERE = Path(__file__).parent


def build(source: Path) -> Path:
    target = source.with_suffix(".wasm")
    target.write_bytes(wasmtime.wat2wasm(source.read_text(encoding="utf-8")))
    return target


def main() -> int:
    for source in sorted(HERE.glob("*.wat")):
        print(f"{source.name} -> {build(source).name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
