import json

import pytest
import torch

from nemo_disco import weights
from nemo_disco.weights import GATE_UP, QKV, REPLICATED, ROW, VOCAB, ModelSpec


def _spec(**over) -> ModelSpec:
    cfg = {
        "model_type": "qwen2",
        "num_hidden_layers": 4,
        "hidden_size": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 6,
        "vocab_size": 10,
        "tie_word_embeddings": False,
    }
    cfg.update(over)
    return ModelSpec.from_hf_config(cfg)


def test_qkv_layout_is_per_query_group():
    # 4 query heads, 2 groups, head_dim 1 (hidden 4): mcore's rows are [q0 q1 k0 v0 | q2 q3 k1 v1].
    spec = _spec(hidden_size=4, head_dim=1)
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # q heads 0..3
    k = torch.tensor([[10.0], [11.0]])  # k of groups 0, 1
    v = torch.tensor([[20.0], [21.0]])
    fused = weights.to_shard(QKV, [q, k, v], spec, tp_size=1, tp_rank=0, padded_vocab=10)
    assert fused.squeeze(1).tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    # TP 2 splits the fused rows contiguously: one whole group per rank.
    assert weights.to_shard(QKV, [q, k, v], spec, 2, 1, 10).squeeze(1).tolist() == [2, 3, 11, 21]
    assert [t.tolist() for t in weights.from_shards(QKV, [fused], spec)] == [q.tolist(), k.tolist(), v.tolist()]
    # Biases use the same layout.
    bias = weights.to_shard(QKV, [q[:, 0], k[:, 0], v[:, 0]], spec, 1, 0, 10)
    assert bias.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


def test_gate_up_shard_is_local_gate_then_local_up():
    spec = _spec()
    gate = torch.arange(6.0).unsqueeze(1)  # rows 0..5
    up = 10 + torch.arange(6.0).unsqueeze(1)  # rows 10..15
    # TP 2: rank 1 holds gate rows 3..5 then up rows 13..15 (the GLU chunks the local output in halves).
    assert weights.to_shard(GATE_UP, [gate, up], spec, 2, 1, 10).squeeze(1).tolist() == [3, 4, 5, 13, 14, 15]
    shards = [weights.to_shard(GATE_UP, [gate, up], spec, 2, r, 10) for r in range(2)]
    back = weights.from_shards(GATE_UP, shards, spec)
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)


def test_vocab_padding_and_its_removal():
    spec = _spec()  # vocab 10
    emb = torch.arange(10.0).unsqueeze(1).repeat(1, 8)
    padded = weights.padded_vocab_size(10, tp_size=2, multiple=4)  # lcm(4, 2) = 4 -> 12 rows
    assert padded == 12
    shards = [weights.to_shard(VOCAB, [emb], spec, 2, r, padded) for r in range(2)]
    assert shards[1].shape == (6, 8) and torch.all(shards[1][4:] == 0)  # rows 10, 11 are zero padding
    assert torch.equal(weights.from_shards(VOCAB, shards, spec)[0], emb)


def test_padded_vocab_size_does_not_depend_on_tp():
    # Qwen2.5's 151936 = 1187 * 128: unchanged at TP 1..8 (Megatron-LM's 128 * TP would give 152064 at TP 2).
    assert {weights.padded_vocab_size(151936, tp) for tp in (1, 2, 4, 8)} == {151936}
    # TP 3 does not divide 128: lcm(128, 3) = 384, ceil(151936 / 384) = 396 -> 396 * 384 = 152064.
    assert weights.padded_vocab_size(151936, 3) == 152064
    assert weights.padded_vocab_size(128, 2, multiple=96) == 192  # the tests' padded tiny vocabulary


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_kind_round_trips_through_tp_shards(tp):
    spec = _spec(num_attention_heads=4, num_key_value_heads=4, hidden_size=8, intermediate_size=8)
    g = torch.Generator().manual_seed(0)
    padded = weights.padded_vocab_size(spec.vocab_size, tp, multiple=4)
    for entry in weights.QWEN2:
        hf = [torch.randn(s, generator=g) for s in weights.hf_shapes(entry, spec)]
        shards = [weights.to_shard(entry.kind, hf, spec, tp, r, padded) for r in range(tp)]
        if entry.kind == REPLICATED:
            shards = shards[:1] * tp
        back = weights.from_shards(entry.kind, shards, spec)
        assert all(torch.equal(a, b) for a, b in zip(back, hf, strict=True)), entry.hf
        if entry.kind == ROW:
            assert shards[0].shape[1] * tp == hf[0].shape[1]


def test_layer_ranges_and_stages():
    assert list(weights.layer_range(4, 2, 1)) == [2, 3]
    assert weights.stage_of_layer(3, 4, 2) == (1, 1)  # global layer 3 = stage 1, local 1
    with pytest.raises(ValueError, match="num_hidden_layers=4 is not divisible by pipeline_parallel_size=3"):
        weights.layer_range(4, 3, 0)


def test_placements_cover_the_model_once():
    tied, untied = _spec(tie_word_embeddings=True), _spec()
    names = [n for p in weights.placements(untied, 2) for n in p.hf_names]
    assert len(names) == len(set(names))
    # Qwen2 per layer: 2 norms + q/k/v weights + q/k/v biases + o + gate + up + down = 12; plus embed, norm, lm_head.
    assert len(names) == 4 * 12 + 3
    assert "lm_head.weight" not in [n for p in weights.placements(tied, 2) for n in p.hf_names]
    stages = {p.hf_names[0]: p.stage for p in weights.placements(untied, 2)}
    assert stages["model.embed_tokens.weight"] == 0 and stages["lm_head.weight"] == 1
    assert stages["model.layers.1.mlp.down_proj.weight"] == 0 and stages["model.layers.2.mlp.down_proj.weight"] == 1
    local = {p.hf_names[0]: p.mcore_names[0] for p in weights.placements(untied, 2)}
    assert local["model.layers.2.self_attn.o_proj.weight"] == "decoder.layers.0.self_attention.linear_proj.weight"
    llama = {n for p in weights.placements(_spec(model_type="llama"), 1) for n in p.hf_names}
    assert not any(n.endswith("_proj.bias") for n in llama)


def test_model_spec_reads_configs_and_refuses_unsupported_ones():
    spec = _spec(rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, head_dim=4)
    assert spec.rope_theta == 1e6 and spec.head_dim == 4 and spec.qkv_bias and spec.num_query_groups == 2
    llama3 = _spec(
        model_type="llama",
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    )
    assert llama3.rope_scaling_factor == 32.0 and not llama3.qkv_bias
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        _spec(model_type="gpt2")
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        _spec(rope_parameters={"rope_type": "yarn"})
    with pytest.raises(ValueError, match="high_freq_factor=8.0 is not supported"):
        _spec(model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 8.0})
    with pytest.raises(ValueError, match="attention_bias=true is not supported"):
        _spec(model_type="llama", attention_bias=True)


def test_load_and_export_without_process_groups(tiny_qwen2, tmp_path):
    """TP1 x PP1 without torch.distributed: HF -> mcore-named params -> HF is bit-exact; errors name the file."""
    spec = ModelSpec.from_dir(tiny_qwen2)
    reader = weights.SafetensorsReader(tiny_qwen2)
    padded = weights.padded_vocab_size(spec.vocab_size, 1, multiple=96)  # 128 -> 192 rows
    params = {}
    for place in weights.placements(spec, 1):
        shape = weights.to_shard(place.entry.kind, [reader(n) for n in place.hf_names], spec, 1, 0, padded).shape
        params[place.mcore_names[0]] = torch.full(shape, float("nan"))
    weights.load_hf_into(params, reader, spec, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, padded_vocab=padded)
    assert params["embedding.word_embeddings.weight"].shape == (192, 64)
    exported = dict(weights.export_hf(params, spec))
    assert sorted(exported) == sorted(reader.names())
    assert all(torch.equal(exported[n], reader(n)) for n in exported)
    with pytest.raises(ValueError, match="does not cover Megatron parameters"):
        weights.load_hf_into(
            {**params, "extra.weight": torch.zeros(1)},
            reader,
            spec,
            tp_size=1,
            tp_rank=0,
            pp_size=1,
            pp_rank=0,
            padded_vocab=padded,
        )
    from safetensors.torch import save_file

    save_file({n: reader(n) for n in reader.names() if n != "model.norm.weight"}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{tmp_path}: tensor 'model.norm.weight' not found"):
        weights.load_hf_into(
            params,
            weights.SafetensorsReader(tmp_path),
            spec,
            tp_size=1,
            tp_rank=0,
            pp_size=1,
            pp_rank=0,
            padded_vocab=padded,
        )
    with pytest.raises(ValueError, match="shard shape"):
        bad = {**params, "decoder.final_layernorm.weight": torch.zeros(3)}
        weights.load_hf_into(bad, reader, spec, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, padded_vocab=padded)


def test_model_spec_from_dir_errors(tmp_path):
    with pytest.raises(ValueError, match="config.json: not found"):
        ModelSpec.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type='bert'"):
        ModelSpec.from_dir(tmp_path)


# ----------------------------------------------------------------------------------------------------------------------
# Qwen3, Qwen3-MoE and the families' real shapes.

QWEN3_4B = {  # Qwen/Qwen3-4B config.json
    "model_type": "qwen3",
    "num_hidden_layers": 36,
    "hidden_size": 2560,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9728,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1000000,
    "attention_bias": False,
    "use_sliding_window": False,
    "layer_types": ["full_attention"] * 36,
}
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B config.json
    "model_type": "qwen3_moe",
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}


def test_qwen3_head_dim_is_the_configs_not_hidden_over_heads():
    spec = ModelSpec.from_hf_config(QWEN3_4B)
    assert (spec.head_dim, spec.qk_layernorm, spec.qkv_bias, spec.tie_word_embeddings) == (128, True, False, True)
    shapes = {p.hf_names[0]: weights.hf_shapes(p.entry, spec) for p in weights.placements(spec, 1)}
    # q: 32 heads x 128 = 4096 rows (not 2560), k / v: 8 x 128 = 1024; o maps 4096 back to 2560.
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == [(4096, 2560), (1024, 2560), (1024, 2560)]
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == [(2560, 4096)]
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == [(128,)]
    assert "lm_head.weight" not in shapes and "model.layers.0.self_attn.q_proj.bias" not in shapes


def test_qwen3_moe_spec_and_placements():
    spec = ModelSpec.from_hf_config(QWEN3_30B_A3B)
    assert (spec.num_experts, spec.moe_ffn_hidden_size, spec.moe_router_topk, spec.norm_topk_prob) == (
        128,
        768,
        8,
        True,
    )
    # transformers >= 5 saves the expert count as num_local_experts.
    v5 = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert ModelSpec.from_hf_config(v5).num_experts == 128
    small = ModelSpec.from_hf_config({**QWEN3_30B_A3B, "num_hidden_layers": 2, "num_experts": 4})
    names = [n for p in weights.placements(small, 1) for n in p.hf_names]
    # Per layer: 2 norms + q/k/v + q/k norms + o + router + 4 experts x (gate, up, down) = 21; + embed, norm, lm_head.
    assert len(names) == len(set(names)) == 2 * 21 + 3
    experts = [p for p in weights.placements(small, 2) if p.entry.per_expert]
    assert [p.stage for p in experts] == [0, 1, 0, 1]  # gate_up of layers 0 and 1, then down of layers 0 and 1
    assert experts[1].expert_hf_names(3) == (
        "model.layers.1.mlp.experts.3.gate_proj.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
    )
    # Layer 1 is stage 1's local layer 0.
    assert experts[1].expert_mcore_names(1)[0] == "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    assert experts[1].expert_mcore_names(1)[1] == "decoder.layers.0.mlp.experts.linear_fc1.weight1"  # TE grouped GEMM


def test_families_real_configs_parse():
    qwen25 = _spec(rope_theta=1000000.0)  # Qwen2.5-7B: rope_theta 1e6, biases, untied
    assert qwen25.rope_theta == 1e6 and qwen25.qkv_bias and not qwen25.qk_layernorm
    llama31 = _spec(  # Llama-3.1-8B(-Instruct)
        model_type="llama",
        rope_theta=500000.0,
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    )
    assert (llama31.rope_theta, llama31.rope_scaling_factor, llama31.qkv_bias) == (500000.0, 8.0, False)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"model_type": "qwen3_next"}, "model_type='qwen3_next' is not supported (linear attention"),
        ({"model_type": "gpt_oss"}, "model_type='gpt_oss' is not supported (attention sinks"),
        ({"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window=true is not supported"),
        (
            {"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]},
            "layer_types has ['sliding_attention'] layers",
        ),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=true is not supported"),
        ({**QWEN3_30B_A3B, "decoder_sparse_step": 2}, "decoder_sparse_step=2 is not supported"),
        ({**QWEN3_30B_A3B, "mlp_only_layers": [0]}, "mlp_only_layers=[0] is not supported"),
        ({**QWEN3_30B_A3B, "shared_expert_intermediate_size": 512}, "shared experts are not supported"),
    ],
)
def test_unsupported_features_fail_in_one_line_naming_the_key(over, message):
    with pytest.raises(ValueError) as err:
        _spec(**over)
    assert message in str(err.value) and "\n" not in str(err.value)


def _moe_spec(experts: int = 4) -> ModelSpec:
    return ModelSpec.from_hf_config(
        {**QWEN3_30B_A3B, "num_hidden_layers": 1, "hidden_size": 4, "num_attention_heads": 2, "num_key_value_heads": 1}
        | {"head_dim": 2, "intermediate_size": 6, "moe_intermediate_size": 3, "num_experts": experts, "vocab_size": 8}
    )


def test_experts_load_on_their_expert_parallel_rank_and_export_in_global_order():
    spec = _moe_spec()
    g = torch.Generator().manual_seed(0)
    hf = {}
    for place in weights.placements(spec, 1):
        shapes = weights.hf_shapes(place.entry, spec) * (spec.num_experts if place.entry.per_expert else 1)
        hf.update({n: torch.randn(s, generator=g) for n, s in zip(place.hf_names, shapes, strict=True)})
    local = {}  # EP rank 1 of 2: global experts 2 and 3 as local 0 and 1 (local-spec names)
    for place in weights.placements(spec, 1):
        if place.entry.per_expert:
            for j in range(2):
                shard = weights.to_shard(place.entry.kind, [hf[n] for n in place.expert_hf_names(2 + j)], spec, 1, 0, 8)
                local[place.expert_mcore_names(j)[0]] = torch.full_like(shard, float("nan"))
        else:
            shard = weights.to_shard(place.entry.kind, [hf[n] for n in place.hf_names], spec, 1, 0, 8)
            local[place.mcore_names[0]] = torch.full_like(shard, float("nan"))
    weights.load_hf_into(local, hf.__getitem__, spec, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, padded_vocab=8,
                         ep_size=2, ep_rank=1)  # fmt: skip
    fc2 = local["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"]
    assert torch.equal(fc2, hf["model.layers.0.mlp.experts.2.down_proj.weight"])
    fc1 = local["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]  # [gate; up] of expert 3
    assert torch.equal(fc1, torch.cat([hf["model.layers.0.mlp.experts.3.gate_proj.weight"],
                                       hf["model.layers.0.mlp.experts.3.up_proj.weight"]]))  # fmt: skip
    assert torch.equal(local["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])
    with pytest.raises(ValueError, match="policy.expert_parallel_size=3 does not divide the model's 4 experts"):
        weights.local_experts(spec, 3)


def test_transformers_fused_experts_and_checkpoint_names_translate_both_ways():
    # transformers 5 keeps a layer's experts as gate_up_proj [E, 2I, h] and down_proj [E, h, I].
    gate_up = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)  # E = 2, I = 2, h = 3
    down = 100 + torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    module = {"m.layers.0.mlp.experts.gate_up_proj": gate_up, "m.layers.0.mlp.experts.down_proj": down, "m.x": down}
    ckpt = dict(weights.to_checkpoint_layout(module.items()))
    assert sorted(ckpt) == sorted(
        ["m.x"] + [f"m.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in (0, 1) for p in ("gate", "up", "down")]
    )
    assert torch.equal(ckpt["m.layers.0.mlp.experts.1.up_proj.weight"], gate_up[1, 2:])  # rows I.. of expert 1
    assert torch.equal(ckpt["m.layers.0.mlp.experts.0.down_proj.weight"], down[0])
    shapes = {n: tuple(t.shape) for n, t in module.items()}
    assert weights.checkpoint_shapes(shapes)["m.layers.0.mlp.experts.1.gate_proj.weight"] == (2, 3)
    back = dict(weights.to_module_layout(reversed(list(ckpt.items())), shapes))  # any order
    assert sorted(back) == sorted(module) and all(torch.equal(back[n], module[n]) for n in module)
    name = "m.layers.0.mlp.experts.0.gate_proj.weight"
    with pytest.raises(ValueError, match="arrived twice"):
        list(weights.to_module_layout([(name, ckpt[name]), (name, ckpt[name])], shapes))
    with pytest.raises(ValueError, match="beyond the model's 2 experts"):
        list(weights.to_module_layout([("m.layers.0.mlp.experts.2.down_proj.weight", down[0])], shapes))
    with pytest.raises(ValueError, match=r"left out expert tensors of 1 fused tensor\(s\)"):
        list(weights.to_module_layout([(name, ckpt[name])], shapes))


def test_dtypes_cover_every_policy_dtype_the_config_accepts():
    import typing

    from nemo_disco.config import PolicyConfig

    names = typing.get_args(PolicyConfig.model_fields["dtype"].annotation)
    assert set(weights.DTYPES) == set(names)
    assert weights.DTYPES["bfloat16"] is torch.bfloat16 and weights.DTYPES["float32"] is torch.float32
