"""nemo_disco.losses.registry: each loss declared once, lookup errors, losses of the user's own, the exactness rule."""

from __future__ import annotations

import pytest
from loss_reference import NAIVE_DEFAULTS, VARIANTS, write_docs_loss_example

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


MALFORMED = """
from nemo_disco.losses import Hyper


class NoParams:
    stat_names = ("x",)


class Incomplete:
    Params = Hyper
"""


def test_a_loss_of_the_users_own_is_found_by_its_module_and_class(tmp_path, monkeypatch) -> None:
    import torch

    name = write_docs_loss_example(tmp_path)
    (tmp_path / "malformed_losses.py").write_text(MALFORMED)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = losses.get_loss(name, scale=0.5)
    assert fn.name == "my_losses:MeanBaselinePG" and fn.hyperparameters["scale"] == 0.5
    assert fn.coupling(first_update=False, weighted=True) == losses.ROLLOUT  # as the class declares
    lp = torch.tensor([[-1.0, -3.0], [-2.0, float("nan")], [-0.5, -0.5]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    gids, rewards = torch.tensor([4, 4, 9]), torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    loss, metrics = fn(lp, lp.detach(), mask, gids, rewards)
    # Question 4: baseline 0.5, advantages +0.5 / -0.5 on token means -2 / -2; question 9: advantage 0.
    # J = (0.5 * -2 + -0.5 * -2 + 0) / 3 = 0; the loss is -0.5 * J.
    assert metrics["objective"] == 0.0 and loss.item() == 0.0
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad[0, 0].item() == pytest.approx(-0.5 * 0.5 / 3 / 2)  # -scale * advantage / N / tokens
    # The trainer's exact two passes give the same gradient, as for a registered loss.
    stats = fn.stats(lp, lp.detach(), mask)
    coeffs, _, _ = losses.coefficients(fn, stats, gids, rewards)
    (two_pass,) = torch.autograd.grad(losses.surrogate(coeffs, stats), lp)
    assert torch.equal(torch.nan_to_num(grad), torch.nan_to_num(two_pass))
    with pytest.raises(
        ValueError, match=r"^tau is not a parameter of my_losses:MeanBaselinePG \(disco, drpo have it\)"
    ):
        losses.get_loss(name, tau=1.0)
    with pytest.raises(ValueError, match="scale=0.0: input should be greater than 0"):
        losses.get_loss(name, scale=0.0)
    for spec, message in (
        ("no_such_module_here:Mean", "module 'no_such_module_here' does not import: No module named"),
        ("my_losses:Median", "module 'my_losses' has no 'Median'"),
        ("malformed_losses:NoParams", "NoParams.Params must be a parameter model, a subclass of losses.Hyper"),
        ("malformed_losses:Incomplete", "Incomplete lacks stat_names, stats, objective"),
    ):
        with pytest.raises(ValueError, match=f"^loss '{spec}': {message}"):
            losses.get_loss(spec)
