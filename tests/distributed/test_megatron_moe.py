"""Qwen3-MoE: expert parallelism across data-parallel ranks (torchrun, 2 processes, gloo) and the router.

The `parallel` launch runs the MoE model at TP1 x DP2 x EP2: each rank holds two of the four experts and trains
on its own share of the rows (6 and 2 of 8), so the two ranks of the expert-parallel group have different
numbers of micro-batches and the rank with fewer adds fillers to keep the all-to-all exchanges in step. The
shared checks (megatron_worker.py) then hold as for every other layout: round trip, log-probs, gradients,
update and the router statistics against transformers. The `router` launch (one process) checks the optional
load-balancing loss and the frozen router.
"""

from __future__ import annotations

import pytest
from megatron_worker import (  # noqa: F401  (pytest collects the imported checks)
    TOL,
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
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("models"), ("qwen3_moe",))


@pytest.fixture(scope="module")
def parallel_results(models, tmp_path_factory):
    results = launch("parallel", models, tmp_path_factory.mktemp("ep2"), nproc=2, tp=1, pp=1, ep=2)
    assert [r["qwen3_moe"]["layout"]["dp"] for r in results] == [[0, 2], [1, 2]]  # TP1 x DP2
    return results


@pytest.fixture(scope="module")
def router(models, tmp_path_factory):
    return launch("router", models, tmp_path_factory.mktemp("router"), nproc=0)[0]


def test_expert_parallel_ranks_with_fewer_microbatches_add_fillers(parallel_results):
    layouts = [r["qwen3_moe"]["layout"] for r in parallel_results]
    assert [x["ep"] for x in layouts] == [2, 2]
    assert layouts[0]["fillers"] == 0 and layouts[1]["fillers"] > 0  # 6 rows need more micro-batches than 2


def test_reported_balance_loss_is_transformers_and_does_not_depend_on_recomputation(router):
    hf = router["hf_balance_loss"]  # ~1.01 for a random router: nearly uniform load
    for key in ("stats", "stats_with_aux", "stats_recompute", "frozen_train"):
        assert abs(router[key]["router_balance_loss"] - hf) <= TOL, key


def test_the_optional_balance_loss_adds_its_exact_gradient(router):
    """grad(c = 0.5) - grad(c = 0) = 0.5 x d(sum over layers of the loss) / d theta (one micro-batch, one rank)."""
    assert router["aux_grad_scale"] > 100 * TOL  # the term is far above the tolerance
    assert router["aux_grad_diff"] <= TOL


def test_a_frozen_router_is_not_updated_and_everything_else_is(router):
    assert router["routers"] == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    assert router["frozen_requires_grad"] == []
    assert router["router_changed"] == [] and router["others_unchanged"] == []
    assert router["frozen_train"]["skipped"] == 0.0
