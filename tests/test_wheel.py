"""The wheel `pip install .` would install: the packages and the `quicedge` command, and no
developer-only tool or test. Built from a copy of the checkout, so no stale `build/` leaks in."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_SKIP = {".git", ".venv", "build", "dist", "__pycache__", "bench-out", ".mypy_cache", ".ruff_cache",
         ".pytest_cache"}  # fmt: skip


def _ignore(folder: str, names: list[str]) -> set[str]:
    skipped = {n for n in names if n in _SKIP or n.endswith(".egg-info")}
    if Path(folder) == REPO / "certs":
        skipped.add("dev")  # generated keys never go anywhere
    return skipped


def test_the_wheel_has_the_packages_and_the_command_but_no_tools(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=_ignore)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "wheel"),
         str(source)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    [wheel] = (tmp_path / "wheel").glob("quicedge-*.whl")
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"backends", "bench", "certs", "edge", "transport"}
    assert not [n for n in names if n.startswith(("tools/", "tests/"))]
    # What `quicedge bench` and `quicedge request` import ships; the experiments do not.
    for module in ("bench/cli.py", "bench/request.py", "bench/edge_latency.py",
                   "bench/routing.py", "bench/relay_cli.py", "bench/clients/h3.py"):  # fmt: skip
        assert module in names
    for moved in ("handshakes", "pool_cpu", "sim_throughput", "tracing_overhead", "tree_gc"):
        assert f"bench/{moved}.py" not in names
    # Nothing shipped imports what is not shipped.
    unshipped = re.compile(rb"^\s*(from|import) (tools|tests)\b", re.M)
    importing = [n for n in names if n.endswith(".py") and unshipped.search(archive.read(n))]
    assert not importing
    [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = archive.read(entry_points).decode()
    assert "[console_scripts]" in scripts and "quicedge = edge.cli:main" in scripts
