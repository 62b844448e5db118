"""Data-parallel exactness of the update unit (nemo_disco.update): 2 gloo processes == one full batch, every loss.

Each rank holds half of the mini-batch (contiguous rows, as the trainer's ``_dp_slice``) in two layouts: every
question whole on one rank, and questions cut by the rank boundary. The unit runs on each rank (one pass where
``update.plan`` allows it, and always two passes: local statistics, all-gather, coefficients, surrogate); the
gradients are summed over ranks (all_reduce SUM through nemo_disco.distributed). The result must equal the
gradient of the full-batch loss within 1e-10 (float64), at a first and a later update, with and without rollout
weights. The harness (a float64 model behind the Policy protocol, the full-batch reference) is
``tests/unit/test_update.py``'s.
"""

from __future__ import annotations

import datetime
import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from procs import free_port

from nemo_disco import losses, update

HARNESS = Path(__file__).resolve().parents[1] / "unit" / "test_update.py"
WORLD = 2


def _harness():
    spec = importlib.util.spec_from_file_location("_update_harness", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_all_losses(rank: int) -> tuple[int, int]:
    """Run every loss variant in every layout; return (checks made, one-pass checks among them)."""
    h = _harness()
    pol, batch, threshold = h.case()
    # Questions (sorted by id) 3, 5, 7, 11, 19, 42 of 1, 2, 5, 3, 4, 4 rollouts. Without question 11: 16 rows,
    # halves of whole questions (3, 5, 7 | 19, 42). Without question 3: 18 rows, the halves cut question 11.
    layouts = {
        "whole": batch.select(torch.nonzero(batch.group_ids != 11).squeeze(1)),
        "split": batch.select(torch.nonzero(batch.group_ids != 3).squeeze(1)),
    }
    checks = one_pass = 0
    for layout_name, sub in layouts.items():
        n = len(sub)
        cut_whole = not bool(torch.isin(sub.group_ids[: n // 2], sub.group_ids[n // 2 :]).any())
        assert cut_whole == (layout_name == "whole")
        rows = slice(rank * n // 2, (rank + 1) * n // 2)
        for name, hp in h.ref.VARIANTS:
            hp = {**hp, "positive_threshold": threshold}
            fn = losses.get_loss(name, **hp)
            for first in (True, False):
                for corr in h.CORRECTIONS.values():
                    full, value, _, _, _ = h.full_batch_gradient(pol, sub, fn, hp, first=first, correction=corr)
                    policy = h.TinyModelPolicy(pol, "3mb", rank, WORLD)
                    pl = update.plan(policy, fn, sub, sub.select(rows), rows, first_update=first, correction=corr)
                    coupling = fn.coupling(first_update=first, weighted=corr.weighted, **hp)
                    if coupling == losses.QUESTION:
                        assert pl.passes == (1 if layout_name == "whole" else 2), (name, hp, layout_name)
                    for passes in sorted({2, pl.passes}):
                        g, res, _ = h.run_update(
                            pol, sub, fn, hp, "3mb", first=first, correction=corr, passes=passes, rows=rows,
                            dp=(rank, WORLD),
                        )  # fmt: skip
                        err = float((g - full).abs().max())
                        tag = f"rank {rank} {layout_name} {name} {hp} first={first} {corr} passes={passes}"
                        assert err <= 1e-10, f"{tag}: max |diff| = {err:.3e}"
                        assert abs(res.metrics["loss"] - value) <= 1e-12, (tag, res.metrics["loss"], value)
                        checks += 1
                        one_pass += passes == 1
    return checks, one_pass


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
        checks, one_pass = _check_all_losses(rank)
        total = torch.tensor([checks, one_pass])
        dist.all_reduce(total)
        # Every (layout, variant, update index, correction) ran two passes; where the plan allowed, one pass too.
        assert int(total[0]) - int(total[1]) == WORLD * 2 * 2 * 2 * len(_harness().ref.VARIANTS)
        assert int(total[1]) > 0
    finally:
        dist.destroy_process_group()


def test_data_parallel_update_equals_full_batch() -> None:
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD, join=True)
