"""Hooks (:mod:`nemo_disco.hooks`): loading from NEMO_DISCO_HOOKS, order, errors, and the points a run reaches."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from nemo_disco import cli, config, hooks
from nemo_disco.batch import QuestionRollouts
from nemo_disco.rollouts.rollouter import step_rollouts

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hook_module(tmp_path, monkeypatch):
    """A module ``my_hooks`` on sys.path whose ``record`` hook appends to ``my_hooks.seen``."""
    (tmp_path / "my_hooks.py").write_text("seen = []\n\ndef record(point, **info):\n    seen.append((point, info))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_hooks", raising=False)
    yield
    hooks.clear()


def test_hooks_of_the_environment_run_first_then_registered_ones(hook_module, monkeypatch):
    monkeypatch.setenv(hooks.HOOKS_ENV, "my_hooks:record")
    order: list[str] = []
    hooks.register(lambda point, **info: order.append(point))
    hooks.point("old_logprobs", step=3)
    import my_hooks

    assert my_hooks.seen == [("old_logprobs", {"step": 3})] and order == ["old_logprobs"]
    monkeypatch.delenv(hooks.HOOKS_ENV)  # read again: the environment's hook is gone, the registered one stays
    hooks.point("rollouts", step=4)
    assert len(my_hooks.seen) == 1 and order == ["old_logprobs", "rollouts"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("my_hooks", "'my_hooks' is not module:function"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz' of 'no_such_module_xyz:f'"),
        ("my_hooks:missing", "'my_hooks' has no function 'missing'"),
    ],
)
def test_a_hook_that_does_not_load_is_named(hook_module, monkeypatch, spec, message):
    monkeypatch.setenv(hooks.HOOKS_ENV, spec)
    with pytest.raises(ValueError, match="NEMO_DISCO_HOOKS: .*") as err:
        hooks.point("rollouts", step=1)
    assert message in str(err.value)


def test_train_refuses_a_bad_hook_in_one_line_before_building_anything(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(hooks.HOOKS_ENV, "no_such_module_xyz:f")
    run_dir = tmp_path / "run"
    argv = ["train", "--config", str(ROOT / "recipes" / "tiny-cpu.yaml"), f"logging.run_dir={run_dir}"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("nemo-disco train: error: NEMO_DISCO_HOOKS: cannot import") and err.count("\n") == 1
    assert not run_dir.exists()


def test_the_rollouts_point_names_each_step(monkeypatch):
    monkeypatch.delenv(hooks.HOOKS_ENV, raising=False)
    seen: list[tuple[str, dict]] = []
    hooks.register(lambda point, **info: seen.append((point, info)))
    try:
        cfg = config.load(ROOT / "recipes" / "disco.yaml", ["cluster.gpus_per_node=1"])
        ro = SimpleNamespace(cfg=cfg, sampler=SimpleNamespace(next_batch=lambda: [0]))
        record = QuestionRollouts(0, [3], [[1]], [[-0.5]], ["stop"], [1.0])
        for step in (1, 2):
            step_rollouts(ro, step, collect=lambda ids, seed: ([record], {}))
    finally:
        hooks.clear()
    assert seen == [("rollouts", {"step": 1}), ("rollouts", {"step": 2})]
