"""Weights down the trainer-generator link (``init_roles`` + ``send_weights`` / ``receive_weights``) into HFGenerator.

One launched job of 1 + G processes (plain subprocesses with torchrun's variables; rank 0 serves the store),
split by :func:`nemo_disco.distributed.init_roles` into a one-rank trainer and a G-rank generator. The trainer
perturbs a tiny Qwen2 before every transfer (different noise each time, a ``-0.0`` included) and streams it in
12 KiB buckets (about 20 per stream, small tensors share one; the largest, 32 KiB in float32, travel alone).
Every generator rank applies the stream with ``HFGenerator.update_weights(receive_weights(link))``; the
generator ranks gather their whole ``state_dict`` to generator rank 0, which sends it up the link.

Compared bit for bit (the bytes of every tensor, so ``-0.0 != 0.0``), after every transfer and on every
generator rank: each entry of the generator model's ``state_dict`` (tied ``lm_head.weight`` included) against
the same entry of the trainer's, dtype and shape included, for a float32 and a bfloat16 generator (each fed
by a trainer model of its own dtype). Also: a stream with an unknown tensor name in the middle fails on
every generator rank with a ValueError naming it, generation is refused until a complete refit, and the next
complete stream makes the weights equal again.

This file is also the worker: ``python test_rollouts_remote.py --worker MODEL_DIR OUT_DIR``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))

from procs import launch_ranks  # noqa: E402

BUCKET_BYTES = 12 * 1024
TRANSFERS = 3
DTYPES = ("float32", "bfloat16")
BAD_NAME = "model.layers.0.mlp.not_a_weight"


def launch(args: list[str], world: int, out: Path, timeout: float) -> list[str]:
    """This file's worker on ``world`` ranks (:func:`procs.launch_ranks`); each rank's output."""
    return launch_ranks(HERE, args, world, out, timeout)


def build_model_dir(out: Path) -> Path:
    """The tiny Qwen2 both roles load."""
    from nemo_disco.config import TinyModelConfig
    from nemo_disco.tiny import build_model

    return build_model(TinyModelConfig(), out, seed=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("weight_link_model"))


@pytest.mark.parametrize("generator_world", [1, 2])
def test_every_generator_rank_holds_the_trainers_bits_after_every_transfer(model_dir, tmp_path, generator_world):
    start = time.perf_counter()
    launch([str(model_dir), str(tmp_path)], 1 + generator_world, tmp_path, timeout=120)
    report = json.loads((tmp_path / "report.json").read_text())
    print(
        f"generator_world={generator_world}: {time.perf_counter() - start:.1f}s, tensors per bucket {report['buckets']}"
    )
    check_report(report, generator_world)


def check_report(report: dict, generator_world: int) -> None:
    """Every transfer bit-exact on every generator rank; the bad stream refused everywhere."""
    assert report["generator_world"] == generator_world
    for dtype in DTYPES:
        buckets = report["buckets"][dtype]  # tensors in each bucket of the last stream
        assert len(buckets) >= 10 and max(buckets) > 1 and report["largest_tensor_bytes"][dtype] > BUCKET_BYTES
        transfers = report["dtypes"][dtype]
        assert len(transfers) == TRANSFERS + 1  # TRANSFERS, then one after the failed stream
        for i, t in enumerate(transfers):
            assert len(t["ranks"]) == generator_world
            assert t["changed"] == t["compared"] > 0, f"{dtype} transfer {i}: the trainer's weights must all change"
            for rank, r in enumerate(t["ranks"]):
                assert r["keys_only_trainer"] == [] and r["keys_only_generator"] == [], (dtype, i, rank, r)
                assert r["different"] == [], f"{dtype} transfer {i}, generator rank {rank}: {r['different']}"
        failed = report["failed"][dtype]
        assert len(failed) == generator_world
        for r in failed:
            assert BAD_NAME in r["error"] and "is not a parameter" in r["error"], r["error"]
            assert "last refit failed" in r["generate_after"], r["generate_after"]


# ----------------------------------------------------------------------------------------------------------------------
# The worker (both roles)


def _bits(t):
    """The tensor's bytes (a uint8 view): equal bits, not equal values (-0.0 and 0.0 differ)."""
    import torch

    return t.detach().contiguous().view(-1).view(torch.uint8)


def _compare(trainer: dict, generator: dict) -> dict:
    import torch

    common = sorted(set(trainer) & set(generator))
    different = []
    for name in common:
        a, b = trainer[name], generator[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(_bits(a), _bits(b)):
            different.append(f"{name}: trainer {a.dtype} {list(a.shape)}, generator {b.dtype} {list(b.shape)}")
    return {
        "keys_only_trainer": sorted(set(trainer) - set(generator)),
        "keys_only_generator": sorted(set(generator) - set(trainer)),
        "different": different,
    }


class _CountingLink:
    """The trainer's link, noting how many tensors each bucket of a stream holds."""

    def __init__(self, link):
        self._link, self.buckets = link, []

    def __getattr__(self, name):
        return getattr(self._link, name)

    def send_down(self, obj):
        if obj.get("tensors") is not None:
            self.buckets.append(len(obj["tensors"]))
        self._link.send_down(obj)


def _trainer(link, model_dir: str, out_dir: str, generator_world: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from nemo_disco.rollouts import send_weights

    report: dict = {"generator_world": generator_world, "dtypes": {}, "failed": {}, "buckets": {}}
    report["weights_device"] = str(link.weights_device)
    report["largest_tensor_bytes"] = {}
    counting = _CountingLink(link)
    for dtype in DTYPES:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        params = dict(model.named_parameters())  # tied weights once (what a policy exports)
        transfers = []
        for k in range(TRANSFERS + 2):
            before = {n: t.clone() for n, t in model.state_dict().items()}
            g = torch.Generator().manual_seed(1000 * DTYPES.index(dtype) + k)
            with torch.no_grad():
                for p in params.values():
                    p.add_((torch.randn(p.shape, generator=g) * 0.01).to(p.dtype))
                params["model.norm.weight"][0] = -0.0  # a sign bit that value comparison would miss
            stream = list(params.items())
            bad = k == TRANSFERS
            if bad:  # an unknown name after about half of the buckets
                stream.insert(len(stream) // 2, (BAD_NAME, torch.zeros(4, 4, dtype=model.dtype)))
            link.send_down({"kind": "weights", "dtype": dtype, "bad": bad})
            counting.buckets = []
            send_weights(counting, stream, BUCKET_BYTES)
            report["buckets"][dtype] = counting.buckets
            reply = link.recv_up()
            if bad:
                report["failed"][dtype] = reply["ranks"]
                continue
            state = model.state_dict()
            changed = sum(not torch.equal(_bits(state[n]), _bits(before[n])) for n in state)
            ranks = [_compare(state, s) for s in reply["ranks"]]
            transfers.append({"ranks": ranks, "changed": changed, "compared": len(state)})
        report["dtypes"][dtype] = transfers
        report["largest_tensor_bytes"][dtype] = max(p.numel() * p.element_size() for p in params.values())
    link.send_down({"kind": "stop"})
    (Path(out_dir) / "report.json").write_text(json.dumps(report, indent=1))


def _generator(link, model_dir: str) -> None:
    from nemo_disco import distributed
    from nemo_disco.generation.base import SamplingParams
    from nemo_disco.generation.hf import HFGenerator
    from nemo_disco.rollouts import receive_weights

    gens = {dtype: HFGenerator(model_dir, dtype=dtype, device="cpu") for dtype in DTYPES}
    while True:
        msg = link.recv_down()
        if msg["kind"] == "stop":
            return
        gen = gens[msg["dtype"]]
        stream = receive_weights(link)
        if msg["bad"]:
            mine = {"error": "", "generate_after": ""}
            try:
                gen.update_weights(stream)
            except ValueError as err:
                mine["error"] = str(err)
            for _ in stream:  # the rest of the stream: the link's order must be kept
                pass
            try:
                gen.generate([[2, 3, 4]], 1, SamplingParams(temperature=0.0, max_tokens=2))
            except RuntimeError as err:
                mine["generate_after"] = str(err)
        else:
            gen.update_weights(stream)
            mine = {n: t.detach().clone() for n, t in gen.model.state_dict().items()}
        ranks = distributed.all_gather_object(mine)  # the generator role's own group
        if link.up_member:
            link.send_up({"ranks": ranks})


def _worker(model_dir: str, out_dir: str) -> None:
    from nemo_disco import distributed

    generator_world = int(os.environ["WORLD_SIZE"]) - 1
    role, env, link = distributed.init_roles(1, generator_world, timeout_minutes=2)
    assert distributed.world_size() == (1 if role == "trainer" else generator_world)
    assert env.rank == (0 if role == "trainer" else int(os.environ["RANK"]) - 1)
    if role == "trainer":
        _trainer(link, model_dir, out_dir, generator_world)
    else:
        _generator(link, model_dir)
    distributed.shutdown()  # the link's groups too: a gloo group alive at exit can abort the process
    assert not distributed.has_roles() and not distributed.is_initialized()
    with pytest.raises(RuntimeError, match="not a member of the link's up direction"):
        link.recv_up()


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2], sys.argv[3])
