"""The Generator protocol: sample rollouts, take new weights, release memory between steps."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature=0`` is greedy; ``top_k=-1`` disables top-k; ``seed`` makes sampling reproducible.

    ``stop_token_ids`` is the complete set of stop tokens: the model's own EOS stops a rollout only when listed.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # Generate exactly max_tokens (benchmarks only).
    ignore_eos: bool = False


@dataclass
class Rollout:
    """One sampled response.

    Attributes:
        token_ids: generated tokens (the stop token included when it was sampled).
        logprobs: the generator's log-prob of each generated token under the SAMPLING distribution
            (temperature applied, then renormalised over the tokens top-k / top-p kept), same length as
            token_ids.
        finish_reason: "stop" (a stop token) or "length" (max_tokens reached).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    text: str = field(default="", repr=False)


@runtime_checkable
class Generator(Protocol):
    """Samples rollouts from the current policy weights."""

    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> list[list[Rollout]]:
        """``n`` rollouts for each prompt: result[i][j] is rollout j of prompt i."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights (Hugging Face names) in place; an unknown name raises naming the tensor."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory (weights and/or KV cache, by the configured level)."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-acquire memory (``tags``: "weights", "kv_cache"; None = all)."""
        ...

    def shutdown(self) -> None:
        """Free everything."""
        ...


@dataclass(frozen=True)
class EngineLayout:
    """How the job's processes form generation engines: consecutive ranks, ``generation.tensor_parallel_size`` each.

    Generation work is split by engine, not by the policy's data-parallel rank: with policy TP 2 and
    generation TP 1 every process is an engine of its own, and two TP peers of the policy must not generate
    the same prompts twice (nor build different batches from a non-batch-invariant engine).

    Attributes:
        index: this process's engine.
        count: engines in the job.
        leader: this process is its engine's first rank (it contributes the engine's rollouts).
    """

    index: int
    count: int
    leader: bool

    @classmethod
    def of(cls, rank: int, world_size: int, tensor_parallel_size: int) -> EngineLayout:
        """The layout of process ``rank`` when engines have ``tensor_parallel_size`` consecutive ranks.

        Raises:
            ValueError: ``tensor_parallel_size`` does not divide ``world_size``.
        """
        if tensor_parallel_size < 1 or world_size % tensor_parallel_size:
            raise ValueError(f"generation TP {tensor_parallel_size} does not divide the world size {world_size}")
        return cls(rank // tensor_parallel_size, world_size // tensor_parallel_size, rank % tensor_parallel_size == 0)

    def share(self, n: int) -> slice:
        """This engine's contiguous share of ``n`` items (shares differ by at most one item)."""
        return slice(self.index * n // self.count, (self.index + 1) * n // self.count)


def buckets(
    weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, align: int = 1
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of tensors into lists of at most ``bucket_bytes`` (a larger tensor is a bucket alone).

    Each tensor counts its bytes rounded up to a multiple of ``align`` (where the bucket places it). The stream
    is read one tensor past a full bucket before the bucket is yielded, never further.
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in weights:
        nbytes = (t.numel() * t.element_size() + align - 1) // align * align
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket
