"""`quicedge certs [--out DIR] [--force]`: make or reuse the development certificates."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from certs.dev import default_dir, ensure_dev_certificates


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="quicedge certs",
        description="Make a development CA and a localhost leaf certificate (EC P-256). "
        "Existing files are reused while valid.",
    )
    parser.add_argument("--out", type=Path, default=None, help=f"folder (default {default_dir()})")
    parser.add_argument("--force", action="store_true", help="regenerate even if still valid")
    args = parser.parse_args(argv)
    try:
        paths = ensure_dev_certificates(args.out, force=args.force)
    except OSError as exc:  # a folder that cannot be made or written
        folder = args.out or default_dir()
        print(
            f"quicedge certs: cannot make the development certificates in {folder}: {exc.strerror}",
            file=sys.stderr,
        )
        return 1
    print(f"CA certificate:   {paths.ca_cert}")
    print(f"leaf certificate: {paths.cert}  (chain: leaf + CA)")
    print(f"leaf key:         {paths.key}")
    return 0
