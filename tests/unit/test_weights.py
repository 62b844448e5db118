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
