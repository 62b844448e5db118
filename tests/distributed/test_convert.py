"""``nemo-disco convert --from-hf DIR --out X --tp 2`` in one process; the result loads at TP 2 (torchrun, 2 gloo
processes) with the same weights and log-probs. Damaged checkpoints and non-empty outputs are one line, exit 2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_worker import TOL, build_models, launch

ROOT = Path(__file__).resolve().parents[2]


def _convert(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "nemo_disco.cli", "convert", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    (model,) = build_models(tmp_path_factory.mktemp("models"), ("qwen2_tied",))
    out = tmp_path_factory.mktemp("conv") / "tp2"
    proc = _convert("--from-hf", str(model), "--out", str(out), "--tp", "2")  # one process: no launcher
    assert proc.returncode == 0, proc.stderr[-3000:]
    return model, out


def test_one_process_writes_a_tp2_checkpoint_that_loads_at_tp2(converted, tmp_path):
    model, out = converted
    meta = json.loads((out / "megatron.json").read_text())
    assert (meta["tensor_parallel_size"], meta["pipeline_parallel_size"]) == (2, 1)  # the layout asked for
    assert meta["written_at"] == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    results = launch("converted", [model, out], tmp_path, nproc=2, tp=2)
    for res in results:
        assert res["tp"] == 2 and res["names_equal"] and res["not_bit_exact"] == []
        assert res["lp_diff"] <= TOL  # transformers' own log-probs
        assert res["lp_vs_direct_diff"] <= TOL  # the HF folder loaded straight at TP 2


def test_convert_refuses_to_merge_and_damaged_checkpoints(converted, tmp_path):
    model, out = converted
    proc = _convert("--from-hf", str(model), "--out", str(out), "--tp", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"nemo-disco convert: error: {out} is not empty: pass --overwrite to replace it, or choose another --out"
    )
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    shard = sorted((damaged / "model").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    proc = _convert("--checkpoint", str(damaged), "--out", str(tmp_path / "hf"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"nemo-disco convert: error: checkpoint {damaged} cannot be read: EOFError (damaged or incomplete)"
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "hf").exists() and not (tmp_path / ".hf.partial").exists()


def test_convert_leaves_megatron_cores_full_scope_warning_out_of_the_terminal(tiny_qwen2, tmp_path):
    """megatron-core warns ``full scope is deprecated`` at every config built with its default CUDA graph scope."""
    to_mcore = _convert("--from-hf", str(tiny_qwen2), "--out", str(tmp_path / "mcore"))
    assert to_mcore.returncode == 0, to_mcore.stderr[-3000:]
    back = _convert("--checkpoint", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf"))
    assert back.returncode == 0, back.stderr[-3000:]
    for proc in (to_mcore, back):
        assert "full scope is deprecated" not in proc.stderr, proc.stderr[-3000:]
        assert "Warning" not in proc.stderr, proc.stderr[-3000:]
