"""DisCO training loop: Algorithm 1 of arXiv 2505.12366 (app. B), top to bottom.

One step (the update alone; the rollouts come from :mod:`nemo_disco.rollouts`, synchronous or one step
ahead in the generator's own processes, ``algorithm.async_rollouts``)::

    rollouts.next(step): algorithm.prompts_per_step questions with rollouts_per_prompt graded responses each and
        the generator's token log-probs (and the weight version that sampled them)
     -> policy.logprobs (no grad): pi_old's log-probs, frozen for the whole step (not of a first mini-batch
        trained in one pass: that pass makes them)
     -> mini-batches of whole questions (minibatch_prompts; prompts_per_step / minibatch_prompts updates)
        for each: nemo_disco.update, one unit: in general pass 1: per-rollout statistics at the current weights
                  (the first mini-batch reuses pi_old's log-probs: the weights have not moved yet), gathered
                  over data-parallel ranks; coefficients c = dL/dstats of the whole mini-batch objective
                  (losses.coefficients); pass 2: policy.train_minibatch backwards sum(c * stats) micro-batch by
                  micro-batch (any micro-batch size, any data-parallel size: the gradient is the mini-batch one).
                  Where the loss couples rollouts no further than a question at this update (Loss.coupling:
                  the GRPO family always; DisCO at the first update, whose KL hinge is exactly 0) and micro-
                  batches hold whole questions, ONE pass: each micro-batch's forward with gradients gives its
                  statistics, its exact coefficients and its backward (update.plan; logged, and counted in
                  update/forward_passes)
     -> rollouts.publish(step): the new weights are the generator's next (synchronous: refit before the next
        generation; asynchronous: streamed to the generator's processes now)
     -> metrics, validation every data.val_every steps, checkpoint every checkpoint.save_every steps

Departures from the paper: the objective averages over ALL questions of the mini-batch (questions
with no positive or no negative add 0; Algorithm 1 is undefined for them); the first update of the
first step has a non-zero learning rate.

Departures from the authors' code (docs/departures.md, with the keys that reproduce them):
the loss is the mini-batch objective, not a per-micro-batch one (the code groups and normalises per
micro-batch of 4 questions); the constraint gradient is the paper's 2*beta*(KL-delta)_+ (the code's
is half: ``loss.official_compat=true``); the logged objective is the true value (the code logs a
surrogate of value ~1); positives are ``reward > reward.positive_threshold`` (the code needs reward
exactly 1 / 0).

Launch::

    nemo-disco train --config recipes/tiny-cpu.yaml                       # CPU laptop / CI
    torchrun --nproc-per-node 8 -m nemo_disco.cli train --config recipes/disco-logl-r1qwen1.5b-1n8g-8k.yaml
    sbatch --nodes=2 --gres=gpu:8 slurm/train.sbatch recipes/disco-logl-r1qwen7b-2n8g-8k.yaml
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nemo_disco import checkpoint, data, distributed, hooks, losses, parts, rollouts, stats, update, watchdog, weights
from nemo_disco import config as config_lib
from nemo_disco.batch import QuestionRollouts, RolloutBatch, StepRows, collate_questions, step_rows
from nemo_disco.config import ConfigError, RunConfig
from nemo_disco.data import PromptSampler
from nemo_disco.metrics import MetricsLogger, Timer, read_jsonl
from nemo_disco.policy import build_policy
from nemo_disco.policy.base import Policy

log = logging.getLogger(__name__)

#: Exit code after a SIGUSR1 checkpoint: "preempted, requeue me" (slurm/train.sbatch requeues on it).
EXIT_REQUEUE = 3
#: Exit code after a Ctrl-C (SIGINT): the shell's "interrupted" (128 + 2), with or without the checkpoint.
EXIT_INTERRUPTED = 130


class Preempted(Exception):  # noqa: N818  (a control-flow signal, not an error)
    """Raised after the checkpoint that a SIGUSR1 / SIGTERM / SIGINT asked for; carries the exit code."""

    def __init__(self, code: int, signum: int = 0, path: Path | None = None) -> None:
        name = signal.Signals(signum).name if signum else "a signal"
        where = f": {path} (the same command resumes from it)" if path is not None else ""
        super().__init__(f"checkpoint saved after {name}{where}; exit code {code}")
        self.code = code


@dataclass
class Trainer:
    """Everything one training process holds; built by :func:`setup`."""

    cfg: RunConfig
    env: distributed.DistEnv
    run_dir: Path
    model_dir: Path
    tokenizer: Any
    policy: Policy
    rollouts: rollouts.RolloutSource
    logger: MetricsLogger
    loss: losses.Loss
    ref_policy: Policy | None = None
    step: int = 0
    update_plans: list[str] = field(default_factory=list)  # the last step's (logged when they change)
    dropped_prompts: int = 0
    signal_received: list[int] = field(default_factory=list)

    @property
    def sampler(self) -> PromptSampler:
        """The question order (its position is the generator's)."""
        return self.rollouts.sampler


# ----------------------------------------------------------------------------------------------------------------------
# Setup


def prepare_model(cfg: RunConfig, run_dir: Path, problems: data.RunProblems | None = None) -> Path:
    """The HF folder the run starts from: ``policy.model_path``, or a tiny model built (and warmed up) in code.

    ``problems``: the run's parsed sources, which the warm-up trains and measures on (None: parsed here if needed).
    """
    if cfg.policy.model_path is not None:
        return Path(cfg.policy.model_path)
    from nemo_disco import tiny

    model_dir = run_dir / "init_model"
    a = cfg.algorithm
    if not (model_dir / "config.json").is_file():
        if a.warmup_sft_steps and problems is None:
            problems = data.load_run_problems(cfg.data)
        # Checked on every rank, so that a held-out set too small for the target fails everywhere, not on rank 0 alone.
        held_out = _warmup_eval_problems(cfg, problems.val) if a.warmup_sft_steps and a.warmup_target else None
        if distributed.rank() == 0:
            tmp = run_dir / "init_model.tmp"
            tiny.build_model(cfg.policy.tiny, tmp, seed=a.seed)
            if a.warmup_sft_steps:
                # The global RNG leaves the warm-up as it entered: a reused warm-up and a redone one start RL alike.
                with torch.random.fork_rng(devices=[]):
                    tiny.warm_up(tmp, problems.train, cfg, held_out, cache=warmup_cache_dir(cfg))
            tmp.rename(model_dir)
    distributed.barrier()
    return model_dir


def warmup_cache_dir(cfg: RunConfig) -> Path | None:
    """Where warmed-up tiny models are kept for reuse: ``.warmup-cache`` beside the run folder (None: off).

    ``runs/tiny-cpu`` gives ``runs/.warmup-cache``, so every run under ``runs/`` shares it;
    ``algorithm.warmup_cache=false`` turns it off.
    """
    if not cfg.algorithm.warmup_cache:
        return None
    return Path(cfg.logging.run_dir).resolve().parent / ".warmup-cache"


def _warmup_eval_problems(cfg: RunConfig, val: list[data.Problem] | None) -> list:
    """The held-out problems the warm-up's accuracy target is measured on: ``val`` (data.val's) after validation's."""
    problems = val or []
    first, n = cfg.data.val_max_problems, cfg.algorithm.warmup_eval_problems
    if len(problems) < first + n:
        raise ConfigError(
            f"data.val={cfg.data.val!r} has {len(problems)} problems: fewer than data.val_max_problems={first} "
            f"(validation) + algorithm.warmup_eval_problems={n} (the warm-up's target); for synthetic data raise "
            "data.synthetic_size"
        )
    return problems[first : first + n]


def resume(run_dir: Path, policy: Policy, sampler: PromptSampler) -> tuple[Path | None, dict[str, Any], list[str]]:
    """Load the newest checkpoint that verifies against its manifest (collective); older ones if it does not.

    A checkpoint that fails verification is set aside (``step_<N>.corrupt``) with a note naming what failed.

    Returns:
        The checkpoint loaded (None: nothing to resume), its trainer state ({} without one) and the notes to log.
    """
    notes: list[str] = []
    for path in checkpoint.resume_candidates(run_dir):
        problems, verified = checkpoint.verify(path)
        if problems:
            aside = checkpoint.set_aside(path) if distributed.rank() == 0 else path.with_name(path.name + ".corrupt")
            distributed.barrier()
            notes.append(
                f"warning: checkpoint {path} skipped: {'; '.join(problems)}; set aside as {aside.name} (kept for "
                "inspection; delete it to free the space)"
            )
            continue
        if not verified:
            notes.append(f"warning: checkpoint {path} has no manifest (written before manifests): loaded unverified")
        state = checkpoint.load_trainer_state(path)
        policy.load(path / "policy")
        sampler.load_state_dict(state["sampler"])
        checkpoint.set_rng_state(state["rng"])
        return path, state, notes
    return None, {}, notes


def setup(
    cfg: RunConfig,
    role: tuple[distributed.DistEnv, distributed.Link] | None = None,
    problems: data.RunProblems | None = None,
) -> Trainer:
    """Process group, data, policy, rollout source, metrics; resume from the newest checkpoint.

    Args:
        cfg: the run.
        role: with asynchronous rollouts, this trainer process's place and its link to the generator
            (:func:`nemo_disco.distributed.init_roles`); None: synchronous, the job is the trainer.
        problems: ``data.train`` and ``data.val`` as the start-up check parsed them; None: parsed here, once, for
            the warm-up, training and validation alike.
    """
    env = role[0] if role is not None else distributed.init()
    if env.world_size != cfg.world_size:
        raise ConfigError(
            f"the launcher started {env.world_size} process(es) but the recipe expects cluster.nodes x "
            f"cluster.gpus_per_node = {cfg.cluster.nodes} x {cfg.cluster.gpus_per_node} = {cfg.world_size}"
        )
    torch.manual_seed(cfg.algorithm.seed)
    run_dir = Path(cfg.logging.run_dir)
    changed_keys = checkpoint.check_resume_config(cfg, run_dir)  # before anything is built or overwritten
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        config_lib.save(cfg, run_dir / "config.yaml")
    distributed.barrier()
    if problems is None:
        problems = data.load_run_problems(cfg.data)
    model_dir = prepare_model(cfg, run_dir, problems)
    if cfg.policy.backend == "megatron":
        # An unsupported architecture stops the run here, in one line, before any engine or policy is built.
        weights.ModelSpec.from_dir(model_dir)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    max_prompt_tokens, prompts_per_step = cfg.generation.max_prompt_tokens, cfg.algorithm.prompts_per_step
    loaded = problems
    problems, prompt_ids, skipped, dropped = data.train_problems(
        cfg.data, tokenizer, max_prompt_tokens=max_prompt_tokens, prompts_per_step=prompts_per_step, loaded=loaded
    )
    sampler = data.new_sampler(cfg.data, len(problems), prompts_per_step)
    # Synchronous: the generator first (asleep when colocated), so that vLLM finds the GPU's memory free.
    generator = rollouts.start_generator(cfg, model_dir) if role is None else None
    policy = build_policy(cfg, model_dir)
    loss = parts.loss_of(cfg)  # its hyper-parameters validated by its own model and bound once
    # The KL reference (GRPO family with kl_coef > 0): forward only, offloaded with the policy when colocated.
    ref_policy = build_policy(cfg, model_dir, trainable=False) if loss.needs_reference else None

    latest, state, notes = resume(run_dir, policy, sampler) if cfg.checkpoint.resume else (None, {}, [])
    step = state.get("step", 0)
    if changed_keys:
        notes.append(f"resuming with changed keys (checkpoint.allow_config_change=true): {'; '.join(changed_keys)}")
    if env.is_main:
        from nemo_disco.metrics import truncate_jsonl

        truncate_jsonl(run_dir / "metrics.jsonl", step)
    logger = MetricsLogger(
        run_dir,
        enabled=env.is_main,
        tensorboard=cfg.logging.tensorboard,
        wandb=cfg.logging.wandb,
        wandb_project=cfg.logging.wandb_project,
        total_steps=cfg.algorithm.steps,
        start_step=step,
        progress=cfg.logging.progress,
        run_config=cfg.model_dump(mode="json"),
    )
    for note in notes:
        logger.write(note)
    logger.write(f"loss {loss.name}: " + ", ".join(f"{k}={v}" for k, v in loss.hyperparameters.items()))
    if latest is not None:
        logger.write(f"resumed from {latest} (step {step})")
    if step > cfg.algorithm.steps:
        logger.write(
            f"warning: {latest} is at step {step}, past algorithm.steps={cfg.algorithm.steps}: nothing is trained and "
            f"the run's results stay those of step {step} (raise algorithm.steps to go on, or use a new "
            "logging.run_dir for a shorter run)"
        )
    elif latest is not None and step == cfg.algorithm.steps:
        logger.write(f"the run is already complete at step {step} (algorithm.steps={step}): nothing to train")
    if skipped or dropped:
        logger.write(
            f"data: {skipped} bad rows skipped, {dropped} prompts over "
            f"{cfg.generation.max_prompt_tokens} tokens dropped"
        )
    if role is not None:
        source: rollouts.RolloutSource = rollouts.RemoteRollouts(
            cfg, role[1], policy, sampler, model_dir, state.get("pending_rollouts", [])
        )
        if cfg.rollout_correction == "none":
            logger.write(
                "warning: asynchronous rollouts without a correction (loss.rollout_correction=none): stale "
                "rollouts are trained on as if the current policy had sampled them"
            )
    else:
        ro = rollouts.build_rollouter(cfg, env, tokenizer, problems, prompt_ids, sampler, generator)
        val = data.val_problems(cfg.data, tokenizer, max_prompt_tokens=max_prompt_tokens, loaded=loaded)
        source = rollouts.LocalRollouts(ro, policy, ref_policy, val)
    return Trainer(
        cfg=cfg,
        env=env,
        run_dir=run_dir,
        model_dir=model_dir,
        tokenizer=tokenizer,
        policy=policy,
        rollouts=source,
        logger=logger,
        loss=loss,
        ref_policy=ref_policy,
        step=step,
        dropped_prompts=dropped,
    )


# ----------------------------------------------------------------------------------------------------------------------
# One step


def _dp_slice(n: int, policy: Policy) -> slice:
    per = n // policy.dp_size
    return slice(policy.dp_rank * per, (policy.dp_rank + 1) * per)


def _reference_logprobs(tr: Trainer, local: RolloutBatch) -> torch.Tensor | None:
    """The reference policy's log-probs of this rank's rows (None without a reference).

    Colocated, the reference lives on the host between steps: it is loaded for its forward pass only.
    """
    if tr.ref_policy is None:
        return None
    tr.ref_policy.onload()
    try:
        return tr.ref_policy.logprobs(local)[0]
    finally:
        if rollouts.is_colocated(tr.cfg):
            tr.ref_policy.offload()


def _local_rows(n_rows: int, num_minibatches: int, policy: Policy) -> torch.Tensor:
    """This DP rank's rows of every mini-batch, mini-batch after mini-batch."""
    per_mb = n_rows // num_minibatches
    share = _dp_slice(per_mb, policy)
    return torch.cat([torch.arange(m * per_mb + share.start, m * per_mb + share.stop) for m in range(num_minibatches)])


def _gather_rows(t: torch.Tensor, policy: Policy, num_minibatches: int) -> torch.Tensor:
    """Inverse of :func:`_local_rows`: every rank's rows back in batch order."""
    if policy.dp_size == 1:
        return t
    full = distributed.all_gather_rows(t, policy.dp_group)  # [dp * n_local, ...] in rank order
    per_rank = t.shape[0] // num_minibatches
    chunks = full.view(policy.dp_size, num_minibatches, per_rank, *t.shape[1:]).transpose(0, 1)
    return chunks.reshape(-1, *t.shape[1:])


def train_step(tr: Trainer) -> dict[str, float]:
    """One step of Algorithm 1; returns its metrics.

    The loop over mini-batches; each update is :func:`nemo_disco.update.run`, in one pass where that is exact
    (:func:`nemo_disco.update.plan`). A first update in one pass makes pi_old's log-probs of its mini-batch
    itself: the no-grad forward then covers the other mini-batches only.
    """
    cfg, loss, policy = tr.cfg, tr.loss, tr.policy
    timer = Timer()
    correction = update.Correction(cfg.rollout_correction, cfg.loss.rollout_correction_cap)
    with timer("step"):
        records, metrics = tr.rollouts.next(tr.step + 1)
        failed = rollouts.reward_errors_line(metrics)
        if failed:  # every step with a failed reward says so (they score 0 and train as negatives)
            tr.logger.write(f"step {tr.step + 1}: {failed}")
        # Every rollout's group id, reward, mask and generator log-probs (the mini-batch objective couples ranks);
        # the tokens of this rank's rows only, padded to the whole batch's widths.
        batch = step_rows(records)
        num_mb = tr.cfg.updates_per_step
        local = collate_questions(records, tr.tokenizer.pad_token_id, rows=_local_rows(len(batch), num_mb, policy))
        per_mb_local = len(local) // num_mb
        per_mb = len(batch) // num_mb
        first = update.plan(
            policy,
            loss,
            batch.select(slice(0, per_mb)),
            local.select(slice(0, per_mb_local)),
            _dp_slice(per_mb, policy),
            first_update=True,
            correction=correction,
        )
        # pi_old's log-probs: of every mini-batch but a first one trained in one pass (it makes its own).
        skip = per_mb_local if first.passes == 1 else 0
        width = local.response_ids.shape[1]
        old_local = torch.zeros((len(local), width), dtype=torch.float32)
        ent_local = torch.zeros((len(local), width), dtype=torch.float32)
        with timer("old_logprobs"):
            if skip < len(local):
                lp, ent = policy.logprobs(local.select(slice(skip, None)), entropy=True)
                old_local[skip:], ent_local[skip:] = lp, ent
            ref_local = _reference_logprobs(tr, local)
        local = local.with_(old_logprobs=old_local, ref_logprobs=ref_local)
        hooks.point("old_logprobs", step=tr.step + 1)
        old = _gather_rows(old_local, policy, num_mb)  # rows of a one-pass first mini-batch: 0 until it ran
        # Each rollout's weight once: here from pi_old's log-probs; a one-pass first mini-batch's rows by that pass
        # (it makes their log-probs), put in place after it. The step's weight metrics read these, not a recount.
        ratio = correction.log_ratios(old, batch.gen_logprobs, batch.response_mask) if correction.weighted else None
        weights = correction.weights(ratio) if ratio is not None else None
        forwards = (num_mb - (1 if skip else 0)) / num_mb
        update_metrics: list[dict[str, float]] = []
        plans: list[str] = []
        one_pass = 0
        with timer("train"):
            for m in range(num_mb):
                rows_local = slice(m * per_mb_local, (m + 1) * per_mb_local)
                rows = slice(m * per_mb, (m + 1) * per_mb)
                full_mb, local_mb = batch.select(rows), local.select(rows_local)
                dp_rows = _dp_slice(per_mb, policy)
                pl = (
                    first
                    if m == 0
                    else update.plan(
                        policy, loss, full_mb, local_mb, dp_rows, first_update=False, correction=correction
                    )
                )
                plans.append(f"{pl.passes} pass{'es' if pl.passes > 1 else ''} ({pl.why})")  # update m's
                one_pass += pl.passes == 1
                one_pass_first = m == 0 and pl.passes == 1
                mb = update.Minibatch(
                    full=full_mb,
                    local=local_mb.with_(old_logprobs=None) if one_pass_first else local_mb,
                    rows=dp_rows,
                    old_entropy=ent_local[rows_local],
                    weights=None if one_pass_first or weights is None else weights[rows],
                )
                res = update.run(policy, loss, mb, passes=pl.passes, first_update=m == 0, correction=correction)
                forwards += res.forwards / num_mb
                if res.log_ratios is not None and ratio is not None and weights is not None:
                    ratio[rows] = _gather_rows(res.log_ratios, policy, 1)
                    weights[rows] = _gather_rows(res.weights, policy, 1)
                if res.old_logprobs is not None:
                    old_local[rows_local] = res.old_logprobs
                    if res.old_entropy is not None:
                        ent_local[rows_local] = res.old_entropy
                if not res.trained:
                    tr.logger.write(
                        f"step {tr.step + 1} update {m}: non-finite loss {res.metrics['loss']}; update skipped"
                    )
                else:
                    tr.rollouts.weights_changed()
                    if res.metrics.get("skipped"):
                        tr.logger.write(f"step {tr.step + 1} update {m}: non-finite gradient; update skipped")
                update_metrics.append(res.metrics)
        if plans != tr.update_plans:
            for line in _plan_lines(plans):
                tr.logger.write(f"step {tr.step + 1}: {line}")
            tr.update_plans = plans
    if skip:  # the first mini-batch's old log-probs came from its one pass
        old = _gather_rows(old_local, policy, num_mb)
    entropy = _gather_rows(ent_local, policy, num_mb)
    mask = batch.response_mask
    metrics.update(timer.metrics())
    metrics.setdefault("timing/refit", 0.0)
    metrics.update(_step_metrics(batch, old, entropy, update_metrics, records, cfg.reward.positive_threshold))
    metrics.update(losses.mismatch_metrics(old, batch.gen_logprobs, mask))
    metrics.update(correction.metrics(ratio, weights))
    metrics["update/forward_passes"] = forwards
    metrics["update/one_pass_updates"] = float(one_pass)
    return metrics


def _plan_lines(plans: list[str]) -> list[str]:
    """The update plans of a step (update m's at index m), one line per run of equal plans (``updates 1-3: ...``)."""
    lines, m = [], 0
    for plan, run in itertools.groupby(plans):
        n = len(list(run))
        lines.append(f"{f'update {m}' if n == 1 else f'updates {m}-{m + n - 1}'}: {plan}")
        m += n
    return lines


def _step_metrics(
    batch: RolloutBatch | StepRows,
    old: torch.Tensor,
    entropy: torch.Tensor,
    updates: list[dict[str, float]],
    records: list[QuestionRollouts],
    threshold: float,
) -> dict[str, float]:
    mask = batch.response_mask
    lengths = mask.sum(1).float()
    correct = batch.rewards > threshold
    # Mean response length (tokens) of the correct and of the wrong rollouts; absent in a step that has none.
    by_outcome = {
        f"train/response_length_{name}_mean": float(lengths[sel].mean())
        for name, sel in (("correct", correct), ("wrong", ~correct))
        if bool(sel.any())
    }
    out = {
        **by_outcome,
        "train/reward_mean": float(batch.rewards.mean()),
        "train/response_length_mean": float(lengths.mean()),
        "train/response_length_max": float(lengths.max()),
        "train/truncated_share": sum(f == "length" for rec in records for f in rec.finish) / len(batch),
        "train/entropy": float(entropy[mask].mean()) if mask.any() else 0.0,
        "train/old_logprob_mean": float(old[mask].mean()) if mask.any() else 0.0,
        "train/updates_skipped": float(sum(u.get("skipped", 0.0) for u in updates)),
    }
    keys = {k for u in updates for k in u}
    for k in sorted(keys - {"skipped"}):
        vals = [u[k] for u in updates if k in u and u[k] is not None]
        if vals:
            out[f"train/{k}"] = sum(vals) / len(vals)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Validation, checkpoints, the loop


def _log_validation(tr: Trainer, step: int, per_problem: list[float], failures: dict[str, float]) -> dict[str, float]:
    """``val/pass@1`` and its standard error over problems; the per-problem values go to validation.jsonl.

    Rewards that failed (``failures``: errors and timeouts, which score 0) are said in one line and counted in the
    record, since they lower the pass@1. A record for ``step`` replaces any of the same or a later step (left by a
    run that resumed before them).
    """
    mean, se = stats.mean_se(per_problem) if per_problem else (0.0, 0.0)
    failed = rollouts.reward_errors_line(failures)
    if failed:
        when = "before step 1" if step == 0 else f"after step {step}"
        tr.logger.write(f"validation {when}: {failed}, counted as wrong")
    if tr.env.is_main:
        path = tr.run_dir / "validation.jsonl"
        kept = [r for r in read_jsonl(path) if r["step"] < step]
        n_failed = int(failures.get("reward/errors", 0) + failures.get("reward/timeouts", 0))
        kept.append(
            {"step": step, "pass@1": mean, "pass@1_se": se, "per_problem": per_problem, "reward_failed": n_failed}
        )
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(path)
    return {"val/pass@1": mean, "val/pass@1_se": se}


def save_checkpoint(tr: Trainer) -> Path:
    """Atomic checkpoint of the current step."""
    state = {**tr.rollouts.state_dict(tr.step), "rng": checkpoint.rng_state()}
    return checkpoint.save(tr.run_dir, tr.step, tr.policy, state, tr.cfg, tr.cfg.checkpoint.keep_last)


def _install_signal_handlers(tr: Trainer) -> None:
    """SIGUSR1, SIGTERM and a first SIGINT (Ctrl-C): checkpoint after the current step, then exit.

    The step in progress finishes first (a step is the unit a checkpoint holds). A second Ctrl-C aborts at once
    (``KeyboardInterrupt``, exit code 130) without a new checkpoint: a save it interrupts is left as a ``.tmp``
    folder that resume ignores, so the run resumes from the newest complete checkpoint.
    """

    def handler(signum: int, _frame: object) -> None:
        tr.signal_received.append(signum)

    def on_interrupt(signum: int, _frame: object) -> None:
        tr.signal_received.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the next Ctrl-C raises KeyboardInterrupt
        if tr.env.is_main:  # os.write: a print here could re-enter a print that the signal interrupted
            line = (
                f"nemo-disco: Ctrl-C: finishing step {tr.step + 1}, then saving a checkpoint and exiting "
                f"(exit code {EXIT_INTERRUPTED}); press Ctrl-C again to stop at once without one\n"
            )
            os.write(sys.stderr.fileno(), line.encode())

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, handler)
    signal.signal(signal.SIGINT, on_interrupt)


def _exit_code(sig: int) -> int:
    """The exit code after the checkpoint a signal asked for: 3 (SIGUSR1, requeue), 130 (SIGINT), 0 (SIGTERM)."""
    return {signal.SIGUSR1: EXIT_REQUEUE, signal.SIGINT: EXIT_INTERRUPTED}.get(sig, 0)


def _signal_agreed(tr: Trainer) -> int:
    """The signal any rank received (all ranks agree, so they checkpoint together); 0 if none."""
    return distributed.max_int(tr.signal_received[0] if tr.signal_received else 0)


def _collective_timeout_minutes(cfg: RunConfig) -> int:
    """The process group's collective timeout: above the step watchdog's floor, so the watchdog acts first."""
    return max(30, math.ceil(4 * cfg.cluster.step_timeout_s / 60))


def train(cfg: RunConfig, problems: data.RunProblems | None = None) -> dict[str, float]:
    """Run (or resume) training to ``algorithm.steps``; returns the last step's metrics.

    ``problems``: ``data.train`` and ``data.val`` already parsed (the CLI's start-up check parses them); None:
    parsed once in :func:`setup`.

    A step watchdog and a peer monitor (:mod:`nemo_disco.watchdog`) run beside the loop: a hung step, validation
    or checkpoint save ends the run with exit code 4 (stacks in the log), a dead, frozen or failed rank ends every
    other rank with exit code 5 (the log names it).

    With ``algorithm.async_rollouts`` the launched job splits into the trainer (this loop) and the generator
    (:func:`nemo_disco.rollouts.serve`, which returns {} when the trainer tells it to stop).

    Raises:
        Preempted: after SIGUSR1 (exit code 3, requeue), SIGTERM (exit code 0) or a first Ctrl-C (SIGINT, exit code
            130) with a checkpoint saved.
        checkpoint.SaveError: a checkpoint could not be written (the previous one is intact).
    """
    timeout = _collective_timeout_minutes(cfg)
    role = None
    if cfg.algorithm.async_rollouts:
        name, env, link = distributed.init_roles(cfg.world_size, cfg.generation_world_size, timeout)
        role = (env, link)
    else:
        distributed.init(timeout_minutes=timeout)
    wd = watchdog.from_env(cfg.cluster.step_timeout_s, Path(cfg.logging.run_dir))
    wd.start()
    try:
        if role is not None and name == "generator":
            code = rollouts.serve(cfg, env, link, wd, problems)
            wd.stop()
            if code:
                raise Preempted(code)
            return {}
        last = _train(cfg, wd, role, problems)
    except (Preempted, KeyboardInterrupt):
        wd.stop()
        raise
    except ConfigError as err:  # every rank meets it at the same point: each exits 2 with it
        wd.on_error(err, wait=False)
        raise
    except Exception as err:
        wd.on_error(err)  # exits here if a peer died or reported first (then that is the cause)
        if isinstance(err, checkpoint.SaveError):
            print(f"nemo-disco: rank {distributed.rank()}: error: {err}", file=sys.stderr, flush=True)
        raise
    wd.stop()
    return last


def _train(
    cfg: RunConfig,
    wd: watchdog.Watchdog,
    role: tuple[distributed.DistEnv, distributed.Link] | None,
    problems: data.RunProblems | None = None,
) -> dict[str, float]:
    tr = setup(cfg, role, problems)
    _install_signal_handlers(tr)
    a = cfg.algorithm
    # data.val_every = 0: no validation at all (data.val may still serve the warm-up's target).
    val_every = cfg.data.val_every if cfg.data.val else 0
    last: dict[str, float] = {}
    code: int | None = None  # the exit code the generator is told to end with (None: an error)
    try:
        if isinstance(tr.rollouts, rollouts.RemoteRollouts):
            first_val = a.seed if val_every and tr.step == 0 else None
            with wd.phase("step", "weights to the generator"):
                tr.rollouts.start(tr.step, first_val)
        if val_every and tr.step == 0:
            with wd.phase("validation", "validation before step 1"):
                per_problem, failures = tr.rollouts.validate(0, a.seed)
            tr.logger.log(0, _log_validation(tr, 0, per_problem, failures))
        while tr.step < a.steps:
            label = f"step {tr.step + 1}"
            with wd.phase("step", label):
                metrics = train_step(tr)
                tr.step += 1
                sig = _signal_agreed(tr)
                # Every data.val_every steps, and at the last step: the run's result is the final weights'.
                val_due = bool(val_every) and (tr.step % val_every == 0 or tr.step == a.steps)
                more = tr.step < a.steps and not sig
                metrics["timing/publish"] = tr.rollouts.publish(
                    tr.step, validate_seed=a.seed + tr.step if val_due else None, more=more
                )
            if val_due:
                with wd.phase("validation", f"validation after {label}"):
                    per_problem, failures = tr.rollouts.validate(tr.step, a.seed + tr.step)
                metrics.update(_log_validation(tr, tr.step, per_problem, failures))
            with wd.phase("step", f"{label} (metrics)"):
                tr.logger.log(tr.step, metrics)
            last = metrics
            periodic = cfg.checkpoint.save_every and tr.step % cfg.checkpoint.save_every == 0
            if periodic or sig or tr.step == a.steps:
                with wd.phase("checkpoint", f"checkpoint step {tr.step}"):
                    path = save_checkpoint(tr)
                tr.logger.write(f"checkpoint {path}")
            if sig:
                code = _exit_code(sig)
                raise Preempted(code, sig, path)
        code = 0
    finally:
        tr.logger.close()
        tr.rollouts.close(code)
    if tr.env.is_main and last:  # a run that trained no step keeps its final.json
        (tr.run_dir / "final.json").write_text(json.dumps({"step": tr.step, **last}, indent=1))
    return last
