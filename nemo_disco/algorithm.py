"""DisCO training loop: Algorithm 1 of arXiv 2505.12366 (app. B), top to bottom.

One step::

    refit: stream the policy's weights (HF names) into the generator (colocated: offload the policy's
           gradients and optimizer state, wake weights, refit, offload the policy's weights, wake the KV cache;
           after generation the engine sleeps, the policy comes back)
    prompts (algorithm.prompts_per_step questions, deterministic resumable order)
     -> generator: rollouts_per_prompt responses each, with the generator's token log-probs (each generation
        engine, generation.tensor_parallel_size consecutive ranks, takes a share of the questions)
     -> rewards: math grading in a process pool (hard per-item timeout)
     -> policy.logprobs (no grad): pi_old's log-probs, frozen for the whole step
     -> mini-batches of whole questions (minibatch_prompts; prompts_per_step / minibatch_prompts updates)
        for each: pass 1: per-rollout statistics at the current weights (the first mini-batch reuses
                  pi_old's log-probs: the weights have not moved yet), gathered over data-parallel ranks;
                  coefficients c = dL/dstats of the whole mini-batch objective (losses.coefficients);
                  pass 2: policy.train_minibatch backwards sum(c * stats) micro-batch by micro-batch
                  (any micro-batch size, any data-parallel size: the gradient is the mini-batch one)
     -> metrics, validation every data.val_every steps, checkpoint every checkpoint.save_every steps

Departures from the paper: the objective averages over ALL questions of the mini-batch (questions
with no positive or no negative add 0; Algorithm 1 is undefined for them); the first update of the
first step has a non-zero learning rate.

Departures from the authors' code (reference/official-code-notes.md), each reproducible:
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

import contextlib
import json
import logging
import math
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nemo_disco import checkpoint, distributed, losses, stats, watchdog
from nemo_disco import config as config_lib
from nemo_disco.batch import RolloutBatch, collate
from nemo_disco.config import ConfigError, RunConfig
from nemo_disco.data import PromptSampler, encode_run_prompts, load_problems
from nemo_disco.generation.base import EngineLayout, Generator, SamplingParams
from nemo_disco.metrics import MetricsLogger, Timer, read_jsonl
from nemo_disco.policy import build_policy
from nemo_disco.policy.base import Policy
from nemo_disco.rewards import GraderPool

log = logging.getLogger(__name__)

#: Exit code after a SIGUSR1 checkpoint: "preempted, requeue me" (slurm/train.sbatch requeues on it).
EXIT_REQUEUE = 3


class Preempted(Exception):  # noqa: N818  (a control-flow signal, not an error)
    """Raised after the checkpoint that a SIGUSR1 / SIGTERM asked for; carries the exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(f"checkpoint saved after signal; exit code {code}")
        self.code = code


@dataclass
class Trainer:
    """Everything one training process holds; built by :func:`setup`."""

    cfg: RunConfig
    env: distributed.DistEnv
    run_dir: Path
    model_dir: Path
    tokenizer: Any
    problems: list
    prompt_ids: list[list[int]]
    sampler: PromptSampler
    policy: Policy
    generator: Generator
    grader: GraderPool
    logger: MetricsLogger
    loss: losses.Loss
    loss_hp: dict[str, Any]
    engines: EngineLayout
    ref_policy: Policy | None = None
    # The generator's weights lag the policy's (vLLM starts from dummy weights; every update and a resume
    # change the policy): refit before the next generation.
    generator_stale: bool = True
    step: int = 0
    dropped_prompts: int = 0
    signal_received: list[int] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------------------------
# Setup


def prepare_model(cfg: RunConfig, run_dir: Path) -> Path:
    """The HF folder the run starts from: ``policy.model_path``, or a tiny model built (and warmed up) in code."""
    if cfg.policy.model_path is not None:
        return Path(cfg.policy.model_path)
    from nemo_disco import tiny

    model_dir = run_dir / "init_model"
    a = cfg.algorithm
    if not (model_dir / "config.json").is_file():
        # Read on every rank, so that a held-out set too small for the target fails everywhere, not on rank 0 alone.
        held_out = _warmup_eval_problems(cfg) if a.warmup_sft_steps and a.warmup_target else None
        if distributed.rank() == 0:
            tmp = run_dir / "init_model.tmp"
            tiny.build_model(cfg.policy.tiny, tmp, seed=a.seed)
            if a.warmup_sft_steps:
                problems, _ = load_problems(cfg.data.train, **_data_kwargs(cfg))
                tiny.warm_up(tmp, problems, cfg, held_out)
            tmp.rename(model_dir)
    distributed.barrier()
    return model_dir


def _warmup_eval_problems(cfg: RunConfig) -> list:
    """The held-out problems the warm-up's accuracy target is measured on: data.val after the validation ones."""
    problems, _ = load_problems(cfg.data.val, **{**_data_kwargs(cfg), "on_bad_row": "skip"})
    first, n = cfg.data.val_max_problems, cfg.algorithm.warmup_eval_problems
    if len(problems) < first + n:
        raise ConfigError(
            f"data.val={cfg.data.val!r} has {len(problems)} problems: fewer than data.val_max_problems={first} "
            f"(validation) + algorithm.warmup_eval_problems={n} (the warm-up's target); for synthetic data raise "
            "data.synthetic_size"
        )
    return problems[first : first + n]


def _data_kwargs(cfg: RunConfig) -> dict[str, Any]:
    return {
        "split": cfg.data.split,
        "on_bad_row": cfg.data.on_bad_row,
        "synthetic_size": cfg.data.synthetic_size,
        "seed": cfg.data.seed,
    }


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


def resume(run_dir: Path, policy: Policy, sampler: PromptSampler) -> tuple[Path | None, list[str]]:
    """Load the newest checkpoint that verifies against its manifest (collective); older ones if it does not.

    A checkpoint that fails verification is set aside (``step_<N>.corrupt``) with a note naming what failed.

    Returns:
        The checkpoint loaded (None: nothing to resume) and the notes to log.
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
        return path, notes
    return None, notes


def setup(cfg: RunConfig) -> Trainer:
    """Process group, data, policy, generator, grader, metrics; resume from the newest checkpoint."""
    env = distributed.init()
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
    model_dir = prepare_model(cfg, run_dir)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    problems, skipped = load_problems(cfg.data.train, **_data_kwargs(cfg))
    prompt_ids, kept, dropped = encode_run_prompts(tokenizer, problems, cfg)
    problems = [problems[i] for i in kept]
    if len(problems) < cfg.algorithm.prompts_per_step:
        raise ConfigError(
            f"data.train={cfg.data.train!r} has {len(problems)} usable problems, fewer than "
            f"algorithm.prompts_per_step={cfg.algorithm.prompts_per_step}"
        )
    sampler = PromptSampler(len(problems), cfg.algorithm.prompts_per_step, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    policy = build_policy(cfg, model_dir)
    hp = config_lib.loss_kwargs(cfg)
    loss = losses.get_loss(cfg.loss.name, **hp)
    # The KL reference (GRPO family with kl_coef > 0): forward only, offloaded with the policy when colocated.
    ref_policy = build_policy(cfg, model_dir, trainable=False) if loss.needs_reference else None

    latest, notes = resume(run_dir, policy, sampler) if cfg.checkpoint.resume else (None, [])
    step = checkpoint.load_trainer_state(latest)["step"] if latest is not None else 0
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
    if latest is not None:
        logger.write(f"resumed from {latest} (step {step})")
    if skipped or dropped:
        logger.write(
            f"data: {skipped} bad rows skipped, {dropped} prompts over "
            f"{cfg.generation.max_prompt_tokens} tokens dropped"
        )
    generator = build_generator(cfg, model_dir)
    grader = GraderPool(cfg.reward.grader, timeout_s=cfg.reward.timeout_s, workers=cfg.reward.workers)
    return Trainer(
        cfg=cfg,
        env=env,
        run_dir=run_dir,
        model_dir=model_dir,
        tokenizer=tokenizer,
        problems=problems,
        prompt_ids=prompt_ids,
        sampler=sampler,
        policy=policy,
        generator=generator,
        grader=grader,
        logger=logger,
        loss=loss,
        loss_hp=hp,
        engines=EngineLayout.of(env.rank, env.world_size, cfg.generation.tensor_parallel_size),
        ref_policy=ref_policy,
        step=step,
        dropped_prompts=dropped,
    )


# ----------------------------------------------------------------------------------------------------------------------
# One step


def _sampling(cfg: RunConfig, tokenizer: Any, seed: int, max_tokens: int | None = None) -> SamplingParams:
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


def _dp_slice(n: int, policy: Policy) -> slice:
    per = n // policy.dp_size
    return slice(policy.dp_rank * per, (policy.dp_rank + 1) * per)


def _gather_engines(items: list, tr: Trainer) -> list:
    """Concatenate the engine leaders' lists in engine order (identical on every rank)."""
    parts = distributed.all_gather_object(items if tr.engines.leader else [])
    return [x for part in parts for x in part]


def _engine_seed(seed: int, tr: Trainer) -> int:
    """The sampling seed of this process's engine: engines draw independent streams.

    The ranks of one engine share theirs, as a tensor-parallel vLLM engine requires.
    """
    return (seed + 1_000_033 * tr.engines.index) % (2**31)


def collect_rollouts(tr: Trainer, question_ids: list[int], seed: int) -> tuple[list[dict], dict[str, float]]:
    """Generate and grade ``rollouts_per_prompt`` responses for each question; identical result on every rank.

    Each generation engine generates for its share of the questions (every rank of a tensor-parallel engine
    with the same requests), its leader grades them, and the leaders' records are gathered on every rank.

    Returns:
        One record per question (prompt ids, responses, generator log-probs, rewards, finish reasons),
        and generation / grading metrics.
    """
    cfg, timer = tr.cfg, Timer()
    g = cfg.algorithm.rollouts_per_prompt
    local = question_ids[tr.engines.share(len(question_ids))]
    with timer("generate"):
        sampling = _sampling(cfg, tr.tokenizer, _engine_seed(seed, tr))
        rollouts = tr.generator.generate([tr.prompt_ids[q] for q in local], g, sampling) if local else []
    if not tr.engines.leader:  # the engine's leader grades and reports its rollouts
        local, rollouts = [], []
    texts = [tr.tokenizer.decode(r.token_ids, skip_special_tokens=True) for rs in rollouts for r in rs]
    truths = [tr.problems[q].answer for q in local for _ in range(g)]
    with timer("grade"):
        scores, grade_metrics = tr.grader.score(texts, truths) if texts else ([], {})
    records = []
    for k, (q, rs) in enumerate(zip(local, rollouts, strict=True)):
        records.append(
            {
                "question": q,
                "prompt": list(tr.prompt_ids[q]),
                "responses": [list(r.token_ids) for r in rs],
                "logprobs": [list(r.logprobs) for r in rs],
                "finish": [r.finish_reason for r in rs],
                "rewards": scores[k * g : (k + 1) * g],
            }
        )
    records = _gather_engines(records, tr)
    timeouts, errors = distributed.sum_floats(
        [grade_metrics.get("reward/timeouts", 0.0), grade_metrics.get("reward/errors", 0.0)]
    )
    return records, {**timer.metrics(), "reward/timeouts": timeouts, "reward/errors": errors}


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


def _colocated(tr: Trainer) -> bool:
    return tr.cfg.generation.backend == "vllm" and torch.cuda.is_available()


@contextlib.contextmanager
def generation_phase(tr: Trainer, timer: Timer, colocated: bool | None = None) -> Iterator[None]:
    """Hand the GPU to the generator and back (the colocated order), refitting stale weights on the way.

    Order: offload the policy's gradients and optimizer state (and the reference policy), wake the engine's
    weights, stream the policy's weights in (refit), offload the policy's weights, wake the KV cache, generate,
    put the engine to sleep, load the policy back. ``colocated`` None: vLLM on a GPU.
    """
    colocated = _colocated(tr) if colocated is None else colocated
    if colocated:
        tr.policy.offload(weights=False)  # the refit reads the weights only: free the rest first
        if tr.ref_policy is not None:
            tr.ref_policy.offload()
        tr.generator.wake_up(["weights"])
    if tr.generator_stale:
        with timer("refit"):
            tr.generator.update_weights(tr.policy.export_weights())
        tr.generator_stale = False
    if colocated:
        tr.policy.offload()
        tr.generator.wake_up(["kv_cache"])
    try:
        yield
    finally:
        if colocated:
            tr.generator.sleep()
            if getattr(tr.generator, "sleep_level", 1) >= 2:  # level 2 drops the weights: the next wake needs a refit
                tr.generator_stale = True
            tr.policy.onload()


def rollout_phase(
    tr: Trainer, collect: Callable[[Trainer, list[int], int], tuple[list[dict], dict[str, float]]] | None = None
) -> tuple[list[dict], dict[str, float]]:
    """The step's questions with their graded rollouts; dynamic sampling tops up informative ones.

    With ``algorithm.dynamic_sampling`` more rounds of questions are sampled (at most
    ``algorithm.max_sampling_rounds`` in all) until ``algorithm.min_valid_share`` of the step's questions have
    both a positive and a negative rollout: 1.0 is DAPO's rule (all of them), 0.6 GPG's beta_th (Alg. 1 of
    arXiv 2504.02546). The informative questions come first, zero-variance ones fill the rest.

    Args:
        tr: the trainer.
        collect: :func:`collect_rollouts` (tests pass their own).
    """
    collect = collect or collect_rollouts
    cfg = tr.cfg
    need = cfg.algorithm.prompts_per_step
    base_seed = (cfg.algorithm.seed * 1_000_003 + tr.step * 7919) % (2**31)
    records, metrics = collect(tr, tr.sampler.next_batch(), base_seed)
    if cfg.algorithm.dynamic_sampling:
        threshold = cfg.reward.positive_threshold
        kept = [r for r in records if _has_variance(r, threshold)]
        spare = [r for r in records if not _has_variance(r, threshold)]
        target = math.ceil(cfg.algorithm.min_valid_share * need - 1e-9)
        rounds = 1
        while len(kept) < target and rounds < cfg.algorithm.max_sampling_rounds:
            more, m = collect(tr, tr.sampler.next_batch(), base_seed + rounds)
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


def build_batch(tr: Trainer, records: list[dict]) -> RolloutBatch:
    """The step's rollouts as one batch, question by question (rollouts of a question adjacent)."""
    prompts, responses, lps, gids, rewards = [], [], [], [], []
    for k, rec in enumerate(records):
        for resp, lp, r in zip(rec["responses"], rec["logprobs"], rec["rewards"], strict=True):
            prompts.append(rec["prompt"])
            responses.append(resp)
            lps.append(lp)
            gids.append(k)
            rewards.append(r)
    return collate(prompts, responses, lps, gids, rewards, pad_id=tr.tokenizer.pad_token_id)


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
        if _colocated(tr):
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
    """One step of Algorithm 1; returns its metrics."""
    cfg, loss, hp, policy = tr.cfg, tr.loss, tr.loss_hp, tr.policy
    timer = Timer()
    with timer("step"):
        with generation_phase(tr, timer):
            records, metrics = rollout_phase(tr)
        batch = build_batch(tr, records)
        num_mb = tr.cfg.updates_per_step
        local = batch.select(_local_rows(len(batch), num_mb, policy))
        with timer("old_logprobs"):
            old_local, ent_local = policy.logprobs(local, entropy=True)
            ref_local = _reference_logprobs(tr, local)
        old = _gather_rows(old_local, policy, num_mb)
        entropy = _gather_rows(ent_local, policy, num_mb)
        mask = batch.response_mask
        weights, w_metrics = losses.rollout_weights(
            old, batch.gen_logprobs, mask, mode=cfg.rollout_correction, cap=cfg.loss.rollout_correction_cap
        )
        per_mb_local = len(local) // num_mb
        per_mb = len(batch) // num_mb
        update_metrics: list[dict[str, float]] = []
        with timer("train"):
            for m in range(num_mb):
                rows_local = slice(m * per_mb_local, (m + 1) * per_mb_local)
                rows = slice(m * per_mb, (m + 1) * per_mb)
                mb_local = local.select(rows_local)
                old_mb, mask_mb = old_local[rows_local], mb_local.response_mask
                ref_mb = ref_local[rows_local] if ref_local is not None else None
                if m == 0:  # The weights are still pi_old's: the current log-probs ARE the old ones.
                    lp_mb, ent_mb = old_mb, ent_local[rows_local]
                else:
                    lp_mb, ent_mb = policy.logprobs(mb_local, entropy=loss.needs_entropy)
                stats_local = loss.stats(lp_mb, old_mb, mask_mb, entropy=ent_mb, ref_logprobs=ref_mb, **hp)
                stats = distributed.all_gather_rows(stats_local, policy.dp_group) if policy.dp_size > 1 else stats_local
                coeffs, value, lm = losses.coefficients(
                    loss,
                    stats,
                    batch.group_ids[rows],
                    batch.rewards[rows],
                    weights=weights[rows] if weights is not None else None,
                    **hp,
                )
                if not math.isfinite(value):
                    update_metrics.append({**lm, "skipped": 1.0})
                    tr.logger.write(f"step {tr.step + 1} update {m}: non-finite loss {value}; update skipped")
                    continue
                c_local = coeffs[_dp_slice(per_mb, policy)]

                def surrogate_fn(
                    idx: torch.Tensor,
                    lp: torch.Tensor,
                    ent: torch.Tensor | None,
                    c_local: torch.Tensor = c_local,
                    old_mb: torch.Tensor = old_mb,
                    mask_mb: torch.Tensor = mask_mb,
                    ref_mb: torch.Tensor | None = ref_mb,
                ) -> torch.Tensor:
                    dev = lp.device
                    st = loss.stats(
                        lp,
                        old_mb[idx].to(dev),
                        mask_mb[idx].to(dev),
                        entropy=ent,
                        ref_logprobs=ref_mb[idx].to(dev) if ref_mb is not None else None,
                        **hp,
                    )
                    return losses.surrogate(c_local[idx].to(dev, st.dtype), st)

                out = policy.train_minibatch(mb_local, surrogate_fn, entropy=loss.needs_entropy)
                tr.generator_stale = True
                if out["skipped"]:
                    tr.logger.write(f"step {tr.step + 1} update {m}: non-finite gradient; update skipped")
                update_metrics.append({**lm, **out})
    metrics.update(timer.metrics())
    metrics.setdefault("timing/refit", 0.0)
    metrics.update(_step_metrics(batch, old, entropy, update_metrics, records))
    metrics.update(losses.mismatch_metrics(old, batch.gen_logprobs, mask))
    metrics.update(w_metrics)
    return metrics


def _step_metrics(
    batch: RolloutBatch, old: torch.Tensor, entropy: torch.Tensor, updates: list[dict[str, float]], records: list[dict]
) -> dict[str, float]:
    mask = batch.response_mask
    lengths = mask.sum(1).float()
    out = {
        "train/reward_mean": float(batch.rewards.mean()),
        "train/response_length_mean": float(lengths.mean()),
        "train/response_length_max": float(lengths.max()),
        "train/truncated_share": sum(f == "length" for rec in records for f in rec["finish"]) / len(batch),
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


def validate(tr: Trainer, problems: list, prompt_ids: list[list[int]], samples: int, seed: int) -> list[float]:
    """Per-problem pass@1 (share of ``samples`` correct samples), in problem order, identical on every rank.

    Each generation engine samples a contiguous share of the problems and its leader grades it; the leaders'
    shares, gathered in engine order, are the problems in order. Their mean is the pass@1; their spread gives
    its standard error (:mod:`nemo_disco.stats`), and two validations on the same problems give a paired gain.
    """
    g = tr.cfg.generation
    share = list(range(len(problems)))[tr.engines.share(len(problems))]
    sampling = _sampling(tr.cfg, tr.tokenizer, _engine_seed(seed, tr))
    sampling = SamplingParams(**{**sampling.__dict__, "top_p": g.top_p})
    with generation_phase(tr, Timer()):
        rollouts = tr.generator.generate([prompt_ids[i] for i in share], samples, sampling) if share else []
    if not tr.engines.leader:
        share, rollouts = [], []
    texts = [tr.tokenizer.decode(r.token_ids, skip_special_tokens=True) for rs in rollouts for r in rs]
    truths = [problems[i].answer for i in share for _ in range(samples)]
    scores, _ = tr.grader.score(texts, truths) if texts else ([], {})
    local = [sum(scores[k * samples : (k + 1) * samples]) / samples for k in range(len(share))]
    return _gather_engines(local, tr)


def _log_validation(tr: Trainer, step: int, per_problem: list[float]) -> dict[str, float]:
    """``val/pass@1`` and its standard error over problems; the per-problem values go to validation.jsonl.

    A record for ``step`` replaces any of the same or a later step (left by a run that resumed before them).
    """
    mean, se = stats.mean_se(per_problem) if per_problem else (0.0, 0.0)
    if tr.env.is_main:
        path = tr.run_dir / "validation.jsonl"
        kept = [r for r in read_jsonl(path) if r["step"] < step]
        kept.append({"step": step, "pass@1": mean, "pass@1_se": se, "per_problem": per_problem})
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(path)
    return {"val/pass@1": mean, "val/pass@1_se": se}


def _val_set(tr: Trainer) -> tuple[list, list[list[int]]]:
    cfg = tr.cfg
    problems, _ = load_problems(cfg.data.val, **{**_data_kwargs(cfg), "on_bad_row": "skip"})
    if cfg.data.val_max_problems:
        problems = problems[: cfg.data.val_max_problems]
    ids, kept, _ = encode_run_prompts(tr.tokenizer, problems, cfg)
    return [problems[i] for i in kept], ids


def save_checkpoint(tr: Trainer) -> Path:
    """Atomic checkpoint of the current step."""
    state = {"sampler": tr.sampler.state_dict(), "rng": checkpoint.rng_state()}
    return checkpoint.save(tr.run_dir, tr.step, tr.policy, state, tr.cfg, tr.cfg.checkpoint.keep_last)


def _install_signal_handlers(tr: Trainer) -> None:
    def handler(signum: int, _frame: object) -> None:
        tr.signal_received.append(signum)

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, handler)


def _signal_agreed(tr: Trainer) -> int:
    """The signal any rank received (all ranks agree, so they checkpoint together); 0 if none."""
    return distributed.max_int(tr.signal_received[0] if tr.signal_received else 0)


def _collective_timeout_minutes(cfg: RunConfig) -> int:
    """The process group's collective timeout: above the step watchdog's floor, so the watchdog acts first."""
    return max(30, math.ceil(4 * cfg.cluster.step_timeout_s / 60))


def train(cfg: RunConfig) -> dict[str, float]:
    """Run (or resume) training to ``algorithm.steps``; returns the last step's metrics.

    A step watchdog and a peer monitor (:mod:`nemo_disco.watchdog`) run beside the loop: a hung step, validation
    or checkpoint save ends the run with exit code 4 (stacks in the log), a dead, frozen or failed rank ends every
    other rank with exit code 5 (the log names it).

    Raises:
        Preempted: after SIGUSR1 (exit code 3, requeue) or SIGTERM (exit code 0) with a checkpoint saved.
        checkpoint.SaveError: a checkpoint could not be written (the previous one is intact).
    """
    distributed.init(timeout_minutes=_collective_timeout_minutes(cfg))
    wd = watchdog.from_env(cfg.cluster.step_timeout_s, Path(cfg.logging.run_dir))
    wd.start()
    try:
        last = _train(cfg, wd)
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


def _train(cfg: RunConfig, wd: watchdog.Watchdog) -> dict[str, float]:
    tr = setup(cfg)
    _install_signal_handlers(tr)
    val = _val_set(tr) if cfg.data.val else None
    last: dict[str, float] = {}
    try:
        if val is not None and tr.step == 0:
            with wd.phase("validation", "validation before step 1"):
                per_problem = validate(tr, *val, cfg.data.val_samples, seed=cfg.algorithm.seed)
            tr.logger.log(0, _log_validation(tr, 0, per_problem))
        while tr.step < cfg.algorithm.steps:
            label = f"step {tr.step + 1}"
            with wd.phase("step", label):
                metrics = train_step(tr)
            tr.step += 1
            if val is not None and cfg.data.val_every and tr.step % cfg.data.val_every == 0:
                with wd.phase("validation", f"validation after {label}"):
                    per_problem = validate(tr, *val, cfg.data.val_samples, seed=cfg.algorithm.seed + tr.step)
                metrics.update(_log_validation(tr, tr.step, per_problem))
            with wd.phase("step", f"{label} (metrics and signals)"):
                tr.logger.log(tr.step, metrics)
                sig = _signal_agreed(tr)
            last = metrics
            periodic = cfg.checkpoint.save_every and tr.step % cfg.checkpoint.save_every == 0
            if periodic or sig or tr.step == cfg.algorithm.steps:
                with wd.phase("checkpoint", f"checkpoint step {tr.step}"):
                    path = save_checkpoint(tr)
                tr.logger.write(f"checkpoint {path}")
            if sig:
                raise Preempted(EXIT_REQUEUE if sig == signal.SIGUSR1 else 0)
    finally:
        tr.logger.close()
        tr.grader.close()
        tr.generator.shutdown()
    if tr.env.is_main:
        (tr.run_dir / "final.json").write_text(json.dumps({"step": tr.step, **last}, indent=1))
    return last
