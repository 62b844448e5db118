r"""``nemo-disco data prepare``: a training set from the hub or a local file, checked row by row, as local JSONL.

Compute nodes of most clusters have no internet. Run this once where the hub is reachable (a login node)
and point ``data.train`` at the JSONL it writes; the recipes read it with :func:`nemo_disco.data.load_problems`.

Sources: a preset name (:data:`PRESETS`: ``deepscaler``, ``dapo-math-17k``), any hub dataset id, a local
``.parquet`` / ``.json`` / ``.jsonl`` file, or a local folder (``save_to_disk`` output, or the data files of
a hub dataset downloaded elsewhere). Two layouts are recognised from the first row, and any other through
``problem_key`` / ``answer_key`` (dotted paths reach into structs, e.g. ``reward_model.ground_truth``):

- DeepScaleR-Preview: ``problem``, ``answer`` (and ``solution``, unused);
- verl / DAPO-Math-17k: ``prompt`` (a list of chat messages; the last user turn is the problem, without the
  instruction the set wraps around it, see :func:`nemo_disco.data.strip_instruction`) and
  ``reward_model.ground_truth``.

Every row is checked. A row that does not fit the file's layout (a missing column, a value of the wrong
type) stops the run with one line naming the row and the column: the file is not what it was said to be.
Rows with an unusable value are skipped and counted by reason: no problem text, no answer, a duplicate of an
earlier problem (normalised text; the first is kept, duplicates with a different answer are counted too),
an answer the reward's grader cannot verify (the answer, boxed, graded against itself, when
``check_answers``). Overlap of the kept problems with the six evaluation benchmarks is contamination and is
always reported: exact (same normalised text) and near (at least half of a benchmark problem's word
8-grams occur in the training problem); ``drop_overlap`` removes those rows. The counts are printed and
written, with every overlapping pair, to ``<out stem>.report.json`` next to the output.

Row numbers count from 0 in the order the source yields rows.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import re
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_disco.config import GradingConfig
from nemo_disco.data import (
    BENCHMARKS,
    load_problems,
    looks_like_hub_id,
    open_dataset,
    read_rows,
    resolve_benchmark,
    strip_instruction,
)

logger = logging.getLogger(__name__)

# Known training sets: name -> hub id.
PRESETS = {
    "deepscaler": "agentica-org/DeepScaleR-Preview-Dataset",  # ~40.3k rows; the DisCO paper's training set (§6)
    "dapo-math-17k": "BytedTsinghua-SIA/DAPO-Math-17k",  # 1.79M rows: ~17k problems, each repeated
}
NGRAM = 8  # word n-gram length of the near-overlap test
NEAR_SHARE = 0.5  # share of a benchmark problem's n-grams that makes a training problem a near copy

SKIP_NO_PROBLEM = "no problem text"
SKIP_NO_ANSWER = "no answer"
SKIP_DUPLICATE = "duplicate problem"
SKIP_UNVERIFIABLE = "answer not verifiable by the grader"
SKIP_OVERLAP = "overlaps a benchmark (dropped)"


class _SkipRowError(Exception):
    """A row with an unusable value: skipped and counted under its reason."""


class _BadRowError(Exception):
    """A row that does not fit the layout: the run stops (the caller adds the file)."""


# ----------------------------------------------------------------------------------------------------------------------
# Text keys


def normalize_problem(text: str) -> str:
    """The key under which two problem texts count as the same: NFKC, case-folded, whitespace collapsed."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def _words(key: str) -> list[str]:
    return re.findall(r"[^\W_]+", key)


def _ngrams(words: Sequence[str], n: int = NGRAM) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


class BenchmarkIndex:
    """The problems of the evaluation benchmarks, for exact and n-gram overlap look-ups."""

    def __init__(self, benchmarks: Sequence[str] = BENCHMARKS) -> None:
        """Load the benchmark files (names or paths, see :func:`nemo_disco.data.resolve_benchmark`)."""
        self.names = [Path(b).stem if b not in BENCHMARKS else b for b in benchmarks]
        self.sizes: dict[str, int] = {}
        self.exact: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
        self.grams: dict[tuple[str, ...], list[tuple[str, int]]] = collections.defaultdict(list)
        self.gram_count: dict[tuple[str, int], int] = {}
        for name, source in zip(self.names, benchmarks, strict=True):
            problems, _ = load_problems(resolve_benchmark(source), on_bad_row="skip")
            self.sizes[name] = len(problems)
            for p in problems:
                key = normalize_problem(p.problem)
                self.exact[key].append((name, p.index))
                grams = _ngrams(_words(key))
                self.gram_count[(name, p.index)] = len(grams)
                for g in grams:
                    self.grams[g].append((name, p.index))

    def matches(self, problem: str) -> list[tuple[str, int, str, float]]:
        """Benchmark problems that ``problem`` copies: (benchmark, index, "exact" | "near", n-gram share)."""
        key = normalize_problem(problem)
        found = {(b, i): (b, i, "exact", 1.0) for b, i in self.exact.get(key, [])}
        hits: collections.Counter[tuple[str, int]] = collections.Counter()
        for g in _ngrams(_words(key)):
            for ref in self.grams.get(g, ()):
                hits[ref] += 1
        for ref, count in hits.items():
            share = count / self.gram_count[ref]
            if ref not in found and share >= NEAR_SHARE:
                found[ref] = (*ref, "near", share)
        return sorted(found.values())


# ----------------------------------------------------------------------------------------------------------------------
# Rows


def _get(row: dict[str, Any], key: str) -> Any:
    """``row[key]`` where ``key`` may be dotted (``reward_model.ground_truth``); _BadRowError when absent."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            cols = ", ".join(row) if isinstance(row, dict) else "none"
            raise _BadRowError(f"column {key!r}: missing (columns: {cols})")
        value = value[part]
    return value


def _problem_text(value: Any, key: str) -> str:
    if value is None:
        raise _SkipRowError(SKIP_NO_PROBLEM)
    if isinstance(value, (list, tuple)):  # chat messages
        users = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if not users or not isinstance(users[-1], str):
            raise _BadRowError(f"column {key!r}: a list without a user message with text content")
        value = strip_instruction(users[-1])
    if not isinstance(value, str):
        raise _BadRowError(f"column {key!r}: expected text or a list of chat messages, got {type(value).__name__}")
    if not value.strip():
        raise _SkipRowError(SKIP_NO_PROBLEM)
    return value.strip()


def _one_answer(value: Any, key: str) -> str | None:
    """A single answer as text; None for a missing one."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _BadRowError(f"column {key!r}: expected text, a number or a list of them, got {type(value).__name__}")
    if isinstance(value, float):
        if math.isinf(value):
            raise _BadRowError(f"column {key!r}: answer is {value}")
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value).strip() or None


def _answer(value: Any, key: str) -> str | list[str]:
    if isinstance(value, (list, tuple)):
        answers = [_one_answer(v, key) for v in value]
        if not answers or any(a is None for a in answers):
            raise _SkipRowError(SKIP_NO_ANSWER)
        return answers  # type: ignore[return-value]
    text = _one_answer(value, key)
    if text is None:
        raise _SkipRowError(SKIP_NO_ANSWER)
    return text


def _layout(row: Any, problem_key: str | None, answer_key: str | None) -> tuple[str, str]:
    """The (problem, answer) columns: given, or recognised from the first row."""
    if not isinstance(row, dict):
        raise _BadRowError(f"expected an object with named columns, got {type(row).__name__}")
    if problem_key is None:
        problem_key = next((k for k in ("problem", "prompt") if k in row), None)
        if problem_key is None:
            cols = ", ".join(row)
            raise _BadRowError(f"no 'problem' or 'prompt' column (columns: {cols}); name it with --problem-column")
    if answer_key is None:
        candidates = ("answer", "reward_model.ground_truth")
        answer_key = next((k for k in candidates if _has(row, k)), None)
        if answer_key is None:
            raise _BadRowError(
                f"no 'answer' or 'reward_model.ground_truth' column (columns: {', '.join(row)}); "
                "name it with --answer-column"
            )
    return problem_key, answer_key


def _has(row: dict[str, Any], key: str) -> bool:
    try:
        _get(row, key)
    except _BadRowError:
        return False
    return True


# ----------------------------------------------------------------------------------------------------------------------
# Sources


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
        for batch in reader.iter_batches(batch_size=8192):
            yield from batch.to_pylist()
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError variants for unreadable files.
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path}: not a readable parquet file: {first}") from None


def open_rows(source: str, split: str = "train") -> tuple[Iterator[Any], str]:
    """Rows of a local file or folder, a preset or a hub id, and the name errors give the source.

    Raises:
        FileNotFoundError: not a file, folder, preset or hub id.
        ValueError: unreadable file, hub unreachable (one line naming the source and what was tried).
    """
    path = Path(source).expanduser()
    if not path.exists() and source in PRESETS:  # an existing file or folder of that name wins
        source = PRESETS[source]
        path = Path(source)
    if path.is_file():
        if path.suffix.lower() == ".parquet":
            return _parquet_rows(path), str(path)
        return iter(read_rows(path)), str(path)
    if path.is_dir() or looks_like_hub_id(source):
        return iter(open_dataset(path if path.is_dir() else source, split)), source
    raise FileNotFoundError(
        f"training set not found: {source} (not a file, a folder, an owner/name hub id or one of {', '.join(PRESETS)})"
    )


# ----------------------------------------------------------------------------------------------------------------------
# Report


@dataclass
class PrepareReport:
    """What :func:`prepare` read, kept, skipped and found overlapping the benchmarks."""

    source: str
    split: str
    out: Path
    problem_key: str = ""
    answer_key: str = ""
    rows: int = 0
    kept: int = 0
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)
    first_skipped: dict[str, int] = field(default_factory=dict)
    conflicting_duplicates: int = 0
    grader: str | None = None
    overlaps: list[dict[str, Any]] = field(default_factory=list)
    benchmark_sizes: dict[str, int] = field(default_factory=dict)
    drop_overlap: bool = False

    def overlap_counts(self) -> dict[str, dict[str, int]]:
        """Per benchmark: training rows overlapping it (exact, near) and distinct benchmark problems hit."""
        out = {}
        for name, size in self.benchmark_sizes.items():
            hits = [o for o in self.overlaps if o["benchmark"] == name]
            exact = {o["row"] for o in hits if o["kind"] == "exact"}
            out[name] = {
                "exact_rows": len(exact),
                "near_rows": len({o["row"] for o in hits if o["kind"] == "near"} - exact),
                "benchmark_problems_hit": len({o["problem_index"] for o in hits}),
                "benchmark_problems": size,
            }
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the report file)."""
        return {
            "source": self.source,
            "split": self.split,
            "out": str(self.out),
            "columns": {"problem": self.problem_key, "answer": self.answer_key},
            "rows": self.rows,
            "kept": self.kept,
            "skipped": dict(self.skipped),
            "first_skipped_row": self.first_skipped,
            "conflicting_duplicates": self.conflicting_duplicates,
            "answers_checked_with": self.grader,
            "overlap": self.overlap_counts(),
            "overlap_dropped": self.drop_overlap,
            "overlapping_pairs": self.overlaps,
            "near_overlap_rule": f"at least {NEAR_SHARE:.0%} of a benchmark problem's word {NGRAM}-grams",
        }

    def to_text(self) -> str:
        """The counts, as printed by ``nemo-disco data prepare``."""
        w = 34
        lines = [
            f"{self.source} (split {self.split}; problem from {self.problem_key!r}, answer from {self.answer_key!r})",
            f"  {'rows read':<{w}} {self.rows:>8}",
            f"  {'kept':<{w}} {self.kept:>8}  -> {self.out}",
            f"  {'skipped':<{w}} {sum(self.skipped.values()):>8}",
        ]
        for reason, count in self.skipped.most_common():
            label = reason if reason != SKIP_UNVERIFIABLE else f"answer not verifiable by {self.grader}"
            extra = f"  (first: row {self.first_skipped[reason]})"
            if reason == SKIP_DUPLICATE and self.conflicting_duplicates:
                extra += f"; {self.conflicting_duplicates} with a different answer"
            lines.append(f"    {label:<{w - 2}} {count:>8}{extra}")
        if self.grader is None:
            lines.append("  answers were not checked with a grader")
        verb = "dropped" if self.drop_overlap else "kept"
        lines.append(f"  overlap with the benchmarks ({verb} rows: exact + near; benchmark problems hit):")
        for name, c in self.overlap_counts().items():
            rows = f"{c['exact_rows']} + {c['near_rows']}"
            lines.append(f"    {name:<{w - 2}} {rows:>8}  ({c['benchmark_problems_hit']} of {c['benchmark_problems']})")
        return "\n".join(lines) + "\n"


def report_path(out: str | os.PathLike) -> Path:
    """Where :func:`prepare` writes its report: ``<out stem>.report.json`` beside the output."""
    out = Path(out)
    return out.with_name(f"{out.stem}.report.json")


# ----------------------------------------------------------------------------------------------------------------------
# prepare


def prepare(
    source: str,
    out: str | os.PathLike,
    *,
    split: str = "train",
    problem_key: str | None = None,
    answer_key: str | None = None,
    dedup: bool = True,
    check_answers: bool = True,
    grader: str = GradingConfig().grader,
    workers: int = GradingConfig().workers,
    timeout_s: float = GradingConfig().timeout_s,
    benchmarks: Sequence[str] = BENCHMARKS,
    drop_overlap: bool = False,
    strict: bool = False,
) -> PrepareReport:
    """Load, check and write a training set as JSONL (``problem``, ``answer``, ``source``, ``row`` per line).

    Args:
        source: preset name, hub id, local file or folder (see the module docstring).
        out: the JSONL to write (written whole or not at all).
        split: dataset split (hub ids and folders).
        problem_key: column of the problem (default: recognised from the first row).
        answer_key: column of the answer (default: recognised).
        dedup: skip repeats of an earlier problem (normalised text).
        check_answers: skip rows whose answer the grader cannot verify against itself.
        grader: grader of that check, a registered one (use the one training will use; its parameters' defaults).
        workers: grading processes.
        timeout_s: grading limit per answer.
        benchmarks: benchmarks checked for overlap (names or files).
        drop_overlap: skip rows overlapping a benchmark instead of only reporting them.
        strict: any skipped row is an error instead.

    Returns:
        The report (also written to :func:`report_path`).

    Raises:
        ValueError: a row that does not fit the layout (``SOURCE: row N, column 'c': what``), an unreadable
            source, no usable rows, or (``strict``) a row that would be skipped.
        FileNotFoundError: no such source.
    """
    rows, name = open_rows(source, split)
    report = PrepareReport(name, split, Path(out), drop_overlap=drop_overlap)
    kept: list[dict[str, Any]] = []
    first: dict[str, int] = {}  # problem key -> position in kept

    def skip(reason: str, row: int, why: str = "") -> None:
        if strict:
            raise ValueError(f"{name}: row {row}: {why or reason}")
        report.skipped[reason] += 1
        report.first_skipped.setdefault(reason, row)

    for i, row in enumerate(rows):
        report.rows += 1
        try:
            if i == 0:
                report.problem_key, report.answer_key = _layout(row, problem_key, answer_key)
            if not isinstance(row, dict):
                raise _BadRowError(f"expected an object with named columns, got {type(row).__name__}")
            problem = _problem_text(_get(row, report.problem_key), report.problem_key)
            answer = _answer(_get(row, report.answer_key), report.answer_key)
        except _SkipRowError as reason:
            skip(str(reason), i)
            continue
        except _BadRowError as err:
            sep = ", " if str(err).startswith("column") else ": "
            raise ValueError(f"{name}: row {i}{sep}{err}") from None
        key = normalize_problem(problem)
        if dedup and key in first:
            if kept[first[key]]["answer"] != answer:
                report.conflicting_duplicates += 1
            skip(SKIP_DUPLICATE, i, f"duplicate of row {kept[first[key]]['row']}")
            continue
        first.setdefault(key, len(kept))
        kept.append({"problem": problem, "answer": answer, "source": name, "row": i})
    if check_answers and kept:
        kept = _check_answers(kept, report, grader, workers, timeout_s, skip)
    index = BenchmarkIndex(benchmarks)
    report.benchmark_sizes = dict(index.sizes)
    survivors = []
    for rec in kept:
        matches = index.matches(rec["problem"])
        for bench, idx, kind, share in matches:
            report.overlaps.append(
                {"row": rec["row"], "benchmark": bench, "problem_index": idx, "kind": kind, "share": round(share, 3)}
            )
        if matches and drop_overlap:
            skip(SKIP_OVERLAP, rec["row"])
        else:
            survivors.append(rec)
    if not survivors:
        raise ValueError(f"{name}: no usable rows ({report.rows} read; skipped: {dict(report.skipped) or 'none'})")
    report.kept = len(survivors)
    _write_jsonl(Path(out), survivors)
    report_path(out).write_text(json.dumps(report.to_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return report


def _check_answers(
    kept: list[dict[str, Any]], report: PrepareReport, grader: str, workers: int, timeout_s: float, skip: Any
) -> list[dict[str, Any]]:
    r"""Rows whose answer, written as ``\boxed{answer}``, the grader accepts against the answer itself."""
    from nemo_disco.rewards import GraderPool

    report.grader = grader
    responses = []
    for rec in kept:
        first = rec["answer"][0] if isinstance(rec["answer"], list) else rec["answer"]
        responses.append(f"\\boxed{{{first}}}")
    with GraderPool(grader, timeout_s=timeout_s, workers=workers) as pool:
        scores, metrics = pool.score(responses, [rec["answer"] for rec in kept])
    if metrics["reward/timeouts"] or metrics["reward/errors"]:
        logger.warning(
            "answer check: %d timeouts, %d errors (those rows are skipped)",
            metrics["reward/timeouts"],
            metrics["reward/errors"],
        )
    out = []
    for rec, score in zip(kept, scores, strict=True):
        if score > 0.5:
            out.append(rec)
        else:
            skip(SKIP_UNVERIFIABLE, rec["row"], f"answer {rec['answer']!r} not verifiable by the {grader} grader")
    return out


def _write_jsonl(path: Path, records: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    tmp.replace(path)
