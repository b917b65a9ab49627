"""Count the instructions a Python module's run executes, under valgrind's cachegrind.

Instructions are not time (cache misses, branch misses and system calls are not in them), but
unlike time on a shared VM they are the same from run to run to within a few hundred, so the
difference between two runs tells whether a change did less work. Benchmarks take the
difference of two runs that differ only in the work measured, so that start-up cancels out.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

VALGRIND_TIMEOUT_S = 1200.0
"""Longest one valgrind run may take, s (a few minutes on a quiet machine)."""


def instructions(module_args: list[str]) -> int:
    """Instructions executed by `python -m MODULE ARGS...` (module_args[0] is the module)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise RuntimeError("--instructions needs valgrind (apt-get install valgrind)")
    command = [
        valgrind, "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
        sys.executable, "-m", *module_args,
    ]  # fmt: skip
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, check=False, timeout=VALGRIND_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"valgrind run did not finish in {VALGRIND_TIMEOUT_S:.0f} s: {' '.join(module_args)}"
        ) from None
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"valgrind run failed: {done.stderr.strip()[-500:]}")
    return int(found.group(1).replace(",", ""))
