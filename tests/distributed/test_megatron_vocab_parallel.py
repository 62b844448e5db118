"""Vocab-parallel log-probs / entropy over 3 gloo processes (torch.multiprocessing, no Megatron).

Vocabulary 10 padded to 18 columns, 6 per rank: rank 0 holds ids 0-5, rank 1 ids 6-9 plus 2 padding
columns, rank 2 only padding. Every rank must get the full-vocabulary values, and the gradients of the
shards must be the slices of the full-vocabulary gradient (zero on padding).
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, SHARD, VOCAB, TEMPERATURE = 3, 6, 10, 0.6


def _worker(rank: int, port: int, queue) -> None:  # noqa: ANN001
    from nemo_disco.policy.logprobs import token_logprobs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 5, WORLD * SHARD, generator=g)  # [B, S, V_padded], same on every rank
    targets = torch.randint(0, VOCAB, (2, 5), generator=g)
    w_lp, w_ent = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    shard = full[..., rank * SHARD : (rank + 1) * SHARD].clone().requires_grad_(True)
    lp, ent = token_logprobs(
        shard,
        targets,
        temperature=TEMPERATURE,
        group=dist.group.WORLD,
        vocab_start=rank * SHARD,
        vocab_size=VOCAB,
        chunk_size=3,
        entropy=True,
    )
    (w_lp * lp + w_ent * ent).sum().backward()
    # numpy arrays travel by value; a tensor would travel as a shared-memory handle that dies with this process
    queue.put((rank, lp.detach().numpy(), ent.detach().numpy(), shard.grad.numpy()))
    dist.barrier()
    dist.destroy_process_group()


def test_vocab_parallel_equals_full_vocabulary_softmax():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got = sorted((queue.get(timeout=120) for _ in procs), key=lambda x: x[0])
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 5, WORLD * SHARD, generator=g).double().requires_grad_(True)
    targets = torch.randint(0, VOCAB, (2, 5), generator=g)
    w_lp, w_ent = torch.randn(2, 5, generator=g).double(), torch.randn(2, 5, generator=g).double()
    logp = torch.log_softmax(full[..., :VOCAB] / TEMPERATURE, -1)  # padding columns excluded
    ref_lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (w_lp * ref_lp + w_ent * ref_ent).sum().backward()
    got = [(rank, *(torch.from_numpy(a) for a in arrays)) for rank, *arrays in got]
    for rank, lp, ent, grad in got:
        torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=1e-6, rtol=0)
        torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-6, rtol=0)
        ref_grad = full.grad[..., rank * SHARD : (rank + 1) * SHARD]
        torch.testing.assert_close(grad.double(), ref_grad, atol=1e-6, rtol=0)
    assert torch.all(got[2][3] == 0) and torch.all(got[1][3][..., VOCAB - SHARD :] == 0)
