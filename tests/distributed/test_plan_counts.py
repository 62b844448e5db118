"""The plan's per-rank element counts equal those of the real Megatron-Core objects, for every shipped recipe.

For each distinct (model, TP, PP, EP, world) of ``recipes/*.yaml``, ``plan_counts_worker.py`` builds the first and
the last pipeline stage's rank for real: mcore's ``parallel_state`` over a single-process ``fake`` process group
of the recipe's world size, the package's own GPTModel builder on the ``meta`` device (a 30B model costs no
memory), Megatron DDP with fp32 gradient buffers and the distributed optimizer's ranges, exactly as
``MegatronPolicy`` wraps it. ``nemo_disco.plan.rank_counts`` must give the same parameters, gradient-buffer
elements and optimizer-shard elements. Run under both megatron-core versions (``make test`` and
``make test-mcore-latest``: this module names Megatron, so it carries the ``mcore`` marker).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_disco import config, plan

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("plan_counts_worker.py")


def _layouts() -> dict[tuple, list[str]]:
    """(config.json, TP, PP, EP, world) -> the recipes with that layout (models with a shipped config.json)."""
    layouts: dict[tuple, list[str]] = {}
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        cfg = config.load(recipe)
        if cfg.policy.model_path is None:
            continue
        _, source = plan.config_json(cfg.policy.model_path)
        p = cfg.policy
        shapes = plan.model_shapes(cfg)
        ep = p.expert_parallel_size if shapes.is_moe else 1
        key = (source, p.tensor_parallel_size, p.pipeline_parallel_size, ep, cfg.world_size)
        layouts.setdefault(key, []).append(recipe.name)
    return layouts


LAYOUTS = _layouts()


def test_every_shipped_model_is_covered():
    models = {Path(k[0]).name for k in LAYOUTS}
    assert models == {p.name for p in plan.MODEL_CONFIGS.glob("*.json")}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[tuple, dict]:
    """Run the worker once over every layout's first- and last-stage rank."""
    jobs, keys = [], []
    for source, tp, pp, ep, world in LAYOUTS:
        # mcore's rank order puts pipeline parallelism outermost: rank world - 1 is in the last stage.
        for rank in sorted({0, world - 1}):
            jobs.append({"config": source, "tp": tp, "pp": pp, "ep": ep, "world": world, "rank": rank})
            keys.append((source, tp, pp, ep, world, rank))
    path = tmp_path_factory.mktemp("plan") / "jobs.json"
    path.write_text(json.dumps(jobs))
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(path)], capture_output=True, text=True, timeout=900, cwd=ROOT, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(zip(keys, json.loads(proc.stdout.strip().splitlines()[-1]), strict=True))


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=["-".join(map(str, (Path(k[0]).stem, *k[1:]))) for k in LAYOUTS])
def test_counts_equal_the_real_megatron_objects(built, layout):
    source, tp, pp, ep, world = layout
    shapes = plan.Shapes.from_hf_config(json.loads(Path(source).read_text()), source)
    for rank in sorted({0, world - 1}):
        real = built[(*layout, rank)]
        assert real["device"] == "meta"
        predicted = plan.rank_counts(shapes, tp, pp, ep, world, real["stage"])
        assert real["dp"] == predicted.dp
        assert real["weights"] == predicted.weights, ("weights", rank)
        assert real["trainable"] == predicted.grads, ("trainable", rank)
        assert real["grad_dtypes"] == ["torch.float32"]  # grad_reduce_in_fp32: 4 B per element
        assert real["grads_unpadded"] == predicted.grads, ("gradient buffers", rank)
        # The distributed optimizer pads each bucket to a multiple of lcm(DP, 128): at most that per bucket.
        assert 0 <= real["grads_allocated"] - real["grads_unpadded"] < 4 * 128 * predicted.dp
        assert real["optimizer_all_ranks_sum"] == predicted.grads  # every trainable element in exactly one shard
        assert real["optimizer_this_rank"] == predicted.optimizer, ("optimizer shard", rank)
