"""The rollout side: questions -> generation -> grading -> dynamic sampling -> overlong shaping.

The trainer (:mod:`nemo_disco.algorithm`) sees one small interface, :class:`RolloutSource`, whatever the mode:

- ``next(step)``: the graded rollouts of training step ``step`` and their metrics;
- ``publish(step, ...)``: the policy has finished step ``step``; its weights are the generator's next ones;
- ``validate(step, ...)``: per-problem pass@1 of the weights after ``step`` steps;
- ``state_dict(step)`` / :func:`restore`: what a checkpoint needs to resume bit for bit; ``close``.

Two sources share the same :class:`Rollouter` (the code that samples, grades and tops up questions):

- :class:`LocalRollouts` (``algorithm.async_rollouts=false``): the generator lives in the trainer's processes
  (colocated with vLLM on GPU) and refits lazily before it generates: every step is generate, grade, train.
- :class:`RemoteRollouts` (``algorithm.async_rollouts=true``): the generator runs :func:`serve` in processes of
  its own (ranks after the trainer's, :func:`nemo_disco.distributed.init_roles`). Step ``t``'s rollouts are
  sampled with the weights after step ``t - 1 - algorithm.max_staleness`` (step 0's at the start), so they are
  made while the trainer works on earlier steps; each carries the version that made it. Weights travel down
  the :class:`~nemo_disco.distributed.Link` after every step in buckets of ``generation.refit_bucket_mb``; the
  generator applies a whole stream before it samples again. The rule is fixed, not "whatever is newest", so
  a run is reproducible bit for bit and ``max_staleness=0`` is the synchronous run exactly.

The message protocol (docs/async.md)::

    down (trainer rank 0 -> every generator rank):
        {"kind": "weights", "version": v, "validate": seed | None, "generate": bool, "start": {...} | None}
            then the weight stream: per bucket {"tensors": [(name, dtype, shape), ...], "nbytes": n} and the
            bucket's bytes; {"tensors": None} ends it
        {"kind": "stop", "code": exit code}
    up (generator rank 0 -> trainer rank 0, from a sender thread, in order):
        {"kind": "rollouts", "step": t, "version": v, "records": [...], "metrics": {...}, "sampler": {...}}
        {"kind": "validation", "step": v, "per_problem": [...]}

Checkpoints (async): the rollouts already made for the steps after the checkpoint (at most
``max_staleness`` of them, made by weights older than the checkpoint's) are saved with the sampler's position
after them; on resume the generator starts at the next step with the checkpoint's weights.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from nemo_disco import distributed
from nemo_disco.config import ConfigError, RunConfig
from nemo_disco.data import PromptSampler, encode_run_prompts, load_problems
from nemo_disco.generation.base import EngineLayout, Generator, SamplingParams
from nemo_disco.metrics import Timer
from nemo_disco.policy.base import Policy
from nemo_disco.rewards import GraderPool

log = logging.getLogger(__name__)

#: Tensors in a weight bucket start at multiples of this many bytes (any dtype's view is aligned).
_ALIGN = 64


# ----------------------------------------------------------------------------------------------------------------------
# Data and engines


def data_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """Keyword arguments of :func:`nemo_disco.data.load_problems` for the run's data."""
    return {
        "split": cfg.data.split,
        "on_bad_row": cfg.data.on_bad_row,
        "synthetic_size": cfg.data.synthetic_size,
        "seed": cfg.data.seed,
    }


def train_problems(cfg: RunConfig, tokenizer: Any) -> tuple[list, list[list[int]], int, int]:
    """The training questions the run samples from, encoded.

    Returns:
        Problems, their prompt ids, bad rows skipped, prompts dropped as too long.

    Raises:
        ConfigError: fewer usable problems than ``algorithm.prompts_per_step``.
    """
    problems, skipped = load_problems(cfg.data.train, **data_kwargs(cfg))
    prompt_ids, kept, dropped = encode_run_prompts(tokenizer, problems, cfg)
    problems = [problems[i] for i in kept]
    if len(problems) < cfg.algorithm.prompts_per_step:
        raise ConfigError(
            f"data.train={cfg.data.train!r} has {len(problems)} usable problems, fewer than "
            f"algorithm.prompts_per_step={cfg.algorithm.prompts_per_step}"
        )
    return problems, prompt_ids, skipped, dropped


def val_problems(cfg: RunConfig, tokenizer: Any) -> tuple[list, list[list[int]]] | None:
    """The validation problems (the first ``data.val_max_problems`` of ``data.val``) and their prompt ids."""
    if not cfg.data.val:
        return None
    problems, _ = load_problems(cfg.data.val, **{**data_kwargs(cfg), "on_bad_row": "skip"})
    if cfg.data.val_max_problems:
        problems = problems[: cfg.data.val_max_problems]
    ids, kept, _ = encode_run_prompts(tokenizer, problems, cfg)
    return [problems[i] for i in kept], ids


def new_sampler(cfg: RunConfig, num_problems: int) -> PromptSampler:
    """The run's deterministic, resumable question order."""
    return PromptSampler(num_problems, cfg.algorithm.prompts_per_step, seed=cfg.data.seed, shuffle=cfg.data.shuffle)


def build_generator(cfg: RunConfig, model_dir: Path) -> Generator:
    """The generator named by ``generation.backend``."""
    g = cfg.generation
    if g.backend == "hf":
        from nemo_disco.generation.hf import HFGenerator

        return HFGenerator(model_dir, dtype=cfg.policy.dtype, batch_size=g.hf_batch_size, decode=g.hf_decode)
    from nemo_disco.generation.vllm import VLLMGenerator

    return VLLMGenerator(
        model_dir,
        tensor_parallel_size=g.tensor_parallel_size,
        gpu_memory_utilization=g.gpu_memory_utilization,
        enforce_eager=g.enforce_eager,
        max_model_len=g.max_prompt_tokens + g.max_response_tokens,
        max_num_batched_tokens=g.max_num_batched_tokens,
        sleep_level=g.sleep_level,
        load_format="dummy",
        seed=cfg.algorithm.seed,
        dtype=cfg.policy.dtype,
        refit_bucket_mb=g.refit_bucket_mb,
    )


def start_generator(cfg: RunConfig, model_dir: Path) -> Generator:
    """The synchronous run's generator, built before the policy fills the GPU, and asleep when colocated.

    vLLM sizes its KV cache from free device memory and refuses to start when less than its share
    (``generation.gpu_memory_utilization``) is free (``v1/worker/utils.py``): built after the policy, its reference
    and their optimizer state, an 8B model on an 80 GB GPU is within a few GB of that limit. Built first and put
    to sleep at once (NeMo-RL's order), it leaves the GPU to the policy until the first generation phase wakes it.
    """
    generator = build_generator(cfg, model_dir)
    if is_colocated(cfg):
        generator.sleep()
    return generator


def build_grader(cfg: RunConfig) -> GraderPool:
    """The run's reward: ``reward.grader`` or ``reward.function``, in a pool of killable workers."""
    r = cfg.reward
    return GraderPool(r.grader, timeout_s=r.timeout_s, workers=r.workers, function=r.function)


def sampling_params(cfg: RunConfig, tokenizer: Any, seed: int, max_tokens: int | None = None) -> SamplingParams:
    """The run's sampling settings; the stop set is the tokenizer's EOS and ``<|im_end|>`` where it exists."""
    g = cfg.generation
    stops = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    if im_end is not None:
        stops.add(im_end)
    return SamplingParams(
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        max_tokens=max_tokens or g.max_response_tokens,
        stop_token_ids=tuple(sorted(s for s in stops if s is not None)),
        seed=seed,
    )


def step_seed(cfg: RunConfig, step: int) -> int:
    """The sampling seed of training step ``step`` (1-based; later dynamic-sampling rounds add their index)."""
    return (cfg.algorithm.seed * 1_000_003 + (step - 1) * 7919) % (2**31)


# ----------------------------------------------------------------------------------------------------------------------
# Sampling and grading (both modes)


@dataclass
class Rollouter:
    """Samples and grades rollouts with one generator; every process of the generating role holds one.

    Attributes:
        phase: wraps each use of the generator (the colocated hand-over in synchronous mode; nothing otherwise).
    """

    cfg: RunConfig
    tokenizer: Any
    problems: list
    prompt_ids: list[list[int]]
    sampler: PromptSampler
    generator: Generator
    grader: GraderPool
    engines: EngineLayout
    phase: Callable[[Timer], contextlib.AbstractContextManager] = field(default=lambda _timer: contextlib.nullcontext())

    def engine_seed(self, seed: int) -> int:
        """The sampling seed of this process's engine: engines draw independent streams.

        The ranks of one engine share theirs, as a tensor-parallel vLLM engine requires.
        """
        return (seed + 1_000_033 * self.engines.index) % (2**31)

    def gather_engines(self, items: list) -> list:
        """Concatenate the engine leaders' lists in engine order (identical on every rank of the role)."""
        parts = distributed.all_gather_object(items if self.engines.leader else [])
        return [x for part in parts for x in part]

    def collect(self, question_ids: list[int], seed: int) -> tuple[list[dict], dict[str, float]]:
        """Generate and grade ``rollouts_per_prompt`` responses for each question; identical on every rank.

        Each generation engine generates for its share of the questions (every rank of a tensor-parallel engine
        with the same requests), its leader grades them, and the leaders' records are gathered on every rank.

        Returns:
            One record per question (prompt ids, responses, generator log-probs, rewards, finish reasons), and
            generation / grading metrics.
        """
        cfg, timer = self.cfg, Timer()
        g = cfg.algorithm.rollouts_per_prompt
        local = question_ids[self.engines.share(len(question_ids))]
        with timer("generate"):
            sampling = sampling_params(cfg, self.tokenizer, self.engine_seed(seed))
            rollouts = self.generator.generate([self.prompt_ids[q] for q in local], g, sampling) if local else []
        if not self.engines.leader:  # the engine's leader grades and reports its rollouts
            local, rollouts = [], []
        texts = [self.tokenizer.decode(r.token_ids, skip_special_tokens=True) for rs in rollouts for r in rs]
        truths = [self.problems[q].answer for q in local for _ in range(g)]
        questions = [self.problems[q].problem for q in local for _ in range(g)]
        fields = [self.problems[q].fields for q in local for _ in range(g)]
        with timer("grade"):
            scores, grade_metrics = self.grader.score(texts, truths, questions, fields) if texts else ([], {})
        records = []
        for k, (q, rs) in enumerate(zip(local, rollouts, strict=True)):
            records.append(
                {
                    "question": q,
                    "prompt": list(self.prompt_ids[q]),
                    "responses": [list(r.token_ids) for r in rs],
                    "logprobs": [list(r.logprobs) for r in rs],
                    "finish": [r.finish_reason for r in rs],
                    "rewards": scores[k * g : (k + 1) * g],
                }
            )
        records = self.gather_engines(records)
        timeouts, errors = distributed.sum_floats(
            [grade_metrics.get("reward/timeouts", 0.0), grade_metrics.get("reward/errors", 0.0)]
        )
        return records, {**timer.metrics(), "reward/timeouts": timeouts, "reward/errors": errors}

    def validate(self, problems: list, prompt_ids: list[list[int]], samples: int, seed: int) -> list[float]:
        """Per-problem pass@1 (share of ``samples`` correct samples), in problem order, identical on every rank.

        Each generation engine samples a contiguous share of the problems and its leader grades it; the leaders'
        shares, gathered in engine order, are the problems in order. Their mean is the pass@1; their spread gives
        its standard error (:mod:`nemo_disco.stats`), and two validations on the same problems give a paired gain.
        """
        g = self.cfg.generation
        share = list(range(len(problems)))[self.engines.share(len(problems))]
        sampling = sampling_params(self.cfg, self.tokenizer, self.engine_seed(seed))
        sampling = SamplingParams(**{**sampling.__dict__, "top_p": g.top_p})
        with self.phase(Timer()):
            rollouts = self.generator.generate([prompt_ids[i] for i in share], samples, sampling) if share else []
        if not self.engines.leader:
            share, rollouts = [], []
        texts = [self.tokenizer.decode(r.token_ids, skip_special_tokens=True) for rs in rollouts for r in rs]
        truths = [problems[i].answer for i in share for _ in range(samples)]
        questions = [problems[i].problem for i in share for _ in range(samples)]
        fields = [problems[i].fields for i in share for _ in range(samples)]
        scores, _ = self.grader.score(texts, truths, questions, fields) if texts else ([], {})
        # A sample counts as correct when its reward is a positive's (the graders' 1.0; a user reward's share).
        correct = [float(s > self.cfg.reward.positive_threshold) for s in scores]
        local = [sum(correct[k * samples : (k + 1) * samples]) / samples for k in range(len(share))]
        return self.gather_engines(local)

    def close(self) -> None:
        """Stop the grading workers and free the generator."""
        self.grader.close()
        self.generator.shutdown()


def _shape_overlong(cfg: RunConfig, records: list[dict]) -> None:
    """DAPO overlong reward shaping: a linear penalty over the last ``overlong_buffer_tokens`` of the budget."""
    a = cfg.algorithm
    if a.overlong_buffer_tokens == 0:
        return
    limit = cfg.generation.max_response_tokens
    start = limit - a.overlong_buffer_tokens
    for rec in records:
        rec["rewards"] = [
            r - a.overlong_penalty * min(max(len(resp) - start, 0) / a.overlong_buffer_tokens, 1.0)
            for r, resp in zip(rec["rewards"], rec["responses"], strict=True)
        ]


def _has_variance(rec: dict, threshold: float) -> bool:
    pos = sum(r > threshold for r in rec["rewards"])
    return 0 < pos < len(rec["rewards"])


def step_rollouts(
    ro: Rollouter, step: int, collect: Callable[[list[int], int], tuple[list[dict], dict[str, float]]] | None = None
) -> tuple[list[dict], dict[str, float]]:
    """Training step ``step``'s questions with their graded rollouts; dynamic sampling tops up informative ones.

    With ``algorithm.dynamic_sampling`` more rounds of questions are sampled (at most
    ``algorithm.max_sampling_rounds`` in all) until ``algorithm.min_valid_share`` of the step's questions have
    both a positive and a negative rollout: 1.0 is DAPO's rule (all of them), 0.6 GPG's beta_th (Alg. 1 of
    arXiv 2504.02546). The informative questions come first, zero-variance ones fill the rest.

    Args:
        ro: the rollouter.
        step: the training step (1-based): it fixes the sampling seeds.
        collect: :meth:`Rollouter.collect` (tests pass their own).
    """
    collect = collect or ro.collect
    cfg = ro.cfg
    need = cfg.algorithm.prompts_per_step
    base_seed = step_seed(cfg, step)
    records, metrics = collect(ro.sampler.next_batch(), base_seed)
    if cfg.algorithm.dynamic_sampling:
        threshold = cfg.reward.positive_threshold
        kept = [r for r in records if _has_variance(r, threshold)]
        spare = [r for r in records if not _has_variance(r, threshold)]
        target = math.ceil(cfg.algorithm.min_valid_share * need - 1e-9)
        rounds = 1
        while len(kept) < target and rounds < cfg.algorithm.max_sampling_rounds:
            more, m = collect(ro.sampler.next_batch(), base_seed + rounds)
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v
            kept += [r for r in more if _has_variance(r, threshold)]
            spare += [r for r in more if not _has_variance(r, threshold)]
            rounds += 1
        metrics["train/sampling_rounds"] = float(rounds)
        # Short of informative questions after max_sampling_rounds: fill with zero-variance ones (zero advantage).
        records = (kept + spare)[:need]
        metrics["train/informative_share"] = min(len(kept), need) / need
    _shape_overlong(cfg, records)
    return records, metrics


def staleness_metrics(step: int, version: int) -> dict[str, float]:
    """``rollout/staleness_*``: steps between the weights being trained (``step - 1``) and those that sampled.

    Every rollout of a step comes from one version, so the mean and the max agree; both are logged for the
    dashboards of runs that mix versions.
    """
    lag = float(step - 1 - version)
    return {"rollout/staleness_mean": lag, "rollout/staleness_max": lag, "rollout/version": float(version)}


# ----------------------------------------------------------------------------------------------------------------------
# The trainer's side: one interface, two sources


class RolloutSource(Protocol):
    """What the trainer asks of the rollout side (see the module docstring)."""

    sampler: PromptSampler

    def next(self, step: int) -> tuple[list[dict], dict[str, float]]:
        """Step ``step``'s records (identical on every trainer rank) and their metrics."""
        ...

    def weights_changed(self) -> None:
        """An optimizer update moved the policy's weights."""
        ...

    def publish(self, step: int, *, validate_seed: int | None, more: bool) -> float:
        """The policy has finished ``step``; returns the seconds spent sending its weights (0: nothing sent)."""
        ...

    def validate(self, step: int, seed: int) -> list[float]:
        """Per-problem pass@1 of the weights after ``step`` steps (identical on every trainer rank)."""
        ...

    def state_dict(self, step: int) -> dict[str, Any]:
        """What the checkpoint after ``step`` needs (JSON-serialisable)."""
        ...

    def close(self, code: int | None) -> None:
        """End of the run (``code``: the exit code the generator should end with; None after an error)."""
        ...


def is_colocated(cfg: RunConfig) -> bool:
    """Whether the generator shares the trainer's GPU (vLLM on a GPU) and the two take turns with it."""
    return cfg.generation.backend == "vllm" and torch.cuda.is_available()


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

    def next(self, step: int) -> tuple[list[dict], dict[str, float]]:
        """Refit if stale, then sample and grade step ``step`` (the generator keeps the GPU throughout)."""
        timer = Timer()
        with generation_phase(self, timer):
            records, metrics = step_rollouts(self.ro, step)
        return records, {**metrics, **timer.metrics(), **staleness_metrics(step, step - 1)}

    def weights_changed(self) -> None:
        """The next generation refits first."""
        self.generator_stale = True

    def publish(self, step: int, *, validate_seed: int | None, more: bool) -> float:
        """Nothing to send: the refit happens when the generator is next used."""
        return 0.0

    def validate(self, step: int, seed: int) -> list[float]:
        """Validate the current weights on :attr:`val`."""
        return self.ro.validate(*self.val, self.cfg.data.val_samples, seed)

    def state_dict(self, step: int) -> dict[str, Any]:
        """The sampler's position."""
        return {"sampler": self.sampler.state_dict()}

    def close(self, code: int | None) -> None:
        """Stop the grading workers, free the generator."""
        self.ro.close()


# ----------------------------------------------------------------------------------------------------------------------
# Asynchronous: the weight stream


def send_weights(link: distributed.Link | None, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> None:
    """Stream ``weights`` down the link in buckets of at most ``bucket_bytes`` (trainer rank 0).

    The other trainer ranks pass ``link=None`` and only drain the iterator, which may be collective (Megatron
    gathers tensor- and pipeline-parallel shards).
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in weights:
        if link is None:
            continue
        nbytes = _aligned(t.numel() * t.element_size())
        if bucket and size + nbytes > bucket_bytes:
            _send_bucket(link, bucket)
            bucket, size = [], 0
        bucket.append((name, t.detach()))
        size += nbytes
    if link is None:
        return
    if bucket:
        _send_bucket(link, bucket)
    link.send_down({"tensors": None})


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _send_bucket(link: distributed.Link, bucket: list[tuple[str, torch.Tensor]]) -> None:
    dev = link.weights_device
    total = sum(_aligned(t.numel() * t.element_size()) for _, t in bucket)
    buf = torch.zeros(total, dtype=torch.uint8, device=dev)
    offset = 0
    for _, t in bucket:
        n = t.numel() * t.element_size()
        buf[offset : offset + n].copy_(t.contiguous().view(-1).view(torch.uint8).to(dev))
        offset += _aligned(n)
    link.send_down({"tensors": [(name, str(t.dtype), tuple(t.shape)) for name, t in bucket], "nbytes": total})
    link.buffer_down(buf)


def receive_weights(link: distributed.Link) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one weight stream, bucket by bucket (views into the received buffers): a generator rank.

    Consume it to the end (the stream's messages are in the link's order).
    """
    while True:
        head = link.recv_down()
        if head["tensors"] is None:
            return
        buf = link.buffer_down(torch.empty(head["nbytes"], dtype=torch.uint8, device=link.weights_device))
        offset = 0
        for name, dtype, shape in head["tensors"]:
            dt = getattr(torch, dtype.removeprefix("torch."))
            n = math.prod(shape) * torch.empty((), dtype=dt).element_size()
            yield name, buf[offset : offset + n].view(dt).view(shape)
            offset += _aligned(n)


# ----------------------------------------------------------------------------------------------------------------------
# Asynchronous: the trainer's side


class RemoteRollouts:
    """Asynchronous rollouts from the generator's processes (trainer side; see the module docstring).

    Trainer rank 0 talks to the generator; it hands every message on to the other trainer ranks.
    """

    def __init__(
        self,
        cfg: RunConfig,
        link: distributed.Link,
        policy: Policy,
        sampler: PromptSampler,
        model_dir: Path,
        pending: list[dict],
    ) -> None:
        """Set up; :meth:`start` sends the first weights.

        Args:
            cfg: the run.
            link: to the generator (used by trainer rank 0 only).
            policy: whose weights are sent.
            model_dir: the Hugging Face folder the generator builds its engine from.
            sampler: at the generator's position (a resumed run's: after the pending rollouts).
            pending: the checkpoint's rollouts made ahead (``pending_rollouts``; empty for a fresh run).
        """
        self.cfg, self.link, self.policy, self.sampler, self.model_dir = cfg, link, policy, sampler, model_dir
        self.leader = distributed.rank() == 0
        # step -> rollouts received and not yet trained on (a resumed run starts with the checkpoint's)
        self.pending: dict[int, dict] = {m["step"]: m for m in pending}
        self.validations: dict[int, dict] = {}
        self.sampler_state = sampler.state_dict()  # the generator's position after the newest rollouts received

    def start(self, step: int, validate_seed: int | None) -> None:
        """Send the weights after ``step`` steps with where to start (collective over the trainer)."""
        start = {"model_dir": str(self.model_dir), "next_step": step + 1 + len(self.pending)}
        start["sampler"] = self.sampler_state
        self._send(step, validate_seed, more=True, start=start)

    def _send(self, step: int, validate_seed: int | None, *, more: bool, start: dict | None = None) -> None:
        if self.leader:
            head = {"kind": "weights", "version": step, "validate": validate_seed, "generate": more, "start": start}
            self.link.send_down(head)
        bucket = self.cfg.generation.refit_bucket_mb * 2**20
        send_weights(self.link if self.leader else None, self.policy.export_weights(), bucket)

    def _receive(self, kind: str, step: int) -> dict:
        """Trainer rank 0 reads up-messages until ``kind`` for ``step`` (others are kept for later)."""
        box = self.pending if kind == "rollouts" else self.validations
        while step not in box:
            msg = self.link.recv_up()
            if msg["kind"] == "rollouts":
                self.pending[msg["step"]] = msg
                self.sampler_state = msg["sampler"]
            else:
                self.validations[msg["step"]] = msg
        return box.pop(step)

    def next(self, step: int) -> tuple[list[dict], dict[str, float]]:
        """Wait for step ``step``'s rollouts (made while earlier steps trained) and share them over the trainer."""
        t0 = time.perf_counter()
        msg = self._receive("rollouts", step) if self.leader else None
        msg = distributed.broadcast_object(msg, src=0)
        wait = time.perf_counter() - t0
        metrics = {**msg["metrics"], "timing/wait_rollouts": wait, **staleness_metrics(step, msg["version"])}
        return msg["records"], metrics

    def weights_changed(self) -> None:
        """Nothing: the weights go out once per step (:meth:`publish`)."""

    def publish(self, step: int, *, validate_seed: int | None, more: bool) -> float:
        """Send the weights after ``step`` (when the generator will sample or validate with them)."""
        if not more and validate_seed is None:
            return 0.0
        t0 = time.perf_counter()
        self._send(step, validate_seed, more=more)
        return time.perf_counter() - t0

    def validate(self, step: int, seed: int) -> list[float]:
        """The generator's validation of the weights after ``step`` (asked for by :meth:`publish`)."""
        msg = self._receive("validation", step) if self.leader else None
        return distributed.broadcast_object(msg, src=0)["per_problem"]

    def state_dict(self, step: int) -> dict[str, Any]:
        """The rollouts made for the steps after ``step`` (waits for them) and the sampler's position after them.

        Only trainer rank 0's is complete (it writes the checkpoint's trainer state).
        """
        if self.leader:
            last = min(step + self.cfg.algorithm.max_staleness, self.cfg.algorithm.steps)
            for s in range(step + 1, last + 1):
                self.pending[s] = self._receive("rollouts", s)
        return {"sampler": self.sampler_state, "pending_rollouts": [self.pending[s] for s in sorted(self.pending)]}

    def close(self, code: int | None) -> None:
        """Tell the generator to stop with ``code`` (nothing after an error: the watchdog ends it)."""
        if code is not None and self.leader:
            self.link.send_down({"kind": "stop", "code": code})


# ----------------------------------------------------------------------------------------------------------------------
# Asynchronous: the generator's side


class _Sender:
    """Sends up-messages in order from a thread of its own, so the generator takes new weights meanwhile."""

    def __init__(self, link: distributed.Link | None) -> None:
        self.link = link
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="nemo-disco-rollout-sender", daemon=True)
        if link is not None:
            self.thread.start()

    def put(self, msg: dict) -> None:
        if self.error is not None:
            raise RuntimeError(f"sending rollouts to the trainer failed: {self.error}") from self.error
        if self.link is not None:
            self.queue.put(msg)

    def _run(self) -> None:
        while True:
            msg = self.queue.get()
            if msg is None:
                return
            try:
                self.link.send_up(msg)
            except BaseException as err:  # reported by the next put, or at the end
                self.error = err
                return

    def flush(self) -> None:
        if self.link is not None:
            self.queue.put(None)
            self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"sending rollouts to the trainer failed: {self.error}") from self.error


def serve(cfg: RunConfig, env: distributed.DistEnv, link: distributed.Link, wd: Any) -> int:
    """The generator's processes: sample, grade and send rollouts one step ahead until the trainer says stop.

    Returns:
        The exit code the trainer asked for.
    """
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):  # the trainer decides (it checkpoints, then stops us)
        signal.signal(sig, signal.SIG_IGN)
    head = link.recv_down()
    start = head["start"]
    model_dir = Path(start["model_dir"])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    problems, prompt_ids, _, _ = train_problems(cfg, tokenizer)
    sampler = new_sampler(cfg, len(problems))
    sampler.load_state_dict(start["sampler"])
    val = val_problems(cfg, tokenizer)
    ro = Rollouter(
        cfg=cfg,
        tokenizer=tokenizer,
        problems=problems,
        prompt_ids=prompt_ids,
        sampler=sampler,
        generator=build_generator(cfg, model_dir),
        grader=build_grader(cfg),
        engines=EngineLayout.of(env.rank, env.world_size, cfg.generation.tensor_parallel_size),
    )
    sender = _Sender(link if env.rank == 0 else None)
    a = cfg.algorithm
    next_step = start["next_step"]
    try:
        while True:
            if head["kind"] == "stop":
                sender.flush()
                return int(head["code"])
            version = head["version"]
            with wd.phase("step", f"generator: weights of step {version}"):
                ro.generator.update_weights(receive_weights(link))
            if head["validate"] is not None:
                with wd.phase("validation", f"generator: validation after step {version}"):
                    per_problem = ro.validate(*val, cfg.data.val_samples, head["validate"])
                sender.put({"kind": "validation", "step": version, "per_problem": per_problem})
            while head["generate"] and next_step <= a.steps and version >= next_step - 1 - a.max_staleness:
                with wd.phase("step", f"generator: rollouts of step {next_step}"):
                    records, metrics = step_rollouts(ro, next_step)
                msg = {"kind": "rollouts", "step": next_step, "version": version, "records": records}
                sender.put({**msg, "metrics": metrics, "sampler": sampler.state_dict()})
                next_step += 1
            head = link.recv_down()
    finally:
        ro.close()
