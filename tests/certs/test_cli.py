"""`quicedge certs`, and `quicedge serve` making the development certificates, where the folder
cannot be written: one line naming the folder, not a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from certs.cli import main as certs_main
from tests.edge.test_settings import quicedge, refused


def test_certs_into_a_folder_that_cannot_be_made_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    out = a_file / "dev"
    assert certs_main(["--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"quicedge certs: cannot make the development certificates in {out}: Not a directory\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "certs", "--out", str(out)], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (1, captured.err)


def test_serve_whose_development_certificates_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    """Without --cert/--key, `serve` makes the development certificates in
    `$QUICEDGE_CERTS_DIR`; a folder it could not make ended `serve --check` (and a start) with
    a traceback."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    folder = a_file / "dev"
    for extra in (["--check"], ["--h3", "127.0.0.1:0", "--tcp", "127.0.0.1:0"]):
        done = quicedge(
            "serve", *extra, "--backend", "http://10.0.0.5:1", "--admin", "127.0.0.1:0",
            env={"QUICEDGE_CERTS_DIR": str(folder)},
        )  # fmt: skip
        assert refused(done) == (
            "quicedge serve: no --cert/--key, and the development certificates cannot be made"
            f" in {folder} ($QUICEDGE_CERTS_DIR): Not a directory"
        )
