"""Data-parallel exactness of nemo_disco.losses: 2 gloo processes == one full batch, for every loss.

Each rank holds half of the rollouts, split so that every question with two or more rollouts has rollouts on
both ranks. Pass 1: local stats (no grad) -> all_gather -> coefficients on the gathered mini-batch. Pass 2:
local surrogate backward over micro-batches of 2 rollouts; all_reduce SUM of the gradients. The result must
equal the gradient of the full-batch loss within 1e-10 (float64), with and without rollout weights.
"""

from __future__ import annotations

import datetime
import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from procs import free_port

from nemo_disco import losses

REFERENCE = Path(__file__).resolve().parents[1] / "unit" / "test_losses.py"
WORLD = 2


def _reference():
    spec = importlib.util.spec_from_file_location("_loss_reference", REFERENCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_all_losses(rank: int) -> int:
    """Run every loss variant, weighted and not; return the number of checks made."""
    ref = _reference()
    pol, c = ref.policy_case(seed=13)
    keep = torch.nonzero(c["gids"] != 3).squeeze(1)  # drop the singleton question: 18 rollouts, 9 per rank
    gids, rewards, mask = c["gids"][keep], c["rewards"][keep], c["mask"][keep]
    old, ref_lp = pol.old[keep], pol.ref[keep]
    gen = old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(14), dtype=old.dtype)
    tis, _ = losses.rollout_weights(old, gen, mask, mode="seq_tis", cap=1.5)
    # Rows sorted by question, dealt alternately: a question's rollouts straddle the ranks.
    order = torch.argsort(gids, stable=True)
    shards = [order[r::WORLD] for r in range(WORLD)]
    local = shards[rank]
    gathered_rows = torch.cat(shards)  # the all_gather order (rank order)
    for q in gids.unique():
        on = [bool((gids[s] == q).any()) for s in shards]
        assert int((gids == q).sum()) < 2 or all(on), f"question {int(q)} does not straddle the ranks"
    checks = 0
    for name, hp in ref.VARIANTS:
        hp = {**hp, "positive_threshold": c["threshold"]}
        fn = losses.get_loss(name, **hp)
        for weights in (None, tis):
            # Full batch on one process (the reference).
            lp, ent = pol.forward(keep, ref.T_MAX)
            full_loss, _ = fn(lp, old, mask, gids, rewards, entropy=ent, ref_logprobs=ref_lp, weights=weights, **hp)
            (full,) = torch.autograd.grad(full_loss, pol.w)
            # Pass 1: local stats without grad, gathered over ranks.
            with torch.no_grad():
                lp_l, ent_l = pol.forward(keep[local], ref.T_MAX)
                st_l = fn.stats(lp_l, old[local], mask[local], entropy=ent_l, ref_logprobs=ref_lp[local], **hp)
            parts = [torch.empty_like(st_l) for _ in range(WORLD)]
            dist.all_gather(parts, st_l)
            w_rows = None if weights is None else weights[gathered_rows]
            coeffs, value, _ = losses.coefficients(
                fn, torch.cat(parts), gids[gathered_rows], rewards[gathered_rows], weights=w_rows, **hp
            )
            assert abs(value - full_loss.item()) <= 1e-12, (name, hp, value, full_loss.item())
            c_local = coeffs[rank * len(local) : (rank + 1) * len(local)]
            # Pass 2: micro-batches of 2 local rollouts, each at its own padding width; gradients summed.
            grad = torch.zeros_like(pol.w)
            for j in torch.arange(len(local)).split(2):
                rows = local[j]
                width = int(mask[rows].sum(1).max())
                lp_mb, ent_mb = pol.forward(keep[rows], width)
                st = fn.stats(
                    lp_mb,
                    old[rows, :width],
                    mask[rows, :width],
                    entropy=ent_mb,
                    ref_logprobs=ref_lp[rows, :width],
                    **hp,
                )
                (g,) = torch.autograd.grad(losses.surrogate(c_local[j], st), pol.w)
                grad += g
            dist.all_reduce(grad, op=dist.ReduceOp.SUM)
            err = float((grad - full).abs().max())
            assert err <= 1e-10, f"rank {rank}: {name} {hp} weighted={weights is not None}: max |diff| = {err:.3e}"
            assert float(full.abs().max()) > 1e-3
            checks += 1
    return checks


def _worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        checks = _check_all_losses(rank)
        total = torch.tensor([checks])
        dist.all_reduce(total)
        assert int(total) == WORLD * 2 * len(_reference().VARIANTS)
    finally:
        dist.destroy_process_group()


def test_data_parallel_gradient_equals_full_batch() -> None:
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD, join=True)
