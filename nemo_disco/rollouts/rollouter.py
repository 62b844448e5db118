"""Sampling and grading, shared by both modes: the :class:`Rollouter`, dynamic sampling, overlong shaping."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nemo_disco import distributed, hooks, parts
from nemo_disco.batch import QuestionRollouts
from nemo_disco.config import ConfigError, RunConfig
from nemo_disco.data import PromptSampler
from nemo_disco.generation.base import EngineLayout, Generator, SamplingParams
from nemo_disco.generation.factory import stop_token_ids
from nemo_disco.metrics import Timer
from nemo_disco.rewards import GraderPool

# ----------------------------------------------------------------------------------------------------------------------
# The run's grader, sampling settings and seeds


class RewardError(ConfigError):
    """So many rewards of a step failed (``reward.max_error_share``) that the run stops: one line, exit code 2."""


def build_grader(cfg: RunConfig) -> GraderPool:
    """The run's reward: ``reward.grader`` and its parameters, or ``reward.function``, in killable workers."""
    r = cfg.reward
    params = parts.grader_params(cfg)
    return GraderPool(r.grader, timeout_s=r.timeout_s, workers=r.workers, params=params, function=r.function)


def sampling_params(cfg: RunConfig, tokenizer: Any, seed: int, max_tokens: int | None = None) -> SamplingParams:
    """The run's sampling settings (the stop set: :func:`nemo_disco.generation.factory.stop_token_ids`)."""
    g = cfg.generation
    return SamplingParams(
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        max_tokens=max_tokens or g.max_response_tokens,
        stop_token_ids=stop_token_ids(tokenizer),
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
    #: The first failed reward's one-line description in the current step (None: none failed so far).
    first_reward_error: str | None = None

    def engine_seed(self, seed: int) -> int:
        """The sampling seed of this process's engine: engines draw independent streams.

        The ranks of one engine share theirs, as a tensor-parallel vLLM engine requires.
        """
        return (seed + 1_000_033 * self.engines.index) % (2**31)

    def gather_engines(self, items: list) -> list:
        """Concatenate the engine leaders' lists in engine order (identical on every rank of the role)."""
        parts = distributed.all_gather_object(items if self.engines.leader else [])
        return [x for part in parts for x in part]

    def collect(self, question_ids: list[int], seed: int) -> tuple[list[QuestionRollouts], dict[str, float]]:
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
                QuestionRollouts(
                    question=q,
                    prompt=list(self.prompt_ids[q]),
                    responses=[list(r.token_ids) for r in rs],
                    logprobs=[list(r.logprobs) for r in rs],
                    finish=[r.finish_reason for r in rs],
                    rewards=scores[k * g : (k + 1) * g],
                )
            )
        records = self.gather_engines(records)
        failures = _grading_failures(grade_metrics, len(texts))
        failed = failures["reward/timeouts"] or failures["reward/errors"]  # every rank agrees on the sums
        if failed and self.first_reward_error is None:
            mine = self.grader.first_error if self.engines.leader and texts else None
            self.first_reward_error = next((e for e in self.gather_engines([mine]) if e), None)
        return records, {**timer.metrics(), **failures}

    def validate(
        self, problems: list, prompt_ids: list[list[int]], samples: int, seed: int
    ) -> tuple[list[float], dict[str, float]]:
        """Per-problem pass@1 (share of ``samples`` correct samples), in problem order, and the grading's failures.

        Each generation engine samples a contiguous share of the problems and its leader grades it; the leaders'
        shares, gathered in engine order, are the problems in order. Their mean is the pass@1; their spread gives
        its standard error (:mod:`nemo_disco.stats`), and two validations on the same problems give a paired gain.
        The second value counts the rewards that failed (``reward/errors``, ``reward/timeouts``, of
        ``reward/graded``): they score 0, so they count as wrong. Both are identical on every rank.
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
        scores, grade_metrics = self.grader.score(texts, truths, questions, fields) if texts else ([], {})
        # A sample counts as correct when its reward is a positive's (the graders' 1.0; a user reward's share).
        correct = [float(s > self.cfg.reward.positive_threshold) for s in scores]
        local = [sum(correct[k * samples : (k + 1) * samples]) / samples for k in range(len(share))]
        return self.gather_engines(local), _grading_failures(grade_metrics, len(texts))

    def close(self) -> None:
        """Stop the grading workers and free the generator."""
        self.grader.close()
        self.generator.shutdown()


def build_rollouter(
    cfg: RunConfig,
    env: distributed.DistEnv,
    tokenizer: Any,
    problems: list,
    prompt_ids: list[list[int]],
    sampler: PromptSampler,
    generator: Generator,
) -> Rollouter:
    """The run's :class:`Rollouter` on ``generator``, its grading workers started.

    Its engines are laid out over the processes of ``env``: the trainer's, or with asynchronous rollouts the
    generator's.
    """
    return Rollouter(
        cfg=cfg,
        tokenizer=tokenizer,
        problems=problems,
        prompt_ids=prompt_ids,
        sampler=sampler,
        generator=generator,
        grader=build_grader(cfg),
        engines=EngineLayout.of(env.rank, env.world_size, cfg.generation.tensor_parallel_size),
    )


def _shape_overlong(cfg: RunConfig, records: list[QuestionRollouts]) -> None:
    """DAPO overlong reward shaping: a linear penalty over the last ``overlong_buffer_tokens`` of the budget."""
    a = cfg.algorithm
    if a.overlong_buffer_tokens == 0:
        return
    limit = cfg.generation.max_response_tokens
    start = limit - a.overlong_buffer_tokens
    for rec in records:
        rec.rewards = [
            r - a.overlong_penalty * min(max(len(resp) - start, 0) / a.overlong_buffer_tokens, 1.0)
            for r, resp in zip(rec.rewards, rec.responses, strict=True)
        ]


def _has_variance(rec: QuestionRollouts, threshold: float) -> bool:
    pos = sum(r > threshold for r in rec.rewards)
    return 0 < pos < len(rec.rewards)


def step_rollouts(
    ro: Rollouter,
    step: int,
    collect: Callable[[list[int], int], tuple[list[QuestionRollouts], dict[str, float]]] | None = None,
) -> tuple[list[QuestionRollouts], dict[str, float]]:
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
    hooks.point("rollouts", step=step)
    collect = collect or ro.collect
    cfg = ro.cfg
    need = cfg.algorithm.prompts_per_step
    base_seed = step_seed(cfg, step)
    ro.first_reward_error = None
    records, metrics = collect(ro.sampler.next_batch(), base_seed)
    check_reward_errors(cfg, step, metrics, ro.first_reward_error)
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
            check_reward_errors(cfg, step, metrics, ro.first_reward_error)  # the rounds so far: stop before the next
            kept += [r for r in more if _has_variance(r, threshold)]
            spare += [r for r in more if not _has_variance(r, threshold)]
            rounds += 1
        metrics["train/sampling_rounds"] = float(rounds)
        # Short of informative questions after max_sampling_rounds: fill with zero-variance ones (zero advantage).
        records = (kept + spare)[:need]
        metrics["train/informative_share"] = min(len(kept), need) / need
    _shape_overlong(cfg, records)
    if metrics.get("reward/graded"):
        failed = metrics.get("reward/errors", 0.0) + metrics.get("reward/timeouts", 0.0)
        metrics["reward/failed_share"] = failed / metrics["reward/graded"]
    return records, metrics


def _grading_failures(grade_metrics: dict[str, float], graded: int) -> dict[str, float]:
    """The failed rewards (``reward/timeouts``, ``reward/errors``) of ``reward/graded``, summed over every rank."""
    timeouts, errors, total = distributed.sum_floats(
        [grade_metrics.get("reward/timeouts", 0.0), grade_metrics.get("reward/errors", 0.0), float(graded)]
    )
    return {"reward/timeouts": timeouts, "reward/errors": errors, "reward/graded": total}


def reward_errors_line(metrics: dict[str, float]) -> str | None:
    """``reward errors 3/64 (2 timeouts)``: the step's failed rewards (errors and timeouts); None when none failed."""
    errors, timeouts = int(metrics.get("reward/errors", 0)), int(metrics.get("reward/timeouts", 0))
    if not errors and not timeouts:
        return None
    graded = int(metrics.get("reward/graded", 0))
    return f"reward errors {errors + timeouts}/{graded} ({timeouts} timeout{'' if timeouts == 1 else 's'})"


def check_reward_errors(cfg: RunConfig, step: int, metrics: dict[str, float], first_error: str | None) -> None:
    """Stop the run when the step's failed rewards reach ``reward.max_error_share`` of those graded so far.

    A failed reward is an error (an exception, a non-number, NaN or an infinity, a worker that died twice) or a
    timeout; it scores 0. With the default 1.0 the run stops only when every reward failed: a reward function
    that fails on everything would otherwise train on reward 0 to the end.

    Raises:
        RewardError: one line with the counts, the key and the first failure's description.
    """
    graded = metrics.get("reward/graded", 0.0)
    failed = metrics.get("reward/errors", 0.0) + metrics.get("reward/timeouts", 0.0)
    limit = cfg.reward.max_error_share
    if not graded or not failed or failed < limit * graded - 1e-9:
        return
    reached = "every reward failed" if failed >= graded else f"reward.max_error_share={limit:g} reached"
    raise RewardError(
        f"step {step}: {reward_errors_line(metrics)}: {reached}, stopping; the first: {first_error or 'unknown'}"
    )


def staleness_metrics(step: int, version: int) -> dict[str, float]:
    """``rollout/staleness_*``: steps between the weights being trained (``step - 1``) and those that sampled.

    Every rollout of a step comes from one version, so the mean and the max agree; both are logged for the
    dashboards of runs that mix versions.
    """
    lag = float(step - 1 - version)
    return {"rollout/staleness_mean": lag, "rollout/staleness_max": lag, "rollout/version": float(version)}
