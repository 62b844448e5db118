"""The rollout side: questions -> generation -> grading -> dynamic sampling -> overlong shaping.

The trainer (:mod:`nemo_disco.algorithm`) sees one small interface, :class:`RolloutSource`, whatever the mode:

- ``next(step)``: the graded rollouts of training step ``step`` and their metrics;
- ``publish(step, ...)``: the policy has finished step ``step``; its weights are the generator's next ones;
- ``validate(step, ...)``: per-problem pass@1 of the weights after ``step`` steps, and the rewards that failed;
- ``state_dict(step)``: what a checkpoint needs to resume bit for bit; ``close``.

Two sources share the same :class:`Rollouter` (the code that samples, grades and tops up questions):

- :class:`LocalRollouts` (``algorithm.async_rollouts=false``): the generator lives in the trainer's processes
  (colocated with vLLM on GPU) and refits lazily before it generates: every step is generate, grade, train.
- :class:`RemoteRollouts` (``algorithm.async_rollouts=true``): the generator runs :func:`serve` in processes of
  its own, one or more steps ahead (:mod:`nemo_disco.rollouts.remote`).

Modules: :mod:`~nemo_disco.rollouts.rollouter` (sampling and grading, both modes), :mod:`~nemo_disco.rollouts.local`
(the colocated source), :mod:`~nemo_disco.rollouts.remote` (the remote source, the weight stream and the
generator's loop).
"""

from __future__ import annotations

from typing import Any, Protocol

from nemo_disco.batch import QuestionRollouts
from nemo_disco.data import PromptSampler
from nemo_disco.rollouts.local import LocalRollouts, generation_phase, is_colocated, start_generator
from nemo_disco.rollouts.remote import RemoteRollouts, receive_weights, send_weights, serve
from nemo_disco.rollouts.rollouter import (
    RewardError,
    Rollouter,
    build_grader,
    build_rollouter,
    check_reward_errors,
    reward_errors_line,
    sampling_params,
    staleness_metrics,
    step_rollouts,
    step_seed,
)

__all__ = [
    "LocalRollouts",
    "RemoteRollouts",
    "RewardError",
    "RolloutSource",
    "Rollouter",
    "build_grader",
    "build_rollouter",
    "check_reward_errors",
    "generation_phase",
    "is_colocated",
    "receive_weights",
    "reward_errors_line",
    "sampling_params",
    "send_weights",
    "serve",
    "staleness_metrics",
    "start_generator",
    "step_rollouts",
    "step_seed",
]


class RolloutSource(Protocol):
    """What the trainer asks of the rollout side (see the module docstring)."""

    sampler: PromptSampler

    def next(self, step: int) -> tuple[list[QuestionRollouts], dict[str, float]]:
        """Step ``step``'s records (identical on every trainer rank) and their metrics."""
        ...

    def weights_changed(self) -> None:
        """An optimizer update moved the policy's weights."""
        ...

    def publish(self, step: int, *, validate_seed: int | None, more: bool) -> float:
        """The policy has finished ``step``; returns the seconds spent sending its weights (0: nothing sent)."""
        ...

    def validate(self, step: int, seed: int) -> tuple[list[float], dict[str, float]]:
        """Per-problem pass@1 of the weights after ``step`` steps and the failed rewards' counts (every rank's)."""
        ...

    def state_dict(self, step: int) -> dict[str, Any]:
        """What the checkpoint after ``step`` needs (JSON-serialisable)."""
        ...

    def close(self, code: int | None) -> None:
        """End of the run (``code``: the exit code the generator should end with; None after an error)."""
        ...
