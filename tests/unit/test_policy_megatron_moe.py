"""The MoE helpers of the Megatron policy: router parameters and the router statistics / load-balancing loss."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_disco.policy.megatron_moe import RouterBalance, is_router

# ----------------------------------------------------------------------------------------------------------------------
# is_router: the parameters policy.freeze_router freezes


def test_is_router_names_only_the_router_weight_and_bias():
    assert is_router("decoder.layers.0.mlp.router.weight")
    assert is_router("decoder.layers.3.mlp.router.bias")
    # Experts, a dense MLP and attention are trained.
    assert not is_router("decoder.layers.0.mlp.experts.linear_fc1.weight0")
    assert not is_router("decoder.layers.0.mlp.linear_fc1.weight")
    assert not is_router("decoder.layers.0.mlp.router.weight._extra_state")


# ----------------------------------------------------------------------------------------------------------------------
# RouterBalance: the router statistics and the optional load-balancing loss

EXPERTS, TOPK = 4, 2


def _topk_routing(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mcore's TopKRouter.routing contract: probs and a boolean routing map, both [tokens, E]."""
    probs = torch.softmax(logits.reshape(-1, EXPERTS), -1)
    routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, probs.topk(TOPK, -1).indices, True)
    return probs * routing_map, routing_map


def _microbatches() -> list[SimpleNamespace]:
    """Micro-batches [B=2, S=3]: padded, a filler (its tokens excluded), one with no real token at all."""
    mask = torch.tensor([[True, True, False], [True, True, True]])
    none = torch.zeros(2, 3, dtype=torch.bool)
    return [
        SimpleNamespace(token_mask=mask, filler=False, input_ids=torch.zeros(2, 3, dtype=torch.long)),
        SimpleNamespace(token_mask=torch.ones_like(mask), filler=True, input_ids=torch.zeros(2, 3, dtype=torch.long)),
        SimpleNamespace(token_mask=none, filler=False, input_ids=torch.zeros(2, 3, dtype=torch.long)),
        SimpleNamespace(token_mask=mask.flip(1), filler=False, input_ids=torch.zeros(2, 3, dtype=torch.long)),
    ]


def _layer_logits(mbs: list[SimpleNamespace], layers: int) -> list[list[torch.Tensor]]:
    """[micro-batch][layer] router logits [S=3, B=2, E] (mcore's order); large on the filler, as garbage would be."""
    gen = torch.Generator().manual_seed(0)
    return [[torch.randn(3, 2, EXPERTS, generator=gen) * (50 if mb.filler else 1) for _ in range(layers)] for mb in mbs]


def _reference(mbs: list[SimpleNamespace], logits: list[list[torch.Tensor]]) -> tuple[dict, list[torch.Tensor]]:
    """The class docstring's statistics by boolean selection of the real tokens, and each micro-batch's loss."""
    layers = len(logits[0])
    counts, prob_sums, tokens = torch.zeros(layers, EXPERTS), torch.zeros(layers, EXPERTS), torch.zeros(layers, 1)
    losses = []
    for mb, per_layer in zip(mbs, logits, strict=True):
        real = mb.token_mask.t().reshape(-1) & (not mb.filler)  # [S * B]
        loss = torch.zeros(())
        for layer, z in enumerate(per_layer):
            _, routing_map = _topk_routing(z)
            c, p = routing_map[real].float().sum(0), torch.softmax(z.reshape(-1, EXPERTS)[real], -1).sum(0)
            counts[layer] += c
            prob_sums[layer] += p.detach()
            tokens[layer] += int(real.sum())
            if real.any():  # E / (k n^2) sum_i (sum_t P_ti) counts_i
                loss = loss + EXPERTS / (TOPK * int(real.sum()) ** 2) * (p * c).sum()
        losses.append(loss)
    share, mean_prob = counts / (TOPK * tokens), prob_sums / tokens  # f_i, P_i per layer
    stats = {
        "router_balance_loss": float((EXPERTS * share * mean_prob).sum(1).mean()),
        "router_max_load": float((EXPERTS * share).max()),
    }
    return stats, losses


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("coef", [0.0, 0.5])
def test_router_balance_is_the_documented_loss_on_real_tokens(coef, recompute):
    """Statistics and the trained term's gradient as the class docstring defines them (real tokens only, fillers
    out, recomputation counted once, no NaN from a micro-batch without real tokens), and the per-layer hook makes
    no host sync: on a GPU it runs in every MoE layer of every micro-batch."""
    from host_syncs import HostSyncs

    layers = 2
    routers = [SimpleNamespace(layer_number=n + 1) for n in range(layers)]
    mbs = _microbatches()
    logits = _layer_logits(mbs, layers)
    spec = SimpleNamespace(num_experts=EXPERTS, moe_router_topk=TOPK)
    balance = RouterBalance(torch.nn.Linear(1, 1), spec, coef, recompute)  # a model without routers: called directly
    balance.start(mbs, dp_group=None)
    ref_stats, _ = _reference(mbs, logits)
    scale = coef / 3  # three micro-batches that are no filler
    for mb, per_layer in zip(mbs, logits, strict=True):
        balance.set_tokens(mb)
        for router, z in zip(routers, per_layer, strict=True):
            z = z.detach().requires_grad_(True)
            if recompute:  # mcore's activation recomputation: a forward without grad first, again in the backward
                with torch.no_grad(), HostSyncs() as syncs:
                    balance._routing(router, _topk_routing, z)
                assert syncs.calls == [], syncs.calls
            with HostSyncs() as syncs:
                probs, _ = balance._routing(router, _topk_routing, z)
            assert syncs.calls == [], syncs.calls
            (grad,) = torch.autograd.grad(probs.sum(), z)
            # The trained term adds scale x d(this micro-batch's layer losses) / dz; zero where no token is real.
            z_ref = z.detach().requires_grad_(True)
            _, ref_layer_losses = _reference([mb], [[z_ref]])
            (ref_grad,) = torch.autograd.grad(_topk_routing(z_ref)[0].sum() + scale * ref_layer_losses[0], z_ref)
            assert torch.isfinite(grad).all()
            torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)
    stats = balance.finish(dp_group=None, pp_group=None)
    assert stats == pytest.approx(ref_stats, abs=1e-6)
    assert 1.0 <= stats["router_balance_loss"] <= EXPERTS / TOPK
