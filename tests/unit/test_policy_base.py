"""The Policy protocol (policy/base.py): both backends implement it alike; the run values a policy is given."""

from __future__ import annotations

import inspect

import pytest
import torch

from nemo_disco.policy.base import Policy, RunValues

METHODS = sorted(name for name, value in vars(Policy).items() if inspect.isfunction(value) and not name.startswith("_"))


def _backends() -> list[type]:
    from nemo_disco.policy.hf import HFPolicy
    from nemo_disco.policy.megatron import MegatronPolicy

    return [HFPolicy, MegatronPolicy]


def test_the_protocol_names_what_the_trainer_calls():
    assert METHODS == [
        "export_weights",
        "load",
        "logprobs",
        "microbatch_rows",
        "offload",
        "onload",
        "save",
        "train_minibatch",
    ]


@pytest.mark.parametrize("method", METHODS)
def test_every_backend_takes_the_protocol_arguments(method):
    """Same positional parameters; every keyword-only parameter of the protocol, with the same default."""
    want = inspect.signature(getattr(Policy, method)).parameters
    for backend in _backends():
        have = inspect.signature(getattr(backend, method)).parameters
        positional = [n for n, p in want.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert [n for n, p in have.items() if p.kind is p.POSITIONAL_OR_KEYWORD][: len(positional)] == positional
        for name, p in want.items():
            if p.kind is p.KEYWORD_ONLY:
                assert name in have and have[name].default == p.default, (backend.__name__, method, name)


def test_an_object_lacking_a_method_is_not_a_policy():
    class Partial:
        dp_rank, dp_size, dp_group = 0, 1, None

        def logprobs(self, batch, *, entropy=False):  # noqa: ANN001, ANN202
            return torch.zeros(0), None

    assert not isinstance(Partial(), Policy)


def _cfg(*overrides: str):
    from nemo_disco import config

    recipe = config.Path(__file__).resolve().parents[2] / "recipes" / "disco.yaml"
    return config.load(recipe, ["policy.backend=hf", "policy.dtype=float32", "cluster.gpus_per_node=1", *overrides])


def test_run_values_of_a_run_config():
    cfg = _cfg(
        "algorithm.steps=7",
        "algorithm.prompts_per_step=8",
        "algorithm.minibatch_prompts=2",
        "algorithm.seed=5",
        "generation.temperature=0.6",
        "generation.refit_bucket_mb=64",
    )
    # 8 prompts a step in mini-batches of 2: 4 updates a step, 7 x 4 = 28 in the run.
    assert RunValues.of(cfg) == RunValues(seed=5, temperature=0.6, total_updates=28, refit_bucket_mb=64)


def test_the_transformers_policy_is_a_policy_built_from_its_section_and_the_run_values(tiny_qwen2):
    from nemo_disco.policy import build_policy

    cfg = _cfg("generation.temperature=0.5", "algorithm.steps=3")
    policy = build_policy(cfg, tiny_qwen2)
    assert isinstance(policy, Policy)
    assert (policy.dp_rank, policy.dp_size, policy.dp_group) == (0, 1, None)
    assert policy.temperature == 0.5 and policy.total_updates == 3 * cfg.updates_per_step
