#!/usr/bin/env bash
# Downloads the wheels that scripts/gpu-check.sh installs on a GPU machine without network (Python 3.12,
# manylinux x86_64; the machine brings torch and transformers) into wheels/gpu-check (git-ignored), about 7 MB,
# and prints their total size. Run it where PyPI is reachable.
#
#   bash scripts/gpu-check-wheels.sh              # megatron-core, pydantic, hydra, math-verify, trl, ... (~7 MB)
#   bash scripts/gpu-check-wheels.sh --datasets   # also HF datasets for the TRL stage (~66 MB with pyarrow and
#                                                 # pandas), split in two folders that each fit a 64 MiB carry:
#                                                 # wheels/gpu-check-datasets-1 (pyarrow ...), -2 (pandas)
#
# Environment: PYTHON (any Python with pip).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=wheels/gpu-check
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
PIP=("$PYTHON" -m pip download -q --disable-pip-version-check --no-deps -d "$OUT")
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
# Binary wheels for Python 3.12 (pydantic-core and psutil are compiled).
"${PIP[@]}" "${TARGET[@]}" \
  "megatron-core==0.19.2" "pydantic==2.12.5" "pydantic-core==2.41.5" "annotated-types==0.7.0" \
  "typing-inspection==0.4.2" "omegaconf==2.3.0" "hydra-core==1.3.8" "math-verify==0.9.0" \
  "latex2sympy2_extended==1.10.2" "trl==1.16.0" "accelerate==1.16.0" "psutil==7.1.3" "einops==0.8.1"
# antlr4-python3-runtime 4.9.3 (what hydra-core and math-verify[antlr4_9_3] need) is published as a source
# archive only: build its pure-Python wheel here.
"$PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps -w "$OUT" "antlr4-python3-runtime==4.9.3"
if [ "${1:-}" = "--datasets" ]; then
  mkdir -p wheels/gpu-check-datasets-1 wheels/gpu-check-datasets-2
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps -d wheels/gpu-check-datasets-1 "${TARGET[@]}" \
    "datasets==5.2.0" "pyarrow==26.0.1" "dill==0.4.1" "multiprocess==0.70.19" "xxhash==4.1.0" "fsspec==2026.9.0"
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps -d wheels/gpu-check-datasets-2 "${TARGET[@]}" \
    "pandas==3.1.1"
fi
for folder in wheels/gpu-check*; do
  du -ch "$folder"/*.whl | tail -1 | sed "s|total|total in $folder|"
done
