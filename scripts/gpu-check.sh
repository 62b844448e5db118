#!/usr/bin/env bash
# The GPU validation (benchmarks/gpu_check.py): the project's own GPU code, stage by stage, on one CUDA GPU.
#
# Usage:
#   bash scripts/gpu-check.sh --call 1            # first device call: collectives, grad_step, logprob_parity,
#                                                 # offload_checkpoint, moe (gpu_check.CALLS)
#   bash scripts/gpu-check.sh --call 2            # second device call: trainer, trl
#   bash scripts/gpu-check.sh [--smoke] [--out DIR] [--stages collectives,grad_step,...] [--budget S]
#   bash scripts/gpu-check.sh --install-only      # install the carried wheels, run nothing
#
# Each call stays within --budget seconds (default gpu_check.CALL_BUDGET_S, 240): a stage that would start with
# less than 15 s left is skipped as "budget". The two calls and one rerun fit 15 minutes of device time.
#
# On a GPU machine without network: the wheels prepared by scripts/gpu-check-wheels.sh are installed first
# (--no-index --no-deps: nothing is downloaded, nothing else is resolved): wheels/gpu-check-common plus the set of
# the running $PYTHON's version, wheels/gpu-check-py3XX (and its -datasets folder when present). When wheel
# sets are present but none is for this Python, it stops with one line naming the version and the sets present.
# NEMO_DISCO_WHEELS (colon-separated folders) replaces that choice. torch and transformers must be there already.
# A stage whose module is missing fails alone and says which.
# --smoke runs every stage on the CPU with tiny shapes (CI runs it; its figures mean nothing) in $PYTHON's own
# environment: it installs no wheels unless NEMO_DISCO_WHEELS names them (run --install-only first on a bare one).
# Results in --out (default $OUT, else runs/gpu-check): summary.json (status, figures, environment) and
# gpu-check.tar.gz (each stage's JSON and log): two files, as a device call returns at most 8. Each failed stage's
# traceback tail is printed, since only the last 12,000 characters of a call's output come back.
# Exit code: 0 when every stage is ok or skipped, 1 otherwise, 2 when no wheel set matches this Python.
#
# Environment: PYTHON (default python3), NEMO_DISCO_WHEELS, OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
SMOKE=0
for arg in "$@"; do
  [ "$arg" = --smoke ] && SMOKE=1
done
VERSION=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
TAG=py${VERSION/./}
FOLDERS=()
if [ -n "${NEMO_DISCO_WHEELS:-}" ]; then
  IFS=: read -r -a FOLDERS <<<"$NEMO_DISCO_WHEELS"
  echo "gpu-check: Python $VERSION ($PYTHON): wheel folders from NEMO_DISCO_WHEELS: ${FOLDERS[*]}"
elif [ "$SMOKE" = 1 ]; then
  echo "gpu-check: --smoke: no wheels installed (Python $VERSION, $PYTHON's own environment)"
else
  shopt -s nullglob
  PRESENT=(wheels/gpu-check*/)
  shopt -u nullglob
  if [ -d "wheels/gpu-check-$TAG" ]; then
    FOLDERS=(wheels/gpu-check-common "wheels/gpu-check-$TAG" "wheels/gpu-check-$TAG-datasets")
    echo "gpu-check: Python $VERSION ($PYTHON): wheel set wheels/gpu-check-$TAG + wheels/gpu-check-common"
  elif [ "${#PRESENT[@]}" -gt 0 ]; then
    echo "gpu-check: no wheel set for Python $VERSION ($PYTHON): wheels/gpu-check-$TAG is missing; present:" \
      "${PRESENT[*]%/} (make it with PY_VERSIONS=$VERSION bash scripts/gpu-check-wheels.sh, or set NEMO_DISCO_WHEELS)" >&2
    exit 2
  else
    echo "gpu-check: Python $VERSION ($PYTHON): no wheels/gpu-check-* folder, nothing installed"
  fi
fi
for folder in ${FOLDERS[@]+"${FOLDERS[@]}"}; do
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
