"""GPU-only generator behaviour: device memory given back by sleep and taken again by wake_up; TP 2 under torchrun.

Each vLLM scenario runs in a process of its own (this file is the worker script), so that engines never
share a process and the free-memory readings are the engine's alone.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[2, 35, 33, 19, 32, 101], [20, 21, 22], [40, 41, 42, 43, 44]]
EOS = 1

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# "vllm.sampling_params", not "vllm": with tests/ on sys.path a bare "vllm" finds the tests/vllm folder.
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm.sampling_params") is None, reason="needs vLLM (the CUDA build)"
)


def _tiny_model(out: Path) -> Path:
    from nemo_disco.config import TinyModelConfig
    from nemo_disco.tiny import build_model

    tiny = TinyModelConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
    return build_model(tiny, out, seed=0)


def test_hf_generator_sleep_moves_the_weights_off_the_gpu(tmp_path):
    from nemo_disco.generation.base import SamplingParams
    from nemo_disco.generation.hf import HFGenerator

    gen = HFGenerator(_tiny_model(tmp_path / "model"), device="cuda")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(EOS,))
    before = gen.generate(PROMPTS, 1, greedy)
    weights = sum(p.numel() * p.element_size() for p in gen.model.parameters())
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    gen.sleep()
    assert held - torch.cuda.memory_allocated() >= weights
    gen.wake_up(["weights"])
    assert torch.cuda.memory_allocated() >= held
    assert gen.generate(PROMPTS, 1, greedy) == before


@needs_vllm
@pytest.mark.parametrize("level", [1, 2])
def test_vllm_sleep_gives_the_memory_back_and_wake_up_takes_it_again(tmp_path, level):
    model_dir = _tiny_model(tmp_path / "model")
    out = tmp_path / "sleep.json"
    cmd = [sys.executable, __file__, "--sleep-worker", str(level), str(model_dir), str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    gib = 2**30
    taken = r["free_before_engine"] - r["free_awake"]  # weights (~1 MiB) + KV cache (~0.3 of the GPU)
    assert taken > 1 * gib
    # Asleep, nearly all of it is back (level 1 keeps the weights in CPU memory, level 2 drops them);
    # waking the weights alone takes back little, the KV cache the rest.
    assert r["free_asleep"] - r["free_awake"] > 0.9 * taken
    assert r["free_asleep"] - r["free_weights_awake"] < 0.05 * taken
    assert abs(r["free_awake_again"] - r["free_awake"]) < 0.05 * taken
    assert r["greedy_after"] == r["greedy_before"]
    if level == 2:
        assert "discarded the weights" in r["refused"]
    print(f"level {level}: engine start {r['start_s']:.1f}s, sleep {r['sleep_s']:.2f}s, wake {r['wake_s']:.2f}s")


@needs_vllm
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_vllm_tensor_parallel_2_under_torchrun(tmp_path):
    """The TP=2 worker of tests/vllm (external_launcher, NCCL): both ranks agree and match transformers."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = ROOT / "tests" / "vllm" / "test_generation_vllm.py"
    model_dir = _tiny_model(tmp_path / "model")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}", str(worker)]
    cmd += ["--tp-worker", str(model_dir), str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["greedy"] == ranks[1]["greedy"] and ranks[0]["sampled"] == ranks[1]["sampled"]
    for r in ranks:
        # GPU kernels differ from transformers' (and may run matmuls in TF32): compare log-probs with a tolerance,
        # not token sequences, which a near-tie can fork. Each greedy token is transformers' argmax within 1e-3.
        assert r["greedy_gap"] < 1e-3
        assert r["max_logprob_diff"] < 1e-3  # fp32 on both sides
        assert "different prompts" in r["mismatch_error"]


def _sleep_worker(level: int, model_dir: str, out: str) -> None:
    from transformers import AutoModelForCausalLM

    from nemo_disco.generation.base import SamplingParams
    from nemo_disco.generation.vllm import VLLMGenerator

    def free() -> int:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    greedy = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(EOS,))
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda")
    r: dict = {"free_before_engine": free()}
    start = time.perf_counter()
    gen = VLLMGenerator(
        model_dir,
        dtype="float32",
        load_format="dummy",
        sleep_level=level,
        gpu_memory_utilization=0.3,
        max_model_len=256,
    )
    r["start_s"] = time.perf_counter() - start
    gen.update_weights(policy.named_parameters())
    r["greedy_before"] = [rs[0].token_ids for rs in gen.generate(PROMPTS, 1, greedy)]
    r["free_awake"] = free()
    start = time.perf_counter()
    gen.sleep()
    r["sleep_s"] = time.perf_counter() - start
    r["free_asleep"] = free()
    start = time.perf_counter()
    gen.wake_up(["weights"])
    r["free_weights_awake"] = free()
    if level == 2:  # the weights came back as uninitialised memory: generation is refused until a refit
        gen.wake_up(["kv_cache"])
        try:
            gen.generate(PROMPTS, 1, greedy)
            r["refused"] = ""
        except RuntimeError as err:
            r["refused"] = str(err)
        gen.update_weights(policy.named_parameters())
    else:
        gen.wake_up(["kv_cache"])
    r["wake_s"] = time.perf_counter() - start
    r["free_awake_again"] = free()
    r["greedy_after"] = [rs[0].token_ids for rs in gen.generate(PROMPTS, 1, greedy)]
    Path(out).write_text(json.dumps(r))
    gen.shutdown()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sleep-worker"]:
        _sleep_worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])
