"""Synchronous rollouts: the generator lives in the trainer's processes (colocated with vLLM on GPU)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from nemo_disco import generators
from nemo_disco.batch import QuestionRollouts
from nemo_disco.config import RunConfig
from nemo_disco.generation import factory
from nemo_disco.generation.base import Generator
from nemo_disco.metrics import Timer
from nemo_disco.policy.base import Policy
from nemo_disco.rollouts import rollouter
from nemo_disco.rollouts.rollouter import Rollouter, staleness_metrics


def start_generator(cfg: RunConfig, model_dir: Path) -> Generator:
    """The synchronous run's generator, built before the policy fills the GPU, and asleep when colocated.

    vLLM sizes its KV cache from free device memory and refuses to start when less than its share
    (``generation.gpu_memory_utilization``) is free (``v1/worker/utils.py``): built after the policy, its reference
    and their optimizer state, an 8B model on an 80 GB GPU is within a few GB of that limit. Built first and put
    to sleep at once (NeMo-RL's order), it leaves the GPU to the policy until the first generation phase wakes it.
    """
    generator = factory.build_run_generator(cfg, model_dir)
    if is_colocated(cfg):
        generator.sleep()
    return generator


def is_colocated(cfg: RunConfig) -> bool:
    """Whether the generator shares the trainer's GPU (a backend that colocates, vLLM, on a GPU) and they take turns."""
    return generators.get_backend(cfg.generation.backend).colocates and torch.cuda.is_available()


@contextlib.contextmanager
def generation_phase(src: LocalRollouts, timer: Timer, colocated: bool | None = None) -> Iterator[None]:
    """Hand the GPU to the generator and back (the colocated order), refitting stale weights on the way.

    Order: offload the policy's gradients and optimizer state (and the reference policy), wake the engine's
    weights, stream the policy's weights in (refit), offload the policy's weights, wake the KV cache, generate,
    put the engine to sleep, load the policy back. ``colocated`` None: vLLM on a GPU.
    """
    colocated = is_colocated(src.cfg) if colocated is None else colocated
    if colocated:
        src.policy.offload(weights=False)  # the refit reads the weights only: free the rest first
        if src.ref_policy is not None:
            src.ref_policy.offload()
        src.generator.wake_up(["weights"])
    if src.generator_stale:
        with timer("refit"):
            src.generator.update_weights(src.policy.export_weights())
        src.generator_stale = False
    if colocated:
        src.policy.offload()
        src.generator.wake_up(["kv_cache"])
    try:
        yield
    finally:
        if colocated:
            src.generator.sleep()
            if getattr(src.generator, "sleep_level", 1) >= 2:  # level 2 drops the weights: the next wake needs a refit
                src.generator_stale = True
            src.policy.onload()


class LocalRollouts:
    """Synchronous rollouts: the generator lives in the trainer's processes and samples the weights being trained."""

    def __init__(
        self, ro: Rollouter, policy: Policy, ref_policy: Policy | None, val: tuple[list, list[list[int]]] | None
    ) -> None:
        """Wrap ``ro`` (its generator starts stale: vLLM loads dummy weights, a resume moved the policy)."""
        self.ro, self.cfg, self.policy, self.ref_policy, self.val = ro, ro.cfg, policy, ref_policy, val
        self.sampler = ro.sampler
        self.generator_stale = True
        ro.phase = lambda timer: generation_phase(self, timer)

    @property
    def generator(self) -> Generator:
        """The generator."""
        return self.ro.generator

    def next(self, step: int) -> tuple[list[QuestionRollouts], dict[str, float]]:
        """Refit if stale, then sample and grade step ``step`` (the generator keeps the GPU throughout)."""
        timer = Timer()
        with generation_phase(self, timer):
            records, metrics = rollouter.step_rollouts(self.ro, step)
        return records, {**metrics, **timer.metrics(), **staleness_metrics(step, step - 1)}

    def weights_changed(self) -> None:
        """The next generation refits first."""
        self.generator_stale = True

    def publish(self, step: int, *, validate_seed: int | None, more: bool) -> float:
        """Nothing to send: the refit happens when the generator is next used."""
        return 0.0

    def validate(self, step: int, seed: int) -> tuple[list[float], dict[str, float]]:
        """Validate the current weights on :attr:`val`."""
        return self.ro.validate(*self.val, self.cfg.data.val_samples, seed)

    def state_dict(self, step: int) -> dict[str, Any]:
        """The sampler's position."""
        return {"sampler": self.sampler.state_dict()}

    def close(self, code: int | None) -> None:
        """Stop the grading workers, free the generator."""
        self.ro.close()
