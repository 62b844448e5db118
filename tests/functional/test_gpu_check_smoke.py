"""scripts/gpu-check.sh --smoke: every stage of the GPU validation runs on CPU at tiny shapes (so it cannot rot).

No figure is asserted beyond what a CPU must reproduce (float32 parity, exact gradients, bitwise onload and
checkpoint round trips): the smoke run's timings mean nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "NEMO_DISCO_WHEELS": str(out / "none")}
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    stages = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    return res, stages


def test_every_stage_runs(run):
    res, stages = run
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = stages["summary"]
    assert summary["status"] == dict.fromkeys(gpu_check.STAGES, "ok"), {
        k: stages[k].get("error") for k in gpu_check.STAGES
    }
    assert "completion_tokens_per_s_vs_trl" in summary
    assert summary["timed_out"] == [] and summary["warnings"] == []  # no compile warning on a CPU run
    env = stages["environment"]
    assert env["device"]["name"] == "cpu"
    assert set(env["torch_compile"]) >= {"triton", "CC", "which", "c_compiler"}
    for name in gpu_check.STAGES:
        assert stages[name]["timed_out"] is False and stages[name]["timeout_s"] == gpu_check.STAGE_TIMEOUT_S[name]
        assert "pass_rule" in stages[name], name


def test_cpu_reproducible_figures(run):
    _, s = run
    assert all(c["ok"] for c in s["collectives"]["checks"].values())
    for model in ("qwen2_tied", "llama_untied"):
        runs = s["logprob_parity"][model]
        assert runs["float32_local"]["logprob_diff"]["max"] < 1e-5 and runs["float32_local"]["layer_spec"] == "local"
        assert runs["bfloat16_local"]["within_tolerance"] and runs["bfloat16_local"]["layer_spec"] == "local"
        assert runs["bfloat16_transformer_engine"]["status"] == "skipped"  # TE is never on a CPU machine
    assert s["grad_step"]["grad_max_abs_diff"] < 1e-4 and s["grad_step"]["weights_max_abs_diff_after_step"] < 1e-6
    assert s["grad_step"]["layer_spec"] == "local"
    assert s["grad_step"]["nan_skipped"] == 1.0 and s["grad_step"]["nan_weights_unchanged"]
    for key in ("distributed_optimizer_true", "distributed_optimizer_false"):
        r = s["offload_checkpoint"][key]
        assert r["logprobs_bitwise_equal_after_onload"] and r["checkpoint_logprobs_equal"]
    assert s["trainer"]["finite"] and s["trainer"]["completion_tokens_per_step"] == 4 * 4 * 8


def test_moe_stage(run):
    """A Qwen3-MoE policy: parity, one update, exported weights. On a CPU every tensor is on the CPU, so the
    device checks hold trivially here; they bite on a GPU (mcore builds the router on the host)."""
    _, s = run
    for key, tol in (("bfloat16_local", 0.15), ("float32_local", 1e-5)):
        r = s["moe"][key]
        assert r["layer_spec"] == "local" and r["device"] == "cpu", key
        assert r["off_device_after_build"] == [] and r["off_device_after_step"] == [], key
        assert r["logprob_diff"]["max"] < tol, key
        assert r["step"]["skipped"] == 0.0 and r["exported_devices"] == ["cpu"] and r["exported_nonfinite"] == []
        routers = ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
        unchanged = r["exported_unchanged"]
        if key == "float32_local":
            # Frozen routers (policy.freeze_router's default) are the only tensors the update leaves alone.
            assert unchanged == routers
        else:
            # bf16 parameters, as Megatron-LM's Float16Module makes them: a norm weight at 1.0 moves by lr = 1e-3,
            # under half of bf16's spacing there (2^-7), so its bf16 copy rounds back to 1.0 (the fp32 main copy
            # in the optimizer moves). Every other tensor changes.
            assert set(routers) <= set(unchanged), unchanged
            assert all(n in routers or n.endswith("norm.weight") for n in unchanged), unchanged
        assert r["exported_changed"] == r["exported_tensors"] - len(unchanged)


def test_r1_distill_qwen_1_5b_matmul_params():
    # Per layer: q, o 2 * 1536^2 + k, v 2 * 1536 * 256 + MLP 3 * 1536 * 8960 = 46,792,704; x 28 = 1,310,195,712;
    # lm_head 1536 * 151,936 = 233,373,696; total 1,543,569,408.
    assert gpu_check._matmul_params(gpu_check.TRAINER_SHAPE) == 1_543_569_408


def test_compile_toolchain_warnings_only_on_a_gpu_run():
    missing = {"triton": {"version": None, "error": "ModuleNotFoundError: triton"}, "c_compiler": None}
    gpu = {"device": {"name": "NVIDIA H200"}, "torch_compile": missing}
    warnings = gpu_check.toolchain_warnings(gpu)
    assert len(warnings) == 2 and "triton" in warnings[0] and "C compiler" in warnings[1]
    assert gpu_check.toolchain_warnings({**gpu, "device": {"name": "cpu"}}) == []
    ready = {"triton": {"version": "3.5.0", "error": None}, "c_compiler": "/usr/bin/cc"}
    assert gpu_check.toolchain_warnings({**gpu, "torch_compile": ready}) == []
    assert gpu_check.summarize({}, gpu)["warnings"] == warnings


def test_no_wheel_set_for_this_python_fails_in_one_line(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "gpu-check.sh").write_text((ROOT / "scripts" / "gpu-check.sh").read_text())
    for name in ("gpu-check-common", "gpu-check-py39"):
        (tmp_path / "wheels" / name).mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "NEMO_DISCO_WHEELS"} | {"PYTHON": sys.executable}
    res = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "gpu-check.sh")], capture_output=True, text=True, env=env, timeout=60
    )
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1
    assert f"no wheel set for Python {version}" in res.stderr
    assert "present: wheels/gpu-check-common wheels/gpu-check-py39 " in res.stderr
