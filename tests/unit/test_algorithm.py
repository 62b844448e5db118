"""Pieces of the training loop that a whole run does not isolate: the colocated order of one generation phase,
dynamic sampling, the asynchronous staleness rule."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_disco import config
from nemo_disco.generation.hf import HFGenerator
from nemo_disco.metrics import Timer
from nemo_disco.policy.hf import HFPolicy
from nemo_disco.rollouts import generation_phase, step_rollouts

torch.set_num_threads(1)


class Recorder:
    """Forwards every call to the real object and writes it into a shared log."""

    def __init__(self, name: str, obj: object, log: list[str]) -> None:
        self._name, self._obj, self._log = name, obj, log

    def __getattr__(self, attr: str):  # noqa: ANN204
        value = getattr(self._obj, attr)
        if not callable(value):
            return value

        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            shown = [repr(a) for a in args if not hasattr(a, "__next__")] + [f"{k}={v!r}" for k, v in kwargs.items()]
            self._log.append(f"{self._name}.{attr}({', '.join(shown)})")
            return value(*args, **kwargs)

        return call


def _trainer(tiny_qwen2, log: list[str], stale: bool) -> SimpleNamespace:
    cfg = config.load(
        config.Path(__file__).resolve().parents[2] / "recipes" / "disco.yaml",
        ["policy.backend=hf", "policy.dtype=float32", "cluster.gpus_per_node=1", "generation.backend=hf"],
    )
    policy = HFPolicy.from_run_config(cfg, tiny_qwen2)
    with torch.no_grad():  # the policy has moved since the generator loaded the folder
        for p in policy.model.parameters():
            p.add_(0.01)
    return SimpleNamespace(
        cfg=cfg,
        policy=Recorder("policy", policy, log),
        ref_policy=Recorder("ref", HFPolicy.from_run_config(cfg, tiny_qwen2, trainable=False), log),
        generator=Recorder("generator", HFGenerator(tiny_qwen2), log),
        generator_stale=stale,
    )


def test_colocated_order_frees_optimizer_state_before_the_refit_and_weights_after(tiny_qwen2):
    log: list[str] = []
    tr = _trainer(tiny_qwen2, log, stale=True)
    with generation_phase(tr, Timer(), colocated=True):
        log.append("generate")
    assert log == [
        "policy.offload(weights=False)",  # gradients + optimizer state leave before the refit reads the weights
        "ref.offload()",
        "generator.wake_up(['weights'])",
        "policy.export_weights()",
        "generator.update_weights()",
        "policy.offload()",  # the weights, once the refit has read them
        "generator.wake_up(['kv_cache'])",
        "generate",
        "generator.sleep()",
        "policy.onload()",
    ]
    assert tr.generator_stale is False
    generated = dict(tr.generator._obj.model.named_parameters())
    for name, p in tr.policy._obj.model.named_parameters():
        assert torch.equal(generated[name], p), name  # the refit really moved the weights


def test_no_refit_when_the_generator_is_current_and_nothing_moves_when_not_colocated(tiny_qwen2):
    log: list[str] = []
    tr = _trainer(tiny_qwen2, log, stale=False)
    with generation_phase(tr, Timer(), colocated=True):
        pass
    assert "generator.update_weights()" not in log and "policy.export_weights()" not in log
    log.clear()
    tr.generator_stale = True
    with generation_phase(tr, Timer(), colocated=False):
        pass
    assert log == ["policy.export_weights()", "generator.update_weights()"]


def test_reference_policy_is_forward_only(tiny_qwen2):
    cfg = config.load(
        config.Path(__file__).resolve().parents[2] / "recipes" / "disco.yaml",
        ["policy.backend=hf", "policy.dtype=float32", "cluster.gpus_per_node=1"],
    )
    ref = HFPolicy.from_run_config(cfg, tiny_qwen2, trainable=False)
    assert ref.optimizer is None and not any(p.requires_grad for p in ref.model.parameters())
    with pytest.raises(RuntimeError, match="forward-only"):
        ref.train_minibatch(None, None)  # type: ignore[arg-type]


class _Sampler:
    def __init__(self) -> None:
        self.calls = 0

    def next_batch(self) -> list[int]:
        self.calls += 1
        return list(range(10))


def _collector(sampler: _Sampler, informative_per_round: list[int]):
    """Rounds of 10 questions of which the first ``k`` have a positive and a negative rollout."""

    def collect(question_ids, seed):  # noqa: ANN001, ANN202
        k = informative_per_round[min(sampler.calls, len(informative_per_round)) - 1]
        records = [{"rewards": [1.0, 0.0] if i < k else [0.0, 0.0], "responses": [[1], [1]]} for i in question_ids]
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
    assert [r["rewards"] for r in records[: int(informative * 10)]] == [[1.0, 0.0]] * int(informative * 10)


def test_setup_starts_the_generator_asleep_before_the_policy_fills_the_gpu(tiny_qwen2, tmp_path, monkeypatch):
    # vLLM refuses to start when less than its gpu_memory_utilization share is free: it must be built (and put to
    # sleep) before the policy and the reference policy, as NeMo-RL does. The real objects run; calls are recorded.
    from nemo_disco import algorithm, rollouts

    log: list[str] = []
    build_generator, build_policy = rollouts.build_generator, algorithm.build_policy

    def generator(cfg, model_dir):  # noqa: ANN001, ANN202
        log.append("build_generator")
        return Recorder("generator", build_generator(cfg, model_dir), log)

    def policy(cfg, model_dir, trainable=True):  # noqa: ANN001, ANN202
        log.append(f"build_policy(trainable={trainable})")
        return build_policy(cfg, model_dir, trainable=trainable)

    monkeypatch.setattr(rollouts, "build_generator", generator)
    monkeypatch.setattr(algorithm, "build_policy", policy)
    monkeypatch.setattr(rollouts, "is_colocated", lambda cfg: True)  # as vLLM on a GPU
    cfg = config.load(
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
    from nemo_disco.batch import collate

    # Responses of 3, 5 (correct: reward 1) and 2, 6, 7 tokens (wrong: rewards 0, 0.5 at threshold 0.5, -1).
    lengths, rewards = [3, 5, 2, 6, 7], [1.0, 1.0, 0.0, 0.5, -1.0]
    batch = collate([[7]] * 5, [[9] * n for n in lengths], [[0.0] * n for n in lengths], [0, 0, 1, 1, 1], rewards, 0)
    zeros = torch.zeros_like(batch.response_mask, dtype=torch.float32)
    records = [{"finish": ["stop"] * 2}, {"finish": ["stop"] * 3}]
    out = _step_metrics(batch, zeros, zeros, [], records, threshold=0.5)
    assert out["train/response_length_correct_mean"] == 4.0  # (3 + 5) / 2
    assert out["train/response_length_wrong_mean"] == 5.0  # (2 + 6 + 7) / 3
    assert out["train/response_length_mean"] == pytest.approx(4.6)  # 23 / 5
    out = _step_metrics(batch, zeros, zeros, [], records, threshold=2.0)  # no rollout is correct
    assert "train/response_length_correct_mean" not in out
    assert out["train/response_length_wrong_mean"] == pytest.approx(4.6)


def test_update_plans_are_logged_one_line_per_run_of_equal_plans():
    from nemo_disco.algorithm import _plan_lines

    plans = ["update 0: 1 pass (a)", "update 1: 2 passes (b)", "update 2: 2 passes (b)", "update 3: 1 pass (a)"]
    assert _plan_lines(plans) == ["update 0: 1 pass (a)", "updates 1-2: 2 passes (b)", "update 3: 1 pass (a)"]
    assert _plan_lines(plans[:1]) == ["update 0: 1 pass (a)"]
