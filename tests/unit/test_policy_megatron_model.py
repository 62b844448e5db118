"""GPU rules of the Megatron model builder that a CPU can check: layer-spec choice, fused kernels, mcore config.

The model-level checks (cross-spec checkpoint load, fusion flags against mcore's constructors) run in a Megatron
process: tests/distributed/test_megatron_gpu_rules.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from nemo_disco.policy import megatron_model as mm

# ----------------------------------------------------------------------------------------------------------------------
# policy.transformer_engine


def test_auto_uses_te_when_cuda_and_the_import_work():
    assert mm.decide_transformer_engine("auto", cuda=True, import_error=None)[0] is True
    assert mm.decide_transformer_engine(True, cuda=True, import_error=None)[0] is True


def test_auto_on_a_gpu_without_te_stops_with_the_import_error_and_the_remedy():
    # The local spec's attention materialises [b * heads, S, S] scores per layer: no fallback at RL lengths.
    with pytest.raises(RuntimeError, match="libcudnn.so.9 not found") as err:
        mm.decide_transformer_engine("auto", cuda=True, import_error="OSError: libcudnn.so.9 not found")
    assert "install transformer-engine" in str(err.value) and "policy.transformer_engine=false" in str(err.value)
    use, why = mm.decide_transformer_engine("auto", cuda=False, import_error=None)
    assert use is False and "no CUDA" in why


def test_float32_takes_the_local_spec_even_when_te_works():
    # TE has no attention backend for packed fp32 (THD) and runs fp32 GEMMs in TF32.
    use, why = mm.decide_transformer_engine("auto", cuda=True, import_error=None, dtype="float32")
    assert use is False and "float32" in why
    # ... and a GPU without TE can still run the fp32 checks.
    assert mm.decide_transformer_engine("auto", cuda=True, import_error="ImportError: x", dtype="float32")[0] is False
    with pytest.raises(RuntimeError, match="needs policy.dtype bfloat16 or float16"):
        mm.decide_transformer_engine(True, cuda=True, import_error=None, dtype="float32")
    for dtype in ("bfloat16", "float16"):
        assert mm.decide_transformer_engine("auto", cuda=True, import_error=None, dtype=dtype)[0] is True


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
    mm.define_missing_te_names()
    assert moe_utils.te_general_gemm is None


def test_false_is_the_local_spec_even_when_te_works():
    assert mm.decide_transformer_engine(False, cuda=True, import_error=None)[0] is False


def test_use_transformer_engine_on_this_cpu_machine(caplog):
    with caplog.at_level(logging.INFO, logger=mm.__name__):
        assert mm.use_transformer_engine("auto") is False
    assert "local layer spec: no CUDA device" in caplog.text
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        mm.use_transformer_engine(True)


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
    none = mm.fusion_flags(on_gpu=True, use_te=True, imports=lambda name: False)
    assert none["masked_softmax_fusion"] is False and none["gradient_accumulation_fusion"] is False
    assert none["bias_activation_fusion"] is True and none["apply_rope_fusion"] is True  # mcore's own / TE's
    every = mm.fusion_flags(on_gpu=True, use_te=False, imports=lambda name: True)
    assert every["masked_softmax_fusion"] is True and every["gradient_accumulation_fusion"] is True
    assert every["apply_rope_fusion"] is False
    cpu = mm.fusion_flags(on_gpu=False, use_te=False, imports=lambda name: True)
    assert not any(cpu.values())


def test_fusion_flags_ask_for_the_apex_modules_mcore_imports():
    asked: list[str] = []
    mm.fusion_flags(on_gpu=True, use_te=False, imports=lambda name: asked.append(name) or True)
    assert set(asked) == {
        "scaled_masked_softmax_cuda",
        "scaled_upper_triang_masked_softmax_cuda",
        "scaled_softmax_cuda",
        "fused_weight_gradient_mlp_cuda",
    }


def test_a_missing_fused_module_is_reported(caplog):
    with caplog.at_level(logging.INFO, logger=mm.__name__):
        assert mm.module_imports("scaled_masked_softmax_cuda") is False  # apex is never on a CPU machine
    assert "scaled_masked_softmax_cuda unavailable (ModuleNotFoundError" in caplog.text
    assert mm.module_imports("json") is True


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
    flags = mm.fusion_flags(on_gpu=True, use_te=False)  # this machine has no apex
    assert softmax(flags["masked_softmax_fusion"]).shape == (2, 4, 32, 32)


# ----------------------------------------------------------------------------------------------------------------------
# The mcore TransformerConfig


def test_gpu_defaults_sequence_parallel_at_tp_and_permute_fusion_only_where_it_imports(tmp_path):
    from nemo_disco import config, weights
    from nemo_disco.config import TinyModelConfig
    from nemo_disco.tiny import build_model

    defaults = config.RunConfig().policy
    assert defaults.overlap_grad_reduce and defaults.sequence_parallel and defaults.moe_permute_fusion
    assert defaults.overlap_param_gather is False  # the refit reads parameters outside a forward
    dense = weights.ModelSpec.from_dir(build_model(TinyModelConfig(), tmp_path / "dense", seed=0))
    common = {"pp": 1, "dtype": torch.float32, "use_te": False, "recompute": False}
    assert mm.transformer_config(dense, tp=2, sequence_parallel=True, **common).sequence_parallel is True
    assert mm.transformer_config(dense, tp=2, sequence_parallel=False, **common).sequence_parallel is False
    assert mm.transformer_config(dense, tp=1, sequence_parallel=True, **common).sequence_parallel is False
    moe_dir = build_model(
        TinyModelConfig(architecture="qwen3_moe", head_dim=32, moe_intermediate_size=32), tmp_path / "moe", seed=0
    )
    moe = weights.ModelSpec.from_dir(moe_dir)
    # TE's fused permutation does not import here: off even when asked for; MoE keeps SP at TP > 1 regardless.
    cfg = mm.transformer_config(moe, tp=2, sequence_parallel=False, moe_permute_fusion=True, **common)
    assert cfg.moe_permute_fusion is False and cfg.sequence_parallel is True
    assert mm.fused_permute_imports() is False


@pytest.mark.parametrize(
    ("setting", "granularity", "method", "layers"),
    [
        (False, None, None, None),
        ("selective", "selective", None, None),  # mcore's default recompute_modules: the core attention only
        ("full", "full", "uniform", 1),
        (True, "full", "uniform", 1),  # the key's old boolean form
    ],
)
def test_activation_checkpointing_reaches_the_transformer_config(tmp_path, setting, granularity, method, layers):
    from nemo_disco import weights
    from nemo_disco.config import TinyModelConfig
    from nemo_disco.tiny import build_model

    dense = weights.ModelSpec.from_dir(build_model(TinyModelConfig(), tmp_path / "dense", seed=0))
    cfg = mm.transformer_config(dense, tp=1, pp=1, dtype=torch.float32, use_te=False, recompute=setting)
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == (granularity, method, layers)
    if granularity == "selective":
        assert cfg.recompute_modules == ["core_attn"]
