"""Device placement of the Megatron policy as on a GPU, seen on a CPU (megatron_worker.py, ``placement``).

On a GPU, mcore builds most of a model on the current device but the MoE router's weight and the local spec's
torch norms on the host, in float32. ``cpu_compat.emulate_device("meta")`` reproduces that split on a CPU
machine (what mcore puts on "the GPU" lands on ``meta``), so these checks fail if the built model is not moved
to its device and cast to its dtype before DDP, the optimizer and the first refit see it.
"""

from __future__ import annotations

import pytest
from megatron_worker import build_models, launch

MODELS = ("qwen2_tied", "qwen3_moe")


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    models = build_models(tmp_path_factory.mktemp("models"), MODELS)
    return launch("placement", models, tmp_path_factory.mktemp("placement"), nproc=0)[0]


@pytest.mark.parametrize("name", [f"{m}_{role}" for m in MODELS for role in ("trained", "reference")])
def test_every_parameter_and_buffer_is_on_the_device_in_the_model_dtype(res, name):
    r = res[name]
    assert r["policy_device"] == "meta"
    assert r["params_off_device"] == []  # before the fix: the routers and every norm, on the cpu
    assert r["buffers_off_device"] == []
    assert r["params_not_bf16"] == []  # before the fix: the torch norms in float32


@pytest.mark.parametrize("model", MODELS)
def test_gradient_buffers_are_on_the_device(res, model):
    r = res[f"{model}_trained"]
    assert r["main_grads_off_device"] == [] and r["grad_buffers_off_device"] == []


@pytest.mark.parametrize("name", [f"{m}_{role}" for m in MODELS for role in ("trained", "reference")])
def test_the_refit_exports_every_tensor_from_the_device(res, name):
    r = res[name]
    assert "export_error" not in r, r.get("export_error")
    assert r["export_count"] > 0 and r["export_off_device"] == []


def test_dense_forward_reaches_the_loss_on_the_device(res):
    for role in ("trained", "reference"):
        r = res[f"qwen2_tied_{role}"]
        assert "forward_error" not in r, r.get("forward_error")
        assert r["forward_logprob_devices"] == ["meta"]


def test_moe_router_gating_runs_on_the_device(res):
    # Before the fix: "Expected all tensors to be on the same device" (router weight on the host) in every layer.
    for role in ("trained", "reference"):
        assert res[f"qwen3_moe_{role}"]["router_gating"] == ["meta", "meta"]
