"""pass@k evaluation on math benchmarks: generate, grade, tabulate, re-grade.

A result is a list of records, one per (problem, sample)::

    {"benchmark": "aime", "problem_index": 3, "sample_index": 0, "response": "...", "score": 1.0, ...}

written one per line to ``responses.jsonl`` (extra fields: ``answer``, ``finish_reason``,
``response_tokens``). A sample is correct when its score is above 0.5 (graders give 1.0 / 0.0).

pass@k uses the unbiased estimator of Chen et al. 2021 (eq. 1): with n samples of which c are correct,
``pass@k = 1 - C(n - c, k) / C(n, k)``, computed as the product ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``
(no large binomials); a benchmark's pass@k is its mean over problems. pass@1 is then the mean over
problems of the share of correct samples, as in the paper's tab. 2 (16 samples, temperature 0.6,
top-p 0.95). Reported k are 1, 2, 4, ... up to the number of samples, and that number itself; the
average row is the unweighted mean over benchmarks.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nemo_disco.data import BENCHMARKS, DEFAULT_TEMPLATE, encode_prompts, load_problems, resolve_benchmark

logger = logging.getLogger(__name__)

RESPONSES_FILE = "responses.jsonl"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct out of ``n`` samples (Chen et al. 2021, eq. 1).

    Raises:
        ValueError: unless 0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i)
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def ks_for(samples: int) -> list[int]:
    """The k reported for ``samples`` samples per problem: powers of two below it, and it."""
    ks, k = [], 1
    while k < samples:
        ks.append(k)
        k *= 2
    return ks + [samples]


@dataclass
class BenchmarkResult:
    """One row of the table: ``metrics`` maps "pass@k" to a value in [0, 1]."""

    benchmark: str
    problems: int
    samples: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class EvalSummary:
    """Per-benchmark pass@k and their unweighted average over benchmarks."""

    rows: list[BenchmarkResult]
    average: dict[str, float]

    @property
    def columns(self) -> list[str]:
        """Every "pass@k" column, by increasing k."""
        keys = {key for r in self.rows for key in r.metrics}
        return sorted(keys, key=lambda key: int(key.split("@")[1]))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the summary.json layout)."""
        return {
            "benchmarks": [
                {"benchmark": r.benchmark, "problems": r.problems, "samples": r.samples, **r.metrics} for r in self.rows
            ],
            "average": self.average,
        }

    def to_csv(self) -> str:
        """CSV: one row per benchmark and an "average" row; values in [0, 1], empty where not defined."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["benchmark", "problems", "samples", *self.columns])
        for r in self.rows:
            writer.writerow([r.benchmark, r.problems, r.samples, *(r.metrics.get(c, "") for c in self.columns)])
        writer.writerow(["average", "", "", *(self.average.get(c, "") for c in self.columns)])
        return buf.getvalue()

    def to_markdown(self) -> str:
        """Markdown table in percent (as the paper's tab. 2)."""
        cols = self.columns

        def cell(values: dict[str, float], c: str) -> str:
            return f"{100 * values[c]:.2f}" if c in values else "-"

        lines = [
            "| benchmark | problems | samples | " + " | ".join(f"{c} (%)" for c in cols) + " |",
            "|---|---:|---:|" + "---:|" * len(cols),
        ]
        for r in self.rows:
            lines.append(
                f"| {r.benchmark} | {r.problems} | {r.samples} | " + " | ".join(cell(r.metrics, c) for c in cols) + " |"
            )
        lines.append("| average | | | " + " | ".join(cell(self.average, c) for c in cols) + " |")
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.to_markdown()


def summarize(records: Sequence[dict[str, Any]]) -> EvalSummary:
    """pass@k per benchmark (benchmarks in order of first appearance) and the average over benchmarks.

    Args:
        records: dicts with ``benchmark``, ``problem_index``, ``sample_index`` and a numeric ``score``.

    Raises:
        ValueError: a record without a score, a repeated (benchmark, problem, sample), no records.
    """
    if not records:
        raise ValueError("no records to summarise")
    correct: dict[str, dict[int, list[bool]]] = {}
    seen: set[tuple[str, int, int]] = set()
    for r in records:
        key = (r["benchmark"], int(r["problem_index"]), int(r["sample_index"]))
        if key in seen:
            raise ValueError(f"record for benchmark {key[0]!r} problem {key[1]} sample {key[2]} appears twice")
        seen.add(key)
        if r.get("score") is None:
            raise ValueError(f"record for benchmark {key[0]!r} problem {key[1]} sample {key[2]} has no score")
        correct.setdefault(key[0], {}).setdefault(key[1], []).append(float(r["score"]) > 0.5)
    rows = []
    for bench, problems in correct.items():
        samples = min(len(s) for s in problems.values())
        if samples != max(len(s) for s in problems.values()):
            logger.warning(
                "%s: problems have %d to %d samples; pass@k is reported up to k=%d",
                bench,
                samples,
                max(len(s) for s in problems.values()),
                samples,
            )
        metrics = {
            f"pass@{k}": sum(pass_at_k(len(s), sum(s), k) for s in problems.values()) / len(problems)
            for k in ks_for(samples)
        }
        rows.append(BenchmarkResult(bench, len(problems), samples, metrics))
    shared = set.intersection(*(set(r.metrics) for r in rows))
    average = {c: sum(r.metrics[c] for r in rows) / len(rows) for c in sorted(shared, key=lambda c: int(c[5:]))}
    return EvalSummary(rows, average)


def write_results(records: Sequence[dict[str, Any]], out_dir: str | os.PathLike) -> EvalSummary:
    """Write ``responses.jsonl`` (one record per line) and ``summary.{md,csv,json}`` into ``out_dir``."""
    summary = summarize(records)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    order = {b.benchmark: i for i, b in enumerate(summary.rows)}
    ordered = sorted(records, key=lambda r: (order[r["benchmark"]], int(r["problem_index"]), int(r["sample_index"])))
    with (out / RESPONSES_FILE).open("w", encoding="utf-8") as f:
        for r in ordered:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    (out / "summary.md").write_text(summary.to_markdown(), encoding="utf-8")
    (out / "summary.csv").write_text(summary.to_csv(), encoding="utf-8")
    (out / "summary.json").write_text(json.dumps(summary.to_dict(), indent=1) + "\n", encoding="utf-8")
    return summary


# ----------------------------------------------------------------------------------------------------------------------
# Re-grading a responses file


def _read_records(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """Records and their line numbers; a bad line raises ``FILE:LINE: what``."""
    if not path.is_file():
        raise FileNotFoundError(f"responses file not found: {path}")
    records, lines = [], []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {err.msg}") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            for key, kind in (("benchmark", str), ("problem_index", int), ("sample_index", int), ("response", str)):
                if not isinstance(rec.get(key), kind) or isinstance(rec.get(key), bool):
                    raise ValueError(f"{path}:{lineno}: field {key!r} missing or not of type {kind.__name__}")
            score = rec.get("score")
            if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))):
                raise ValueError(f"{path}:{lineno}: field 'score' is not a number")
            records.append(rec)
            lines.append(lineno)
    if not records:
        raise ValueError(f"{path}: no records")
    return records, lines


def _benchmark_key(name_or_path: str) -> str:
    """The name records use for a benchmark: the name itself, or a file's stem."""
    return name_or_path if name_or_path in BENCHMARKS else Path(name_or_path).stem


def grade_responses_file(
    path: str | os.PathLike,
    benchmarks: Sequence[str] | None = None,
    grader: str = "math_verify",
    *,
    out_dir: str | os.PathLike | None = None,
    regrade: bool = False,
    timeout_s: float = 5.0,
    workers: int = 2,
) -> EvalSummary:
    """Tabulate a ``responses.jsonl``; records without a score (all of them with ``regrade``) are graded.

    Gold answers come from the benchmark files (``benchmarks`` names or paths; a record's ``benchmark``
    is the name, or the file's stem), so another grader's verdict can be compared on the same responses.

    Args:
        path: the JSONL file (see the module docstring).
        benchmarks: benchmarks to tabulate (None: every benchmark in the file).
        grader: "math_verify" or "deepscaler".
        out_dir: if given, write the graded records and tables there (:func:`write_results`).
        regrade: grade every record, replacing stored scores.
        timeout_s: per-item grading limit.
        workers: grading processes.

    Raises:
        ValueError: a bad line (``FILE:LINE: what``), a problem index the benchmark lacks, nothing to tabulate.
        FileNotFoundError: the file or a needed benchmark file is missing.
    """
    path = Path(path)
    records, lines = _read_records(path)
    sources = {_benchmark_key(b): b for b in benchmarks} if benchmarks is not None else None
    if sources is not None:
        keep = [i for i, r in enumerate(records) if r["benchmark"] in sources]
        if len(keep) < len(records):
            logger.info("%s: %d records of other benchmarks left out", path, len(records) - len(keep))
        rank = {key: n for n, key in enumerate(sources)}
        keep.sort(key=lambda i: rank[records[i]["benchmark"]])  # tables list benchmarks in the order given
        records, lines = [dict(records[i]) for i in keep], [lines[i] for i in keep]
        if not records:
            raise ValueError(f"{path}: no records of benchmarks {', '.join(sources)}")
    else:
        records = [dict(r) for r in records]
    todo = [i for i, r in enumerate(records) if regrade or r.get("score") is None]
    if todo:
        answers: dict[str, dict[int, Any]] = {}
        truths = []
        for i in todo:
            bench = records[i]["benchmark"]
            if bench not in answers:
                source = sources[bench] if sources is not None else bench
                problems, _ = load_problems(resolve_benchmark(source))
                answers[bench] = {p.index: p.answer for p in problems}
            idx = records[i]["problem_index"]
            if idx not in answers[bench]:
                raise ValueError(
                    f"{path}:{lines[i]}: problem_index {idx} is not in benchmark {bench!r} "
                    f"({len(answers[bench])} problems)"
                )
            truths.append(answers[bench][idx])
        from nemo_disco.rewards import GraderPool

        with GraderPool(grader, timeout_s=timeout_s, workers=workers) as pool:
            scores, metrics = pool.score([records[i]["response"] for i in todo], truths)
        if metrics["reward/timeouts"] or metrics["reward/errors"]:
            logger.warning(
                "grading: %d timeouts, %d errors (scored 0)", metrics["reward/timeouts"], metrics["reward/errors"]
            )
        for i, s in zip(todo, scores, strict=True):
            records[i]["score"] = s
    return write_results(records, out_dir) if out_dir is not None else summarize(records)


# ----------------------------------------------------------------------------------------------------------------------
# Generating and grading


def _build_generator(
    model_dir: str | os.PathLike, backend: str, max_model_len: int, seed: int, tensor_parallel_size: int
) -> Any:
    if backend == "hf":
        from nemo_disco.generation.hf import HFGenerator

        return HFGenerator(model_dir)
    if backend == "vllm":
        from nemo_disco.generation.vllm import VLLMGenerator

        return VLLMGenerator(
            model_dir, tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len, seed=seed
        )
    raise ValueError(f"backend={backend!r}: expected 'hf' or 'vllm'")


def _stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """EOS and, for ChatML templates, ``<|im_end|>``."""
    stops = {tokenizer.eos_token_id}
    if "<|im_end|>" in tokenizer.get_vocab():
        stops.add(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return tuple(sorted(s for s in stops if s is not None))


def evaluate_model(
    model_dir: str | os.PathLike,
    benchmarks: Sequence[str],
    *,
    samples: int = 16,
    temperature: float = 0.6,
    top_p: float = 0.95,
    max_tokens: int = 8192,
    backend: Literal["hf", "vllm"] = "vllm",
    out_dir: str | os.PathLike = "eval_results",
    grader: str = "math_verify",
    seed: int = 0,
    max_problems: int | None = None,
    template: str = DEFAULT_TEMPLATE,
    use_chat_template: bool = True,
    max_prompt_tokens: int | None = None,
    timeout_s: float = 5.0,
    workers: int = 2,
    tensor_parallel_size: int = 1,
    generator: Any | None = None,
) -> EvalSummary:
    """Sample ``samples`` responses per benchmark problem, grade them, write and return the pass@k table.

    Args:
        model_dir: Hugging Face model folder (weights + tokenizer).
        benchmarks: benchmark names (``aime``, ``math``, ...) or DeepScaleR-format files.
        samples: responses per problem (the paper: 16).
        temperature: sampling temperature (the paper: 0.6).
        top_p: nucleus sampling (the authors' evaluation: 0.95).
        max_tokens: longest response (the paper: 8192 or 32768).
        backend: "vllm" or "hf" (transformers generate) when ``generator`` is None.
        out_dir: where :func:`write_results` writes.
        grader: "math_verify" or "deepscaler".
        seed: sampling seed.
        max_problems: only the first N problems of each benchmark (smoke tests).
        template: prompt template (:func:`nemo_disco.data.format_prompt`).
        use_chat_template: wrap prompts in the tokenizer's chat template.
        max_prompt_tokens: drop (and log) longer prompts; None keeps all.
        timeout_s: per-item grading limit.
        workers: grading processes.
        tensor_parallel_size: vLLM tensor parallelism.
        generator: an already built Generator (then ``backend`` is unused and it is not shut down here).

    Raises:
        ValueError / FileNotFoundError: bad benchmark names, files or settings.
    """
    from transformers import AutoTokenizer

    from nemo_disco.generation.base import SamplingParams
    from nemo_disco.rewards import GraderPool

    if samples < 1 or max_tokens < 1:
        raise ValueError(f"samples={samples} and max_tokens={max_tokens} must be >= 1")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    sets = []
    for bench in benchmarks:
        problems, _ = load_problems(resolve_benchmark(bench))
        problems = problems[:max_problems] if max_problems else problems
        ids, kept, dropped = encode_prompts(
            tokenizer,
            problems,
            template=template,
            use_chat_template=use_chat_template,
            max_prompt_tokens=max_prompt_tokens,
        )
        if dropped:
            logger.warning("%s: %d prompts over %s tokens left out", bench, dropped, max_prompt_tokens)
        sets.append((_benchmark_key(bench), [problems[i] for i in kept], ids))
    longest = max((len(p) for _, _, ids in sets for p in ids), default=0)
    own = generator is None
    if own:
        generator = _build_generator(model_dir, backend, longest + max_tokens, seed, tensor_parallel_size)
    sampling = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        stop_token_ids=_stop_token_ids(tokenizer),
        seed=seed,
    )
    records: list[dict[str, Any]] = []
    try:
        with GraderPool(grader, timeout_s=timeout_s, workers=workers) as pool:
            for bench, problems, ids in sets:
                rollouts = generator.generate(ids, samples, sampling)  # [P][samples]
                texts = [tokenizer.decode(r.token_ids, skip_special_tokens=True) for rs in rollouts for r in rs]
                scores, metrics = pool.score(texts, [p.answer for p in problems for _ in range(samples)])
                if metrics["reward/timeouts"] or metrics["reward/errors"]:
                    logger.warning(
                        "%s: grading had %d timeouts, %d errors (scored 0)",
                        bench,
                        metrics["reward/timeouts"],
                        metrics["reward/errors"],
                    )
                flat = [(p, j, r) for p, rs in zip(problems, rollouts, strict=True) for j, r in enumerate(rs)]
                for (p, j, r), text, score in zip(flat, texts, scores, strict=True):
                    records.append(
                        {
                            "benchmark": bench,
                            "problem_index": p.index,
                            "sample_index": j,
                            "response": text,
                            "score": score,
                            "answer": p.answer,
                            "finish_reason": r.finish_reason,
                            "response_tokens": len(r.token_ids),
                        }
                    )
    finally:
        if own:
            generator.shutdown()
    return write_results(records, out_dir)
