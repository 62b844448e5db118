"""Graded records built from small tables, and the hand-computed tables the evaluation tests share."""

from __future__ import annotations


def graded(table: dict[tuple[str, int], list[int]]) -> list[dict]:
    """Graded records from {(benchmark, problem): [score of each sample]}."""
    return [
        {"benchmark": b, "problem_index": p, "sample_index": j, "response": "", "score": float(s)}
        for (b, p), scores in table.items()
        for j, s in enumerate(scores)
    ]


def timed(table: dict[tuple[str, int], list[tuple[int, int]]]) -> list[dict]:
    """Graded records with token counts from {(benchmark, problem): [(tokens, score) of each sample]}."""
    return [
        {"benchmark": b, "problem_index": p, "sample_index": j, "response": "", "score": float(s), "response_tokens": t}
        for (b, p), samples in table.items()
        for j, (t, s) in enumerate(samples)
    ]


# Three runs on one benchmark, 2 problems x 2 samples:
#   run a: p0 [1, 1], p1 [0, 0] -> pass@1 (1 + 0) / 2 = 0.5,          pass@2 (1 + 0) / 2 = 0.5
#   run b: p0 [1, 0], p1 [0, 0] -> pass@1 (1/2 + 0) / 2 = 0.25,       pass@2 (1 + 0) / 2 = 0.5
#   run c: p0 [1, 1], p1 [1, 0] -> pass@1 (1 + 1/2) / 2 = 0.75,       pass@2 (1 + 1) / 2 = 1.0
# pass@1 over runs: mean 0.5; deviations 0, -1/4, 1/4 -> variance (1/16 + 1/16) / 2 = 1/16 -> sd 1/4
# pass@2 over runs: mean 2/3; deviations -1/6, -1/6, 1/3 -> variance (1/36 + 1/36 + 4/36) / 2 = 1/12
RUNS = {
    "a": {("alpha", 0): [1, 1], ("alpha", 1): [0, 0]},
    "b": {("alpha", 0): [1, 0], ("alpha", 1): [0, 0]},
    "c": {("alpha", 0): [1, 1], ("alpha", 1): [1, 0]},
}

# alpha, 2 samples per problem; correct counts A [2, 1, 1, 0], B [1, 1, 0, 0]
#   pass@1 A: (1 + 1/2 + 1/2 + 0) / 4 = 1/2; B: (1/2 + 1/2 + 0 + 0) / 4 = 1/4
#   per-problem differences 1/2, 0, 1/2, 0: mean 1/4; variance 4 * (1/4)^2 / 3 = 1/12; se sqrt(1/12 / 4)
#   A better on 2 problems, B on none. pass@2: A [1, 1, 1, 0] -> 3/4, B [1, 1, 0, 0] -> 1/2, diff 1/4
# beta, correct counts A [2, 2], B [0, 2]: differences 1, 0: mean 1/2; variance 1/2; se sqrt(1/2 / 2) = 1/2
# average of pass@1: diff (1/4 + 1/2) / 2 = 3/8; se sqrt(1/48 + 1/4) / 2
COUNTS_A = {("alpha", 0): [1, 1], ("alpha", 1): [1, 0], ("alpha", 2): [0, 1], ("alpha", 3): [0, 0],
            ("beta", 0): [1, 1], ("beta", 1): [1, 1], ("alpha", 9): [1, 1]}  # fmt: skip
COUNTS_B = {("alpha", 0): [0, 1], ("alpha", 1): [1, 0], ("alpha", 2): [0, 0], ("alpha", 3): [0, 0],
            ("beta", 0): [0, 0], ("beta", 1): [1, 1]}  # fmt: skip

# alpha: problem 0 samples (10 tokens, right), (20, wrong); problem 1 (30, wrong), (50, wrong).
# beta: (4, right), (6, right).
LENGTHS_A = {("alpha", 0): [(10, 1), (20, 0)], ("alpha", 1): [(30, 0), (50, 0)], ("beta", 5): [(4, 1), (6, 1)]}
# B on alpha: problem 0 (12, right), (14, right); problem 1 (40, wrong), (40, right).
LENGTHS_B = {("alpha", 0): [(12, 1), (14, 1)], ("alpha", 1): [(40, 0), (40, 1)]}
