"""Pieces of the training loop that a whole run does not isolate: the forward-only reference, the order of setup,
the step's metrics."""

from __future__ import annotations

import pytest
import torch
from recorder import Recorder

from nemo_disco import config, parts
from nemo_disco.policy.hf import HFPolicy

torch.set_num_threads(1)


def test_reference_policy_is_forward_only(tiny_qwen2):
    cfg = config.load(
        config.Path(__file__).resolve().parents[2] / "recipes" / "disco.yaml",
        ["policy.backend=hf", "policy.dtype=float32", "cluster.gpus_per_node=1"],
    )
    ref = HFPolicy.from_run_config(cfg, tiny_qwen2, trainable=False)
    assert ref.optimizer is None and not any(p.requires_grad for p in ref.model.parameters())
    with pytest.raises(RuntimeError, match="forward-only"):
        ref.train_minibatch(None, None)  # type: ignore[arg-type]


def test_setup_starts_the_generator_asleep_before_the_policy_fills_the_gpu(tiny_qwen2, tmp_path, monkeypatch):
    # vLLM refuses to start when less than its gpu_memory_utilization share is free: it must be built (and put to
    # sleep) before the policy and the reference policy, as NeMo-RL does. The real objects run; calls are recorded.
    from nemo_disco import algorithm
    from nemo_disco.generation import factory
    from nemo_disco.rollouts import local

    log: list[str] = []
    build_generator, build_policy = factory.build_run_generator, algorithm.build_policy

    def generator(cfg, model_dir):  # noqa: ANN001, ANN202
        log.append("build_generator")
        return Recorder("generator", build_generator(cfg, model_dir), log)

    def policy(cfg, model_dir, trainable=True):  # noqa: ANN001, ANN202
        log.append(f"build_policy(trainable={trainable})")
        return build_policy(cfg, model_dir, trainable=trainable)

    monkeypatch.setattr(factory, "build_run_generator", generator)
    monkeypatch.setattr(algorithm, "build_policy", policy)
    monkeypatch.setattr(local, "is_colocated", lambda cfg: True)  # as vLLM on a GPU
    cfg = parts.load(
        config.Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml",
        [
            f"policy.model_path={tiny_qwen2}",
            f"logging.run_dir={tmp_path / 'run'}",
            "loss.name=grpo",  # with a KL reference policy
            "loss.kl_coef=0.001",
            "data.synthetic_size=64",
            "logging.progress=false",
        ],
    )
    tr = algorithm.setup(cfg)
    try:
        assert tr.ref_policy is not None
        assert log == [
            "build_generator",
            "generator.sleep()",
            "build_policy(trainable=True)",
            "build_policy(trainable=False)",
        ]
    finally:
        tr.rollouts.close(0)


def test_step_metrics_report_the_length_of_correct_and_of_wrong_rollouts():
    from nemo_disco.algorithm import _step_metrics
    from nemo_disco.batch import QuestionRollouts, collate

    # Responses of 3, 5 (correct: reward 1) and 2, 6, 7 tokens (wrong: rewards 0, 0.5 at threshold 0.5, -1).
    lengths, rewards = [3, 5, 2, 6, 7], [1.0, 1.0, 0.0, 0.5, -1.0]
    batch = collate([[7]] * 5, [[9] * n for n in lengths], [[0.0] * n for n in lengths], [0, 0, 1, 1, 1], rewards, 0)
    zeros = torch.zeros_like(batch.response_mask, dtype=torch.float32)
    records = [QuestionRollouts(q, [3], [[1]] * g, [[0.0]] * g, ["stop"] * g, [0.0] * g) for q, g in ((0, 2), (1, 3))]
    out = _step_metrics(batch, zeros, zeros, [], records, threshold=0.5)
    assert out["train/response_length_correct_mean"] == 4.0  # (3 + 5) / 2
    assert out["train/response_length_wrong_mean"] == 5.0  # (2 + 6 + 7) / 3
    assert out["train/response_length_mean"] == pytest.approx(4.6)  # 23 / 5
    out = _step_metrics(batch, zeros, zeros, [], records, threshold=2.0)  # no rollout is correct
    assert "train/response_length_correct_mean" not in out
    assert out["train/response_length_wrong_mean"] == pytest.approx(4.6)


def test_update_plans_are_logged_one_line_per_run_of_equal_plans():
    from nemo_disco.algorithm import _plan_lines

    plans = ["1 pass (a)", "2 passes (b)", "2 passes (b)", "1 pass (a)"]
    assert _plan_lines(plans) == ["update 0: 1 pass (a)", "updates 1-2: 2 passes (b)", "update 3: 1 pass (a)"]
    assert _plan_lines(plans[:1]) == ["update 0: 1 pass (a)"]


class _FixedRollouts:
    """A rollout source that hands out the same records every step (the generator is not under test here)."""

    def __init__(self, records: list) -> None:
        self.records, self.changes = records, 0

    def next(self, step: int) -> tuple[list, dict[str, float]]:
        return self.records, {"timing/generate": 0.0}

    def weights_changed(self) -> None:
        self.changes += 1


def _step_case(tiny_qwen2, tmp_path, overrides: list[str]):
    """A Trainer on the tiny Qwen2 whose 4 questions x 4 rollouts carry the policy's own log-probs as the
    generator's: pi_old assembled by train_step must equal them wherever each mini-batch's log-probs came from."""
    from nemo_disco import distributed
    from nemo_disco.algorithm import Trainer
    from nemo_disco.batch import QuestionRollouts, collate_questions
    from nemo_disco.metrics import MetricsLogger

    cfg = parts.load(
        config.Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml",
        [
            f"policy.model_path={tiny_qwen2}",
            "algorithm.prompts_per_step=4",
            "algorithm.rollouts_per_prompt=4",
            f"logging.run_dir={tmp_path}",
            *overrides,
        ],
    )
    policy = HFPolicy.from_run_config(cfg, tiny_qwen2)
    gen = torch.Generator().manual_seed(3)
    records = []
    for q in range(4):
        responses = [torch.randint(5, 20, (int(n),), generator=gen).tolist() for n in torch.randint(3, 8, (4,))]
        rewards = [float(r) for r in torch.randint(0, 2, (4,), generator=gen)]
        rewards[q % 4] = 1.0 - rewards[(q + 1) % 4]  # every question has a right and a wrong rollout
        records.append(
            QuestionRollouts(q, [7, 8, 9 + q], responses, [[0.0] * len(r) for r in responses], ["stop"] * 4, rewards)
        )
    batch = collate_questions(records, pad_id=0)
    own, _ = policy.logprobs(batch)
    for i, rec in enumerate(records):
        for g, resp in enumerate(rec.responses):
            rec.logprobs[g] = own[4 * i + g, : len(resp)].tolist()
    tokenizer = type("Tok", (), {"pad_token_id": 0})()
    logger = MetricsLogger(
        tmp_path,
        enabled=True,
        tensorboard=False,
        wandb=False,
        wandb_project="",
        total_steps=1,
        start_step=0,
        progress=False,
        terminal=False,
    )
    env = distributed.DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0)
    tr = Trainer(
        cfg=cfg,
        env=env,
        run_dir=tmp_path,
        model_dir=tiny_qwen2,
        tokenizer=tokenizer,
        policy=policy,
        rollouts=_FixedRollouts(records),
        logger=logger,
        loss=parts.loss_of(cfg),
    )
    return tr, [p.detach().clone() for p in policy.model.parameters()]


@pytest.mark.parametrize(
    ("minibatch_prompts", "forwards", "one_pass"),
    [
        (4, 1.0, 1.0),  # one update: one pass makes pi_old and the gradient together (F + B)
        (2, 2.0, 1.0),  # first: one pass on half the batch; pi_old of the other half; second update: two passes
    ],
)
def test_train_step_runs_each_minibatch_by_its_plan_and_assembles_pi_old(
    tiny_qwen2, tmp_path, capsys, minibatch_prompts, forwards, one_pass
):
    from nemo_disco.algorithm import train_step

    tr, before = _step_case(tiny_qwen2, tmp_path, [f"algorithm.minibatch_prompts={minibatch_prompts}"])
    metrics = train_step(tr)
    # pi_old of every row, from the one-pass update or from the no-grad forward, is the policy's own log-prob.
    assert metrics["mismatch/max_abs_logprob_diff"] < 1e-5
    assert metrics["update/forward_passes"] == forwards and metrics["update/one_pass_updates"] == one_pass
    assert tr.rollouts.changes == 4 // minibatch_prompts  # the generator hears of each update
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, tr.policy.model.parameters(), strict=True))
    assert metrics["train/reward_mean"] == sum(sum(r.rewards) for r in tr.rollouts.records) / 16
    out = capsys.readouterr().out
    assert "step 1: update 0: 1 pass (loss disco couples a question's rollouts at the first update" in out
    if minibatch_prompts == 2:  # the trust region's KL couples the whole mini-batch once the weights have moved
        assert "step 1: update 1: 2 passes (loss disco couples the whole mini-batch at a later update)" in out
    assert tr.step == 0  # the caller counts steps


SCALED_GPG = '''
"""A loss of the user's own: GPG's objective times a scale, declared by its class (docs/losses.md)."""

from typing import Literal

from pydantic import Field

from nemo_disco.losses import Hyper
from nemo_disco.losses.base import rollout_coupled
from nemo_disco.losses.gpg import GPG_STATS, gpg_objective, gpg_stats


class ScaledGpg:
    class Params(Hyper):
        scale: float = Field(1.0, gt=0)
        adv_std_norm: bool = False
        alpha_correction: bool = True
        token_norm: Literal["question", "batch"] = "question"

    stat_names = GPG_STATS
    stats = staticmethod(gpg_stats)
    coupling = staticmethod(rollout_coupled)

    @staticmethod
    def objective(stats, group_ids, rewards, weights, p):
        loss, metrics = gpg_objective(stats, group_ids, rewards, weights, p)
        return p.scale * loss, {**metrics, "scale": p.scale}
'''


def test_a_loss_from_a_module_of_the_users_own_trains_exactly_like_a_built_in(tiny_qwen2, tmp_path, monkeypatch):
    # The module lives outside the package (tmp_path on sys.path); the config names it and sets its own parameter.
    from nemo_disco.algorithm import train_step

    (tmp_path / "my_rl_losses.py").write_text(SCALED_GPG)
    monkeypatch.syspath_prepend(str(tmp_path))
    results = {}
    for name, overrides in (
        ("user", ["loss.name=my_rl_losses:ScaledGpg", "loss.scale=1.0"]),
        ("gpg", ["loss.name=gpg"]),
    ):
        torch.manual_seed(0)  # the same rollouts for both (_step_case draws response lengths from torch's global RNG)
        tr, before = _step_case(tiny_qwen2, tmp_path / name, ["algorithm.minibatch_prompts=2", *overrides])
        metrics = train_step(tr)
        after = [p.detach().clone() for p in tr.policy.model.parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)), name
        results[name] = (metrics, after)
    assert results["user"][0]["train/scale"] == 1.0 and "train/scale" not in results["gpg"][0]
    for key in ("train/loss", "train/objective", "train/alpha", "update/forward_passes", "update/one_pass_updates"):
        assert results["user"][0][key] == results["gpg"][0][key], key
    assert all(torch.equal(a, b) for a, b in zip(results["user"][1], results["gpg"][1], strict=True))


def test_a_run_parses_each_data_source_once(tmp_path, monkeypatch):
    # `nemo-disco train`'s start-up check parses data.train and data.val; the warm-up (trains on data.train,
    # measures on data.val), the training questions and validation then take those problems, not the files again.
    # Each real load is counted, as the CLI runs it: check, then setup (a tiny model built and warmed up in code).
    import json

    from nemo_disco import algorithm, cli, data

    sources = {}
    for name, split, size in (("train", "train", 64), ("val", "heldout", 16)):
        path = tmp_path / f"{name}.jsonl"
        rows = [{"problem": p.problem, "answer": p.answer} for p in data.synthetic_arithmetic(size, 0, split=split)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        sources[name] = str(path)
    loads: list[str] = []
    load_problems = data.load_problems

    def counted(source, **kwargs):  # noqa: ANN001, ANN003, ANN202
        loads.append(str(source))
        return load_problems(source, **kwargs)

    monkeypatch.setattr(data, "load_problems", counted)
    cfg = parts.load(
        config.Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml",
        [
            f"logging.run_dir={tmp_path / 'run'}",
            f"data.train={sources['train']}",
            f"data.val={sources['val']}",
            "data.val_max_problems=8",
            "algorithm.prompts_per_step=4",
            "algorithm.minibatch_prompts=4",
            "algorithm.warmup_sft_steps=2",
            "algorithm.warmup_eval_every=1",
            "algorithm.warmup_eval_problems=8",
            "algorithm.warmup_target=[0.99,1.0]",
            "algorithm.warmup_cache=false",
            "logging.progress=false",
        ],
    )
    problems = cli._check_sources(cfg)
    tr = algorithm.setup(cfg, problems=problems)
    try:
        assert (tr.run_dir / "init_model" / "config.json").is_file()  # the warm-up ran, on the problems handed on
        assert tr.sampler.num_problems == 64  # every training problem, from the one parse
        assert loads == [sources["train"], sources["val"]]
    finally:
        tr.rollouts.close(0)


@pytest.mark.parametrize("minibatch_prompts", [2, 4])
def test_train_step_reports_the_weights_each_rollout_trained_with(tiny_qwen2, tmp_path, minibatch_prompts):
    # seq_tis with generator log-probs off the policy's own by -0.1, 0 or +0.1 per token: every weight differs
    # from 1 and some are capped. A one-pass first mini-batch weights its rows inside its pass (it makes pi_old);
    # the step's metrics are those of the weights used, the same as of pi_old recomputed over the whole batch.
    from nemo_disco import losses
    from nemo_disco.algorithm import train_step
    from nemo_disco.batch import collate_questions

    overrides = [f"algorithm.minibatch_prompts={minibatch_prompts}", "loss.rollout_correction=seq_tis"]
    tr, _ = _step_case(tiny_qwen2, tmp_path, [*overrides, "loss.rollout_correction_cap=1.5"])
    own = collate_questions(tr.rollouts.records, pad_id=0).gen_logprobs  # pi_old: the policy's own log-probs
    for k, rec in enumerate(tr.rollouts.records):
        for g in range(len(rec.logprobs)):
            rec.logprobs[g] = [x + 0.1 * ((k + g) % 3 - 1) for x in rec.logprobs[g]]
    batch = collate_questions(tr.rollouts.records, pad_id=0)
    _, expected = losses.rollout_weights(own, batch.gen_logprobs, batch.response_mask, mode="seq_tis", cap=1.5)
    assert 0 < expected["mismatch/truncated_share"] < 1 and expected["mismatch/weight_min"] < 1
    metrics = train_step(tr)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-4), key
