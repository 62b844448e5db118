"""The collective helpers of nemo_disco.distributed on 2 gloo ranks (torchrun): values, devices, in-place contract.

This file is also the worker: ``python -m torch.distributed.run ... test_distributed_helpers.py OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))

from procs import THREADS, free_port, run_group  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import os

    out = tmp_path_factory.mktemp("helpers")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_port()), str(HERE), str(out)]
    res = run_group(cmd, timeout=180, env={**os.environ, **THREADS})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_reductions(ranks):
    for r in ranks:
        assert r["sum"] == [1.0, 3.0]  # [0, 1] + [1, 2]
        assert r["max"] == [1.0, 2.0]
        assert r["sum_in_place"] is True
        assert r["sum_floats"] == [1.5, 2.0]  # 0.5 + 1.0 and 1 + 1
        assert r["any_rank"] is True and r["none"] is False
        assert r["max_int"] == 15  # SIGTERM on rank 1, nothing on rank 0


def test_broadcast_and_gathers(ranks):
    for r in ranks:
        assert r["broadcast"] == [10.0, 11.0]  # rank 1's tensor everywhere, written into the caller's tensor
        assert r["broadcast_in_place"] is True
        assert r["rows"] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]  # rank 0's 2 rows, then rank 1's
        assert r["objects"] == [{"rank": 0}, {"rank": 1}]
        assert r["broadcast_object"] == "from rank 0"
        assert r["subgroup_rows"] == [[1.0]]  # a one-rank group: each rank keeps its own row
        assert r["devices"] == ["cpu"]


def _worker(out_dir: str) -> None:
    import torch

    from nemo_disco import distributed

    env = distributed.init()
    rank = env.rank
    res: dict = {}
    t = torch.tensor([float(rank), float(rank + 1)])
    res["sum_in_place"] = distributed.all_reduce(t) is t
    res["sum"] = t.tolist()
    res["max"] = distributed.all_reduce(torch.tensor([float(rank), 2.0 * rank]), "max").tolist()
    res["sum_floats"] = distributed.sum_floats([0.5 * (rank + 1), 1])
    res["any_rank"] = distributed.any_rank(rank == 1)
    res["none"] = distributed.any_rank(False)
    res["max_int"] = distributed.max_int(15 if rank == 1 else 0)
    b = torch.tensor([10.0, 11.0]) if rank == 1 else torch.zeros(2)
    res["broadcast_in_place"] = distributed.broadcast(b, src=1) is b
    res["broadcast"] = b.tolist()
    rows = torch.full((2, 2), float(2 * rank)) + torch.tensor([[0.0], [1.0]])
    gathered = distributed.all_gather_rows(rows)
    res["rows"] = gathered.tolist()
    res["devices"] = sorted({str(x.device) for x in (t, b, gathered)})
    res["objects"] = distributed.all_gather_object({"rank": rank})
    res["broadcast_object"] = distributed.broadcast_object("from rank 0" if rank == 0 else None, src=0)
    import torch.distributed as dist  # the test builds a subgroup; the package never does

    groups = [dist.new_group([0]), dist.new_group([1])]
    res["subgroup_rows"] = distributed.all_gather_rows(torch.ones(1, 1), groups[rank]).tolist()
    distributed.barrier()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(res))
    # Torn down before exit: gloo's threads left to the interpreter's exit can abort the process ("terminate called
    # without an active exception"), seen under load.
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
