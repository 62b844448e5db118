"""Ranks of a recipe's Megatron layout, built for real on ``meta``: their element counts as JSON (test_plan_counts.py).

``python plan_counts_worker.py JOBS_JSON`` (a list of ``{"config", "tp", "pp", "ep", "world", "rank"}``) joins,
per job, a ``fake`` process group of ``world`` ranks as ``rank`` (torch's single-process fake backend: every
collective is a no-op, every group has its real size and rank), builds mcore's ``parallel_state``, the GPTModel
stage of that rank (the package's own ``transformer_config`` / ``build_gpt_model``, GPU placement emulated on
``meta``: no memory), wraps it in Megatron DDP as ``MegatronPolicy`` does (fp32 gradient buffers, distributed
optimizer), and prints what it holds: parameters, gradient-buffer elements (unpadded and allocated), and the
optimizer shard of every data-parallel rank as mcore's distributed optimizer ranges it
(``DistributedOptimizer._build_model_gbuf_param_range_map``).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


def main() -> None:
    """Build, count, print one JSON list (one object per job)."""
    from megatron.core import parallel_state as ps

    from nemo_disco.policy import cpu_compat

    cpu_compat.emulate_device("meta")
    cpu_compat.apply()
    # The fake backend has no gloo twin: mcore's host-side groups (used by checkpointing only) are left out.
    ps.initialize_model_parallel = functools.partial(ps.initialize_model_parallel, create_gloo_process_groups=False)
    out = []
    for job in json.loads(Path(sys.argv[1]).read_text()):
        dist.init_process_group("fake", store=FakeStore(), rank=job["rank"], world_size=job["world"])
        out.append(count(job["config"], job["tp"], job["pp"], job["ep"]))
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    print(json.dumps(out))


def count(config: str, tp: int, pp: int, ep: int) -> dict:
    """This rank's element counts (see the module docstring)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    from nemo_disco import weights
    from nemo_disco.policy import cpu_compat
    from nemo_disco.policy.megatron_model import build_gpt_model, init_parallel, transformer_config
    from nemo_disco.policy.megatron_moe import is_router

    spec = weights.ModelSpec.from_hf_config(json.loads(Path(config).read_text()), config)
    init_parallel(tp, pp, ep=ep if spec.is_moe else None)
    tf = transformer_config(
        spec, tp=tp, pp=pp, dtype=torch.bfloat16, use_te=False, recompute="full", ep=ep, sequence_parallel=True
    )
    gpt = build_gpt_model(spec, tf, weights.padded_vocab_size(spec.vocab_size, tp), use_te=False)
    for name, p in gpt.named_parameters():
        if spec.is_moe and is_router(name):  # policy.freeze_router (the recipes' default)
            p.requires_grad_(False)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True, average_in_collective=False
    )
    with cpu_compat.device_scope():
        ddp = DistributedDataParallel(config=tf, ddp_config=ddp_config, module=gpt)
    buffers = list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))
    res = {
        "stage": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_world_size(),
        "device": str(next(gpt.parameters()).device),
        "weights": sum(p.numel() for p in gpt.parameters()),
        "trainable": sum(p.numel() for p in gpt.parameters() if p.requires_grad),
        "grad_dtypes": sorted({str(b.grad_dtype) for b in buffers}),
        "grads_unpadded": sum(b.numel_unpadded for b in buffers),
        "grads_padded": sum(b.numel for b in buffers),
        "grads_allocated": sum(b.grad_data.numel() for b in buffers),
    }
    # The optimizer shard of each data-parallel rank: the rank's 1/DP of every bucket, ranged by mcore.
    shards: dict[int, int] = {}
    for buffer in buffers:
        size = buffer.data_parallel_group.size()
        for bucket in buffer.buckets:
            per_rank = bucket.grad_data.numel() // size
            for r in range(size):
                world_range = Range(bucket.offset + r * per_rank, bucket.offset + (r + 1) * per_rank)
                ranges = DistributedOptimizer._build_model_gbuf_param_range_map(
                    buffer.param_index_map, world_range, bucket.offset
                )
                shards[r] = shards.get(r, 0) + sum(v["param"].size for v in ranges.values())
    # Experts shard over the (smaller) expert data-parallel group: rank keys are group ranks, so sum per buffer kind.
    own = sum(
        sum(
            v["param"].size
            for bucket in DistributedOptimizer._build_gbuf_range_map(b)[(b.param_dtype, b.grad_dtype)]
            for v in bucket["param_map"].values()
        )
        for b in buffers
    )
    res["optimizer_this_rank"] = own
    res["optimizer_all_ranks_sum"] = sum(shards.values())
    return res


if __name__ == "__main__":
    main()
