"""The `quicedge` command: a thin dispatcher to each subcommand's own parser.

Each subcommand lives with the package that owns it and parses its own arguments, so that
`quicedge sim ...` and `python -m backends.sim ...` are the same program.
"""

from __future__ import annotations

import signal
import sys


def _serving(argv: list[str]) -> bool:
    """Whether this process is `quicedge serve`: the console script, or `python -m edge.cli`."""
    return argv[1:2] == ["serve"] and (
        __name__ == "__main__" or argv[0].removesuffix(".exe").endswith("quicedge")
    )


# SIGHUP (reload) is held from the first instruction of ours that the program runs until
# serve's handler is in place (`transport.workers`): its default action would end the process
# while it imports, and a config-management tool may send it right after the start. Here, at
# the top of the module the console script imports first, not in `main`: the imports below and
# those of the subcommand take tens of milliseconds.
if _serving(sys.argv):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})

import importlib  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402

# subcommand -> (module, one-line help). The module exposes `main(argv) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("edge.serve", "run the edge proxy (HTTP/3, HTTP/2, HTTP/1.1)"),
    "sim": ("backends.sim.cli", "run a CPU stand-in for an SGLang server"),
    "certs": ("certs.cli", "make development certificates (CA + localhost leaf)"),
    "bench": ("bench.cli", "TTFT load generator, RTT relay and comparisons"),
    "request": ("bench.request", "send one request and print the stream and its TTFT"),
    "audit": ("edge.audit", "audit log tools: `verify FILE` checks its hash chain"),
}


def usage() -> str:
    lines = ["usage: quicedge [--version] COMMAND [options]", "", "commands:"]
    width = max(len(name) for name in SUBCOMMANDS)
    for name, (_, help_text) in SUBCOMMANDS.items():
        lines.append(f"  {name:<{width}}  {help_text}")
    lines.append("")
    lines.append("Run `quicedge COMMAND --help` for a command's options.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    if args[0] == "--version":
        from importlib.metadata import version  # tens of ms: only where it is asked for

        print(f"quicedge {version('quicedge')}")
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"quicedge: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if name == "serve":  # held already where this module is the program (above)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    module = importlib.import_module(SUBCOMMANDS[name][0])
    entry: Callable[[list[str]], int] = module.main
    return entry(rest)


if __name__ == "__main__":
    sys.exit(main())
