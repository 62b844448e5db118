"""Checkpoints and conversion (torchrun, 2 processes, gloo; padded vocabulary).

One launch per model (Qwen2 with tied embeddings; Qwen3-MoE, saved at TP2 x EP2): train one update at TP2 and
save ``checkpoints/step_1/{policy/, config.yaml}``, take a second update; re-initialise at TP1 x DP2 (EP1), load
the checkpoint and take the same second update; convert the step to Hugging Face (from the step dir and from its
policy/ dir); convert the HF folder to Megatron at TP2 and use it as the model of a PP2 policy.
"""

from __future__ import annotations

import pytest
from megatron_worker import TEMPERATURE, TOL, build_models, launch


@pytest.fixture(scope="module", params=["qwen2_tied", "qwen3_moe"])
def results(request, tmp_path_factory):
    models = build_models(tmp_path_factory.mktemp("models"), (request.param,))
    return launch("checkpoint", models, tmp_path_factory.mktemp("ckpt"), nproc=2, ep=2)


def test_tp2_checkpoint_loads_at_tp1_with_the_same_logprobs(results):
    for res in results:
        assert res["dp"][1] == 2 and res["updates_after_load"] == 1
        assert res["lp_after_load_diff"] <= TOL


def test_optimizer_and_schedule_state_survive_resharding(results):
    """The update after loading at TP1 x DP2 equals the TP2 run's own second update (Adam moments restored)."""
    for res in results:
        a, b = res["second_update_grad_norm"]
        assert abs(a - b) <= TOL * a
        assert res["second_update_lr"][0] == res["second_update_lr"][1]
        assert res["weights_after_second_update_diff"] <= TOL


@pytest.mark.parametrize("tag", ["hf_from_step", "hf_from_policy"])
def test_megatron_to_hf_writes_a_folder_transformers_loads(results, tag):
    res = results[0][tag]
    assert res["not_bit_exact"] == []  # the converted weights are the checkpoint's, bit for bit
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= set(res["files"])
    assert res["tokenizer_vocab"] > 0
    gen = res["generation_config"]
    assert gen["eos_token_id"] == 1 and gen["pad_token_id"] == 0
    assert gen["temperature"] == TEMPERATURE  # from config.yaml: found next to policy/ in both cases


def test_hf_to_megatron_at_tp2_loads_at_pp2_bit_exactly(results):
    for res in results:
        assert res["converted_at_pp2"]["names_equal"] and res["converted_at_pp2"]["not_bit_exact"] == []
        assert res["converted_updates"] == 0
