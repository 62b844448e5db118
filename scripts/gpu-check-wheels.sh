#!/usr/bin/env bash
# Downloads the wheels that scripts/gpu-check.sh installs on a GPU machine without network (manylinux x86_64; the
# machine brings torch and transformers), one set per Python minor version, since the machine's Python can change
# (3.12 last seen). Run it where PyPI is reachable; every folder is under wheels/ (git-ignored):
#
#   wheels/gpu-check-common     pure-Python wheels, the same for every version (pydantic, hydra, trl, ...)
#   wheels/gpu-check-py3XX      for Python 3.XX: the compiled wheels (megatron-core, pydantic-core, psutil) and
#                               the pure ones whose newest release differs by version (trl, accelerate)
#
# A GPU call carries wheels/gpu-check-common plus the folder of the machine's Python (or all of them: every set
# together stays far under a 64 MiB carry; the script prints each folder's size).
#
#   bash scripts/gpu-check-wheels.sh              # every version in PY_VERSIONS
#   bash scripts/gpu-check-wheels.sh --datasets   # also HF datasets for the TRL stage, per version:
#                                                 # wheels/gpu-check-py3XX-datasets (datasets, dill, multiprocess;
#                                                 # the GPU machine has pyarrow, pandas, xxhash and fsspec: < 1 MiB)
#
# megatron-core: 0.19.2 for Python >= 3.12; 0.16.1 for 3.10 and 3.11 (the newest release with wheels for them).
# Python 3.10 also takes older trl (1.14.2) and accelerate (1.15.0): the pinned releases need >= 3.11.
# Each pure-Python wheel is resolved against every version (pip checks its Requires-Python), so a set that
# downloads is a set that installs.
#
# Environment: PYTHON (any Python with pip), PY_VERSIONS (default "3.10 3.11 3.12 3.13").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
read -r -a VERSIONS <<<"${PY_VERSIONS:-3.10 3.11 3.12 3.13}"
COMMON=wheels/gpu-check-common
mkdir -p "$COMMON"

download() {  # download DIR PYTHON_VERSION REQUIREMENT...
  local dir=$1 version=$2
  shift 2
  mkdir -p "$dir"
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps -d "$dir" --only-binary=:all: \
    --python-version "$version" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any "$@"
}

# antlr4-python3-runtime 4.9.3 (what hydra-core and math-verify[antlr4_9_3] need) is published as a source archive
# only: build its pure-Python wheel here.
"$PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps -w "$COMMON" "antlr4-python3-runtime==4.9.3"
for version in "${VERSIONS[@]}"; do
  tag=py${version/./}
  # The newest release of each with wheels / Requires-Python for this version (pip download checks both).
  case "$version" in
    3.10) mcore=0.16.1 trl=1.14.2 accelerate=1.15.0 ;;
    3.11) mcore=0.16.1 trl=1.16.0 accelerate=1.16.0 ;;
    *) mcore=0.19.2 trl=1.16.0 accelerate=1.16.0 ;;
  esac
  echo "gpu-check-wheels: Python $version -> wheels/gpu-check-$tag (megatron-core $mcore, trl $trl) + $COMMON"
  # Compiled wheels, and the pure ones whose release depends on the version.
  download "wheels/gpu-check-$tag" "$version" "megatron-core==$mcore" "pydantic-core==2.41.5" "psutil==7.1.3" \
    "trl==$trl" "accelerate==$accelerate"
  download "$COMMON" "$version" "pydantic==2.12.5" "annotated-types==0.7.0" "typing-inspection==0.4.2" \
    "omegaconf==2.3.0" "hydra-core==1.3.8" "math-verify==0.9.0" "latex2sympy2_extended==1.11.0" "einops==0.8.1"
  if [ "${1:-}" = "--datasets" ]; then
    # Only what the GPU machine lacks: its image has pyarrow, pandas, xxhash and fsspec (scripts/gpu-machine-packages.txt).
    download "wheels/gpu-check-$tag-datasets" "$version" "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19"
  fi
done
for folder in wheels/gpu-check*/; do
  folder=${folder%/}
  du -ch "$folder"/*.whl | tail -1 | sed "s|total|total in $folder|"
done
