"""scripts/gpu-check.sh --smoke: every stage of the GPU validation runs on CPU at tiny shapes (so it cannot rot).

No figure is asserted beyond what a CPU must reproduce (float32 parity, exact gradients, bitwise onload and
checkpoint round trips): the smoke run's timings mean nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def read_call(out: Path) -> dict:
    """One call's results: summary.json and everything packed in its archive, by file stem."""
    with tarfile.open(out / gpu_check.ARCHIVE) as tar:
        stages = {
            Path(m.name).stem: json.load(tar.extractfile(m)) for m in tar.getmembers() if m.name.endswith(".json")
        }
    return stages | {"summary": json.loads((out / "summary.json").read_text())}


@pytest.fixture(scope="module")
def calls(tmp_path_factory):
    """The two device calls of the documented split, each in a bare out folder as the device tool gives it.

    The calls run under $GPU_CHECK_PYTHON where it is set (scripts/gpu-check-rehearsal.sh: the GPU machine's
    package set), else under this interpreter.
    """
    python = os.environ.get("GPU_CHECK_PYTHON") or sys.executable
    env = {**os.environ, "PYTHON": python, "OMP_NUM_THREADS": "1"}
    env["NEMO_DISCO_WHEELS"] = str(tmp_path_factory.getbasetemp() / "none")
    done = {}
    for call in gpu_check.CALLS:
        out = tmp_path_factory.mktemp(f"call{call}")
        cmd = ["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--smoke", "--call", str(call), "--out", str(out)]
        done[call] = (subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900), out)
    return done


@pytest.fixture(scope="module")
def run(calls):
    """Both calls' results together: the return code of each, and every stage's JSON by name."""
    stages: dict = {}
    for _, out in calls.values():
        stages |= read_call(out)
    stages["summary"] = {
        "status": {k: v for _, out in calls.values() for k, v in read_call(out)["summary"]["status"].items()}
    }
    for _, out in calls.values():
        summary = read_call(out)["summary"]
        for key in ("timed_out", "warnings"):
            stages["summary"].setdefault(key, []).extend(summary[key])
        if "completion_tokens_per_s_vs_trl" in summary:
            stages["summary"]["completion_tokens_per_s_vs_trl"] = summary["completion_tokens_per_s_vs_trl"]
    failed = [(r.returncode, r.stdout[-3000:] + r.stderr[-3000:]) for r, _ in calls.values() if r.returncode]
    return (failed, stages)


def test_every_stage_runs(run):
    failed, stages = run
    assert failed == []
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
        assert stages[name]["timed_out"] is False and stages[name]["timeout_s"] <= gpu_check.STAGE_TIMEOUT_S[name]
        assert "pass_rule" in stages[name], name


def test_each_call_returns_what_the_device_tool_brings_back(calls):
    """Two files per call (summary.json and the archive), within the tool's limits, and within the call budget."""
    for call, (res, out) in calls.items():
        assert sorted(p.name for p in out.iterdir()) == [gpu_check.ARCHIVE, "summary.json"], call
        assert gpu_check.check_returnable(out) == [], call
        summary = read_call(out)["summary"]
        assert set(summary["status"]) == set(gpu_check.CALLS[call])
        assert summary["wall_s"] < gpu_check.CALL_BUDGET_S
        assert summary["environment"]["call"] == call and summary["environment"]["budget_s"] == gpu_check.CALL_BUDGET_S
        # The stages ran under the interpreter asked for (the rehearsal's: the GPU machine's package set).
        python = os.environ.get("GPU_CHECK_PYTHON") or sys.executable
        assert Path(summary["environment"]["executable"]).absolute() == Path(python).absolute()
        assert "GPU_CHECK_SUMMARY" in res.stdout


def test_the_calls_cover_every_stage_once_within_the_device_time():
    covered = [s for stages in gpu_check.CALLS.values() for s in stages]
    assert sorted(covered) == sorted(gpu_check.STAGES)
    for stages in gpu_check.CALLS.values():  # each call's estimate fits its budget
        assert sum(gpu_check.STAGE_ESTIMATE_S[s] for s in stages) + gpu_check.PACK_RESERVE_S < gpu_check.CALL_BUDGET_S
    start_s, device_s, call_limit_s = 120, 900, 600  # a machine's start, a session's device time, one call
    assert gpu_check.CALL_BUDGET_S + 20 < call_limit_s  # 20 s: installing the carried wheels
    # The start, both calls and the rerun of one, with the wheels installed in each.
    assert start_s + 3 * (gpu_check.CALL_BUDGET_S + 20) <= device_s


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
    # The memory plan's bytes beside the measured ones (those are None on the CPU): positive, weights freed last.
    plan = s["offload_checkpoint"]["plan"]
    assert plan["policy_bytes"] == plan["freed_by_optimizer_offload"] + plan["freed_by_weights_offload"] > 0
    assert s["offload_checkpoint"]["reference_policy"]["planned_bytes"] == plan["freed_by_weights_offload"]
    assert s["trainer"]["planned_policy_peak_gib"] > 0
    assert s["trainer"]["finite"] and s["trainer"]["completion_tokens_per_step"] == 4 * 4 * 8
    # One update per step is a one-pass update: no log-prob pass ran, so it has no MFU.
    assert s["trainer"]["logprob_pass_mfu"] is None and s["trainer"]["logprob_pass"].startswith("skipped")
    assert s["trainer"]["train_pass_mfu"] > 0 and s["trainer"]["measured"]["matmul_tflops"] > 0
    assert s["trainer"]["peaks"] == {"bf16_tflops": 989.0, "hbm_tbps": 3.35, "from": "H100 SXM (no figures for cpu)"}


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


def test_peaks_by_device_name():
    assert gpu_check.device_peaks("NVIDIA H200") == {"bf16_tflops": 989.0, "hbm_tbps": 4.8}
    assert gpu_check.device_peaks("NVIDIA H100 80GB HBM3") == {"bf16_tflops": 989.0, "hbm_tbps": 3.35}
    assert gpu_check.device_peaks("NVIDIA H100 PCIe") == {"bf16_tflops": 756.0, "hbm_tbps": 2.0}
    assert gpu_check.device_peaks("cpu") is None


def test_the_trl_stage_names_a_missing_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError, as on the bare machine
    why = gpu_check.trl_missing()
    assert why is not None and why.startswith("datasets does not import")
    res = gpu_check.stage_trl(None)
    assert res["status"] == "skipped" and res["why"] == why


def test_return_rules(tmp_path):
    for i in range(9):
        (tmp_path / f"f{i}.json").write_text("{}")
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c" / "deep.txt").write_text("x")
    (tmp_path / "bad name.txt").write_text("x")
    problems = gpu_check.check_returnable(tmp_path)
    assert problems[0] == "11 files, at most 8 come back"
    assert any("deep.txt: more than 2 folders down" in p for p in problems)
    assert any("bad name.txt: a name other than" in p for p in problems)
