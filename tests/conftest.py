"""Shared fixtures: tiny models built in code (nothing from a hub)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

#: A test module that names Megatron (builds a Megatron policy, converts its checkpoints, launches a worker that
#: does) is marked ``mcore``: ``make test-mcore-latest`` runs those against the newest megatron-core on Python 3.12.
_NAMES_MEGATRON = re.compile(r"megatron|mcore", re.IGNORECASE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of a module that names Megatron ``mcore`` (see ``_NAMES_MEGATRON``)."""
    names: dict[Path, bool] = {}
    for item in items:
        path = item.path
        if path not in names:
            names[path] = bool(_NAMES_MEGATRON.search(path.read_text()))
        if names[path]:
            item.add_marker(pytest.mark.mcore)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """A random 2-layer Qwen2 (hidden 64, GQA 4/2, tied embeddings) with the char-level tokenizer."""
    from nemo_disco.config import TinyModelConfig
    from nemo_disco.tiny import build_model

    return build_model(TinyModelConfig(), tmp_path_factory.mktemp("tiny_qwen2"), seed=0)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A random 2-layer Llama with untied embeddings and Llama-3 rope scaling (the R1-Distill-Llama layout)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        rope_scaling={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A random 2-layer Qwen3 with q / k norms and head_dim 32 != hidden 64 / 4 heads (the Qwen3-4B layout)."""
    from nemo_disco.config import TinyModelConfig
    from nemo_disco.tiny import build_model

    return build_model(TinyModelConfig(architecture="qwen3", head_dim=32), tmp_path_factory.mktemp("q3"), seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory):
    """A random 2-layer Qwen3-MoE: 4 experts, top-2 renormalised, untied embeddings (the Qwen3-30B-A3B layout)."""
    from nemo_disco.config import TinyModelConfig
    from nemo_disco.tiny import build_model

    tiny = TinyModelConfig(architecture="qwen3_moe", head_dim=32, tie_word_embeddings=False)
    return build_model(tiny, tmp_path_factory.mktemp("q3moe"), seed=2)


@pytest.fixture(scope="session")
def tiny_default_models(tmp_path_factory):
    """A registered family's tiny model with the tiny defaults (``TinyModelConfig``), built once per session."""
    from nemo_disco.config import TinyModelConfig
    from nemo_disco.tiny import build_model

    built: dict[str, Path] = {}

    def model_dir(model_type: str) -> Path:
        if model_type not in built:
            out = tmp_path_factory.mktemp(f"tiny_{model_type}")
            built[model_type] = build_model(TinyModelConfig(architecture=model_type), out, seed=0)
        return built[model_type]

    return model_dir


@pytest.fixture
def tiny_family(request, tiny_default_models) -> Path:
    """The tiny model of the family ``request.param`` (parametrize it indirectly over ``families.FAMILIES``).

    The family's own fixture ``tiny_<model_type>`` above where it has one (shaped like a real model of it), else
    its model with the tiny defaults: a family added to the registry is tested with no fixture of its own.
    """
    try:
        return request.getfixturevalue(f"tiny_{request.param}")
    except pytest.FixtureLookupError:
        return tiny_default_models(request.param)


# Shared check modules (tests/generation_checks.py) importable from every test folder.
import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
