#!/usr/bin/env bash
# The GPU check rehearsed on CPU against the GPU validation machine's limits: everything about that machine but
# the GPU itself, so that its one run works the first time.
#
#   1. A Python 3.12 venv (.venv-gpu-rehearsal) holding only the machine image's packages
#      (scripts/gpu-machine-packages.txt): torch and its own dependencies hard-linked from .venv-mcore-latest (on
#      Python 3.12 the registry's torch 2.13.0 is a CUDA build that runs on CPU; the machine has 2.11.0+cu130), and
#      the few image packages the check imports, at the versions seen there where known.
#   2. The wheels scripts/gpu-check-wheels.sh prepares for Python 3.12 (--datasets included), installed by
#      scripts/gpu-check.sh --install-only exactly as on the machine (--no-index --no-deps).
#   3. Every distribution in the venv checked against the image's list, torch's dependencies and the wheels.
#   4. What a device call carries (the working tree, tracked and untracked-not-ignored, plus the wheel folders)
#      checked against 64 MiB.
#   5. The stages at smoke sizes in the documented two calls (gpu_check.CALLS), each within its budget and in a
#      bare out folder, run and checked by tests/functional/test_gpu_check_smoke.py (pytest from the Python 3.12
#      venv, the calls under this venv's Python): each out folder against what a device call returns
#      (gpu_check.RETURN_LIMITS), every stage ok (the rehearsal carries every module: none skips), the CPU figures.
#
#   bash scripts/gpu-check-rehearsal.sh               # steps 1-5 (make gpu-check-rehearsal)
#   bash scripts/gpu-check-rehearsal.sh --setup-only  # steps 1-2 (make setup-gpu-rehearsal)
#
# Exit code: 0 when every step holds and every stage is ok, else 1 (the failing step says why).
# Environment: REHEARSAL_VENV (default .venv-gpu-rehearsal), MCORE_LATEST_VENV (default .venv-mcore-latest),
# REHEARSAL_OUT (default runs/gpu-check-rehearsal).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${REHEARSAL_VENV:-.venv-gpu-rehearsal}"
SOURCE_VENV="${MCORE_LATEST_VENV:-.venv-mcore-latest}"
OUT_ROOT="${REHEARSAL_OUT:-runs/gpu-check-rehearsal}"
CARRY_LIMIT=$((64 * 1024 * 1024))
# The image packages the check imports (directly or through transformers, accelerate, datasets), pinned where a
# version was seen on the machine.
IMAGE_PACKAGES=(transformers==5.17.0 tokenizers==0.23.2 safetensors==0.8.0 huggingface-hub==1.33.0 numpy==2.5.2
  accelerate==1.15.0 pyyaml psutil regex tqdm requests packaging pandas pyarrow xxhash fsspec)
t0=$SECONDS
step() { echo "gpu-check-rehearsal: $*"; }
fail() { echo "gpu-check-rehearsal: FAILED: $*" >&2; exit 1; }
[ -x "$SOURCE_VENV/bin/python" ] || fail "$SOURCE_VENV is missing (make setup-mcore-latest)"

STAMP="$VENV/.installed-$(cat "$0" scripts/gpu-machine-packages.txt scripts/gpu-check-wheels.sh scripts/gpu-check.sh \
  | sha1sum | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
  # shellcheck source=scripts/python312.sh
  source scripts/python312.sh
  rm -rf "$VENV"
  PY="$(find_python312)"
  step "1. creating $VENV with $("$PY" --version 2>&1)"
  "$PY" -m venv "$VENV"
  "$SOURCE_VENV/bin/python" - "$SOURCE_VENV" "$VENV" <<'PYEOF'
"""Hard-link torch and its dependencies (the files their RECORDs list) from one Python 3.12 venv into another."""
import os
import re
import sys
from importlib.metadata import distributions
from pathlib import Path

from packaging.requirements import Requirement

source = Path(sys.argv[1]).resolve()
src_site = next(source.glob("lib/python3.12/site-packages"))
dst_site = next(Path(sys.argv[2]).resolve().glob("lib/python3.12/site-packages"))
dists = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d for d in distributions(path=[str(src_site)])}
todo, seen = ["torch"], set()
while todo:
    name = todo.pop()
    if name in seen:
        continue
    seen.add(name)
    for req in map(Requirement, dists[name].requires or []):
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(re.sub(r"[-_.]+", "-", req.name).lower())
for name in sorted(seen):
    for f in dists[name].files:
        src, dst = src_site / f, dst_site / f
        if not src.is_file() or str(f).startswith(".."):
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            os.link(src, dst)
print("torch and its dependencies:", " ".join(sorted(seen)))
(dst_site / "nemo_disco_rehearsal_torch_deps.txt").write_text("\n".join(sorted(seen)) + "\n")
PYEOF
  step "1. the image packages the check imports: ${IMAGE_PACKAGES[*]}"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${IMAGE_PACKAGES[@]}"
  step "2. the carried wheels (Python 3.12, --datasets), installed as on the machine"
  PY_VERSIONS=3.12 PYTHON="$VENV/bin/python" bash scripts/gpu-check-wheels.sh --datasets
  PYTHON="$VENV/bin/python" bash scripts/gpu-check.sh --install-only
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
else
  step "1-2. $VENV is up to date"
fi
[ "${1:-}" = "--setup-only" ] && exit 0

# The folders gpu-check.sh installs from on Python 3.12, whatever gpu-check-wheels.sh names them.
mapfile -t WHEEL_FOLDERS < <(ls -d wheels/gpu-check-common wheels/gpu-check-py312 wheels/gpu-check-py312-datasets* 2>/dev/null)
step "3. every distribution in $VENV is the image's, torch's own or a carried wheel's"
"$VENV/bin/python" - "${WHEEL_FOLDERS[@]}" <<'PYEOF'
import re
import sys
from importlib.metadata import distributions
from pathlib import Path
from zipfile import ZipFile

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
lines = Path("scripts/gpu-machine-packages.txt").read_text().splitlines()
image = {norm(line.split("==")[0]) for line in lines if line and not line.startswith("#")}
site = Path(next(p for p in sys.path if p.endswith("site-packages")))
torch_deps = set((site / "nemo_disco_rehearsal_torch_deps.txt").read_text().split())
wheels = set()
for folder in sys.argv[1:]:
    for whl in Path(folder).glob("*.whl"):
        with ZipFile(whl) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            wheels.add(norm(re.search(r"^Name: (.+)$", z.read(meta).decode(), re.M).group(1).strip()))
installed = {norm(d.metadata["Name"]) for d in distributions(path=[str(site)])}
# pandas needs tzdata on every platform (pandas >= 2); the image has pandas, so it has tzdata, unlisted.
unlisted_needs = {"tzdata"}
extra = sorted(installed - image - torch_deps - wheels - unlisted_needs - {"pip"})
if extra:
    sys.exit(f"gpu-check-rehearsal: FAILED: the venv holds what the GPU machine would lack: {', '.join(extra)}")
print(f"gpu-check-rehearsal: {len(installed)} distributions: {len(installed & image)} of the image, "
      f"{len(wheels)} carried wheels")
PYEOF

step "4. what a device call carries: the working tree plus the wheel folders"
carried=$( { git ls-files -z --cached --others --exclude-standard; \
  find "${WHEEL_FOLDERS[@]}" -type f -print0; } \
  | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {printf "%.0f\n", s}')
step "   carried: $((carried / 1024)) KiB of $((CARRY_LIMIT / 1024)) KiB"
[ "$carried" -le "$CARRY_LIMIT" ] || fail "the carry is $carried bytes, over 64 MiB"

step "5. the two calls at smoke sizes, each within its budget in a bare out folder, checked by"
step "   tests/functional/test_gpu_check_smoke.py (return rules, every stage ok, the CPU figures), the calls in $VENV"
mkdir -p "$OUT_ROOT"  # pytest makes --basetemp, not its parents
GPU_CHECK_PYTHON="$VENV/bin/python" "$SOURCE_VENV/bin/python" -m pytest tests/functional/test_gpu_check_smoke.py \
  -q -p no:cacheprovider --basetemp="$OUT_ROOT" || fail "the calls or what they return (above)"
step "passed in $((SECONDS - t0)) s"
