"""Mixture-of-experts helpers of the Megatron policy: which parameters are routers, and the routers' statistics.

:class:`RouterBalance` measures the load-balancing loss of every MoE router on real tokens and, when asked,
trains it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from nemo_disco import distributed, weights

if TYPE_CHECKING:
    from nemo_disco.policy.megatron_layout import MicroBatch


def is_router(name: str) -> bool:
    """Whether a GPTModel parameter name is an MoE router's weight."""
    return name.endswith(".mlp.router.weight") or name.endswith(".mlp.router.bias")


class RouterBalance:
    """The load-balancing loss of this stage's MoE routers: measured on real tokens every update, trained if asked.

    Per layer, over the N real tokens of a pass (padding and filler micro-batches excluded): ``f_i`` = the share
    of the N x k routing choices that picked expert i, ``P_i`` = expert i's mean routing probability (softmax
    over all E experts); ``loss = E * sum_i f_i P_i`` (the Switch Transformer loss as mcore normalises it: 1.0
    when the load is uniform, E / k at worst). Each layer's counts are summed over the data-parallel ranks first.
    :meth:`finish` reports the mean over layers (``router_balance_loss``) and the busiest expert's load relative
    to a uniform one, ``E * max_i f_i`` (``router_max_load``).

    Training it (``policy.router_aux_loss_coef`` = c > 0; 0 by default, as NeMo-RL's load-balancing type
    "none"): each micro-batch adds ``c * (its per-layer losses summed over layers) / (micro-batches summed over
    the data-parallel ranks)`` through mcore's ``MoEAuxLossAutoScaler``, so the update follows
    ``surrogate + c * mean over micro-batches of the summed layer losses``. mcore's own aux loss is left off: in
    per-token-loss mode it scales by the micro-batch's token count, which the policy's globally normalised
    surrogate does not divide away.

    The per-layer work runs in every MoE layer of every micro-batch, so it never waits for the GPU: real tokens
    are selected by masked arithmetic (no boolean indexing), each layer's sums stay on the device, and
    :meth:`finish` reads them once at the end of the pass.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        spec: weights.ModelSpec,
        coef: float,
        recompute: bool,
        sp_group: distributed.Group = None,
    ) -> None:
        """Wrap the routing of every ``TopKRouter`` of ``model``.

        Args:
            model: this rank's GPTModel stage.
            spec: the architecture (experts, top-k).
            coef: ``policy.router_aux_loss_coef``.
            recompute: activation recomputation is on (a forward then runs twice).
            sp_group: the TP group under sequence parallelism (each rank routes a slice of the sequence), else None.
        """
        from megatron.core.transformer.moe.router import TopKRouter

        self.experts, self.topk, self.coef, self.recompute = spec.num_experts, spec.moe_router_topk, coef, recompute
        self.sp_group = sp_group
        self.active = False
        self.mask: torch.Tensor | None = None  # [S * B] real tokens of the running micro-batch, mcore's order
        self.scale = 0.0
        # layer number -> [2E + 1] float64 sums on the model's device: counts, probability sums, tokens
        self.sums: dict[int, torch.Tensor] = {}
        for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
            router.routing = functools.partial(self._routing, router, router.routing)

    def set_tokens(self, mb: MicroBatch) -> None:
        """The real tokens of the micro-batch about to run, in mcore's [S, B] order (this rank's slice under SP).

        Moved to the model's device here, once per micro-batch, not in every layer (non-blocking: a host-to-device
        copy of a CPU tensor does not wait for the device's queue).
        """
        real = mb.token_mask.t() & (not mb.filler)  # [S, B]
        if self.sp_group is not None:
            real = real.chunk(distributed.world_size(self.sp_group))[distributed.rank(self.sp_group)]
        self.mask = real.reshape(-1).to(mb.input_ids.device, non_blocking=True)

    def start(self, mbs: list[MicroBatch], dp_group: distributed.Group) -> None:
        """Begin a training pass over ``mbs`` (this DP rank's micro-batches)."""
        self.active, self.sums = True, {}
        if self.coef > 0:
            (total,) = distributed.sum_floats([float(sum(not mb.filler for mb in mbs))], group=dp_group)
            self.scale = self.coef / max(total, 1.0)

    def finish(self, dp_group: distributed.Group, pp_group: distributed.Group) -> dict[str, float]:
        """End the pass; the statistics of every layer of the model (same on every rank)."""
        self.active = False
        e, k = self.experts, self.topk
        layers = sorted(self.sums)
        stats = torch.stack([self.sums[n] for n in layers])  # [L_stage, 2E + 1]: counts, prob sums, tokens (device)
        distributed.all_reduce(stats, group=dp_group)
        if self.sp_group is not None:  # each TP rank routed a slice of the sequence
            distributed.all_reduce(stats, group=self.sp_group)
        tokens = stats[:, 2 * e :].clamp(min=1.0)
        share, mean_prob = stats[:, :e] / (k * tokens), stats[:, e : 2 * e] / tokens  # f_i, P_i per layer
        total = torch.stack([(e * share * mean_prob).sum(), stats.new_tensor(float(len(layers)))])
        busiest = (e * share).max().reshape(1)
        if pp_group is not None:
            distributed.all_reduce(total, group=pp_group)
            distributed.all_reduce(busiest, op="max", group=pp_group)
        loss, load = torch.cat([total[:1] / total[1:], busiest]).tolist()  # the pass's one read to the host
        return {"router_balance_loss": loss, "router_max_load": load}

    def _routing(
        self, router: Any, routing: Callable, logits: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        probs, routing_map = routing(logits, *args, **kwargs)
        if not self.active or self.mask is None:
            return probs, routing_map
        # Every layer of every micro-batch: no host sync (no boolean indexing, no float() / .item() / .cpu(), no
        # branch on a value). Padding and filler rows are zeroed by torch.where, which also keeps a non-finite
        # logit there out of the sums and their gradient.
        flat = logits.reshape(-1, self.experts)  # [T, E]
        real = self.mask if self.mask.device == flat.device else self.mask.to(flat.device)
        real = real.unsqueeze(-1)  # [T, 1]
        dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32
        scores = torch.softmax(torch.where(real, flat.to(dtype), 0.0), -1)  # [T, E]
        prob_sums = torch.where(real, scores, 0.0).sum(0)  # [E]
        counts = (routing_map.reshape(-1, self.experts) & real).sum(0).to(dtype)  # [E]
        n = real.sum().to(dtype).reshape(1)  # [1]
        row = torch.cat([counts, prob_sums.detach(), n]).double()  # this slice's sums, on the device
        if self.sp_group is not None:  # the loss is over the whole sequence: picks and tokens of every slice
            total = distributed.all_reduce(torch.cat([counts, n]), group=self.sp_group)
            counts, n = total[:-1], total[-1:]
        # With activation recomputation the forward runs twice (no grad, then with grad in the backward): count
        # the first. A layer without real tokens adds a row of zeros.
        if not (self.recompute and torch.is_grad_enabled()):
            self.sums[router.layer_number] = self.sums.get(router.layer_number, 0) + row
        if self.coef > 0 and torch.is_grad_enabled():
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            # E sum_i f_i P_i; under SP this slice's share of it (its tokens' probabilities, every slice's picks).
            # The factor E / (k n^2) in float64 as a Python float would be; n = 0 (no real token): counts and
            # probability sums are 0, the clamp keeps the loss 0 rather than NaN.
            factor = self.experts / (self.topk * n[0].double().clamp(min=1.0) ** 2)
            loss = factor.to(dtype) * (prob_sums * counts).sum()
            probs = MoEAuxLossAutoScaler.apply(probs, loss * self.scale)
        return probs, routing_map
