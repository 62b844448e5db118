"""Building a generator and its stop tokens: one factory and one rule, for training and evaluation alike."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from nemo_disco.config import GenerationConfig, RunConfig
from nemo_disco.generation.base import Generator

BACKENDS = ("hf", "vllm")


def build_generator(
    model_dir: str | os.PathLike,
    backend: str,
    *,
    seed: int,
    max_model_len: int,
    tensor_parallel_size: int,
    dtype: str | None = None,
    settings: GenerationConfig | None = None,
    engine: Mapping[str, Any] | None = None,
) -> Generator:
    """The generator of ``backend`` on the Hugging Face folder ``model_dir``.

    Args:
        model_dir: the model folder (its tokenizer and config; its weights too unless ``engine`` loads dummy ones).
        backend: "hf" (transformers) or "vllm".
        seed: the vLLM engine's seed (transformers samples with each call's seed only).
        max_model_len: the vLLM engine's prompt + response limit.
        tensor_parallel_size: ranks per vLLM engine (a transformers engine is one process).
        dtype: the weights' dtype; None: the backend's default.
        settings: a training run's ``generation`` section (the transformers engine's batch and decoding);
            None: the backend's defaults.
        engine: more ``VLLMGenerator`` keyword arguments (vLLM only): :func:`run_engine_options` for a training
            run's engine; None: ``VLLMGenerator``'s defaults, an engine with its GPU to itself (evaluation).

    Raises:
        ValueError: an unknown ``backend``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected 'hf' or 'vllm'")
    options: dict[str, Any] = {} if dtype is None else {"dtype": dtype}
    if backend == "hf":
        from nemo_disco.generation.hf import HFGenerator

        if settings is not None:
            options.update(batch_size=settings.hf_batch_size, decode=settings.hf_decode)
        return HFGenerator(model_dir, **options)
    from nemo_disco.generation.vllm import VLLMGenerator

    options.update(engine or {})
    return VLLMGenerator(
        model_dir, tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len, seed=seed, **options
    )


def run_engine_options(cfg: RunConfig) -> dict[str, Any]:
    """A training run's ``VLLMGenerator`` settings.

    Its ``generation`` section, the ``auto`` values resolved by the generator's place
    (``RunConfig.engine_gpu_memory_utilization`` / ``engine_sleep_level``), and dummy weights (the policy's arrive
    with the first refit).
    """
    g = cfg.generation
    return {
        "gpu_memory_utilization": cfg.engine_gpu_memory_utilization,
        "enforce_eager": g.enforce_eager,
        "max_num_batched_tokens": g.max_num_batched_tokens,
        "sleep_level": cfg.engine_sleep_level,
        "load_format": "dummy",
        "refit_bucket_mb": g.refit_bucket_mb,
    }


def build_run_generator(cfg: RunConfig, model_dir: str | os.PathLike) -> Generator:
    """A training run's generator: ``generation.backend`` with the run's engine settings, seed and dtype."""
    g = cfg.generation
    return build_generator(
        model_dir,
        g.backend,
        seed=cfg.algorithm.seed,
        max_model_len=g.max_prompt_tokens + g.max_response_tokens,
        tensor_parallel_size=g.tensor_parallel_size,
        dtype=cfg.policy.dtype,
        settings=g,
        engine=run_engine_options(cfg),
    )


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The stop set: the tokenizer's EOS and, for ChatML templates, ``<|im_end|>``."""
    stops = {tokenizer.eos_token_id}
    if "<|im_end|>" in tokenizer.get_vocab():
        stops.add(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return tuple(sorted(s for s in stops if s is not None))
