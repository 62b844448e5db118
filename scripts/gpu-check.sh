#!/usr/bin/env bash
# The GPU validation (benchmarks/gpu_check.py): the project's own GPU code, stage by stage, on one CUDA GPU.
#
# Usage:
#   bash scripts/gpu-check.sh [--smoke] [--out DIR] [--stages collectives,grad_step,...] [--stage-timeout S]
#   bash scripts/gpu-check.sh --install-only      # install the carried wheels, run nothing
#
# On a GPU machine without network: the wheels prepared by scripts/gpu-check-wheels.sh are installed first
# (--no-index --no-deps: nothing is downloaded, nothing else is resolved) from every folder named in
# $NEMO_DISCO_WHEELS (colon-separated; default: every wheels/gpu-check* folder that exists). torch and
# transformers must be there. A stage whose module is missing fails alone and says which.
# Results: one JSON per stage, environment.json and summary.json in --out (default $OUT, else runs/gpu-check).
# --smoke runs every stage on the CPU with tiny shapes (CI runs it); its figures mean nothing.
# Exit code: 0 when every stage is ok or skipped, 1 otherwise.
#
# Environment: PYTHON (default python3), NEMO_DISCO_WHEELS, OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ -n "${NEMO_DISCO_WHEELS:-}" ]; then
  IFS=: read -r -a FOLDERS <<<"$NEMO_DISCO_WHEELS"
else
  FOLDERS=(wheels/gpu-check*)
fi
for folder in "${FOLDERS[@]}"; do
  if [ -d "$folder" ] && compgen -G "$folder/*.whl" >/dev/null; then
    echo "gpu-check: installing the wheels of $folder (no index, no dependencies)"
    "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps "$folder"/*.whl
  fi
done
if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
exec "$PYTHON" benchmarks/gpu_check.py "$@"
