"""One generator factory and one stop-token rule for training and evaluation; the vLLM engine arguments each
recipe kind produces (colocated training, asynchronous generator, evaluation), read from a stand-in ``vllm``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from nemo_disco import config
from nemo_disco.generation.factory import build_generator, build_run_generator, stop_token_ids
from nemo_disco.generation.hf import HFGenerator

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
RECIPE = RECIPES / "tiny-cpu.yaml"


def test_evaluation_gets_the_backends_defaults_and_training_its_recipes_settings(tiny_qwen2, tmp_path):
    plain = build_generator(tiny_qwen2, "hf", seed=3, max_model_len=64, tensor_parallel_size=1)
    assert isinstance(plain, HFGenerator) and plain.batch_size == 64  # HFGenerator's defaults
    assert next(plain.model.parameters()).dtype == torch.float32
    cfg = config.load(RECIPE, [f"logging.run_dir={tmp_path}", "generation.hf_batch_size=7", "policy.dtype=bfloat16"])
    run = build_run_generator(cfg, tiny_qwen2)
    assert isinstance(run, HFGenerator) and run.batch_size == 7
    assert next(run.model.parameters()).dtype == torch.bfloat16


def test_an_unknown_backend_is_one_line():
    with pytest.raises(ValueError, match="^unknown generator backend 'sglang'; registered: vllm, hf$"):
        build_generator("any", "sglang", seed=0, max_model_len=1, tensor_parallel_size=1)


class _Tokenizer(SimpleNamespace):
    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.vocab[token]


def test_the_stop_set_is_eos_and_im_end_where_it_exists(tmp_path):
    from nemo_disco.tiny import build_tokenizer

    tok = build_tokenizer(tmp_path)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(tok) == tuple(sorted({tok.eos_token_id, im_end}))
    assert stop_token_ids(_Tokenizer(eos_token_id=5, vocab={"a": 1})) == (5,)  # no ChatML: EOS alone
    assert stop_token_ids(_Tokenizer(eos_token_id=None, vocab={"<|im_end|>": 9})) == (9,)  # no EOS: not listed
    assert stop_token_ids(_Tokenizer(eos_token_id=9, vocab={"<|im_end|>": 9})) == (9,)  # once when they agree


# ----------------------------------------------------------------------------------------------------------------------
# The vLLM engine arguments of each kind of run (vLLM is not installed here: a stand-in records what LLM() receives)


class _Completion(SimpleNamespace):
    pass


@pytest.fixture
def engine_kwargs(monkeypatch) -> list[dict]:
    """Every ``vllm.LLM(**kwargs)`` call, from a stand-in ``vllm`` module whose engine answers with token 0."""
    calls: list[dict] = []

    class LLM:
        def __init__(self, **kwargs) -> None:
            calls.append(kwargs)
            self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))

        def generate(self, prompts, params, use_tqdm=False):  # noqa: ANN001, ANN201, ARG002
            step = {0: SimpleNamespace(logprob=-0.5)}
            out = _Completion(index=0, finish_reason="length", token_ids=[0], logprobs=[step])
            return [
                SimpleNamespace(
                    request_id=str(i), outputs=[_Completion(**{**vars(out), "index": j}) for j in range(p.n)]
                )
                for i, p in enumerate(params)
            ]

    vllm = ModuleType("vllm")
    vllm.LLM = LLM
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    platforms = ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(
        is_sleep_mode_available=lambda: True, is_cpu=lambda: False, device_type="cuda"
    )
    vllm.platforms = platforms
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    return calls


def _engine(kwargs: dict) -> dict:
    keys = ("gpu_memory_utilization", "enforce_eager", "enable_sleep_mode", "load_format")
    return {k: kwargs[k] for k in keys}


def _run_engine(recipe: str, tiny_qwen2, tmp_path, *overrides: str):
    cfg = config.load(RECIPES / recipe, [f"logging.run_dir={tmp_path}", *overrides])
    return cfg, build_run_generator(cfg, tiny_qwen2)


def test_a_colocated_training_engine_runs_cuda_graphs_and_sleeps_at_level_2(engine_kwargs, tiny_qwen2, tmp_path):
    cfg, gen = _run_engine("disco-logl-r1qwen1.5b-1n8g-8k.yaml", tiny_qwen2, tmp_path)
    assert not cfg.algorithm.async_rollouts
    assert _engine(engine_kwargs[-1]) == {
        "gpu_memory_utilization": 0.6,  # beside the trainer (COLOCATED_GPU_MEMORY_UTILIZATION)
        "enforce_eager": False,  # CUDA graphs
        "enable_sleep_mode": True,
        "load_format": "dummy",  # the policy's weights arrive with the first refit
    }
    assert gen.sleep_level == 2  # the refit after every wake rewrites every weight: nothing to copy to the host
    assert engine_kwargs[-1]["max_num_batched_tokens"] == 10240
    # Level 1 and eager mode stay available.
    _, gen = _run_engine(
        "disco-logl-r1qwen1.5b-1n8g-8k.yaml", tiny_qwen2, tmp_path, "generation.sleep_level=1",
        "generation.enforce_eager=true", "generation.gpu_memory_utilization=0.5",
    )  # fmt: skip
    assert gen.sleep_level == 1
    assert _engine(engine_kwargs[-1])["enforce_eager"] is True
    assert engine_kwargs[-1]["gpu_memory_utilization"] == 0.5


@pytest.mark.parametrize("recipe", ["disco-logl-r1qwen7b-2n8g-8k.yaml", "disco-logl-qwen3-30ba3b-4n8g-16k.yaml"])
def test_every_colocated_paper_or_family_recipe_gets_graphs_and_level_2(engine_kwargs, tiny_qwen2, tmp_path, recipe):
    cfg, gen = _run_engine(recipe, tiny_qwen2, tmp_path, "generation.tensor_parallel_size=1")
    assert engine_kwargs[-1]["enforce_eager"] is False and engine_kwargs[-1]["enable_sleep_mode"] is True
    assert gen.sleep_level == 2
    share = cfg.generation.gpu_memory_utilization  # the MoE recipe states NeMo-RL's 0.7
    assert engine_kwargs[-1]["gpu_memory_utilization"] == (0.6 if share == "auto" else share)


def test_an_asynchronous_generator_owns_its_gpu(engine_kwargs, tiny_qwen2, tmp_path):
    cfg, gen = _run_engine(
        "disco-logl-r1qwen7b-async-2n8g-8k.yaml", tiny_qwen2, tmp_path, "generation.tensor_parallel_size=1"
    )
    assert cfg.algorithm.async_rollouts
    assert _engine(engine_kwargs[-1]) == {
        "gpu_memory_utilization": 0.9,  # OWN_GPU_MEMORY_UTILIZATION: nothing else on its GPU
        "enforce_eager": False,
        "enable_sleep_mode": False,  # it never sleeps: no sleep-mode allocator either
        "load_format": "dummy",
    }
    assert gen.sleep_level == 0


def test_an_evaluation_engine_owns_its_gpu_and_eager_mode_is_one_flag(engine_kwargs, tiny_qwen2, tmp_path):
    from nemo_disco import cli

    bench = tmp_path / "arith.json"
    bench.write_text(json.dumps([{"problem": "1+1", "answer": 2}]))
    common = ["eval", "--model", str(tiny_qwen2), "--benchmarks", str(bench), "--samples", "2", "--max-tokens", "4"]
    common += ["--workers", "1", "--no-chat-template", "--bootstrap", "0"]
    assert cli.main([*common, "--out", str(tmp_path / "graphs")]) == 0
    assert _engine(engine_kwargs[-1]) == {
        "gpu_memory_utilization": 0.9,
        "enforce_eager": False,
        "enable_sleep_mode": False,
        "load_format": "auto",  # the folder's weights
    }
    argv = [*common, "--out", str(tmp_path / "eager"), "--enforce-eager", "--gpu-memory-utilization", "0.8"]
    assert cli.main(argv) == 0
    assert _engine(engine_kwargs[-1])["enforce_eager"] is True
    assert engine_kwargs[-1]["gpu_memory_utilization"] == 0.8
