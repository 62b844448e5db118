"""GPU-path defects shown on CPU in one Megatron process (tests/distributed/megatron_worker.py, gpu_rules)."""

from __future__ import annotations

import pytest
from megatron_worker import build_models, launch


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    models = build_models(tmp_path_factory.mktemp("models"), ("qwen2_tied",))
    return launch("gpu_rules", models, tmp_path_factory.mktemp("gpu_rules"), nproc=0)[0]


def test_both_optimizer_paths_decay_the_same_parameters(res):
    cpu, gpu, raw = res["decay_cpu"], res["decay_megatron"], res["decay_megatron_raw"]
    assert cpu == gpu
    no_decay = {n for n, d in cpu.items() if d == 0.0}
    assert no_decay and all(n.endswith(".bias") or "norm" in n for n in no_decay)
    assert {n for n, d in cpu.items() if d == 0.1} == set(cpu) - no_decay
    # Without writing each group's decay, mcore's inner Adam decays the norms and biases too.
    assert {n for n, d in raw.items() if d == 0.0} == set()


def test_gradient_accumulation_fusion_only_with_its_module(res):
    assert "fused_weight_gradient_mlp_cuda" in res["old_grad_acc_fusion_error"]
    assert res["gpu_flags"]["gradient_accumulation_fusion"] is False  # no apex here
    assert res["gpu_flags"]["masked_softmax_fusion"] is False
    assert res["new_flags_build"] is True


def test_checkpoints_load_across_layer_specs(res):
    assert res["te_loads_local"] is True  # a TE model (extra _extra_state requested) loads a local checkpoint
    assert res["local_loads_te"] is True  # and a local model one written with the extra objects
    assert "lacks 1 tensor(s): ['decoder.final_layernorm.extra']" in res["missing_weight_error"]
    assert res["meta_layer_spec"] == "local"


def test_reference_policy_is_forward_only(res):
    assert res["ref_optimizer_none"] and res["ref_unwrapped"]
    assert not res["ref_requires_grad"] and not res["ref_main_grad"]
    assert res["ref_lp_equal"] and res["ref_lp_after_offload_equal"]
    assert "forward-only" in res["ref_train_error"]


def test_overlapped_gradient_reduction_is_exact_when_the_micro_batch_count_varies(res):
    assert res["overlap_True_microbatches"][0] > res["overlap_True_microbatches"][1]
    assert res["overlap_errors"] == []
    assert res["overlap_grads_equal"] is True
