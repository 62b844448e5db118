"""GPU-only paths of the Megatron policy: bf16, Transformer Engine layer spec with packed (THD) sequences,
the distributed optimizer, offload / onload of weights, gradient buffers and optimizer state, save / load.

Skipped on CPU. With two or more GPUs it runs at TP2, else TP1. bf16 log-probs are compared to the fp32
transformers forward with a bf16-sized tolerance.
"""

from __future__ import annotations

import pytest
import torch
from megatron_worker import build_models, launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    nproc = min(2, torch.cuda.device_count())
    models = build_models(tmp_path_factory.mktemp("models"), ("qwen2_tied",))
    return launch("gpu", models, tmp_path_factory.mktemp("gpu"), nproc=nproc, tp=nproc, timeout=600)


def test_te_spec_and_packing_follow_transformer_engine(results):
    from nemo_disco.policy.megatron_model import te_available

    for res in results:
        assert res["use_te"] == te_available() and res["packed"] == res["use_te"]


def test_bf16_weights_round_trip_and_logprobs(results):
    for res in results:
        assert res["export_not_bit_exact_bf16"] == []
        assert res["lp_diff"] < 0.1 and res["ent_diff"] < 0.1  # bf16 forward vs fp32 reference


def test_distributed_optimizer_update_and_nan_skip(results):
    for res in results:
        assert res["train"]["skipped"] == 0.0 and res["train"]["grad_norm"] > 0
        assert res["nan"]["skipped"] == 1.0


def test_offload_frees_memory_and_onload_restores(results):
    for res in results:
        assert res["memory_freed_by_offload"] > 0
        assert res["lp_diff_after_onload"] == 0.0


def test_save_load_on_gpu(results):
    for res in results:
        assert res["updates_after_load"] == 1 and res["lp_diff_after_load"] == 0.0
