#!/usr/bin/env bash
# Creates .venv-mcore-latest: Python 3.12 + the newest megatron-core that GPU containers ship (0.19.x), for
# `make test-mcore-latest` (the unit and distributed suites against it). megatron-core >= 0.17 needs
# Python >= 3.12, hence a venv of its own beside the Python 3.11 + megatron-core 0.16.1 one (.venv).
# On Python 3.12 torch==2.13.0 resolves to a CUDA build (~4.7 GB); it runs on a CPU-only machine.
# Idempotent: a stamp keyed on this script's and pyproject.toml's content skips the work when nothing changed.
# MCORE_LATEST_VENV=<dir> builds elsewhere; PYTHON312=<interpreter> picks the Python 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MCORE_LATEST_VENV:-.venv-mcore-latest}"
MCORE="megatron-core==0.19.2"
STAMP="$VENV/.installed-$(cat "$0" pyproject.toml | sha1sum | cut -c1-12)"
if [ -f "$STAMP" ]; then
  echo "setup-mcore-latest: $VENV is up to date"
  exit 0
fi
step() { echo "setup-mcore-latest: $*"; }
trap 'echo "setup-mcore-latest: FAILED (see the messages above); $VENV is left incomplete and will be redone" >&2' ERR

# shellcheck source=scripts/python312.sh
source scripts/python312.sh  # (the working folder is the repository root)

if [ ! -x "$VENV/bin/python" ]; then
  PY="$(find_python312)"
  step "creating $VENV with $("$PY" --version 2>&1)"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
step "upgrading pip"
"${PIP[@]}" --upgrade pip
step "installing torch==2.13.0 (on Python 3.12 a CUDA build; it runs on CPU)"
"${PIP[@]}" torch==2.13.0
# The cpu and test extras of pyproject.toml, with their megatron-core pin replaced by $MCORE.
mapfile -t DEPS < <("$VENV/bin/python" - <<'PYEOF'
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
for req in project["dependencies"] + extras["cpu"] + extras["test"]:
    if not req.startswith(("megatron-core", "torch")):
        print(req)
PYEOF
)
step "installing $MCORE and the project's dependencies (cpu + test extras)"
"${PIP[@]}" torch==2.13.0 "$MCORE" "${DEPS[@]}"
"${PIP[@]}" -e . --no-deps
step "checking the imports"
"$VENV/bin/python" - <<'PYEOF'
import sys
from importlib.metadata import version

import megatron.core  # noqa: F401
import torch

import nemo_disco.policy.cpu_compat  # noqa: F401

want, got = "0.19.2", version("megatron-core")
if got != want:
    raise SystemExit(f"setup-mcore-latest: megatron-core {got} installed, expected {want}")
print(f"setup-mcore-latest: python {sys.version.split()[0]}, megatron-core {got}, torch {torch.__version__}")
PYEOF
rm -f "$VENV"/.installed-*
touch "$STAMP"
step "done ($(du -sh "$VENV" | cut -f1))"
