"""nemo_disco.distributed: the only module that talks to torch.distributed, and the device rules it enforces.

The NCCL rule (a collective takes tensors on the group's CUDA device only) cannot fail on a CPU machine, so it
is made structural: no other module imports ``torch.distributed`` (checked here on the source), and every
helper places the tensor on :func:`comm_device` (its placement rule is checked here for NCCL, gloo and mixed
groups as a pure function; tests/distributed/test_distributed_helpers.py runs the helpers on 2 gloo ranks).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from nemo_disco import distributed

ROOT = Path(__file__).resolve().parents[2]


def _imports_torch_distributed(path: Path) -> list[str]:
    """Lines of ``path`` that import torch.distributed or reach it as an attribute (``torch.distributed.x``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            hits += [f"{path}:{node.lineno}" for a in node.names if a.name.startswith("torch.distributed")]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.startswith("torch.distributed") or (
                mod == "torch" and any(a.name == "distributed" for a in node.names)
            ):
                hits.append(f"{path}:{node.lineno}")
        elif isinstance(node, ast.Attribute) and node.attr == "distributed":
            if isinstance(node.value, ast.Name) and node.value.id == "torch":
                hits.append(f"{path}:{node.lineno}")
    return hits


def test_no_module_but_distributed_py_uses_torch_distributed():
    sources = sorted((ROOT / "nemo_disco").rglob("*.py"))
    assert len(sources) > 20
    offenders = [
        hit for p in sources if p != ROOT / "nemo_disco" / "distributed.py" for hit in _imports_torch_distributed(p)
    ]
    assert offenders == [], "collectives must go through nemo_disco/distributed.py (NCCL takes device tensors only)"


def test_the_structural_check_catches_each_form(tmp_path):
    for i, line in enumerate(
        [
            "import torch.distributed as dist",
            "from torch.distributed import all_reduce",
            "from torch import distributed",
            "import torch\ntorch.distributed.all_reduce(x)",
        ]
    ):
        f = tmp_path / f"m{i}.py"
        f.write_text(line + "\n")
        assert _imports_torch_distributed(f), line


NCCL = {"cuda": "nccl"}
GLOO = {"cpu": "gloo", "cuda": "gloo"}
MIXED = {"cpu": "gloo", "cuda": "nccl"}
CPU, CUDA0, CUDA3 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 3)


@pytest.mark.parametrize(
    ("backends", "device", "expected"),
    [
        (NCCL, CPU, CUDA3),  # a host tensor travels to this process's GPU
        (NCCL, CUDA3, CUDA3),
        (GLOO, CPU, CPU),
        (GLOO, CUDA0, CUDA0),  # gloo takes CUDA tensors as they are
        (MIXED, CPU, CPU),
        (MIXED, CUDA0, CUDA0),
    ],
)
def test_comm_device_rule(backends, device, expected):
    assert distributed.comm_device_for(backends, device, cuda_index=3) == expected


def test_comm_device_rule_without_a_usable_backend():
    with pytest.raises(RuntimeError, match="cannot communicate"):
        distributed.comm_device_for(NCCL, CPU, cuda_index=None)


def test_backend_devices_of_a_real_gloo_group():
    import torch.distributed as dist  # the test, not the package

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert distributed.backend_devices() == GLOO
        assert distributed.comm_device(None, "cpu") == CPU
        t = torch.arange(3.0)
        assert distributed.all_reduce(t) is t and torch.equal(t, torch.arange(3.0))  # one rank: the sum is itself
        assert torch.equal(distributed.all_gather_rows(t), t)
    finally:
        dist.destroy_process_group()


_ENDS_GROUPS = """
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from nemo_disco import cli, distributed
from nemo_disco.policy import megatron_model

distributed.shutdown()  # no group yet: nothing to do
assert cli.main(["convert", "--from-hf", sys.argv[1], "--out", sys.argv[2]]) == 0  # Megatron's groups on gloo
print("after convert:", dist.is_initialized(), ps.model_parallel_is_initialized())
megatron_model.init_parallel(1, 1)
sub = distributed.new_gloo_group(1)
assert distributed.all_reduce(torch.ones(2), group=sub).tolist() == [1.0, 1.0]
distributed.shutdown()
print("after shutdown:", dist.is_initialized(), ps.model_parallel_is_initialized())
distributed.init_single_process()  # the caller's own group: a command called from Python leaves it
assert cli.main(["convert", "--from-hf", sys.argv[1], "--out", sys.argv[2] + "-again"]) == 0
print("caller's group:", dist.is_initialized())
"""


def test_shutdown_ends_every_group_and_a_finished_command_calls_it(tiny_qwen2, tmp_path):
    """A gloo group alive at interpreter exit can abort a process that succeeded (SIGABRT, exit -6).

    In a process of its own: the suite's in-process Megatron tests keep their groups.
    """
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _ENDS_GROUPS, str(tiny_qwen2), str(tmp_path / "mcore")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "after convert: False False" in out.stdout
    assert "after shutdown: False False" in out.stdout
    assert "caller's group: True" in out.stdout


@pytest.mark.parametrize(
    ("local_rank", "local_world", "count", "expected"),
    [
        (3, 8, 8, 3),  # every process sees the node's 8 GPUs
        (3, 4, 8, 3),  # fewer processes than GPUs
        (3, 8, 1, 0),  # srun --gpus-per-task=1: each task sees its own GPU as cuda:0
        (0, 1, 1, 0),
    ],
)
def test_select_cuda_device(local_rank, local_world, count, expected):
    assert distributed.select_cuda_device(local_rank, local_world, count) == expected


def test_select_cuda_device_refuses_shared_gpus():
    # 8 processes, 4 GPUs: local_rank % count would put two processes on each GPU.
    with pytest.raises(RuntimeError, match="8 processes on this node but 4 visible GPUs"):
        distributed.select_cuda_device(5, 8, 4)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        distributed.select_cuda_device(0, 1, 0)
