"""Peak resident memory (RSS) of one training step of the CPU tiny recipe.

Each run is a fresh process: set-up (model, optimizer, generator, grader pool), then the kernel's peak-RSS mark
is reset (``/proc/self/clear_refs``) and step 1 runs (it also creates the optimizer state), the mark is reset
again and step 2 runs. Reported per step: the trainer process's RSS before, its peak during the step and the
increase, and the grader workers' RSS (separate processes). Medians over runs.

Run::

    .venv/bin/python benchmarks/bench_memory.py            # 3 runs
    .venv/bin/python benchmarks/bench_memory.py --quick    # 1 run
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


def child(args: argparse.Namespace) -> dict[str, Any]:
    """Set up the tiny recipe, then measure two steps' peak RSS."""
    from nemo_disco import algorithm

    start_rss = C.rss_mb()
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        cfg = C.load_config(Path(tmp), [f"policy.model_path={args.model_dir}", *args.override])
        tr = algorithm.setup(cfg)
        steps = []
        try:
            for i in range(2):
                before = C.rss_mb()
                resettable = C.reset_peak_rss()
                metrics = algorithm.train_step(tr)
                tr.step += 1
                peak = C.peak_rss_mb()
                steps.append(
                    {
                        "step": i + 1,
                        "rss_before_mb": before,
                        "peak_mb": peak,
                        "increase_mb": peak - before,
                        "peak_is_this_step": resettable,
                        "grader_workers_mb": C.children_rss_mb(),
                        "step_s": metrics["timing/step"],
                    }
                )
        finally:
            tr.rollouts.close(None)
            tr.logger.close()
    return {"interpreter_start_mb": start_rss, "steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--override", action="append", default=[], help="extra recipe override (key=value), repeatable")
    ap.add_argument("--threads", type=int, default=1, help=C.THREADS_HELP)
    ap.add_argument("--quick", action="store_true", help="1 run")
    args = ap.parse_args(argv)
    if args.child:
        C.emit(child(args))
        return 0
    if args.quick:
        args.runs = 1
    model_dir = C.tiny_recipe_model()
    base = ["--child", "--model-dir", str(model_dir)]
    for o in args.override:
        base += ["--override", o]
    runs = [C.run_child(Path(__file__), base, timeout=1800, threads=args.threads) for _ in range(args.runs)]
    summary = {}
    for i in range(2):
        summary[f"step{i + 1}"] = {
            k: statistics.median(r["steps"][i][k] for r in runs)
            for k in ("rss_before_mb", "peak_mb", "increase_mb", "grader_workers_mb")
        }
    result = {
        "settings": {"runs": args.runs, "override": args.override, "threads": args.threads},
        "runs": runs,
        "summary": summary,
    }
    for k, v in summary.items():
        print(
            f"{k}: RSS before {v['rss_before_mb']:.0f} MiB, peak {v['peak_mb']:.0f} MiB "
            f"(+{v['increase_mb']:.0f}), grader workers {v['grader_workers_mb']:.0f} MiB"
        )
    path = C.write_json("memory", result)
    print(f"wrote {path}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
