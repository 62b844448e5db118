"""benchmarks/gpu_step.py: the GPU benchmark runs end to end at tiny sizes on CPU, and its engine and counts are right.

No timing is asserted (benchmarks are not tests): only that every part ran, the plain-torch engine computes
the same function as transformers' Qwen2, and the FLOP / parameter counts match hand arithmetic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_step.py"
sys.path.insert(0, str(SCRIPT.parent))

import gpu_step  # noqa: E402

PARTS = ("peaks", "refit", "engine_check", "decode", "train", "step")


def _smoke(*args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("GPU_STEP_SUMMARY "))
    return json.loads(line.removeprefix("GPU_STEP_SUMMARY "))


@pytest.mark.parametrize("policy", ["auto", "mini"])
def test_smoke_runs_every_part(policy):
    s = _smoke("--policy", policy)
    assert s["mode"] == "smoke"
    for part in PARTS:
        assert part in s, part
        assert "failed" not in s[part] and "skipped" not in s[part], (part, s[part])
    # The decode engine computes the policy's function: a packed-row forward (block-causal per document) and
    # one KV-cached decode step agree with the policy's full forward (float32 on CPU: rounding only).
    assert s["engine_check"]["packed_forward_max_abs_diff"] < 1e-4
    assert s["engine_check"]["decode_step_max_abs_diff"] < 1e-4
    paths = s["decode"]["paths"]
    assert "engine_eager" in paths and "tokens_per_s" in paths["engine_eager"]
    if policy == "auto":  # transformers imports here, so its static-cache generate is measured too
        assert "Qwen2ForCausalLM" in s["policy"]
        assert "tokens_per_s" in paths["hf_generate_static"]
    else:
        assert s["policy"].startswith("MiniQwen2")
        assert "hf_generate_static" not in paths
    assert set(s["step"]["phases_s"]) == {"generate", "old_logprobs", "train", "refit"}
    # 4 rollouts x 8 response tokens per step.
    assert s["step"]["rollouts"] * s["step"]["response_tokens"] == 32


def test_out_file_equals_printed_summary(tmp_path):
    out = tmp_path / "gpu.json"
    s = _smoke("--out", str(out))
    assert json.loads(out.read_text())["model"] == s["model"]


def test_r1_distill_qwen_1_5b_counts():
    shape = gpu_step.ModelShape()
    # Per layer: q 1536*1536 + k, v 2 * 1536*256 + o 1536*1536 = 5,505,024; MLP 3 * 1536*8960 = 41,287,680;
    # 28 layers * 46,792,704 = 1,310,195,712; lm_head 151936*1536 = 233,373,696; sum 1,543,569,408.
    assert shape.matmul_params() == 1_543_569_408
    with torch.device("meta"):
        model = gpu_step.MiniQwen2(shape)
    # + embedding 233,373,696 + q/k/v biases 28 * (1536 + 256 + 256) = 57,344
    # + norms 28 * 2 * 1536 + 1536 = 87,552 -> 1,777,088,000 (the published model's 1.78 B).
    assert sum(p.numel() for p in model.parameters()) == 1_777_088_000


def test_train_flops_hand_computed():
    shape = gpu_step.SMOKE_SHAPE  # hidden 64, 2 layers, 4 heads x 16, 2 KV heads, intermediate 128, vocab 256
    # matmul params: per layer q 4096 + k, v 2 * 64*32 = 4096 + o 4096 + MLP 3 * 64*128 = 24576 -> 36864;
    # 2 layers 73,728 + lm_head 256*64 = 16,384 -> 90,112.
    assert shape.matmul_params() == 90_112
    # 10 tokens in documents of 6 and 4: 6 * 90,112 * 10 = 5,406,720; attention 6 * 2 layers * 64 * (36 + 16)
    # = 39,936; total 5,446,656.
    assert gpu_step.train_flops(shape, 10, [[6, 4]]) == 5_446_656


def test_block_causal_mask_separates_documents():
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    m = gpu_step.block_causal_mask(pos)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [0, 0, 0, 1, 0],  # the second document sees only itself
            [0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m, expected)
    assert gpu_step.block_causal_mask(torch.arange(5).unsqueeze(0)) is None  # one document: plain causal


def test_sampled_tokens_follow_the_distribution():
    # The exponential-race sampler draws token k with probability softmax(logits)_k: logits log(0.7), log(0.3).
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.7, 0.3]])).expand(20000, 2).contiguous()
    tok, lp = gpu_step.sample(logits)
    assert abs(tok.float().mean().item() - 0.3) < 0.02  # 3-sigma of a 20000-draw Bernoulli(0.3) is 0.01
    assert torch.allclose(lp, torch.log(torch.tensor([0.7, 0.3]))[tok], atol=1e-6)
