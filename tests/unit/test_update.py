"""nemo_disco.update: one pass == two passes == full-batch autograd (float64), for every loss.

The model is ``TinyPolicy`` of ``tests/loss_reference.py`` (shared parameters W: every rollout's log-probs depend on all
W), wrapped as a :class:`nemo_disco.policy.base.Policy` whose ``train_minibatch`` sums the micro-batch gradients
(no optimizer: the test reads the gradient). The reference is the full-batch loss differentiated by autograd,
computed independently of the update unit. Layouts: 1, 2 and 3 micro-batches of whole questions, and
micro-batches of 3 rows that split questions; first update (pi_theta = pi_old: old log-probs are the current
ones) and later update (old log-probs of other weights, the KL constraint active); with and without rollout
weights.
"""

from __future__ import annotations

import math

import loss_reference as ref
import pytest
import torch

from nemo_disco import losses, update
from nemo_disco.batch import RolloutBatch, pack_questions

DT = torch.float64
# Row caps of the micro-batches: whole questions (sizes 2, 3, 4, 4, 5 in question order) in 1, 2 or 3 micro-batches,
# and fixed chunks of 3 rows that split questions.
LAYOUTS = {"1mb": 100, "2mb": 10, "3mb": 7, "split3": None}


class TinyModelPolicy:
    """The Policy protocol on a TinyPolicy (float64); ``prompt_ids[:, 0]`` holds each row's index into it."""

    def __init__(self, pol: ref.TinyPolicy, layout: str, dp_rank: int = 0, dp_size: int = 1) -> None:
        self.pol, self.layout = pol, layout
        self.dp_rank, self.dp_size, self.dp_group = dp_rank, dp_size, None
        self.grad = torch.zeros_like(pol.w)
        self.forwards = 0

    def microbatch_rows(self, batch: RolloutBatch) -> list[torch.Tensor]:
        cap = LAYOUTS[self.layout]
        if cap is None:
            return list(torch.arange(len(batch)).split(3))
        return pack_questions(batch.group_ids, lambda start, stop: stop - start <= cap)

    def _forward(self, batch: RolloutBatch, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.forwards += 1
        lp, ent = self.pol.forward(batch.prompt_ids[:, 0], batch.response_ids.shape[1])
        return lp, (ent if entropy else None)

    def logprobs(self, batch: RolloutBatch, *, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.no_grad():
            return self._forward(batch, entropy)

    def train_minibatch(self, batch: RolloutBatch, surrogate_fn, *, entropy: bool = False) -> dict[str, float]:
        total = 0.0
        for rows in self.microbatch_rows(batch):
            lp, ent = self._forward(batch.select(rows), entropy)
            value = surrogate_fn(rows, lp, ent)
            (g,) = torch.autograd.grad(value, self.pol.w)
            self.grad += g
            total += float(value.detach())
        if self.dp_size > 1:
            from nemo_disco import distributed

            distributed.all_reduce(self.grad)
        skipped = not (math.isfinite(total) and bool(torch.isfinite(self.grad).all()))
        return {"grad_norm": float(self.grad.norm()), "lr": 0.0, "skipped": float(skipped), "surrogate": total}


def case(seed: int = 5) -> tuple[ref.TinyPolicy, RolloutBatch]:
    """loss_reference's 19 rollouts (uneven questions, a singleton), sorted by question; generator log-probs apart."""
    pol, c = ref.policy_case(seed=seed)
    order = torch.argsort(c["gids"], stable=True)
    gen = pol.old + 0.4 * torch.randn(pol.old.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=DT)
    n, t = c["mask"].shape
    batch = RolloutBatch(
        prompt_ids=order[:, None],
        prompt_mask=torch.ones((n, 1), dtype=torch.bool),
        response_ids=torch.zeros((n, t), dtype=torch.long),
        response_mask=c["mask"][order],
        group_ids=c["gids"][order],
        rewards=c["rewards"][order],
        gen_logprobs=torch.where(c["mask"], gen, 0.0)[order],
        ref_logprobs=pol.ref[order],
    )
    return pol, batch, c["threshold"]


def full_batch_gradient(pol, batch, fn, hp, *, first: bool, correction: update.Correction):
    """Autograd of the whole mini-batch loss: the reference, independent of nemo_disco.update."""
    lp, ent = pol.forward(batch.prompt_ids[:, 0], batch.response_ids.shape[1])
    old = lp.detach() if first else pol.old[batch.prompt_ids[:, 0]]
    weights, _ = losses.rollout_weights(
        old, batch.gen_logprobs, batch.response_mask, mode=correction.mode, cap=correction.cap
    )
    value, metrics = fn(
        lp,
        old,
        batch.response_mask,
        batch.group_ids,
        batch.rewards,
        entropy=ent,
        ref_logprobs=batch.ref_logprobs,
        weights=weights,
        **hp,
    )
    (g,) = torch.autograd.grad(value, pol.w)
    return g, value.item(), metrics, old, weights


def run_update(pol, batch, fn, hp, layout, *, first, correction, passes, rows=None, dp=(0, 1)):
    """One update through nemo_disco.update with ``passes``; returns (gradient, result, policy)."""
    rows = rows if rows is not None else slice(0, len(batch))
    policy = TinyModelPolicy(pol, layout, *dp)
    local = batch.select(rows)
    weights = None
    if first and passes == 2:
        old, ent = policy.logprobs(local, entropy=True)  # pi_old's: the trainer's no-grad forward
        local = local.with_(old_logprobs=old)
        old_entropy = ent
    elif first:
        local, old_entropy = local.with_(old_logprobs=None), None
    else:
        local, old_entropy = local.with_(old_logprobs=pol.old[local.prompt_ids[:, 0]]), None
    if correction.weighted and not (first and passes == 1):
        old_full = pol.old[batch.prompt_ids[:, 0]]
        if first:
            with torch.no_grad():
                old_full = pol.forward(batch.prompt_ids[:, 0], batch.response_ids.shape[1])[0]
        weights, _ = losses.rollout_weights(
            old_full, batch.gen_logprobs, batch.response_mask, mode=correction.mode, cap=correction.cap
        )
    mb = update.Minibatch(full=batch, local=local, rows=rows, old_entropy=old_entropy, weights=weights)
    res = update.run(policy, fn, mb, passes=passes, first_update=first, correction=correction)
    return policy.grad, res, policy


CORRECTIONS = {"unweighted": update.Correction(), "seq_tis": update.Correction("seq_tis", 1.5)}


@pytest.mark.parametrize("correction", list(CORRECTIONS))
@pytest.mark.parametrize("first", [True, False], ids=["first", "later"])
@pytest.mark.parametrize(("name", "hp"), ref.VARIANTS, ids=ref.VARIANT_IDS)
def test_one_pass_equals_two_passes_equals_full_batch(name, hp, first, correction):
    pol, batch, threshold = case()
    hp = {**hp, "positive_threshold": threshold}
    fn = losses.get_loss(name, **hp)
    corr = CORRECTIONS[correction]
    full, value, _, _, _ = full_batch_gradient(pol, batch, fn, hp, first=first, correction=corr)
    assert float(full.abs().max()) > 1e-3
    one_pass_layouts = []
    for layout in LAYOUTS:
        policy = TinyModelPolicy(pol, layout)
        pl = update.plan(policy, fn, batch, batch, slice(0, len(batch)), first_update=first, correction=corr)
        g2, res2, pol2 = run_update(pol, batch, fn, hp, layout, first=first, correction=corr, passes=2)
        torch.testing.assert_close(g2, full, atol=1e-10, rtol=0)
        assert res2.metrics["loss"] == pytest.approx(value, abs=1e-12)
        # Two passes forward twice, except at a first update (pass 1 is pi_old's log-probs, made before).
        assert res2.forwards == (1 if first else 2)
        if pl.passes == 1:
            g1, res1, pol1 = run_update(pol, batch, fn, hp, layout, first=first, correction=corr, passes=1)
            torch.testing.assert_close(g1, full, atol=1e-10, rtol=0)
            assert res1.metrics["loss"] == pytest.approx(value, abs=1e-12)
            assert res1.forwards == 1 and pol1.forwards == len(pol1.microbatch_rows(batch))
            for key, v in res2.metrics.items():
                if key not in ("grad_norm", "surrogate"):
                    assert res1.metrics[key] == pytest.approx(v, abs=1e-10), key
            if first:  # the one pass hands back pi_old's log-probs (and weights) of the mini-batch
                lp, _ = pol.forward(batch.prompt_ids[:, 0], batch.response_ids.shape[1])
                torch.testing.assert_close(res1.old_logprobs, lp.detach(), atol=0, rtol=0)
                assert res1.old_logprobs.dtype == torch.float64 and res1.old_logprobs.device.type == "cpu"
            one_pass_layouts.append(layout)
    coupling = fn.coupling(first_update=first, weighted=corr.weighted, **hp)
    expected = {
        losses.ROLLOUT: list(LAYOUTS),
        losses.QUESTION: ["1mb", "2mb", "3mb"],
        losses.MINIBATCH: [],
    }[coupling]
    assert one_pass_layouts == expected, (coupling, one_pass_layouts)


def test_disco_takes_one_pass_at_the_first_update_only_and_that_is_where_it_is_exact():
    """The plan is exact where it says one pass, and forcing one pass where it says two gives a wrong gradient."""
    pol, batch, threshold = case()
    hp = {"score": "logl", "positive_threshold": threshold}
    fn = losses.get_loss("disco", **hp)
    corr = update.Correction()
    policy = TinyModelPolicy(pol, "2mb")
    args = (policy, fn, batch, batch, slice(0, len(batch)))
    assert update.plan(*args, first_update=True, correction=corr).passes == 1
    assert update.plan(*args, first_update=False, correction=corr).passes == 2
    # Later update with the constraint active: the hinge couples the micro-batches, one pass would be wrong.
    full, _, metrics, _, _ = full_batch_gradient(pol, batch, fn, hp, first=False, correction=corr)
    assert metrics["constraint_active"] == 1.0
    wrong, _, _ = run_update(pol, batch, fn, hp, "2mb", first=False, correction=corr, passes=1)
    assert float((wrong - full).abs().max()) > 1e-3
    # Questions split over micro-batches: DisCO's DRO couples them, so one pass is refused and would be wrong.
    split = TinyModelPolicy(pol, "split3")
    assert update.plan(split, fn, batch, batch, slice(0, len(batch)), first_update=True, correction=corr).passes == 2
    full_first, *_ = full_batch_gradient(pol, batch, fn, hp, first=True, correction=corr)
    wrong_split, _, _ = run_update(pol, batch, fn, hp, "split3", first=True, correction=corr, passes=1)
    assert float((wrong_split - full_first).abs().max()) > 1e-6
    # beta = 0: no hinge, one pass at every update.
    hp0 = {**hp, "beta": 0.0}
    fn0 = losses.get_loss("disco", **hp0)
    assert update.plan(policy, fn0, batch, batch, slice(0, len(batch)), first_update=False, correction=corr).passes == 1


def test_divisor_valid_with_weights_keeps_two_passes():
    pol, batch, threshold = case()
    hp = {"divisor": "valid", "positive_threshold": threshold}
    for name in ("disco", "discob", "drpo", "grpo_rw"):
        fn = losses.get_loss(name, **hp)
        policy = TinyModelPolicy(pol, "1mb")
        args = (policy, fn, batch, batch, slice(0, len(batch)))
        assert update.plan(*args, first_update=True, correction=CORRECTIONS["seq_tis"]).passes == 2
        assert update.plan(*args, first_update=True, correction=CORRECTIONS["unweighted"]).passes == 1


def test_pack_questions_keeps_questions_together_where_they_fit():
    gids = torch.tensor([4, 4, 4, 9, 9, 1, 1, 1, 1, 1, 2])

    def cap(n):
        return lambda start, stop: stop - start <= n

    assert [r.tolist() for r in pack_questions(gids, cap(5))] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10]]
    assert [r.tolist() for r in pack_questions(gids, cap(4))] == [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9, 10]]
    assert [r.tolist() for r in pack_questions(gids, cap(1))] == [[i] for i in range(11)]
    assert [r.tolist() for r in pack_questions(gids, cap(100))] == [list(range(11))]
