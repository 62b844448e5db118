"""nemo_disco.losses.registry: each loss declared once, lookup errors, losses of the user's own, the exactness rule."""

from __future__ import annotations

import pytest
from loss_reference import NAIVE_DEFAULTS, VARIANTS

from nemo_disco import losses

#: The paper's DisCO variants and baselines and DRPO (a loss added later needs no entry here).
NAMES = ["disco", "discob", "drpo", "gpg", "grpo", "grpo_rw", "dr_grpo", "dapo", "grpo_er", "trpa"]


def test_registry_and_lookup_errors() -> None:
    assert list(losses.LOSSES)[: len(NAMES)] == NAMES  # in the order the loss modules declare them
    with pytest.raises(ValueError, match="unknown loss 'ppo'; valid names: " + ", ".join(losses.LOSSES)):
        losses.get_loss("ppo")
    with pytest.raises(ValueError, match=r"unknown loss 'dsico' \(did you mean disco\?\)"):
        losses.get_loss("dsico")
    with pytest.raises(
        ValueError, match=r"^clip_eps is not a parameter of disco \(grpo, grpo_rw, dr_grpo, dapo, grpo_er"
    ):
        losses.get_loss("disco", clip_eps=0.2)
    with pytest.raises(ValueError, match=r"^tau is not a parameter of grpo \(disco, drpo have it\)$"):
        losses.get_loss("grpo", tau=1.0)
    with pytest.raises(ValueError, match=r"unknown hyper-parameter 'betta' \(did you mean beta\?\); disco takes: "):
        losses.get_loss("disco", betta=1.0)
    with pytest.raises(ValueError, match="loss 'disco': tau=-1.0: input should be greater than 0"):
        losses.get_loss("disco", tau=-1.0)
    with pytest.raises(ValueError, match="score='ratio': input should be 'logl' or 'lratio'"):
        losses.get_loss("discob", score="ratio")
    with pytest.raises(ValueError, match="max_log_ratio=inf"):
        losses.get_loss("disco", max_log_ratio=float("inf"))


def test_every_registered_loss_is_in_the_exactness_reference() -> None:
    # tests/loss_reference.py's VARIANTS drive the exactness tests (the library against the naive per-question loops,
    # test_losses_base.py; micro-batched and data-parallel gradients, test_update.py, test_losses_dp.py): a loss
    # declared without a row there fails here.
    assert set(losses.LOSSES) <= {name for name, _ in VARIANTS}


@pytest.mark.parametrize("name", list(losses.LOSSES))
def test_each_loss_takes_the_defaults_the_reference_was_written_for(name: str) -> None:
    # The defaults live once, on each loss's parameter model; the naive reference states them independently.
    naive = {**NAIVE_DEFAULTS, **({"clip_eps_high": 0.28} if name == "dapo" else {})}
    hp = losses.get_loss(name).hyperparameters
    assert hp == {k: naive[k] for k in hp}
    assert set(hp) == set(losses.LOSSES[name].hparams.model_fields)


def test_a_name_is_declared_once() -> None:
    with pytest.raises(ValueError, match="loss 'disco' is registered twice"):
        losses.register_loss(
            "disco", params=losses.Hyper, stat_names=("x",), stats=lambda *a: None, coupling=lambda *a: "rollout"
        )(lambda *a: None)
    assert losses.LOSSES["disco"].objective_fn is losses.disco_objective


USER_MODULE = '''
from pydantic import Field

from nemo_disco.losses import Hyper


class Mean:
    """Minus the mean token log-prob of the positives, times a scale."""

    class Params(Hyper):
        scale: float = Field(1.0, gt=0)

    stat_names = ("logp_mean",)

    @staticmethod
    def stats(logprobs, old_logprobs, mask, entropy, ref_logprobs, p):
        m = mask.bool()
        return ((logprobs * m).sum(1) / m.sum(1).clamp(min=1))[:, None]

    @staticmethod
    def objective(stats, group_ids, rewards, weights, p):
        pos = (rewards > p.positive_threshold).to(stats.dtype)
        return -p.scale * (stats[:, 0] * pos).sum() / pos.sum().clamp(min=1), {}


class NoParams:
    stat_names = ("x",)


class Incomplete:
    Params = Hyper
'''


def test_a_loss_of_the_users_own_is_found_by_its_module_and_class(tmp_path, monkeypatch) -> None:
    import torch

    (tmp_path / "my_loss_module.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = losses.get_loss("my_loss_module:Mean", scale=2.0)
    assert fn.name == "my_loss_module:Mean" and fn.hyperparameters["scale"] == 2.0
    assert fn.coupling(first_update=True, weighted=False) == losses.MINIBATCH  # none declared: always exact
    lp = torch.tensor([[-1.0, -3.0], [-2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    loss, _ = fn(lp, lp.detach(), mask, torch.tensor([0, 0]), torch.tensor([1.0, 0.0], dtype=torch.float64))
    assert loss.item() == pytest.approx(2.0 * 2.0)  # -2 x mean(-1, -3) over the one positive
    with pytest.raises(ValueError, match=r"^tau is not a parameter of my_loss_module:Mean \(disco, drpo have it\)"):
        losses.get_loss("my_loss_module:Mean", tau=1.0)
    with pytest.raises(ValueError, match="scale=0.0: input should be greater than 0"):
        losses.get_loss("my_loss_module:Mean", scale=0.0)
    for spec, message in (
        ("no_such_module_here:Mean", "module 'no_such_module_here' does not import: No module named"),
        ("my_loss_module:Median", "module 'my_loss_module' has no 'Median'"),
        ("my_loss_module:NoParams", "NoParams.Params must be a parameter model, a subclass of losses.Hyper"),
        ("my_loss_module:Incomplete", "Incomplete lacks stat_names, stats, objective"),
    ):
        with pytest.raises(ValueError, match=f"^loss '{spec}': {message}"):
            losses.get_loss(spec)


def test_the_worked_example_of_docs_losses_md_runs(tmp_path, monkeypatch) -> None:
    import re
    from pathlib import Path

    import torch

    doc = (Path(__file__).resolve().parents[2] / "docs" / "losses.md").read_text()
    section = doc[doc.index("## A loss of your own") :]
    (tmp_path / "my_losses.py").write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = losses.get_loss("my_losses:MeanBaselinePG", scale=0.5)
    lp = torch.tensor([[-1.0, -3.0], [-2.0, float("nan")], [-0.5, -0.5]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    gids, rewards = torch.tensor([4, 4, 9]), torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    loss, metrics = fn(lp, lp.detach(), mask, gids, rewards)
    # Question 4: baseline 0.5, advantages +0.5 / -0.5 on token means -2 / -2; question 9: advantage 0.
    # J = (0.5 * -2 + -0.5 * -2 + 0) / 3 = 0; the loss is -0.5 * J.
    assert metrics["objective"] == 0.0 and loss.item() == 0.0
    (grad,) = torch.autograd.grad(loss, lp)
    stats = fn.stats(lp, lp.detach(), mask)
    coeffs, _, _ = losses.coefficients(fn, stats, gids, rewards)
    (two_pass,) = torch.autograd.grad(losses.surrogate(coeffs, stats), lp)
    assert torch.equal(torch.nan_to_num(grad), torch.nan_to_num(two_pass))
    assert grad[0, 0].item() == pytest.approx(-0.5 * 0.5 / 3 / 2)  # -scale * adv / N / tokens
    assert fn.coupling(first_update=False, weighted=True) == losses.ROLLOUT
