"""``nemo-disco train | eval | convert | plot``.

Bad input (a recipe key, a file, a row) ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from nemo_disco import config as config_lib

EXIT_USAGE = 2


class UserError(Exception):
    """An error the user can fix; printed as one line, exit code 2."""


def _train(args: argparse.Namespace) -> int:
    cfg = config_lib.load(args.config, args.overrides)
    if args.print_config:
        if os.environ.get("RANK", "0") == "0":
            print(config_lib.to_yaml(cfg), end="")
        return 0
    from nemo_disco import algorithm

    try:
        algorithm.train(cfg)
    except algorithm.Preempted as stop:
        print(f"nemo-disco: {stop}", file=sys.stderr)
        return stop.code
    if os.environ.get("RANK", "0") == "0":
        _report(cfg)
    return 0


def _report(cfg: config_lib.RunConfig) -> None:
    """End-of-run summary: held-out pass@1 before and after RL with standard errors, and the plot.

    A run on a tiny model built in code (the embedded demo) also writes it to ``demo.json``.
    """
    from nemo_disco.metrics import plot_runs

    run_dir = Path(cfg.logging.run_dir)
    plot = plot_runs([run_dir], run_dir / "curves.png")
    summary = validation_summary(run_dir)
    if summary is not None:
        warmup_file = run_dir / "init_model" / "warmup.json"
        warmup = json.loads(warmup_file.read_text()) if warmup_file.is_file() else None
        if warmup is not None:
            print(warmup["message"])
        v = summary
        print(f"held-out pass@1 on {v['problems']} problems x {cfg.data.val_samples} samples (+- one standard error):")
        print(f"  before RL (step {v['step_before']}): {v['accuracy_before']:.3f} +- {v['accuracy_before_se']:.3f}")
        print(f"  after RL (step {v['step_after']}): {v['accuracy_after']:.3f} +- {v['accuracy_after_se']:.3f}")
        if v["gain_se"] > 0:
            z = v["gain"] / v["gain_se"]
            print(f"  gain: {v['gain']:+.3f} +- {v['gain_se']:.3f} (paired by problem: {z:.1f} standard errors)")
        if cfg.policy.model_path is None:
            demo = {**summary, "samples": cfg.data.val_samples, "steps": summary["step_after"], "loss": cfg.loss.name}
            demo["warmup"] = warmup
            (run_dir / "demo.json").write_text(json.dumps(demo, indent=1) + "\n")
    print(f"curves: {plot}")


def validation_summary(run_dir: Path) -> dict | None:
    """Held-out pass@1 of the first and the last validation of a run, and the gain paired by problem.

    Reads ``validation.jsonl`` (per-problem pass@1 of every validation). Returns None when the run has no
    validation; before and after are the same record when it has one.
    """
    from nemo_disco import stats
    from nemo_disco.metrics import read_jsonl

    records = read_jsonl(run_dir / "validation.jsonl")
    if not records:
        return None
    first, last = records[0], records[-1]
    before, before_se = stats.mean_se(first["per_problem"])
    after, after_se = stats.mean_se(last["per_problem"])
    gain, gain_se = stats.paired_difference(last["per_problem"], first["per_problem"])
    return {
        "accuracy_before": before,
        "accuracy_before_se": before_se,
        "accuracy_after": after,
        "accuracy_after_se": after_se,
        "gain": gain,
        "gain_se": gain_se,
        "problems": len(first["per_problem"]),
        "step_before": first["step"],
        "step_after": last["step"],
    }


def _plot(args: argparse.Namespace) -> int:
    from nemo_disco.metrics import plot_runs

    out = args.out or str(Path(args.runs[0]) / "curves.png")
    print(plot_runs(args.runs, out, labels=args.labels.split(",") if args.labels else None))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from nemo_disco import evaluate

    benchmarks = [b for b in args.benchmarks.split(",") if b]
    if args.responses:
        table = evaluate.grade_responses_file(
            args.responses,
            benchmarks,
            grader=args.grader,
            out_dir=args.out,
            regrade=args.regrade,
            timeout_s=args.timeout,
            workers=args.workers,
        )
    elif args.model:
        table = evaluate.evaluate_model(
            args.model,
            benchmarks,
            samples=args.samples,
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            backend=args.backend,
            out_dir=args.out,
            grader=args.grader,
            seed=args.seed,
            max_problems=args.max_problems,
            max_prompt_tokens=args.max_prompt_tokens,
            timeout_s=args.timeout,
            workers=args.workers,
            tensor_parallel_size=args.tp,
        )
    else:
        raise UserError("eval needs --model HF_DIR or --responses FILE.jsonl")
    print(table)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from nemo_disco import convert

    if bool(args.from_hf) == bool(args.checkpoint):
        raise UserError("convert needs exactly one of --from-hf HF_DIR or --checkpoint DIR")
    if args.from_hf:
        convert.hf_to_megatron(args.from_hf, args.out, tp=args.tp, pp=args.pp)
    else:
        convert.megatron_to_hf(args.checkpoint, args.out)
    print(f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="nemo-disco", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train with a recipe (Hydra key=value overrides)")
    t.add_argument("--config", required=True, help="recipe YAML (recipes/*.yaml)")
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. loss.tau=1 algorithm.steps=10")
    t.set_defaults(fn=_train)

    e = sub.add_parser("eval", help="pass@k on benchmark files (aime, aime25, math, amc, minerva, olympiad_bench)")
    e.add_argument("--model", help="Hugging Face model folder")
    e.add_argument("--responses", help="grade an existing per-problem JSONL instead of generating")
    e.add_argument("--benchmarks", default="aime,aime25,math,amc,minerva,olympiad_bench")
    e.add_argument("--samples", type=int, default=16)
    e.add_argument("--temperature", type=float, default=0.6)
    e.add_argument("--top-p", type=float, default=0.95)
    e.add_argument("--max-tokens", type=int, default=8192)
    e.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    e.add_argument("--grader", choices=["math_verify", "deepscaler"], default="math_verify")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--max-problems", type=int, default=None, help="first N problems of each benchmark (smoke tests)")
    e.add_argument("--max-prompt-tokens", type=int, default=1536, help="longer prompts are dropped and counted")
    e.add_argument("--regrade", action="store_true", help="re-grade records of --responses that already have a score")
    e.add_argument("--timeout", type=float, default=5.0, help="hard per-response grading limit (seconds)")
    e.add_argument("--workers", type=int, default=2, help="grading processes")
    e.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size")
    e.add_argument("--out", default="eval_results")
    e.set_defaults(fn=_eval)

    c = sub.add_parser("convert", help="HF <-> Megatron checkpoints")
    c.add_argument("--from-hf", help="HF folder to convert into a Megatron checkpoint")
    c.add_argument("--checkpoint", help="run step_N folder (or its policy/) to convert to an HF folder")
    c.add_argument("--out", required=True)
    c.add_argument("--tp", type=int, default=1)
    c.add_argument("--pp", type=int, default=1)
    c.set_defaults(fn=_convert)

    pl = sub.add_parser("plot", help="PNG training curves of one or several runs")
    pl.add_argument("runs", nargs="+", help="run folders (holding metrics.jsonl)")
    pl.add_argument("--out", help="PNG path (default RUN/curves.png)")
    pl.add_argument("--labels", help="comma-separated legend labels")
    pl.set_defaults(fn=_plot)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``nemo-disco`` console script."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (config_lib.ConfigError, UserError, FileNotFoundError, ValueError) as err:
        if os.environ.get("NEMO_DISCO_DEBUG"):
            raise
        print(f"nemo-disco {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
