"""Megatron policy at TP 2 (torchrun, 2 processes, gloo).

The `parallel` launch checks one tiny model per family (megatron_worker.MODELS: Qwen2 tied, Qwen2.5 untied,
Llama 3.1 with llama3 rope scaling, Qwen3 with q / k norms and head_dim != hidden / heads, Qwen3-MoE) at TP2,
the MoE model at TP2 x EP2 (expert TP 1, sequence parallel), then the same models at TP1 x DP2 (the shared
checks are in megatron_worker.py). The vocabulary is padded (128 -> 192 rows) so the padding columns of the
vocab-parallel softmax and their removal on export are exercised.
"""

from __future__ import annotations

import pytest
from megatron_worker import (  # noqa: F401  (pytest collects the imported checks)
    build_models,
    launch,
    test_gradients_match_transformers_and_tp1,
    test_logprobs_and_entropy_match_transformers,
    test_non_finite_surrogate_skips_the_update,
    test_round_trip_is_bit_exact,
    test_router_statistics_match_transformers,
    test_update_matches_hf_policy,
)


@pytest.fixture(scope="module")
def parallel_results(tmp_path_factory):
    models = build_models(tmp_path_factory.mktemp("models"))
    results = launch("parallel", models, tmp_path_factory.mktemp("tp2"), nproc=2, tp=2, pp=1, ep=2)
    assert [r["qwen2_tied"]["layout"]["dp"] for r in results] == [[0, 1], [0, 1]]  # TP2 x DP1
    return results
