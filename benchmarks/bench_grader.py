"""Grading throughput: GraderPool / score_batch workers vs a serial in-process loop, and worst-case latency.

Responses are built from the shared benchmark answers (aime, aime25, math, amc, minerva, olympiad_bench):
a few hundred characters of reasoning with inline LaTeX, then ``\\boxed{answer}``; half carry the gold
answer, half a wrong one. The pathological rows mix power towers (``\\boxed{9^{9^{9^{9}}}}``), which run
for minutes without a limit, into the same batch.

    .venv/bin/python benchmarks/bench_grader.py            # 1,024 responses, median of 3 runs
    .venv/bin/python benchmarks/bench_grader.py --n 256 --runs 1
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nemo_disco.data import BENCHMARKS, load_problems  # noqa: E402
from nemo_disco.rewards import GraderPool, gold_latex, parsed_gold, score_batch, score_response  # noqa: E402

REASONING = (
    "Let me set up the problem. Let $x$ be the unknown, so $x^2 - 5x + 6 = 0$ and hence "
    "$(x-2)(x-3) = 0$. Checking both roots against the constraint $\\frac{x+1}{2} > 1$ leaves one case. "
    "Next, summing the series gives $\\sum_{k=1}^{n} k = \\frac{n(n+1)}{2}$, which we substitute. "
)


def wrong(answer: str) -> str:
    """A plausible wrong answer: an integer off by one, anything else with ``+1``."""
    a = answer.strip()
    return str(int(a) + 1) if a.lstrip("-").isdigit() else f"{a}+1"


def build(n: int, seed: int, rollouts: int = 8) -> tuple[list[str], list]:
    """``n`` responses: ``n // rollouts`` problems x ``rollouts`` each (as a training step), half of them right."""
    problems = [p for b in BENCHMARKS for p in load_problems(b)[0]]
    rng = random.Random(seed)
    responses, truths = [], []
    for i in range(n):
        if i % rollouts == 0:
            p = rng.choice(problems)
        gold = p.answer if isinstance(p.answer, str) else p.answer[0]
        answer = gold_latex(gold) if i % 2 == 0 else wrong(gold_latex(gold))
        reasoning = REASONING * rng.randint(1, 4)
        responses.append(f"<think>{reasoning}</think>{reasoning[:200]} The final answer is $\\boxed{{{answer}}}$.")
        truths.append(p.answer)
    return responses, truths


def timed(fn, *args) -> tuple[float, list[float]]:  # noqa: ANN001
    """Wall time of ``fn(*args)`` and its scores."""
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def serial(responses: list[str], truths: list, grader: str) -> list[float]:
    parsed_gold.cache_clear()  # start cold, as a fresh worker does
    return [score_response(r, t, grader) for r, t in zip(responses, truths, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--pathological", type=int, default=4, help="power towers mixed into the batch")
    ap.add_argument("--graders", default="math_verify,deepscaler")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    # A different batch per run, so no run profits from the gold-answer cache of an earlier one.
    batches = [build(args.n, seed=run) for run in range(args.runs)]
    tower = r"\boxed{9^{9^{9^{9}}}}"
    towers = [tower] * args.pathological, ["1"] * args.pathological
    rows = []

    def add(name: str, grader: str, items: int, runs: list[tuple[float, list[float]]]) -> None:
        med = statistics.median(t for t, _ in runs)
        scores = [s for _, out in runs for s in out]
        rows.append((name, grader, items, med, items / med, sum(scores) / len(scores)))

    for grader in args.graders.split(","):
        add("serial loop, in process", grader, args.n, [timed(serial, r, t, grader) for r, t in batches])

        def fresh(r: list[str], t: list, g: str = grader) -> list[float]:
            return score_batch(r, t, grader=g, timeout_s=args.timeout, workers=args.workers)[0]

        add(f"score_batch, {args.workers} workers (start-up included)", grader, args.n,
            [timed(fresh, r, t) for r, t in batches])  # fmt: skip
        with GraderPool(grader, timeout_s=args.timeout, workers=args.workers) as pool:
            pool.score(["\\boxed{1}"] * args.workers, ["1"] * args.workers)  # workers started

            def warm(r: list[str], t: list, p: GraderPool = pool) -> list[float]:
                return p.score(r, t)[0]

            add(f"GraderPool.score, {args.workers} running workers", grader, args.n,
                [timed(warm, r, t) for r, t in batches])  # fmt: skip
            trivial = ["\\boxed{1}"] * args.n, ["1"] * args.n
            add("  same, trivial items (dispatch overhead)", grader, args.n,
                [timed(warm, *trivial) for _ in range(args.runs)])  # fmt: skip
            others = [build(args.n, seed=100 + run) for run in range(args.runs)]
            add(f"  same, + {args.pathological} power towers in the batch", grader, args.n + args.pathological,
                [timed(warm, r + towers[0], t + towers[1]) for r, t in others])  # fmt: skip
            single = [timed(warm, [tower], ["1"])[0] for _ in range(args.runs)]
            rows.append(("  one power tower alone (its latency)", grader, 1, statistics.median(single), 0.0, 0.0))
        with GraderPool(grader, timeout_s=args.timeout, workers=1) as pool:
            pool.score(["\\boxed{1}"], ["1"])
            add("GraderPool.score, 1 running worker", grader, args.n,
                [timed(lambda r, t, p=pool: p.score(r, t)[0], r, t) for r, t in batches])  # fmt: skip

    load = os.getloadavg()
    print(f"\n{args.n} responses per batch ({args.n // 8} problems x 8), median of {args.runs} runs, "
          f"timeout_s={args.timeout}, {os.cpu_count()} CPUs, load average {load[0]:.1f} at the end\n")  # fmt: skip
    print("| setting | grader | items | median s | responses/s | mean score |")
    print("|---|---|---:|---:|---:|---:|")
    for name, grader, items, med, rate, avg in rows:
        print(f"| {name} | {grader} | {items} | {med:.2f} | {f'{rate:.0f}' if rate else '-'} | {avg:.3f} |")


if __name__ == "__main__":
    main()
