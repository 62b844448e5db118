"""Shared fixtures: tiny models built in code (nothing from a hub)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """A random 2-layer Qwen2 (hidden 64, GQA 4/2, tied embeddings) with the char-level tokenizer."""
    from nemo_disco.config import TinyModelConfig
    from nemo_disco.tiny import build_model

    return build_model(TinyModelConfig(), tmp_path_factory.mktemp("tiny_qwen2"), seed=0)


# Shared check modules (tests/generation_checks.py) importable from every test folder.
import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
