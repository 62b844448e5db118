"""How the CPU step time of nemo_disco grows with rollouts per step and with response length.

Two sweeps of the tiny-cpu recipe's architecture (random 2-layer Qwen2, hidden 64; fixed-length generation,
so every rollout has exactly max_response_tokens tokens and the work per point is known):

- rollouts per step 256, 512, 1024 (prompts_per_step / 8, 4 updates per step) at 32 response tokens;
- max response tokens 16, 32, 64, 128 at 256 rollouts per step.

A least-squares line is fitted to each sweep (step seconds against rollouts, and against tokens); the slope
and the largest deviation of a point from the line are reported, for the step and for each phase. Points
run in interleaved rounds (one child process per point and round); each point's figure is its median.

Run::

    .venv/bin/python benchmarks/bench_scaling.py            # 3 rounds x 2 measured steps per point
    .venv/bin/python benchmarks/bench_scaling.py --quick    # 1 round, 1 step, fewer points
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

ROLLOUTS_PER_PROMPT = 8
UPDATES_PER_STEP = 4
PHASES = ("generate", "grade", "old_logprobs", "train", "refit")


def overrides(model_dir: Path, rollouts: int, tokens: int) -> list[str]:
    """The tiny-cpu recipe at ``rollouts`` per step and ``tokens`` response tokens."""
    prompts = rollouts // ROLLOUTS_PER_PROMPT
    return [
        f"policy.model_path={model_dir}",
        f"algorithm.prompts_per_step={prompts}",
        f"algorithm.minibatch_prompts={prompts // UPDATES_PER_STEP}",
        f"algorithm.rollouts_per_prompt={ROLLOUTS_PER_PROMPT}",
        f"generation.max_response_tokens={tokens}",
        "data.synthetic_size=2000",
    ]


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One point: setup, warm-up step(s), measured steps."""
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        cfg = C.load_config(Path(tmp), overrides(args.model_dir, args.rollouts, args.tokens))
        out = C.nd_steps(cfg, args.steps, args.warmup, fixed_length=True)
    phases = [C.step_phases(m) for m in out["metrics"]]
    return {
        "rollouts": args.rollouts,
        "tokens": args.tokens,
        "wall_s": statistics.median(out["wall_s"]),
        "phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
        "completion_tokens_per_step": statistics.median(out["completion_tokens"]),
    }


def _fit(points: list[dict[str, Any]], x_key: str) -> dict[str, Any]:
    xs = [float(p[x_key]) for p in points]
    fits = {"wall": C.fit_line(xs, [p["wall_s"] for p in points])}
    for ph in PHASES:
        fits[ph] = C.fit_line(xs, [p["phases_s"][ph] for p in points])
    return fits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--rollouts", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=32, help=argparse.SUPPRESS)
    ap.add_argument("--rollout-points", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--token-points", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--rollout-sweep-tokens", type=int, default=32, help="response tokens of the rollout sweep")
    ap.add_argument("--token-sweep-rollouts", type=int, default=256, help="rollouts per step of the token sweep")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all points")
    ap.add_argument("--steps", type=int, default=2, help="measured steps per point and round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per child")
    ap.add_argument("--threads", type=int, default=1, help=C.THREADS_HELP)
    ap.add_argument("--quick", action="store_true", help="1 round, 1 step, rollouts 256/512, tokens 16/32")
    args = ap.parse_args(argv)
    if args.child:
        C.emit(child(args))
        return 0
    if args.quick:
        args.rounds, args.steps = 1, 1
        args.rollout_points, args.token_points = [256, 512], [16, 32]
    for r in args.rollout_points + [args.token_sweep_rollouts]:
        if r % (ROLLOUTS_PER_PROMPT * UPDATES_PER_STEP):
            ap.error(f"rollouts per step {r} must be a multiple of {ROLLOUTS_PER_PROMPT * UPDATES_PER_STEP}")
    # The recipe's architecture with room for 32 prompt + 128 response tokens.
    model_dir = C.build_bench_model(
        C.RESULTS / "scaling_model", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, max_positions=512
    )
    points = [("rollouts", r, args.rollout_sweep_tokens) for r in args.rollout_points]
    points += [("tokens", args.token_sweep_rollouts, t) for t in args.token_points]
    raw: dict[tuple[str, int, int], list[dict[str, Any]]] = {p: [] for p in points}
    for rnd in range(args.rounds):
        for sweep, r, t in points:
            child_args = ["--child", "--model-dir", str(model_dir), "--rollouts", str(r), "--tokens", str(t)]
            child_args += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            res = C.run_child(Path(__file__), child_args, timeout=3600, threads=args.threads)
            raw[(sweep, r, t)].append(res)
            print(f"round {rnd} {sweep:8s} rollouts {r:5d} tokens {t:4d}: {res['wall_s']:.3f} s/step", flush=True)
    sweeps: dict[str, list[dict[str, Any]]] = {"rollouts": [], "tokens": []}
    for (sweep, r, t), runs in raw.items():
        sweeps[sweep].append(
            {
                "rollouts": r,
                "tokens": t,
                "wall_s": statistics.median(x["wall_s"] for x in runs),
                "wall_s_all": [x["wall_s"] for x in runs],
                "phases_s": {k: statistics.median(x["phases_s"][k] for x in runs) for k in runs[0]["phases_s"]},
            }
        )
    result: dict[str, Any] = {"settings": vars(args) | {"model_dir": str(model_dir)}, "sweeps": sweeps, "fits": {}}
    for sweep, x_key in (("rollouts", "rollouts"), ("tokens", "tokens")):
        if len(sweeps[sweep]) >= 2:
            result["fits"][sweep] = _fit(sweeps[sweep], x_key)
    for sweep, unit in (("rollouts", "rollout"), ("tokens", "token")):
        print(f"\n{sweep} sweep:")
        for p in sweeps[sweep]:
            print(f"  rollouts {p['rollouts']:5d} tokens {p['tokens']:4d}: {p['wall_s']:.3f} s/step")
        if sweep in result["fits"]:
            f = result["fits"][sweep]["wall"]
            print(
                f"  fit: {f['intercept']:.3f} s + {1000 * f['slope']:.3f} ms per {unit}; "
                f"max deviation {f['max_abs_deviation']:.3f} s ({100 * f['max_rel_deviation']:.1f}%)"
            )
    path = C.write_json("scaling", result)
    print(f"wrote {path}")
    print(json.dumps(result["fits"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
