"""The memory plan and cost of every shipped recipe as a Markdown table (docs/planning.md; ``make plan-table``).

``python benchmarks/plan_table.py [--gpu h100-80gb]`` runs ``nemo_disco.plan`` (what ``nemo-disco plan --json``
prints) on every ``recipes/*.yaml`` and prints one row per recipe: GPUs, layout, the peak per GPU and its phase, the
headroom, whether it also fits an A100-80GB, the step time and the GPU-hours. No GPU, no hub: the shipped config.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nemo_disco import config, plan

ROOT = Path(__file__).resolve().parents[1]


def rows(gpu: str) -> list[str]:
    """The table's lines for every shipped recipe on ``gpu``."""
    out = [
        f"| recipe | GPUs | policy TP x PP (x EP) | peak GiB / GPU ({gpu}) | phase | headroom GiB | fits a100-80gb "
        "| step s | GPU-hours |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        cfg = config.load(recipe)
        p = plan.make_plan(cfg, gpu)
        a100 = plan.make_plan(cfg, "a100-80gb")
        group, phase, peak = p.peak
        pc = cfg.policy
        layout = f"{pc.tensor_parallel_size} x {pc.pipeline_parallel_size}"
        if p.shapes.is_moe:
            layout += f" x {pc.expert_parallel_size}"
        gpus = f"{cfg.world_size}" + (f" + {cfg.generation_world_size}" if cfg.generation_world_size else "")
        out.append(
            f"| {recipe.stem} | {gpus} | {layout} | {peak / plan.GIB:.1f} | {p.phase_label(group, phase)} "
            f"| {(p.gpu.memory_bytes - peak) / plan.GIB:.1f} | {'yes' if a100.fits else 'NO'} | {p.step['step_s']:.0f} "
            f"| {p.step['gpu_hours']:.0f} |"
        )
    return out


def main() -> None:
    """Print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default=plan.DEFAULT_GPU, choices=sorted(plan.GPUS))
    print("\n".join(rows(ap.parse_args().gpu)))


if __name__ == "__main__":
    main()
