"""Megatron policy in one process without torchrun (a one-rank gloo group is created), Qwen2 tied, TP1."""

from __future__ import annotations

import pytest
from megatron_worker import TOL, build_models, launch


@pytest.fixture(scope="module")
def single_results(tmp_path_factory):
    models = build_models(tmp_path_factory.mktemp("models"), ("qwen2_tied",))
    return launch("single", models, tmp_path_factory.mktemp("single"), nproc=0)[0]


def test_single_process_without_torchrun(single_results):
    """No process group yet: the policy creates a one-rank gloo group; TP1 matches transformers."""
    res = single_results["plain"]
    assert res["names_equal"] and res["not_bit_exact"] == []
    assert res["lp_diff"] <= TOL and res["ent_diff"] <= TOL and res["grad_diff"] <= TOL


def test_activation_checkpointing_gives_the_same_gradient(single_results):
    """Full recomputation (mcore's checkpoint with the CPU RNG tracker) changes nothing numerically."""
    res = single_results["recompute"]
    assert res["lp_diff"] <= TOL and res["grad_diff"] <= TOL


def test_microbatch_and_chunk_sizes_do_not_matter(single_results):
    """One micro-batch with 4096-token chunks == 30-token micro-batches with 5-token chunks (both == HF)."""
    for tag in ("plain", "one_microbatch_big_chunks"):
        assert single_results[tag]["grad_diff"] <= TOL and single_results[tag]["lp_diff"] <= TOL, tag


def test_offload_onload_is_a_correct_no_op_on_cpu(single_results):
    for res in single_results.values():
        assert res["lp_diff_after_offload"] == res["lp_diff"]
