"""The Policy protocol every training backend implements.

The trainer owns the algorithm; a policy only knows how to (1) compute per-token log-probs (and
entropy) of a batch without gradient and (2) run one optimizer update whose gradient is the sum over
micro-batches of ``surrogate_fn(...)``. The surrogate carries global normalisation (see
``nemo_disco.losses``), so a policy sums gradients over micro-batches AND over data-parallel ranks;
it never averages. That is what makes the gradient exact for any micro-batch size, packing or
data-parallel size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from nemo_disco.batch import RolloutBatch

if TYPE_CHECKING:
    from nemo_disco.config import RunConfig

# surrogate_fn(rows, logprobs, entropy) -> scalar. ``rows``: [n] int64 indices of the micro-batch's
# rollouts within the batch passed to train_minibatch; logprobs / entropy: [n, R] with grad.
SurrogateFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class RunValues:
    """The few values of the run a policy needs besides its own section (``policy.*``).

    Attributes:
        seed: ``algorithm.seed`` (the Megatron model-parallel RNG seed).
        temperature: ``generation.temperature``: log-probs are those of logits / temperature, as sampled.
        total_updates: optimizer updates of the whole run (``algorithm.steps`` x updates per step), where the
            learning-rate schedule ends.
        refit_bucket_mb: ``generation.refit_bucket_mb``, the size of the buckets the Megatron policy exports
            its weights in.
    """

    seed: int
    temperature: float
    total_updates: int
    refit_bucket_mb: int

    @classmethod
    def of(cls, cfg: RunConfig) -> RunValues:
        """The values of a run config."""
        return cls(
            seed=cfg.algorithm.seed,
            temperature=cfg.generation.temperature,
            total_updates=cfg.algorithm.steps * cfg.updates_per_step,
            refit_bucket_mb=cfg.generation.refit_bucket_mb,
        )


@runtime_checkable
class Policy(Protocol):
    """pi_theta: log-probs, exact micro-batched updates, weight export, checkpoints, offload."""

    #: data-parallel rank / size / process group (None when not distributed) of this process.
    dp_rank: int
    dp_size: int
    dp_group: object | None

    def logprobs(self, batch: RolloutBatch, *, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs (and entropy) of ``batch.response_ids`` at the sampling temperature.

        No gradient. Every rank of the model-parallel group returns the same [N, R] tensors (float32).
        """
        ...

    def microbatch_rows(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """Row indices [n] of the micro-batches :meth:`train_minibatch` runs ``batch`` in, in order.

        A question's rollouts (adjacent rows of equal ``group_ids``) share a micro-batch wherever they fit its
        token budget: a loss that couples only a question's rollouts then needs one pass (``nemo_disco.update``).
        """
        ...

    def train_minibatch(
        self,
        batch: RolloutBatch,
        surrogate_fn: SurrogateFn,
        *,
        entropy: bool = False,
    ) -> dict[str, float]:
        """One optimizer update: sum of surrogate backward over micro-batches and DP ranks, clip, step.

        A non-finite surrogate or gradient skips the step (gradients zeroed) and reports ``skipped=1``.
        The learning rate follows ``nemo_disco.policy.schedule.lr_at`` (update 0 has a non-zero lr).

        Returns:
            ``grad_norm`` (before clipping), ``lr``, ``skipped`` (0/1), ``surrogate`` (summed value).
        """
        ...

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (TP-gathered, PP-broadcast) tensors under Hugging Face names, one at a time."""
        ...

    def save(self, directory: Path) -> None:
        """Weights, optimizer and scheduler state into ``directory`` (collective on all ranks)."""
        ...

    def load(self, directory: Path) -> None:
        """Inverse of :meth:`save` (collective)."""
        ...

    def offload(self, *, weights: bool = True) -> None:
        """Move gradients and optimizer state, and (``weights``) the weights, to CPU (colocated generation).

        The colocated order frees gradients and optimizer state before the refit and the weights after it.
        """
        ...

    def onload(self) -> None:
        """Inverse of :meth:`offload`."""
        ...
