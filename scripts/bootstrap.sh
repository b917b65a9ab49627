#!/usr/bin/env bash
# Create the virtual environment and install quicedge with its dev and bench extras.
# Works on a fresh Debian machine as root: installs python3-venv when the interpreter lacks it.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}

if ! "$python" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
  echo "quicedge needs Python >= 3.11 (found: $("$python" --version 2>&1))" >&2
  exit 1
fi
if ! "$python" -m venv --help >/dev/null 2>&1 || ! "$python" -c 'import ensurepip' 2>/dev/null; then
  echo "python venv support is missing; installing python3-venv with apt-get" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -e ".[dev,bench]"
