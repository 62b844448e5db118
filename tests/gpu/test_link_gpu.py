"""The trainer-generator weight stream over NCCL, between the GPUs of two processes (needs 2 GPUs).

The CPU suite (tests/distributed/test_rollouts_remote.py) streams over gloo. On a CUDA machine the same job sends
its weight buffers over the link's NCCL group instead (``Link.weights_device`` is the process's GPU): this runs
that job with the trainer on GPU 0 and the generator on GPU 1 and asserts the same bit-for-bit equality.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

import test_rollouts_remote as link_test  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (one per process)"),
]


def test_weights_cross_nccl_bit_for_bit(tmp_path):
    model_dir = link_test.build_model_dir(tmp_path / "model")
    link_test.launch([str(model_dir), str(tmp_path)], 2, tmp_path, timeout=300)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["weights_device"].startswith("cuda")
    link_test.check_report(report, generator_world=1)
