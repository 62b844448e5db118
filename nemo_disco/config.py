"""Typed run configuration: the one place where every default lives (a loss's hyper-parameters: beside the loss).

A recipe is a YAML file that may start with a Hydra ``defaults:`` list (``[disco, _self_]``) naming
other recipes, looked for in the recipe's own folder, then among the shipped recipes (:data:`SHIPPED_RECIPES`),
so that ``~/exp/my.yaml`` can inherit ``disco``; it is composed with Hydra, ``key=value`` overrides are applied,
and the result is validated ONCE into a frozen :class:`RunConfig`. Call sites read
``cfg.loss.beta``, never ``cfg.get("beta", 1e3)``. An evaluation is configured the same way (:class:`EvalConfig`,
:func:`load_eval`; recipes in ``recipes/eval/``): its sampling, prompt and grading keys are training's fields, their
ranges and, unless the evaluation protocol differs, their defaults.

Validation failures raise :class:`ConfigError` whose message is one line naming the full key path
and the offending value (and the recipe file and line that set it); the CLI prints it and exits with code 2.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from nemo_disco import families
from nemo_disco.stats import DEFAULT_REPLICATES


class ConfigError(ValueError):
    """A recipe or override is invalid. The message is a single line naming the key."""


#: vLLM's share of a GPU it shares with the colocated policy: the engine is awake only while the policy's weights,
#: gradients and optimizer state are offloaded, but the CUDA context, NCCL buffers and the caching allocator's
#: leftovers of the trainer stay (NeMo-RL's colocated grpo_math_1B.yaml: 0.6 as well).
COLOCATED_GPU_MEMORY_UTILIZATION = 0.6
#: vLLM's share of a GPU of its own: an asynchronous run's generator, ``nemo-disco eval`` (vLLM's own default).
OWN_GPU_MEMORY_UTILIZATION = 0.9

#: The repository's recipes folder: the second place a recipe's ``defaults:`` entries are looked for.
SHIPPED_RECIPES = Path(__file__).resolve().parents[1] / "recipes"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class _PartSection(_Section):
    """A section whose key ``PART_KEY`` names a pluggable part: its other keys beyond the fields are that part's own.

    The part's parameter model checks them, and fills in their defaults, in :mod:`nemo_disco.parts`; a recipe or
    override that names another part than the one it inherits starts the section afresh
    (:func:`_restart_named_sections`), keeping only the fields (the keys every part shares).
    """

    model_config = ConfigDict(extra="allow")
    PART_KEY: ClassVar[str] = "name"


class TinyModelConfig(_Section):
    """A randomly initialised model built in code (CPU demo and tests; nothing from a hub)."""

    # A registered model family's model_type (nemo_disco.families.FAMILIES; a wrong one is told the names).
    architecture: str = "qwen2"
    num_layers: int = Field(2, ge=1)
    hidden_size: int = Field(64, ge=8)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    # Per-head width; null = hidden_size / num_attention_heads (Qwen3 sets it independently).
    head_dim: int | None = Field(None, ge=1)
    intermediate_size: int = Field(128, ge=8)
    max_position_embeddings: int = Field(512, ge=16)
    tie_word_embeddings: bool = True
    # qwen3_moe only: routed experts per layer, experts per token, each expert's MLP width.
    num_experts: int = Field(4, ge=1)
    num_experts_per_tok: int = Field(2, ge=1)
    moe_intermediate_size: int = Field(64, ge=8)

    @field_validator("architecture", mode="before")
    @classmethod
    def _registered_family(cls, value: Any) -> Any:
        if not isinstance(value, str) or value not in families.FAMILIES:
            names = [repr(n) for n in families.FAMILIES]
            choices = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
            raise PydanticCustomError("family", "Input should be {choices}", {"choices": choices})
        return value

    @model_validator(mode="after")
    def _heads(self) -> TinyModelConfig:
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={self.num_attention_heads}"
                " (or set head_dim)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must not exceed num_experts={self.num_experts}"
            )
        return self


class PolicyConfig(_Section):
    """The trained policy (pi_theta) and its optimiser."""

    backend: Literal["hf", "megatron"] = "megatron"
    # HF folder (config.json + safetensors + tokenizer) or hub id on a cluster; null = build `tiny`.
    model_path: str | None = None
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    # Mixture-of-experts models: experts split over this many of a pipeline stage's ranks (expert tensor
    # parallelism 1); must divide the number of experts and world / pipeline_parallel_size.
    expert_parallel_size: int = Field(1, ge=1)
    # MoE router weights frozen during RL (NeMo-RL's freeze_moe_router default); false trains them.
    freeze_router: bool = True
    # Weight of the router's load-balancing loss in the objective (0 = off, NeMo-RL's default); the loss is
    # reported either way (train/router_balance_loss).
    router_aux_loss_coef: float = Field(0.0, ge=0)
    # Precision of the router's logits and softmax in the Megatron MoE layer (NeMo-RL: fp64).
    router_dtype: Literal["float32", "float64"] = "float64"
    # Activation recomputation in the backward: false = none (every layer's activations kept), "selective" = the
    # core attention only (Megatron: recompute_modules ["core_attn"]; the transformers policy refuses it), "full" =
    # every layer from its input. true is read as "full" (the key was a boolean before).
    activation_checkpointing: Literal[False, "selective", "full"] = False
    # Tokens per micro-batch in the backward pass (pass 2); any value gives the same gradient.
    microbatch_tokens: int = Field(16384, ge=1)
    # Sequence chunk (tokens) of the vocab-parallel log-prob / entropy computation.
    logprob_chunk_size: int = Field(1024, ge=1)
    lr: float = Field(2e-6, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_updates: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    use_distributed_optimizer: bool = True
    # Megatron DDP reduces each gradient bucket as soon as the last micro-batch's backward fills it, overlapping
    # the data-parallel reduction with the rest of the backward (the same sums: exact).
    overlap_grad_reduce: bool = True
    # With the distributed optimizer: all-gather updated parameter shards bucket by bucket during the next
    # forward instead of right after the step. Off by default: the refit, checkpoints and offload read the
    # parameters outside a forward and must first force the gather (done, but not yet run on a GPU).
    overlap_param_gather: bool = False
    # Sequence parallelism at tensor_parallel_size > 1 (norms, dropout and residuals on 1/TP of the sequence;
    # the sequence is padded to a multiple of TP). Mixture-of-experts models always use it at TP > 1 (mcore
    # requires it to train).
    sequence_parallel: bool = True
    # MoE token permutation through Transformer Engine's fused kernels where they import (TE layer spec on a GPU).
    moe_permute_fusion: bool = True
    # Megatron layer spec: "auto" = Transformer Engine on a GPU in bf16 / fp16 (a TE that does not import is an
    # error there, naming the remedy), the local spec on the CPU and in float32 (TE has no packed fp32
    # attention and runs fp32 GEMMs in TF32); true = require it; false = the local spec (short sequences only:
    # its attention is quadratic in memory).
    transformer_engine: bool | Literal["auto"] = "auto"
    # `train` on a GPU first checks the memory plan (nemo_disco.plan): a layout whose peak exceeds the device's
    # memory stops at once, naming the largest term and a remedy; false skips the check.
    memory_check: bool = True

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _true_is_full(cls, value: Any) -> Any:
        return "full" if value is True else value


class GenerationConfig(_PartSection):
    """The rollout generator: the keys every backend shares, and the chosen backend's own.

    ``backend`` picks a registered backend (:data:`nemo_disco.generators.BACKENDS`: ``vllm``, colocated on GPU, or
    ``hf``, transformers). The section's other keys are that backend's own (vLLM's ``gpu_memory_utilization``,
    ``enforce_eager``, ``max_num_batched_tokens``, ``sleep_level``; transformers' ``hf_batch_size``, ``hf_decode``):
    their types, ranges and defaults are the backend's parameter model, declared once in
    :mod:`nemo_disco.generators`, and :mod:`nemo_disco.parts` checks them against it (a key of another backend
    fails in one line naming the backend that has it). A recipe or override that names another backend than the
    one it inherits starts this section afresh; only the fields below carry over.
    """

    PART_KEY: ClassVar[str] = "backend"

    backend: str = Field("vllm", pattern=r"^[A-Za-z_]\w*$")
    temperature: float = Field(0.6, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    max_prompt_tokens: int = Field(1024, ge=1)
    max_response_tokens: int = Field(8192, ge=1)
    # Ranks per engine (a backend that runs one process per engine takes 1 only).
    tensor_parallel_size: int = Field(1, ge=1)
    # The buckets the trainer streams its weights to the generator in (a refit), in MB.
    refit_bucket_mb: int = Field(512, ge=1)


class DataConfig(_Section):
    """Training prompts and the prompt template."""

    # Path (json / jsonl / parquet), hub dataset name, or "synthetic:arithmetic".
    train: str = "agentica-org/DeepScaleR-Preview-Dataset"
    split: str = "train"
    prompt_template: str = "{problem} Let's think step by step and output the final answer within \\boxed{{}}."
    use_chat_template: bool = True
    # Extra variables for the chat template, e.g. {enable_thinking: true} for Qwen3's thinking mode.
    chat_template_kwargs: dict[str, bool | int | float | str] = {}
    on_bad_row: Literal["error", "skip"] = "error"
    shuffle: bool = True
    seed: int = 42
    # Synthetic task size (only for synthetic:*).
    synthetic_size: int = Field(2000, ge=1)
    # Validation benchmark file (pass@1 over val_samples), evaluated before step 1, every val_every steps and after
    # the last step; val_every 0 = never.
    val: str | None = None
    val_every: int = Field(0, ge=0)
    val_samples: int = Field(1, ge=1)
    val_max_problems: int | None = Field(None, ge=1)


class RewardConfig(_PartSection):
    """Grading of rollouts: the keys every grader shares, and the chosen grader's own.

    ``grader`` picks a registered grader (:data:`nemo_disco.rewards.GRADERS`: ``math_verify``, ``deepscaler``). The
    section's other keys are that grader's own parameters (deepscaler's ``require_think``): their types, ranges and
    defaults are the grader's parameter model, declared once beside it, and :mod:`nemo_disco.parts` checks them
    against it (a key of another grader fails in one line naming the grader that has it). A recipe or override that
    names another grader than the one it inherits starts this section afresh; only the fields below carry over.
    """

    PART_KEY: ClassVar[str] = "grader"

    grader: str = Field("math_verify", pattern=r"^[A-Za-z_]\w*$")
    timeout_s: float = Field(5.0, gt=0)
    workers: int = Field(2, ge=1)
    # Rollouts with reward above this are positives (so {0,1} and {-1,+1} rewards both work).
    positive_threshold: float = 0.5
    # Any verifier as the reward: "package.module:function", called in the grading workers (same timeout) as
    # fn(response, answer, problem=..., **row_fields) -> float instead of the grader; null = the grader.
    function: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    # A step whose failed rewards (errors: exceptions, non-numbers, NaN / inf; timeouts) reach this share of its
    # rewards stops the run in one line (exit code 2). 1.0: only a step where every reward failed; 0: any failure.
    max_error_share: float = Field(1.0, ge=0, le=1)


class LossConfig(_PartSection):
    """The objective and its hyper-parameters: the keys every loss shares, and the chosen loss's own.

    ``name`` picks a registered loss (``nemo_disco.losses.LOSSES``) or one of the user's own
    (``package.module:Class``). The section's other keys are that loss's own parameters: their types, ranges and
    defaults are the loss's parameter model, declared once beside the loss, and :mod:`nemo_disco.parts` checks them
    against it and fills in the defaults (a key of another loss fails in one line naming the losses that have it).
    A recipe or override that names another loss than the one it inherits starts this section afresh
    (:func:`compose`); only the fields below carry over.
    """

    name: str = Field("disco", pattern=r"^([A-Za-z_]\w*|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$")
    # Rollout / training log-prob mismatch correction.
    # auto: seq_tis with algorithm.async_rollouts (stale rollouts), none otherwise (RunConfig.rollout_correction).
    rollout_correction: Literal["auto", "none", "seq_tis"] = "auto"
    rollout_correction_cap: float = Field(2.0, gt=0)


class AlgorithmConfig(_Section):
    """Algorithm 1: batch sizes (named by their unit), steps, seeds and data-side baselines."""

    steps: int = Field(1400, ge=1)
    prompts_per_step: int = Field(128, ge=1)
    rollouts_per_prompt: int = Field(8, ge=1)
    minibatch_prompts: int = Field(32, ge=1)
    seed: int = 1
    # Supervised warm-up on the gold answers before RL (tiny models built in code only; 0 on real runs): at most
    # warmup_sft_steps updates. With warmup_target = [low, high] it stops at the first evaluation (every
    # warmup_eval_every updates, greedy, on warmup_eval_problems problems of data.val beyond data.val_max_problems)
    # whose accuracy reaches low; null = exactly warmup_sft_steps updates.
    warmup_sft_steps: int = Field(0, ge=0)
    warmup_sft_lr: float = Field(3e-3, gt=0)
    warmup_target: tuple[float, float] | None = None
    warmup_eval_every: int = Field(25, ge=1)
    warmup_eval_problems: int = Field(256, ge=1)
    # Reuse a warmed-up model: stored in .warmup-cache beside logging.run_dir (runs/.warmup-cache for runs/<run>)
    # under a hash of everything that decides it (initial model, data, seed, warmup_* keys, versions, CPU).
    warmup_cache: bool = True
    # DAPO data-side tricks.
    dynamic_sampling: bool = False
    max_sampling_rounds: int = Field(3, ge=1)
    # Dynamic sampling stops once this share of the step's questions have a positive and a negative rollout:
    # 1.0 = DAPO (all of them), 0.6 = GPG's beta_th.
    min_valid_share: float = Field(1.0, gt=0, le=1)
    overlong_buffer_tokens: int = Field(0, ge=0)
    overlong_penalty: float = Field(1.0, ge=0)
    # Asynchronous rollouts (docs/async.md): the generator runs in processes of its own (cluster.generation_*) and
    # produces step t's rollouts while step t-1 trains, with the weights of step t-1-max_staleness (the
    # policy after that many fewer steps; 0 = the weights being trained, as in a synchronous run).
    async_rollouts: bool = False
    max_staleness: int = Field(1, ge=0)


class CheckpointConfig(_Section):
    """Atomic checkpoints and resume."""

    save_every: int = Field(20, ge=0)
    # Checkpoints kept; older ones are deleted only once this many newer complete ones exist.
    keep_last: int = Field(3, ge=1)
    resume: bool = True
    # Resume even though a model, loss, data or layout key differs from the checkpoint's config (logged).
    allow_config_change: bool = False


class LoggingConfig(_Section):
    """Where metrics go."""

    run_dir: str = "runs/disco"
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "nemo-disco"
    progress: bool = True


class ClusterConfig(_Section):
    """The process layout the recipe expects; checked against the launcher's world size."""

    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    # Step watchdog (docs/reliability.md): a step, validation or checkpoint save that runs longer than
    # max(step_timeout_s, 2 x the slowest of its kind so far) dumps every rank's Python stacks and ends the run
    # with exit code 4 (slurm/train.sbatch requeues it). 0 = off. A silent rank (dead, frozen, node lost) is
    # detected after min(60, max(5, step_timeout_s / 4)) s without its heartbeat (60 s when off).
    step_timeout_s: float = Field(1800.0, ge=0)
    # The generator's processes with algorithm.async_rollouts (ignored otherwise), ranks after the trainer's:
    # generation_nodes = 0: generation_gpus_per_node more processes on the trainer's one node; >= 1: that many
    # nodes of their own, generation_gpus_per_node (0: gpus_per_node, the only other value allowed) each.
    generation_nodes: int = Field(0, ge=0)
    generation_gpus_per_node: int = Field(0, ge=0)


class RunConfig(_Section):
    """The whole run."""

    policy: PolicyConfig = PolicyConfig()
    generation: GenerationConfig = GenerationConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    loss: LossConfig = LossConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    cluster: ClusterConfig = ClusterConfig()

    @model_validator(mode="after")
    def _cross_field(self) -> RunConfig:
        a, p, g = self.algorithm, self.policy, self.generation
        if a.prompts_per_step % a.minibatch_prompts:
            raise ValueError(
                f"algorithm.prompts_per_step={a.prompts_per_step} must be divisible by "
                f"algorithm.minibatch_prompts={a.minibatch_prompts}"
            )
        world = self.cluster.nodes * self.cluster.gpus_per_node
        model_parallel = p.tensor_parallel_size * p.pipeline_parallel_size
        if world % model_parallel:
            raise ValueError(
                f"policy.tensor_parallel_size x policy.pipeline_parallel_size = {model_parallel} must divide "
                f"cluster.nodes x cluster.gpus_per_node = {world}"
            )
        if not a.async_rollouts and self.cluster.gpus_per_node % g.tensor_parallel_size:
            raise ValueError(
                f"generation.tensor_parallel_size={g.tensor_parallel_size} must divide "
                f"cluster.gpus_per_node={self.cluster.gpus_per_node} (an engine is consecutive ranks of one node)"
            )
        if p.backend == "hf" and p.activation_checkpointing == "selective":
            raise ValueError(
                "policy.activation_checkpointing=selective needs policy.backend=megatron (the transformers policy "
                "checkpoints whole layers only: use full or false)"
            )
        if p.backend == "megatron" and p.transformer_engine is True and p.dtype == "float32":
            raise ValueError(
                "policy.transformer_engine=true needs policy.dtype bfloat16 or float16 (Transformer Engine has no "
                "packed float32 attention and runs float32 GEMMs in TF32); use policy.transformer_engine=auto"
            )
        data_parallel = world // model_parallel
        stage_ranks = world // p.pipeline_parallel_size
        if stage_ranks % p.expert_parallel_size:
            raise ValueError(
                f"policy.expert_parallel_size={p.expert_parallel_size} must divide the ranks of a pipeline stage, "
                f"cluster world {world} / policy.pipeline_parallel_size {p.pipeline_parallel_size} = {stage_ranks}"
            )
        rollouts = a.minibatch_prompts * a.rollouts_per_prompt
        if rollouts % data_parallel:
            raise ValueError(
                f"algorithm.minibatch_prompts x algorithm.rollouts_per_prompt = {rollouts} must be divisible by "
                f"the data-parallel size {data_parallel} (cluster world / policy TP x PP)"
            )
        if a.async_rollouts:
            self._check_generation_layout()
        if g.max_prompt_tokens + g.max_response_tokens > 10_000_000:
            raise ValueError("generation.max_prompt_tokens + generation.max_response_tokens is implausibly large")
        if self.data.val_every and not self.data.val:
            raise ValueError(f"data.val_every={self.data.val_every} needs data.val (a benchmark file)")
        if a.warmup_target is not None and p.model_path is None:  # the warm-up only applies to models built in code
            low, high = a.warmup_target
            if not 0 < low < high <= 1:
                raise ValueError(
                    f"algorithm.warmup_target=[{low}, {high}] must be a band [low, high] with 0 < low < high <= 1"
                )
            if not a.warmup_sft_steps:
                raise ValueError(
                    "algorithm.warmup_target needs algorithm.warmup_sft_steps > 0 (the cap on warm-up updates)"
                )
            if not (self.data.val and self.data.val_max_problems):
                raise ValueError(
                    "algorithm.warmup_target needs data.val and data.val_max_problems: the warm-up is measured on the "
                    "data.val problems beyond the first data.val_max_problems (those are kept for validation)"
                )
        return self

    def _check_generation_layout(self) -> None:
        c, g = self.cluster, self.generation
        if c.generation_nodes == 0:
            if c.generation_gpus_per_node == 0:
                raise ValueError(
                    "algorithm.async_rollouts=true needs processes for the generator: cluster.generation_gpus_per_node"
                    "=K (K more on the trainer's node) or cluster.generation_nodes=N (nodes of their own)"
                )
            if c.nodes != 1:
                raise ValueError(
                    f"cluster.generation_gpus_per_node={c.generation_gpus_per_node} without cluster.generation_nodes "
                    f"shares the trainer's node, but cluster.nodes={c.nodes}: set cluster.generation_nodes"
                )
        elif c.generation_gpus_per_node not in (0, c.gpus_per_node):
            raise ValueError(
                f"cluster.generation_gpus_per_node={c.generation_gpus_per_node} on nodes of their own must be 0 or "
                f"cluster.gpus_per_node={c.gpus_per_node} (every node of a job runs as many processes)"
            )
        per_node = c.generation_gpus_per_node or c.gpus_per_node
        if per_node % g.tensor_parallel_size:
            raise ValueError(
                f"generation.tensor_parallel_size={g.tensor_parallel_size} must divide the generator's {per_node} "
                "process(es) per node (an engine is consecutive ranks of one node)"
            )

    @property
    def rollout_correction(self) -> Literal["none", "seq_tis"]:
        """``loss.rollout_correction`` with ``auto`` resolved (seq_tis with async rollouts, else none)."""
        if self.loss.rollout_correction == "auto":
            return "seq_tis" if self.algorithm.async_rollouts else "none"
        return self.loss.rollout_correction

    @property
    def world_size(self) -> int:
        """The trainer's processes (nodes x gpus_per_node); the whole job in synchronous mode."""
        return self.cluster.nodes * self.cluster.gpus_per_node

    @property
    def generation_world_size(self) -> int:
        """The generator's own processes (0: synchronous, the generator lives in the trainer's processes)."""
        c = self.cluster
        if not self.algorithm.async_rollouts:
            return 0
        if c.generation_nodes == 0:
            return c.generation_gpus_per_node
        return c.generation_nodes * (c.generation_gpus_per_node or c.gpus_per_node)

    @property
    def launch_world_size(self) -> int:
        """Processes the launcher starts: the trainer's ranks first, then the generator's."""
        return self.world_size + self.generation_world_size

    @property
    def launch_layout(self) -> tuple[int, int]:
        """(nodes, processes per node) of the whole job."""
        c = self.cluster
        if not self.algorithm.async_rollouts:
            return c.nodes, c.gpus_per_node
        if c.generation_nodes == 0:
            return 1, c.gpus_per_node + c.generation_gpus_per_node
        return c.nodes + c.generation_nodes, c.gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        """World size over the policy's model-parallel size."""
        return self.world_size // (self.policy.tensor_parallel_size * self.policy.pipeline_parallel_size)

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per training step (mini-batches of whole questions)."""
        return self.algorithm.prompts_per_step // self.algorithm.minibatch_prompts


# ----------------------------------------------------------------------------------------------------------------------
# Evaluation: the same composition (``nemo-disco eval --config recipes/eval/<name>.yaml``).

#: The paper's six benchmarks (§6: AIME 2024, AIME 2025, MATH-500, AMC 2023, Minerva, OlympiadBench).
PAPER_BENCHMARKS = ("aime", "aime25", "math", "amc", "minerva", "olympiad_bench")
#: Where an evaluation recipe's ``defaults:`` entries are looked for after its own folder.
SHIPPED_EVAL_RECIPES = SHIPPED_RECIPES / "eval"


def _same_as(section: type[BaseModel], name: str, **changes: Any) -> Any:
    """The field of a training key for the evaluation key of the same meaning: its type's range, and its default.

    ``changes`` replace what the evaluation sets otherwise (``default=0.95``): a range is written once, on the
    training key, and each default once, here or there.
    """
    return FieldInfo.merge_field_infos(section.model_fields[name], **changes)


class EvalGenerationConfig(_Section):
    """How the responses are sampled (the keys that training's ``generation`` has too keep its ranges)."""

    # "auto": vLLM where it imports and finds a device, else transformers (one line says which and why); or a
    # registered backend (nemo_disco.generators.BACKENDS).
    backend: str = Field("auto", pattern=r"^[A-Za-z_]\w*$")
    # Responses per problem (the paper: 16).
    samples: int = Field(16, ge=1)
    temperature: float = _same_as(GenerationConfig, "temperature")
    top_p: float = _same_as(GenerationConfig, "top_p", default=0.95)  # the authors' evaluation (training: 1.0)
    # Longer prompts are left out and counted (the authors' evaluation: 1536 tokens); null keeps every prompt.
    max_prompt_tokens: Annotated[int, Field(ge=1)] | None = 1536
    max_response_tokens: int = _same_as(GenerationConfig, "max_response_tokens")
    # Each chunk of problems is sampled with a seed of its own, derived from this seed, the benchmark and the chunk.
    seed: int = 0
    # Problems per generation call: the unit of progress, resumption and data-parallel sharing. Part of the
    # sampling: another value draws other responses.
    chunk_problems: int = Field(32, ge=1)
    # vLLM: GPUs per engine; launched with one process per GPU the job runs processes / this many engines.
    tensor_parallel_size: int = _same_as(GenerationConfig, "tensor_parallel_size")
    # vLLM's share of each GPU, which the evaluation has to itself (no sleep mode).
    gpu_memory_utilization: float = Field(OWN_GPU_MEMORY_UTILIZATION, gt=0, le=1)
    # vLLM without CUDA graphs: a faster start, slower decoding (training's generation.enforce_eager, default false).
    enforce_eager: bool = False


class EvalDataConfig(_Section):
    """The problems and the prompt they are put in (the prompt keys are training's ``data.*`` keys)."""

    # Benchmark names (docs/data.md; the CPU demo's task: synthetic:arithmetic-heldout) or DeepScaleR-format
    # files. null: the paper's six (PAPER_BENCHMARKS) for a model, every benchmark the results hold for --responses.
    benchmarks: list[str] | None = None
    # Only the first N problems of each benchmark (smoke tests).
    max_problems: int | None = Field(None, ge=1)
    prompt_template: str = _same_as(DataConfig, "prompt_template")
    use_chat_template: bool = _same_as(DataConfig, "use_chat_template")
    chat_template_kwargs: dict[str, bool | int | float | str] = _same_as(DataConfig, "chat_template_kwargs")

    @field_validator("benchmarks", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str):  # "aime, math": spaces allowed, as --benchmarks takes them
            value = [name.strip() for name in value.split(",") if name.strip()]
        if isinstance(value, list) and not value:
            raise ValueError("names no benchmark (null: the paper's six)")
        return value


class GradingConfig(_Section):
    """How responses are graded: training's ``reward`` keys of the same names and defaults."""

    # A registered grader (nemo_disco.rewards.GRADERS), checked when the evaluation starts; it grades with its
    # parameters' defaults.
    grader: str = _same_as(RewardConfig, "grader")
    timeout_s: float = _same_as(RewardConfig, "timeout_s")
    # Grading processes per engine.
    workers: int = _same_as(RewardConfig, "workers")


class BootstrapConfig(_Section):
    """The percentile bootstrap intervals of the tables (docs/evaluation.md, "What the numbers are")."""

    # Replicates of each interval; 0: no intervals.
    replicates: int = Field(DEFAULT_REPLICATES, ge=0)
    seed: int = 0
    # For pass@1, redraw the samples within the drawn problems too; false: problems only.
    resample_samples: bool = True


class EvalConfig(_Section):
    """An evaluation: what is evaluated, on which problems, how it is sampled, graded and tabulated.

    What is evaluated is ``model`` (a Hugging Face folder or hub id) or ``run`` (a training run's folder) with
    ``checkpoint``: the checkpoint is converted to a Hugging Face folder (``<run>/hf/<checkpoint>``) and evaluated
    with the run's prompt and lengths (:data:`RUN_KEYS`, read from the checkpoint's ``config.yaml``).
    """

    model: str | None = None
    run: str | None = None
    # A checkpoint of run: step_N (or N); null: its newest complete one.
    checkpoint: str | None = None
    # Results folder; null: eval_results, or <run>/eval/<checkpoint> for a run's checkpoint.
    out: str | None = None
    generation: EvalGenerationConfig = EvalGenerationConfig()
    data: EvalDataConfig = EvalDataConfig()
    reward: GradingConfig = GradingConfig()
    bootstrap: BootstrapConfig = BootstrapConfig()

    @model_validator(mode="after")
    def _source(self) -> EvalConfig:
        if self.model is not None and self.run is not None:
            raise ValueError(f"model={self.model} and run={self.run}: evaluate one (a run's checkpoint, or a model)")
        if self.checkpoint is not None and self.run is None:
            raise ValueError(f"checkpoint={self.checkpoint} needs run (the training run folder that holds it)")
        return self

    @property
    def benchmark_names(self) -> list[str]:
        """``data.benchmarks``, the paper's six when null."""
        return list(self.data.benchmarks or PAPER_BENCHMARKS)


#: The keys an evaluation of a run's checkpoint takes from the run's saved config: the run's prompt, chat template
#: and lengths (the same keys in both schemas). A key given on the command line keeps its value.
RUN_KEYS = (
    "data.prompt_template",
    "data.use_chat_template",
    "data.chat_template_kwargs",
    "generation.max_prompt_tokens",
    "generation.max_response_tokens",
)


def run_values(saved_config: str | os.PathLike) -> dict[str, Any]:
    """The :data:`RUN_KEYS` of a run's saved ``config.yaml``, as dotted keys (those it lacks left out).

    Read as plain YAML, not validated as a run config: a run written by an older version still evaluates.

    Raises:
        ConfigError: no such file, or not YAML (one line naming it).
    """
    path = Path(saved_config)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read the run's config {path}: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {getattr(err, 'problem', err)}") from None
    found = {}
    for key in RUN_KEYS:
        node: Any = raw
        for name in key.split("."):
            node = node.get(name, _MISSING) if isinstance(node, dict) else _MISSING
        if node is not _MISSING:
            found[key] = node
    return found


_MISSING = object()


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"generation.samples": 4}`` as ``{"generation": {"samples": 4}}``."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Loading: Hydra composition, overrides, validation.


def _known_keys(model: type[BaseModel], prefix: str = "") -> dict[str, type[BaseModel] | None]:
    """Every dotted key of the schema -> its section class (or None for a leaf)."""
    keys: dict[str, type[BaseModel] | None] = {}
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys[path] = ann
            keys.update(_known_keys(ann, path + "."))
        else:
            keys[path] = None
    return keys


def _leaf_is_mapping(model: type[BaseModel], path: list[str]) -> bool:
    for name in path[:-1]:
        model = model.model_fields[name].annotation  # type: ignore[assignment]
    return getattr(model.model_fields[path[-1]].annotation, "__origin__", None) is dict


@functools.cache
def _schema_keys(schema: type[BaseModel]) -> tuple[dict[str, type[BaseModel] | None], frozenset[str]]:
    """A schema's dotted keys (:func:`_known_keys`) and its leaves that hold a mapping."""
    keys = _known_keys(schema)
    return keys, frozenset(k for k, sec in keys.items() if sec is None and _leaf_is_mapping(schema, k.split(".")))


_KEYS = _schema_keys(RunConfig)[0]
# Leaves holding a mapping (data.chat_template_kwargs): overrides may set their entries (key.entry=value).
_MAPPING_KEYS = _schema_keys(RunConfig)[1]
# Sections whose other keys belong to the part they name (loss: the chosen loss's parameters, checked by its own model
# in nemo_disco.parts); their own fields are the keys every part shares.
_OPEN_SECTIONS: dict[str, type[_PartSection]] = {
    k: sec for k, sec in _KEYS.items() if isinstance(sec, type) and issubclass(sec, _PartSection)
}
#: Where each schema's recipes name their ``defaults:`` after their own folder.
_SHIPPED = {RunConfig: SHIPPED_RECIPES, EvalConfig: SHIPPED_EVAL_RECIPES}


def _open_sections(schema: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """A schema's open sections (:data:`_OPEN_SECTIONS` for the run's; an evaluation has none)."""
    return _OPEN_SECTIONS if schema is RunConfig else {}


def _suggestion(key: str, schema: type[BaseModel] = RunConfig) -> str:
    """`` (did you mean loss.beta?)`` for ``loss.betta``: the closest key of the same section; "" if none is close."""
    parent, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in _schema_keys(schema)[0] if k.rpartition(".")[0] == parent]
    hint = difflib.get_close_matches(leaf, siblings, n=1)
    return f" (did you mean {parent + '.' if parent else ''}{hint[0]}?)" if hint else ""


def _quoted(override: str) -> str:
    """``key=value`` with a plain value holding non-ASCII characters quoted: Hydra's lexer takes those only quoted.

    ``logging.run_dir=runs/données`` becomes ``logging.run_dir='runs/données'`` (a string either way). Values that
    are quoted, lists or mappings, interpolations, or that hold a quote or end in a backslash are left as given.
    """
    key, sep, value = override.partition("=")
    if not sep or value.isascii() or value[:1] in "[{" or "${" in value or "'" in value or '"' in value:
        return override
    if value.endswith("\\"):
        return override
    return f"{key}='{value}'"


def override_key(override: str) -> str:
    """The dotted key a Hydra override sets (``+key=value``, ``~key``)."""
    return override.split("=", 1)[0].lstrip("+~")


def _check_override_key(override: str, schema: type[BaseModel] = RunConfig) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r} is not of the form key=value")
    key = override_key(override)
    keys, mappings = _schema_keys(schema)
    if key in keys or key.rpartition(".")[0] in mappings or key.rpartition(".")[0] in _open_sections(schema):
        return
    raise ConfigError(f"unknown config key {key!r} in override {override!r}{_suggestion(key, schema)}")


def _unknown_keys(raw: dict[str, Any], prefix: str = "", schema: type[BaseModel] = RunConfig) -> list[str]:
    """Dotted keys of a composed recipe that the schema lacks (a section's unknown name stops the descent)."""
    keys = _schema_keys(schema)[0]
    out = []
    for name, value in raw.items():
        key = f"{prefix}{name}"
        if key not in keys:
            if prefix.rstrip(".") not in _open_sections(schema):  # an open section's other keys: its part's to check
                out.append(key)
        elif keys[key] is not None and isinstance(value, dict):
            out.extend(_unknown_keys(value, key + ".", schema))
    return out


def _search_path(recipe: Path, shipped: Path = SHIPPED_RECIPES) -> list[Path]:
    """Where a recipe's ``defaults:`` entries are looked for: its own folder, then the shipped recipes."""
    folders = [recipe.parent.resolve()]
    if shipped.is_dir() and shipped.resolve() != folders[0]:
        folders.append(shipped.resolve())
    return folders


def _recipe_files(recipe: Path, folders: list[Path]) -> list[Path]:
    """The recipe and every recipe its ``defaults:`` list names, recursively (the files the composition read)."""
    files: list[Path] = []
    todo = [recipe]
    while todo:
        path = todo.pop(0)
        if path in files:
            continue
        files.append(path)
        todo.extend(_defaults_of(path, folders))
    return files


def _mapping(path: Path) -> dict[str, Any]:
    """A recipe file's top-level mapping ({} when it cannot be read: the composition reports that)."""
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _defaults_entries(path: Path, folders: list[Path]) -> list[Path | None]:
    """A recipe's ``defaults:`` list as the files it names (first folder first); None stands for ``_self_``."""
    defaults = _mapping(path).get("defaults") or []
    found: list[Path | None] = []
    for entry in defaults if isinstance(defaults, list) else []:
        if entry == "_self_":
            found.append(None)
        elif isinstance(entry, str):
            found.extend([f / f"{entry}.yaml" for f in folders if (f / f"{entry}.yaml").is_file()][:1])
    return found


def _defaults_of(path: Path, folders: list[Path]) -> list[Path]:
    """The recipe files a recipe's ``defaults:`` list names, as the composition finds them (first folder first)."""
    return [f for f in _defaults_entries(path, folders) if f is not None]


def _merge_order(recipe: Path, folders: list[Path], seen: frozenset[Path] = frozenset()) -> list[Path]:
    """The recipe files in the order the composition merges them.

    A defaults list's entries in turn, the file itself where ``_self_`` stands (last when the list has none).
    """
    entries = _defaults_entries(recipe, folders)
    out: list[Path] = []
    for entry in entries if None in entries else [*entries, None]:
        if entry is None:
            out.append(recipe)
        elif entry not in seen:
            out.extend(_merge_order(entry, folders, seen | {recipe}))
    return out


def _restart_named_sections(raw: dict[str, Any], recipe: Path, folders: list[Path], overrides: list[str]) -> None:
    """A layer (a recipe file, then the overrides) that names another part starts that part's section afresh.

    ``defaults: [disco]`` with ``loss: {name: grpo, kl_coef: 0.001}``, or ``loss.name=grpo`` on the command line,
    keeps none of the keys the layers before it set for disco (tau, beta, ...), as choosing a config group in Hydra
    replaces its node; the section's own fields (the keys every part shares) carry over. Keys the composition holds
    from earlier layers for another name are dropped from ``raw`` here, in place.
    """
    for section, model in _OPEN_SECTIONS.items():
        composed = raw.get(section)
        if not isinstance(composed, dict):
            continue
        layers = []
        for path in _merge_order(recipe.resolve(), folders):
            own = _mapping(path).get(section)
            if isinstance(own, dict):
                layers.append((own.get(model.PART_KEY), set(own)))
        given = {o.split("=", 1)[0].lstrip("+~").removeprefix(section + ".") for o in overrides}
        given = {k for k in given if k in composed and "." not in k}
        if given:
            layers.append((composed.get(model.PART_KEY) if model.PART_KEY in given else None, given))
        name, kept = None, set()
        for layer_name, keys in layers:
            if layer_name is not None and layer_name != name:
                name, kept = layer_name, set()
            kept |= keys
        for key in [k for k in composed if k not in kept and k not in model.model_fields]:
            del composed[key]


def _check_defaults_cycle(recipe: Path, folders: list[Path]) -> None:
    """A recipe that includes itself through its ``defaults:`` lists: one line naming the loop.

    Raises:
        ConfigError: ``a.yaml -> b.yaml -> a.yaml``, with each file's folder once.
    """

    def visit(path: Path, chain: list[Path]) -> list[Path] | None:
        if path in chain:
            return [*chain[chain.index(path) :], path]
        for child in _defaults_of(path, folders):
            loop = visit(child, [*chain, path])
            if loop:
                return loop
        return None

    loop = visit(recipe.resolve(), [])
    if loop:
        names = " -> ".join(f.name for f in loop)
        raise ConfigError(f"{loop[0]}: its defaults: list includes itself ({names}); remove the entry that loops")


def _key_line(path: Path, key: str) -> int | None:
    """The 1-based line of a dotted key in a YAML file (None: not in it)."""
    try:
        node = yaml.compose(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    for name in key.split("."):
        if not isinstance(node, yaml.MappingNode):
            return None
        match = [(k, v) for k, v in node.value if getattr(k, "value", None) == name]
        if not match:
            return None
        key_node, node = match[-1]
    return key_node.start_mark.line + 1


def key_place(recipe: str | os.PathLike, key: str, folders: list[Path] | None = None) -> str | None:
    """``file:line`` of the recipe (or a recipe its ``defaults:`` names, the recipe first) that sets a dotted key."""
    recipe = Path(recipe)
    files = _recipe_files(recipe, folders if folders is not None else _search_path(recipe))
    return next((f"{f}:{line}" for f in files if (line := _key_line(f, key)) is not None), None)


def _check_recipe_keys(
    raw: dict[str, Any], recipe: Path, folders: list[Path], schema: type[BaseModel] = RunConfig
) -> None:
    """An unknown key in a recipe: one line naming the file (and line) that sets it, with the closest known key."""
    unknown = _unknown_keys(raw, schema=schema)
    if not unknown:
        return
    key = unknown[0]
    place = key_place(recipe, key, folders) or str(recipe)
    more = f" (and {len(unknown) - 1} more: {', '.join(unknown[1:4])})" if len(unknown) > 1 else ""
    raise ConfigError(f"{place}: unknown config key {key!r}{_suggestion(key, schema)}{more}")


def _format_validation_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            parts.append(f"unknown config key {loc!r} (value {e['input']!r})")
        elif loc:
            parts.append(f"{loc}={e['input']!r}: {e['msg']}")
        else:
            parts.append(e["msg"].removeprefix("Value error, "))
    return "; ".join(parts)


def validate(
    raw: dict[str, Any],
    schema: type[BaseModel] = RunConfig,
    *,
    recipe: str | os.PathLike | None = None,
    given: Collection[str] = (),
) -> Any:
    """Validate a plain nested dict into a frozen :class:`RunConfig` (or another ``schema``: :class:`EvalConfig`).

    Args:
        raw: the composed dict.
        schema: the schema.
        recipe: the recipe ``raw`` was composed from: a wrong value that a recipe file sets is named with that
            file and line (``my.yaml:7: generation.top_p=2: ...``).
        given: the dotted keys set on the command line rather than by a recipe file (not blamed on one).

    Raises:
        ConfigError: one line naming the key path(s) and value(s).
    """
    try:
        return schema.model_validate(raw)
    except ValidationError as err:
        message = _format_validation_error(err)
        loc = err.errors()[0]["loc"]
        key = ".".join(str(x) for x in loc)
        if recipe is not None and key and key not in given and not any(key.startswith(g + ".") for g in given):
            path = Path(recipe)
            place = key_place(path, key, _search_path(path, _SHIPPED.get(schema, SHIPPED_RECIPES)))
            message = f"{place}: {message}" if place else message
        raise ConfigError(message) from None


def compose(
    recipe: str | os.PathLike | None,
    overrides: list[str] | tuple[str, ...] = (),
    schema: type[BaseModel] = RunConfig,
) -> dict[str, Any]:
    """Compose a recipe with Hydra (``defaults:`` list, ``key=value`` overrides) into a plain dict.

    Args:
        recipe: path to a YAML recipe; its ``defaults:`` entries name recipes in its own folder or, failing that,
            among the shipped ones (:data:`SHIPPED_RECIPES`; :data:`SHIPPED_EVAL_RECIPES` for an evaluation).
            None: the overrides alone (on the schema's defaults).
        overrides: Hydra override strings (``loss.tau=1``, ``+key=value``, ``~key``).
        schema: the schema whose keys the recipe and the overrides may set.

    Raises:
        ConfigError: missing file, bad YAML, unknown override key or a Hydra composition error.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    shipped = _SHIPPED.get(schema, SHIPPED_RECIPES)
    path = Path(recipe if recipe is not None else "")
    if recipe is not None and not path.is_file():
        raise ConfigError(f"recipe file not found: {path}")
    try:
        if recipe is not None:
            yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: invalid YAML: {getattr(err, 'problem', err)}") from None
    for override in overrides:
        _check_override_key(override, schema)
    # Keys were checked against the schema above, so a plain `key=value` may also set a schema field that
    # the recipe does not state: Hydra's `++` (add or override).
    hydra_overrides = [_quoted(o) if o.startswith(("+", "~")) else f"++{_quoted(o)}" for o in overrides]
    # No recipe: Hydra composes the overrides alone, in a folder that exists wherever the package is installed.
    folders = _search_path(path, shipped) if recipe is not None else [Path(__file__).resolve().parent]
    if recipe is not None:
        _check_defaults_cycle(path, folders)
    search = [f"hydra.searchpath=[{','.join(f.as_uri() for f in folders[1:])}]"] if len(folders) > 1 else []
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(folders[0]), version_base=None):
            name = path.stem if recipe is not None else None
            cfg = hydra_compose(config_name=name, overrides=[*search, *hydra_overrides])
    except Exception as err:  # Hydra raises several exception types; all are user errors here.
        from hydra.errors import OverrideParseException

        if isinstance(err, OverrideParseException):  # the override's fault, not the recipe's
            given = next((o for o in overrides if err.override.lstrip("+~") == _quoted(o).lstrip("+~")), err.override)
            raise ConfigError(
                f"override {given!r} cannot be parsed: quote a value with spaces, brackets or other symbols "
                "(key='value', inside double quotes for the shell)"
            ) from None
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        missing = re.search(r"Could not load '([^']+)'", first)
        if missing:
            name, looked = missing.group(1), " and ".join(str(f) for f in folders)
            names = sorted({p.stem for f in folders for p in f.glob("*.yaml")})
            hint = difflib.get_close_matches(name, names, n=1)
            raise ConfigError(
                f"{path}: defaults entry {name!r} not found: looked for {name}.yaml in {looked}"
                + (f" (did you mean {hint[0]}?)" if hint else "")
            ) from None
        raise ConfigError(f"{path}: {first}") from None
    finally:
        GlobalHydra.instance().clear()
    raw = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(raw, dict)
    raw.pop("defaults", None)
    _check_recipe_keys(raw, path, folders, schema)
    if schema is RunConfig:
        _restart_named_sections(raw, path, folders, list(overrides))
    return raw


def load(recipe: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Compose, override and validate a recipe.

    Raises:
        ConfigError: one line naming the file or key.
    """
    return validate(compose(recipe, overrides), recipe=recipe, given=[override_key(o) for o in overrides])


def load_eval(
    recipe: str | os.PathLike | None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    run: dict[str, Any] | None = None,
    flags: dict[str, tuple[str, Any]] | None = None,
) -> EvalConfig:
    """Compose and validate an evaluation: the schema's defaults, then each layer over the one before.

    1. ``recipe`` (``recipes/eval/<name>.yaml``, its ``defaults:`` list composed as a training recipe's);
    2. ``run``: the values a training run's saved config gives (:data:`RUN_KEYS`, :func:`run_values`);
    3. the command line: ``overrides`` (``key=value``) and ``flags`` (dotted key -> (flag, value): the command's
       flags that stand for keys). The same key given both ways with two values is refused; with one, taken.

    Raises:
        ConfigError: one line naming the file and line, or the override or flag, and the key.
    """
    raw = compose(recipe, overrides, EvalConfig)
    given = {override_key(o) for o in overrides}
    for key, value in (run or {}).items():
        if key not in given and not any(g.startswith(key + ".") for g in given):
            _set(raw, key, value)
    for key, (flag, value) in (flags or {}).items():
        if key in given and _get(raw, key) != value:
            raise ConfigError(f"{flag} and {key}={_get(raw, key)!r} set the same key to two values: give one of them")
        _set(raw, key, value)
    return validate(raw, EvalConfig, recipe=recipe, given={*given, *(run or {}), *(flags or {})})


def _get(raw: dict[str, Any], key: str) -> Any:
    node: Any = raw
    for name in key.split("."):
        node = node.get(name) if isinstance(node, dict) else None
    return node


def _set(raw: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = raw
    for name in parents:
        node = node.setdefault(name, {})
    node[leaf] = value


def to_yaml(cfg: BaseModel) -> str:
    """The fully resolved config as YAML (every field, defaults included)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def save(cfg: RunConfig, path: str | os.PathLike) -> None:
    """Write the resolved config (atomically) so ``convert`` / ``eval`` / resume can read it back."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(to_yaml(cfg))
    os.replace(tmp, path)


def load_resolved(path: str | os.PathLike) -> RunConfig:
    """Read a config written by :func:`save` (no composition)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return validate(raw)


def check_value(key: str, value: Any, flag: str, schema: type[BaseModel] = RunConfig) -> Any:
    """Validate a command-line value against the config key it stands for: the key's own type and range.

    ``eval --temperature`` is the evaluation's ``generation.temperature`` and ``convert --tp`` is
    ``policy.tensor_parallel_size``: their ranges live once, on the fields above.

    Args:
        key: the dotted config key whose type and range apply (``generation.temperature``).
        value: the value given on the command line.
        flag: the command-line flag, for the message (``--temperature``).
        schema: the schema of the key (:class:`EvalConfig` for ``eval``'s flags).

    Returns:
        The value, validated.

    Raises:
        ConfigError: one line naming the flag, its value, what is wrong and the config key.
    """
    *sections, name = key.split(".")
    model = schema
    for section in sections:
        model = model.model_fields[section].annotation  # type: ignore[assignment]
    field = model.model_fields[name]
    try:
        return TypeAdapter(Annotated[field.annotation, field]).validate_python(value)
    except ValidationError as err:
        msg = err.errors()[0]["msg"].replace("Input should be", "must be")
        raise ConfigError(f"{flag} {value}: {msg} (as {key} in a recipe)") from None
