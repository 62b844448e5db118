"""Megatron policy at TP 2 x PP 2 (torchrun, 4 processes, gloo), then TP1 x DP4 on the same models.

Every family of megatron_worker.MODELS, the MoE model at TP2 x PP2 x EP2. Shared checks in megatron_worker.py:
round trip, log-probs / entropy / gradients vs transformers, one update vs HFPolicy, NaN skip; the DP4 phase
proves the gradient is summed over four data-parallel ranks.
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
    results = launch("parallel", models, tmp_path_factory.mktemp("tp2pp2"), nproc=4, tp=2, pp=2, ep=2, timeout=600)
    assert [r["qwen25_untied"]["tp1_dp"]["dp"] for r in results] == [[r, 4] for r in range(4)]
    return results
