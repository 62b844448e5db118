"""GPU rules of the Megatron policy that a CPU can check: layer-spec choice, fused kernels, optimizer groups.

The model-level checks (decay sets of both optimizer paths, cross-spec checkpoint load, forward-only reference,
fusion flags against mcore's constructors) run in a Megatron process: tests/distributed/test_megatron_gpu_rules.py.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from nemo_disco.policy import megatron as mp

# ----------------------------------------------------------------------------------------------------------------------
# policy.transformer_engine


def test_auto_uses_te_when_cuda_and_the_import_work():
    assert mp.decide_transformer_engine("auto", cuda=True, import_error=None)[0] is True
    assert mp.decide_transformer_engine(True, cuda=True, import_error=None)[0] is True


def test_auto_on_a_gpu_without_te_stops_with_the_import_error_and_the_remedy():
    # The local spec's attention materialises [b * heads, S, S] scores per layer: no fallback at RL lengths.
    with pytest.raises(RuntimeError, match="libcudnn.so.9 not found") as err:
        mp.decide_transformer_engine("auto", cuda=True, import_error="OSError: libcudnn.so.9 not found")
    assert "install transformer-engine" in str(err.value) and "policy.transformer_engine=false" in str(err.value)
    use, why = mp.decide_transformer_engine("auto", cuda=False, import_error=None)
    assert use is False and "no CUDA" in why


def test_float32_takes_the_local_spec_even_when_te_works():
    # TE has no attention backend for packed fp32 (THD) and runs fp32 GEMMs in TF32.
    use, why = mp.decide_transformer_engine("auto", cuda=True, import_error=None, dtype="float32")
    assert use is False and "float32" in why
    # ... and a GPU without TE can still run the fp32 checks.
    assert mp.decide_transformer_engine("auto", cuda=True, import_error="ImportError: x", dtype="float32")[0] is False
    with pytest.raises(RuntimeError, match="needs policy.dtype bfloat16 or float16"):
        mp.decide_transformer_engine(True, cuda=True, import_error=None, dtype="float32")
    for dtype in ("bfloat16", "float16"):
        assert mp.decide_transformer_engine("auto", cuda=True, import_error=None, dtype=dtype)[0] is True


def test_config_refuses_te_with_float32():
    from nemo_disco import config

    raw = config.RunConfig().model_dump(mode="json")
    raw["policy"].update(transformer_engine=True, dtype="float32")
    with pytest.raises(config.ConfigError, match="policy.transformer_engine=true needs policy.dtype"):
        config.validate(raw)


def test_te_general_gemm_is_defined_without_te_on_a_gpu_too(monkeypatch):
    # megatron-core 0.16.1 names te_general_gemm in the router only when TE imports; the CPU shim used to define
    # it only without CUDA, so a GPU without TE hit a NameError. The model builder defines it wherever it is absent.
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    mp.define_missing_te_names()
    assert moe_utils.te_general_gemm is None


def test_false_is_the_local_spec_even_when_te_works():
    assert mp.decide_transformer_engine(False, cuda=True, import_error=None)[0] is False


def test_use_transformer_engine_on_this_cpu_machine(caplog):
    with caplog.at_level(logging.INFO, logger=mp.__name__):
        assert mp.use_transformer_engine("auto") is False
    assert "local layer spec: no CUDA device" in caplog.text
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        mp.use_transformer_engine(True)


def test_config_accepts_auto_true_false():
    from nemo_disco import config

    for value, expected in (("auto", "auto"), (True, True), (False, False), ("true", True)):
        raw = config.RunConfig().model_dump(mode="json")
        raw["policy"]["transformer_engine"] = value
        assert config.validate(raw).policy.transformer_engine == expected
    raw["policy"]["transformer_engine"] = "sometimes"
    with pytest.raises(config.ConfigError, match="policy.transformer_engine"):
        config.validate(raw)


# ----------------------------------------------------------------------------------------------------------------------
# Fused kernels: only when their extension imports


def test_fusions_need_their_modules_on_gpu():
    none = mp.fusion_flags(on_gpu=True, use_te=True, imports=lambda name: False)
    assert none["masked_softmax_fusion"] is False and none["gradient_accumulation_fusion"] is False
    assert none["bias_activation_fusion"] is True and none["apply_rope_fusion"] is True  # mcore's own / TE's
    every = mp.fusion_flags(on_gpu=True, use_te=False, imports=lambda name: True)
    assert every["masked_softmax_fusion"] is True and every["gradient_accumulation_fusion"] is True
    assert every["apply_rope_fusion"] is False
    cpu = mp.fusion_flags(on_gpu=False, use_te=False, imports=lambda name: True)
    assert not any(cpu.values())


def test_fusion_flags_ask_for_the_apex_modules_mcore_imports():
    asked: list[str] = []
    mp.fusion_flags(on_gpu=True, use_te=False, imports=lambda name: asked.append(name) or True)
    assert set(asked) == {
        "scaled_masked_softmax_cuda",
        "scaled_upper_triang_masked_softmax_cuda",
        "scaled_softmax_cuda",
        "fused_weight_gradient_mlp_cuda",
    }


def test_a_missing_fused_module_is_reported(caplog):
    with caplog.at_level(logging.INFO, logger=mp.__name__):
        assert mp.module_imports("scaled_masked_softmax_cuda") is False  # apex is never on a CPU machine
    assert "scaled_masked_softmax_cuda unavailable (ModuleNotFoundError" in caplog.text
    assert mp.module_imports("json") is True


def test_masked_softmax_fusion_flag_decides_whether_mcore_softmax_runs():
    """mcore's fused softmax imports apex's kernel for 16-bit inputs: with the flag on and no apex it raises.

    The flag our config gives a GPU without apex is off, and that softmax runs.
    """
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    def softmax(fusion: bool) -> torch.Tensor:
        sm = FusedScaleMaskSoftmax(
            input_in_fp16=False,
            input_in_bf16=True,
            attn_mask_type=AttnMaskType.padding,
            scaled_masked_softmax_fusion=fusion,
            mask_func=attention_mask_func,
            softmax_in_fp32=True,
            scale=None,
        )
        x = torch.randn(2, 4, 32, 32, dtype=torch.bfloat16)
        return sm(x, torch.zeros(2, 1, 32, 32, dtype=torch.bool))

    with pytest.raises(ModuleNotFoundError, match="scaled_masked_softmax_cuda"):
        softmax(True)  # the old flag on a GPU (masked_softmax_fusion=on_gpu)
    flags = mp.fusion_flags(on_gpu=True, use_te=False)  # this machine has no apex
    assert softmax(flags["masked_softmax_fusion"]).shape == (2, 4, 32, 32)


# ----------------------------------------------------------------------------------------------------------------------
# Optimizer groups


def test_set_group_hyperparameters_applies_the_multipliers():
    groups = [{"wd_mult": 1.0, "lr_mult": 1.0}, {"wd_mult": 0.0}, {"lr_mult": 0.5}]
    mp.set_group_hyperparameters(groups, lr=2e-6, weight_decay=0.01)
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0, 0.01]
    assert [g["lr"] for g in groups] == [2e-6, 2e-6, 1e-6]


def test_no_weight_decay_rule():
    assert mp.no_weight_decay("decoder.layers.0.self_attention.linear_qkv.bias", torch.zeros(8))
    assert mp.no_weight_decay("decoder.final_layernorm.weight", torch.zeros(8))
    assert not mp.no_weight_decay("decoder.layers.0.mlp.linear_fc2.weight", torch.zeros(8, 8))


def test_gpu_defaults_sequence_parallel_at_tp_and_permute_fusion_only_where_it_imports(tmp_path):
    from nemo_disco import config, weights
    from nemo_disco.config import TinyModelConfig
    from nemo_disco.tiny import build_model

    defaults = config.RunConfig().policy
    assert defaults.overlap_grad_reduce and defaults.sequence_parallel and defaults.moe_permute_fusion
    assert defaults.overlap_param_gather is False  # the refit reads parameters outside a forward
    dense = weights.ModelSpec.from_dir(build_model(TinyModelConfig(), tmp_path / "dense", seed=0))
    common = {"pp": 1, "dtype": torch.float32, "use_te": False, "recompute": False}
    assert mp.transformer_config(dense, tp=2, sequence_parallel=True, **common).sequence_parallel is True
    assert mp.transformer_config(dense, tp=2, sequence_parallel=False, **common).sequence_parallel is False
    assert mp.transformer_config(dense, tp=1, sequence_parallel=True, **common).sequence_parallel is False
    moe_dir = build_model(
        TinyModelConfig(architecture="qwen3_moe", head_dim=32, moe_intermediate_size=32), tmp_path / "moe", seed=0
    )
    moe = weights.ModelSpec.from_dir(moe_dir)
    # TE's fused permutation does not import here: off even when asked for; MoE keeps SP at TP > 1 regardless.
    cfg = mp.transformer_config(moe, tp=2, sequence_parallel=False, moe_permute_fusion=True, **common)
    assert cfg.moe_permute_fusion is False and cfg.sequence_parallel is True
    assert mp.fused_permute_imports() is False


# ----------------------------------------------------------------------------------------------------------------------
# RouterBalance: the router statistics and the optional load-balancing loss

EXPERTS, TOPK = 4, 2


def _topk_routing(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mcore's TopKRouter.routing contract: probs and a boolean routing map, both [tokens, E]."""
    probs = torch.softmax(logits.reshape(-1, EXPERTS), -1)
    routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, probs.topk(TOPK, -1).indices, True)
    return probs * routing_map, routing_map


def _microbatches() -> list[SimpleNamespace]:
    """Micro-batches [B=2, S=3]: padded, a filler (its tokens excluded), one with no real token at all."""
    mask = torch.tensor([[True, True, False], [True, True, True]])
    none = torch.zeros(2, 3, dtype=torch.bool)
    return [
        SimpleNamespace(token_mask=mask, filler=False, input_ids=torch.zeros(2, 3, dtype=torch.long)),
        SimpleNamespace(token_mask=torch.ones_like(mask), filler=True, input_ids=torch.zeros(2, 3, dtype=torch.long)),
        SimpleNamespace(token_mask=none, filler=False, input_ids=torch.zeros(2, 3, dtype=torch.long)),
        SimpleNamespace(token_mask=mask.flip(1), filler=False, input_ids=torch.zeros(2, 3, dtype=torch.long)),
    ]


def _layer_logits(mbs: list[SimpleNamespace], layers: int) -> list[list[torch.Tensor]]:
    """[micro-batch][layer] router logits [S=3, B=2, E] (mcore's order); large on the filler, as garbage would be."""
    gen = torch.Generator().manual_seed(0)
    return [[torch.randn(3, 2, EXPERTS, generator=gen) * (50 if mb.filler else 1) for _ in range(layers)] for mb in mbs]


def _reference(mbs: list[SimpleNamespace], logits: list[list[torch.Tensor]]) -> tuple[dict, list[torch.Tensor]]:
    """The class docstring's statistics by boolean selection of the real tokens, and each micro-batch's loss."""
    layers = len(logits[0])
    counts, prob_sums, tokens = torch.zeros(layers, EXPERTS), torch.zeros(layers, EXPERTS), torch.zeros(layers, 1)
    losses = []
    for mb, per_layer in zip(mbs, logits, strict=True):
        real = mb.token_mask.t().reshape(-1) & (not mb.filler)  # [S * B]
        loss = torch.zeros(())
        for layer, z in enumerate(per_layer):
            _, routing_map = _topk_routing(z)
            c, p = routing_map[real].float().sum(0), torch.softmax(z.reshape(-1, EXPERTS)[real], -1).sum(0)
            counts[layer] += c
            prob_sums[layer] += p.detach()
            tokens[layer] += int(real.sum())
            if real.any():  # E / (k n^2) sum_i (sum_t P_ti) counts_i
                loss = loss + EXPERTS / (TOPK * int(real.sum()) ** 2) * (p * c).sum()
        losses.append(loss)
    share, mean_prob = counts / (TOPK * tokens), prob_sums / tokens  # f_i, P_i per layer
    stats = {
        "router_balance_loss": float((EXPERTS * share * mean_prob).sum(1).mean()),
        "router_max_load": float((EXPERTS * share).max()),
    }
    return stats, losses


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("coef", [0.0, 0.5])
def test_router_balance_is_the_documented_loss_on_real_tokens(coef, recompute):
    """Statistics and the trained term's gradient as the class docstring defines them (real tokens only, fillers
    out, recomputation counted once, no NaN from a micro-batch without real tokens), and the per-layer hook makes
    no host sync: on a GPU it runs in every MoE layer of every micro-batch."""
    from host_syncs import HostSyncs

    layers = 2
    routers = [SimpleNamespace(layer_number=n + 1) for n in range(layers)]
    mbs = _microbatches()
    logits = _layer_logits(mbs, layers)
    spec = SimpleNamespace(num_experts=EXPERTS, moe_router_topk=TOPK)
    balance = mp.RouterBalance(torch.nn.Linear(1, 1), spec, coef, recompute)  # a model without routers: called directly
    balance.start(mbs, dp_group=None)
    ref_stats, _ = _reference(mbs, logits)
    scale = coef / 3  # three micro-batches that are no filler
    for mb, per_layer in zip(mbs, logits, strict=True):
        balance.set_tokens(mb)
        for router, z in zip(routers, per_layer, strict=True):
            z = z.detach().requires_grad_(True)
            if recompute:  # mcore's activation recomputation: a forward without grad first, again in the backward
                with torch.no_grad(), HostSyncs() as syncs:
                    balance._routing(router, _topk_routing, z)
                assert syncs.calls == [], syncs.calls
            with HostSyncs() as syncs:
                probs, _ = balance._routing(router, _topk_routing, z)
            assert syncs.calls == [], syncs.calls
            (grad,) = torch.autograd.grad(probs.sum(), z)
            # The trained term adds scale x d(this micro-batch's layer losses) / dz; zero where no token is real.
            z_ref = z.detach().requires_grad_(True)
            _, ref_layer_losses = _reference([mb], [[z_ref]])
            (ref_grad,) = torch.autograd.grad(_topk_routing(z_ref)[0].sum() + scale * ref_layer_losses[0], z_ref)
            assert torch.isfinite(grad).all()
            torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)
    stats = balance.finish(dp_group=None, pp_group=None)
    assert stats == pytest.approx(ref_stats, abs=1e-6)
    assert 1.0 <= stats["router_balance_loss"] <= EXPERTS / TOPK
