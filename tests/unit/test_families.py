"""The model families: each registered family's table against a real transformers model, and the one registry."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open

from nemo_disco import families, plan, weights
from nemo_disco.config import TinyModelConfig
from nemo_disco.generation import kv_decode
from nemo_disco.tiny import build_model, hf_config

torch.set_num_threads(1)


def _checkpoint(model_dir) -> dict[str, tuple[int, ...]]:  # noqa: ANN001
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("model_type", sorted(families.FAMILIES))
def test_the_table_names_every_tensor_of_the_familys_tiny_model_with_its_shape(model_type, tied, tmp_path):
    # head_dim 32 != hidden 64 / 4 heads: a table that took one for the other would give the wrong q / k / v shapes.
    tiny = TinyModelConfig(architecture=model_type, tie_word_embeddings=tied, head_dim=32, num_layers=2)
    model_dir = build_model(tiny, tmp_path, seed=0)
    saved = _checkpoint(model_dir)
    spec = weights.ModelSpec.from_dir(model_dir)
    family = families.FAMILIES[model_type]
    assert spec.architecture == model_type
    assert (spec.qkv_bias, spec.qk_layernorm, spec.is_moe) == (family.qkv_bias, family.qk_norm, family.moe)
    expanded = {}
    for place in weights.placements(spec, 1):
        shapes = weights.hf_shapes(place.entry, spec)
        shapes = shapes * spec.num_experts if place.entry.per_expert else shapes
        expanded.update(zip(place.hf_names, shapes, strict=True))
    assert sorted(expanded) == sorted(saved)
    assert expanded == saved
    assert ("lm_head.weight" in saved) is not tied


@pytest.mark.parametrize("model_type", sorted(families.FAMILIES))
def test_a_familys_features_agree_with_its_table_and_its_config_class(model_type):
    transformers = pytest.importorskip("transformers")
    family = families.FAMILIES[model_type]
    names = {n for e in family.table for n in e.hf}
    assert ("model.layers.{layer}.self_attn.q_proj.bias" in names) is family.qkv_bias
    assert ("model.layers.{layer}.self_attn.q_norm.weight" in names) is family.qk_norm
    assert any(e.per_expert for e in family.table) is family.moe
    # The tiny builder's config class is the family's own: its model_type is the registered name.
    assert getattr(transformers, family.config_class).model_type == model_type
    assert hf_config(TinyModelConfig(architecture=model_type)).model_type == model_type


def test_an_unknown_or_unsupported_model_type_is_one_line_naming_the_supported_ones():
    supported = str(sorted(families.FAMILIES))
    with pytest.raises(ValueError) as err:
        families.get_family("gpt2")
    assert str(err.value) == f"model_type='gpt2' is not supported; supported: {supported}"
    with pytest.raises(ValueError) as err:
        families.get_family("qwen2_moe")
    assert str(err.value) == f"model_type='qwen2_moe' is not supported (shared experts); supported: {supported}"
    with pytest.raises(ValueError, match="'qwen3_next' is listed as unsupported"):
        families.register_family(families.Family("qwen3_next", families.QWEN3, "Qwen3NextConfig"))


def test_a_family_is_registered_once_and_its_moe_flag_matches_its_table():
    with pytest.raises(ValueError, match="model family 'qwen2' is registered twice"):
        families.register_family(families.FAMILIES["qwen2"])
    with pytest.raises(ValueError, match="moe=True but its table lacks per-expert entries"):
        families.register_family(families.Family("x_moe", families.QWEN3, "Qwen3Config", moe=True))
    with pytest.raises(ValueError, match="moe=False but its table has per-expert entries"):
        families.register_family(families.Family("x_dense", families.QWEN3_MOE, "Qwen3MoeConfig"))
    assert "x_moe" not in families.FAMILIES and "x_dense" not in families.FAMILIES


def test_registering_a_family_is_all_that_makes_every_part_accept_it(monkeypatch):
    # A family registered once is known to the config, the weight map, the plan and the decode loop alike.
    monkeypatch.setattr(families, "FAMILIES", dict(families.FAMILIES))
    config = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    config |= {"intermediate_size": 128, "vocab_size": 128, "model_type": "llama_with_norms"}
    with pytest.raises(ValueError, match="'llama_with_norms' is not supported"):
        weights.ModelSpec.from_hf_config(config)
    with pytest.raises(plan.PlanError, match="x: model_type='llama_with_norms' is not supported"):
        plan.Shapes.from_hf_config(config, "x")
    with pytest.raises(ValueError, match="Input should be 'qwen2', 'llama', 'qwen3' or 'qwen3_moe'"):
        TinyModelConfig(architecture="llama_with_norms")
    new = families.register_family(
        dataclasses.replace(families.FAMILIES["qwen3"], model_type="llama_with_norms", kv_decode=False)
    )
    assert TinyModelConfig(architecture="llama_with_norms").architecture == "llama_with_norms"
    spec = weights.ModelSpec.from_hf_config(config)
    assert (spec.qk_layernorm, spec.qkv_bias) == (True, False)
    assert {n for p in weights.placements(spec, 1) for n in p.hf_names} >= {"model.layers.1.self_attn.k_norm.weight"}
    assert plan.Shapes.from_hf_config(config, "x").qk_norm
    assert "llama_with_norms" not in kv_decode.decodable()
    assert families.get_family("llama_with_norms") is new
