"""Where one training step of the CPU tiny recipe spends its time: generate / grade / old log-probs / train / refit.

``other`` is the step time minus those phases (batch building, statistics, Python overhead); ``loop`` is what
the training loop adds around a step (metric logging). Goal: other + loop under 5% of the step.

The run is the tiny-cpu recipe exactly (32 prompts x 8 rollouts, 4 updates per step, natural-length
generation up to 12 tokens) from its SFT-warmed starting model, which is built once and shared by every run.

Run::

    .venv/bin/python benchmarks/bench_step_breakdown.py              # 3 runs x 5 measured steps
    .venv/bin/python benchmarks/bench_step_breakdown.py --profile    # + cProfile's top functions of one run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

PHASES = ("generate", "grade", "old_logprobs", "train", "refit", "other", "loop")


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One run: setup, warm-up steps, measured steps; per-phase medians."""
    overrides = [f"policy.model_path={args.model_dir}", *args.override]
    with tempfile.TemporaryDirectory(prefix="bench_breakdown_") as tmp:
        cfg = C.load_config(Path(tmp), overrides)
        prof = Path(args.profile_out) if args.profile_out else None
        out = C.nd_steps(cfg, args.steps, args.warmup, fixed_length=args.fixed_length, profile=prof)
    per_step = []
    for m, wall in zip(out["metrics"], out["wall_s"], strict=True):
        ph = C.step_phases(m)
        ph["loop"] = wall - ph["step"]
        ph["wall"] = wall
        per_step.append(ph)
    result = {
        "setup_s": out["setup_s"],
        "steps": per_step,
        "median_s": {k: statistics.median(p[k] for p in per_step) for k in per_step[0]},
        "completion_tokens_per_step": statistics.median(out["completion_tokens"]),
    }
    if prof is not None:
        result["profile_top"] = C.top_functions(prof, 40)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=3, help="child runs (medians over runs)")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per run")
    ap.add_argument("--fixed-length", action="store_true", help="generate exactly max_response_tokens (ignore EOS)")
    ap.add_argument("--profile", action="store_true", help="profile one extra run with cProfile and print the top")
    ap.add_argument("--override", action="append", default=[], help="extra recipe override (key=value), repeatable")
    ap.add_argument("--threads", type=int, default=1, help=C.THREADS_HELP)
    ap.add_argument("--quick", action="store_true", help="1 run x 2 measured steps")
    args = ap.parse_args(argv)
    if args.child:
        C.emit(child(args))
        return 0
    if args.quick:
        args.runs, args.steps = 1, 2
    model_dir = C.tiny_recipe_model()
    base = ["--child", "--model-dir", str(model_dir), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    base += ["--fixed-length"] if args.fixed_length else []
    for o in args.override:
        base += ["--override", o]
    runs = []
    for i in range(args.runs):
        res = C.run_child(Path(__file__), base, timeout=1800, threads=args.threads)
        runs.append(res)
        print(f"run {i}: step {res['median_s']['step']:.3f} s, wall {res['median_s']['wall']:.3f} s", flush=True)
    med = {k: statistics.median(r["median_s"][k] for r in runs) for k in (*PHASES, "step", "wall")}
    share = {k: med[k] / med["wall"] for k in PHASES}
    result = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("model_dir",)},
        "model_dir": str(model_dir),
        "runs": runs,
        "median_s": med,
        "share_of_wall": share,
        "other_plus_loop_share": share["other"] + share["loop"],
        "goal_other_under_5pct": share["other"] + share["loop"] < 0.05,
    }
    if args.profile:
        prof = C.RESULTS / "breakdown.prof"
        C.RESULTS.mkdir(parents=True, exist_ok=True)
        res = C.run_child(Path(__file__), [*base, "--profile-out", str(prof)], timeout=1800, threads=args.threads)
        result["profile_top"] = res["profile_top"]
        print(res["profile_top"])
    print("\nphase          median s   share of the step (wall)")
    for k in PHASES:
        print(f"{k:13s}  {med[k]:8.4f}   {100 * share[k]:5.1f}%")
    print(f"{'wall':13s}  {med['wall']:8.4f}   (timing/step {med['step']:.4f})")
    print(f"other + loop = {100 * result['other_plus_loop_share']:.1f}% (goal < 5%)")
    path = C.write_json("step_breakdown", result)
    print(f"wrote {path}")
    print(json.dumps({"median_s": med, "share_of_wall": share}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
