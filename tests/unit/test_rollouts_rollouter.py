"""Sampling and grading shared by both rollout modes (:mod:`nemo_disco.rollouts.rollouter`): dynamic sampling's
stopping rule and one step sampled and graded on one engine."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from nemo_disco import config
from nemo_disco.batch import QuestionRollouts
from nemo_disco.rollouts.rollouter import step_rollouts


class _Sampler:
    def __init__(self) -> None:
        self.calls = 0

    def next_batch(self) -> list[int]:
        self.calls += 1
        return list(range(10))


def _record(question: int, rewards: list[float]) -> QuestionRollouts:
    g = len(rewards)
    return QuestionRollouts(question, [3], [[1]] * g, [[-0.5]] * g, ["stop"] * g, rewards)


def _collector(sampler: _Sampler, informative_per_round: list[int]):
    """Rounds of 10 questions of which the first ``k`` have a positive and a negative rollout."""

    def collect(question_ids, seed):  # noqa: ANN001, ANN202
        k = informative_per_round[min(sampler.calls, len(informative_per_round)) - 1]
        records = [_record(i, [1.0, 0.0] if i < k else [0.0, 0.0]) for i in question_ids]
        return records, {"timing/generate": 1.0}

    return collect


@pytest.mark.parametrize(
    ("share", "per_round", "rounds", "informative"),
    [
        (1.0, [4, 4, 4], 3, 1.0),  # DAPO: 4 + 4 + 4 >= 10 informative after the third round
        (0.6, [4, 4, 4], 2, 0.8),  # GPG beta_th 0.6: 8 >= 6 after the second round; 8 of the 10 kept
        (0.6, [6, 0, 0], 1, 0.6),  # 6 >= 6 at once
        (1.0, [1, 1, 1], 3, 0.3),  # the round cap: 3 informative, 7 zero-variance fill the step
    ],
)
def test_dynamic_sampling_stops_at_the_informative_share(share, per_round, rounds, informative):
    cfg = config.load(
        config.Path(__file__).resolve().parents[2] / "recipes" / "disco.yaml",
        [
            "algorithm.prompts_per_step=10",
            "algorithm.minibatch_prompts=10",
            "algorithm.rollouts_per_prompt=2",
            "algorithm.dynamic_sampling=true",
            "algorithm.max_sampling_rounds=3",
            f"algorithm.min_valid_share={share}",
            "cluster.gpus_per_node=1",
        ],
    )
    ro = SimpleNamespace(cfg=cfg, sampler=_Sampler())
    records, metrics = step_rollouts(ro, 1, collect=_collector(ro.sampler, per_round))
    assert len(records) == 10
    assert metrics["train/sampling_rounds"] == rounds and ro.sampler.calls == rounds
    assert metrics["train/informative_share"] == informative
    assert metrics["timing/generate"] == rounds  # each round's metrics add up
    assert [r.rewards for r in records[: int(informative * 10)]] == [[1.0, 0.0]] * int(informative * 10)


def test_build_rollouter_samples_and_grades_a_step_on_one_engine(tiny_qwen2):
    ro = _rollouter(tiny_qwen2)
    try:
        assert (ro.engines.index, ro.engines.leader) == (0, True)
        records, metrics = step_rollouts(ro, 1)
    finally:
        ro.close()
    from nemo_disco.data import new_sampler

    assert [r.question for r in records] == new_sampler(ro.cfg.data, len(ro.problems), 4).next_batch()
    g = ro.cfg.algorithm.rollouts_per_prompt
    for rec in records:
        assert rec.prompt == ro.prompt_ids[rec.question]
        assert len(rec.responses) == len(rec.logprobs) == len(rec.finish) == len(rec.rewards) == g
        assert all(len(lp) == len(resp) <= 12 for lp, resp in zip(rec.logprobs, rec.responses, strict=True))
    assert metrics["reward/timeouts"] == metrics["reward/errors"] == 0.0 and metrics["timing/generate"] > 0


# ----------------------------------------------------------------------------------------------------------------------
# Failed rewards: counted, said in the step's line, and a run stops when (a share of) a step's rewards failed


def _failing_collector(sampler: _Sampler, failed_per_round: list[tuple[int, int]], graded: int = 20):
    """Rounds of 10 zero-variance questions; round k reports ``failed_per_round[k]`` = (errors, timeouts)."""

    def collect(question_ids, seed):  # noqa: ANN001, ANN202
        errors, timeouts = failed_per_round[sampler.calls - 1]
        metrics = {"reward/errors": float(errors), "reward/timeouts": float(timeouts), "reward/graded": float(graded)}
        return [_record(i, [0.0, 0.0]) for i in question_ids], metrics

    return collect


def _cfg(*overrides: str) -> config.RunConfig:
    base = ["algorithm.prompts_per_step=10", "algorithm.minibatch_prompts=10", "algorithm.rollouts_per_prompt=2"]
    return config.load(
        config.Path(__file__).resolve().parents[2] / "recipes" / "disco.yaml",
        [*base, "cluster.gpus_per_node=1", *overrides],
    )


def test_some_failed_rewards_are_counted_and_said_in_a_line():
    from nemo_disco.rollouts import reward_errors_line

    ro = SimpleNamespace(cfg=_cfg(), sampler=_Sampler(), first_reward_error="reward.function m:f failed on an item")
    _, metrics = step_rollouts(ro, 1, collect=_failing_collector(ro.sampler, [(1, 2)]))
    assert metrics["reward/failed_share"] == 3 / 20 and metrics["reward/graded"] == 20
    assert reward_errors_line(metrics) == "reward errors 3/20 (2 timeouts)"
    assert reward_errors_line({**metrics, "reward/timeouts": 1.0}) == "reward errors 2/20 (1 timeout)"
    assert reward_errors_line({**metrics, "reward/errors": 0.0, "reward/timeouts": 0.0}) is None


@pytest.mark.parametrize(
    ("overrides", "failed", "stops"),
    [
        ((), (19, 0), False),  # the default 1.0: only a step where every reward failed stops the run
        ((), (12, 8), True),
        (("reward.max_error_share=0.5",), (5, 4), False),
        (("reward.max_error_share=0.5",), (6, 4), True),  # half failed: the share is reached
        (("reward.max_error_share=0",), (0, 1), True),  # 0: any failure
    ],
)
def test_a_step_stops_the_run_at_the_share_of_failed_rewards(overrides, failed, stops):
    from nemo_disco.rollouts import RewardError

    ro = SimpleNamespace(cfg=_cfg(*overrides), sampler=_Sampler())
    collect = _failing_collector(ro.sampler, [failed])

    def first(question_ids, seed):  # noqa: ANN001, ANN202  (the rollouter notes the step's first failure)
        ro.first_reward_error = "reward.function m:f failed on an item: ValueError: boom"
        return collect(question_ids, seed)

    if not stops:
        step_rollouts(ro, 3, collect=first)
        return
    with pytest.raises(RewardError) as err:
        step_rollouts(ro, 3, collect=first)
    n = sum(failed)
    assert str(err.value).startswith(f"step 3: reward errors {n}/20 ({failed[1]} timeout")
    assert str(err.value).endswith("; the first: reward.function m:f failed on an item: ValueError: boom")
    assert ("every reward failed" in str(err.value)) == (n == 20) and "\n" not in str(err.value)
    assert isinstance(err.value, config.ConfigError)  # a one-line error, exit code 2


def test_dynamic_sampling_stops_topping_up_once_the_failed_share_is_reached():
    from nemo_disco.rollouts import RewardError

    cfg = _cfg("algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=5", "reward.max_error_share=0.5")
    ro = SimpleNamespace(cfg=cfg, sampler=_Sampler())
    with pytest.raises(RewardError, match=r"^step 1: reward errors 24/40 \(0 timeouts\): reward.max_error_share=0.5"):
        step_rollouts(ro, 1, collect=_failing_collector(ro.sampler, [(4, 0), (20, 0), (0, 0)]))
    assert ro.sampler.calls == 2  # not the five rounds dynamic sampling would take with zero-variance questions


def test_a_reward_function_that_returns_nan_everywhere_stops_the_step(tiny_qwen2, tmp_path, monkeypatch):
    # Before: NaN rewards trained as negatives and the run ended with exit 0.
    from nemo_disco.rollouts import RewardError

    (tmp_path / "nan_rewards.py").write_text("def nan(response, answer, **fields):\n    return float('nan')\n")
    monkeypatch.chdir(tmp_path)
    ro = _rollouter(tiny_qwen2, "reward.function=nan_rewards:nan")
    n = 4 * ro.cfg.algorithm.rollouts_per_prompt
    try:
        with pytest.raises(RewardError) as err:
            step_rollouts(ro, 1)
    finally:
        ro.close()
        monkeypatch.delitem(sys.modules, "nan_rewards", raising=False)
    assert str(err.value) == (
        f"step 1: reward errors {n}/{n} (0 timeouts): every reward failed, stopping; the first: reward.function "
        "nan_rewards:nan failed on an item: ValueError: the reward function returned nan, expected a finite float"
    )


def _rollouter(tiny_model, *overrides: str):
    """A real rollouter over the tiny recipe (4 questions a step, one grading worker) on one engine."""
    from transformers import AutoTokenizer

    from nemo_disco.data import new_sampler, train_problems
    from nemo_disco.distributed import DistEnv
    from nemo_disco.generation.factory import build_run_generator
    from nemo_disco.rollouts.rollouter import build_rollouter

    base = [f"policy.model_path={tiny_model}", "data.synthetic_size=16", "algorithm.prompts_per_step=4"]
    base += ["algorithm.minibatch_prompts=4", "reward.workers=1"]
    cfg = config.load(config.Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml", [*base, *overrides])
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    problems, prompt_ids, _, _ = train_problems(cfg.data, tokenizer, max_prompt_tokens=32, prompts_per_step=4)
    sampler = new_sampler(cfg.data, len(problems), 4)
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0)
    return build_rollouter(cfg, env, tokenizer, problems, prompt_ids, sampler, build_run_generator(cfg, tiny_model))
