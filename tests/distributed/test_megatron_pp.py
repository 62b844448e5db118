"""Megatron policy at PP 2 (torchrun, 2 processes, gloo): 1F1B schedule with variable micro-batch shapes.

Checks one tiny model per family (Qwen2 tied: the output layer on the last stage is a synced copy of the
embedding; Qwen2.5 and Llama 3.1 untied; Qwen3; Qwen3-MoE with one MoE layer per stage), then TP1 x DP2 on
the same models (shared checks in megatron_worker.py).
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
    results = launch("parallel", models, tmp_path_factory.mktemp("pp2"), nproc=2, tp=1, pp=2)
    assert [r["llama31"]["layout"]["dp"] for r in results] == [[0, 1], [0, 1]]  # PP2 x DP1
    return results
