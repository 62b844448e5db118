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
    assert stages["environment"]["device"]["name"] == "cpu"


def test_cpu_reproducible_figures(run):
    _, s = run
    assert all(c["ok"] for c in s["collectives"]["checks"].values())
    for model in ("qwen2_tied", "llama_untied"):
        assert s["logprob_parity"][model]["float32"]["logprob_diff"]["max"] < 1e-5
    assert s["grad_step"]["grad_max_abs_diff"] < 1e-4 and s["grad_step"]["weights_max_abs_diff_after_step"] < 1e-6
    assert s["grad_step"]["nan_skipped"] == 1.0 and s["grad_step"]["nan_weights_unchanged"]
    for key in ("distributed_optimizer_true", "distributed_optimizer_false"):
        r = s["offload_checkpoint"][key]
        assert r["logprobs_bitwise_equal_after_onload"] and r["checkpoint_logprobs_equal"]
    assert s["trainer"]["finite"] and s["trainer"]["completion_tokens_per_step"] == 4 * 4 * 8


def test_r1_distill_qwen_1_5b_matmul_params():
    # Per layer: q, o 2 * 1536^2 + k, v 2 * 1536 * 256 + MLP 3 * 1536 * 8960 = 46,792,704; x 28 = 1,310,195,712;
    # lm_head 1536 * 151,936 = 233,373,696; total 1,543,569,408.
    assert gpu_check._matmul_params(gpu_check.TRAINER_SHAPE) == 1_543_569_408
