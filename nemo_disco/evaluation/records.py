"""Results on disk: ``responses.jsonl`` read, checked and re-graded; the tables written beside it.

A results folder holds ``responses.jsonl`` (one graded record per line) and ``summary.{md,csv,json}``;
:func:`load_results` reads one (a bad line raises ``FILE:LINE: what``), :func:`grade_responses_file` grades the
records that lack a score against the benchmark files' gold answers, and :func:`write_results`,
:func:`write_runs` and :func:`write_comparison` write each table's three forms atomically. An evaluation in
progress appends each chunk's records to ``partial/part-<engine>.jsonl`` (:func:`append_records`) and reads them
back on a rerun (:func:`read_partial`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_disco.config import GradingConfig
from nemo_disco.data import BENCHMARKS, load_problems, resolve_benchmark
from nemo_disco.evaluation.compare import Comparison, RunsSummary
from nemo_disco.evaluation.summary import EvalSummary, summarize
from nemo_disco.files import naming_failed_write
from nemo_disco.stats import DEFAULT_CONFIDENCE, DEFAULT_REPLICATES

logger = logging.getLogger(__name__)
#: The grading defaults: the schema's (training's ``reward.*``, the evaluation's ``reward.*``).
_GRADING = GradingConfig()

RESPONSES_FILE = "responses.jsonl"

__all__ = [
    "RESPONSES_FILE",
    "grade_responses_file",
    "load_results",
    "result_file",
    "result_label",
    "write_comparison",
    "write_results",
    "write_runs",
]


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


def result_file(path: str | os.PathLike) -> Path:
    """The ``responses.jsonl`` of a results folder, or ``path`` itself when it is a file.

    Raises:
        FileNotFoundError: neither a file nor a folder holding responses.jsonl.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / RESPONSES_FILE).is_file():
            raise FileNotFoundError(f"results folder {path} has no {RESPONSES_FILE}")
        return path / RESPONSES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"results not found: {path} (a folder holding {RESPONSES_FILE}, or such a file)")
    return path


def result_label(path: str | os.PathLike) -> str:
    """A short name for a result: its folder's name (the parent folder's for a responses file)."""
    path = Path(path).resolve()
    return path.parent.name if path.is_file() else path.name


def load_results(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The graded records of a results folder or responses file.

    Raises:
        FileNotFoundError: no such results.
        ValueError: a bad line, or a record without a score (``FILE:LINE: ...``).
    """
    file = result_file(path)
    records, lines = _read_records(file)
    for r, line in zip(records, lines, strict=True):
        if r.get("score") is None:
            raise ValueError(f"{file}:{line}: record has no score; grade it first: nemo-disco eval --responses {file}")
    return records


def benchmark_problems(name_or_path: str) -> list[Any]:
    """A benchmark's problems: a shipped name, a file, or a synthetic task (the CPU demo's held-out split)."""
    text = str(name_or_path)
    problems, _ = load_problems(text if text.startswith("synthetic:") else resolve_benchmark(text))
    return problems


def benchmark_key(name_or_path: str) -> str:
    """The name records use for a benchmark: the name itself, or a file's stem."""
    return name_or_path if name_or_path in BENCHMARKS else Path(name_or_path).stem


def grade_responses_file(
    path: str | os.PathLike,
    benchmarks: Sequence[str] | None = None,
    grader: str = _GRADING.grader,
    *,
    out_dir: str | os.PathLike | None = None,
    regrade: bool = False,
    timeout_s: float = _GRADING.timeout_s,
    workers: int = _GRADING.workers,
    replicates: int = DEFAULT_REPLICATES,
    seed: int = 0,
    resample_samples: bool = True,
) -> EvalSummary:
    """Tabulate a ``responses.jsonl``; records without a score (all of them with ``regrade``) are graded.

    Gold answers come from the benchmark files (``benchmarks`` names or paths; a record's ``benchmark``
    is the name, or the file's stem), so another grader's verdict can be compared on the same responses.

    Args:
        path: the JSONL file (its records: :mod:`nemo_disco.evaluation`).
        benchmarks: benchmarks to tabulate (None: every benchmark in the file).
        grader: a registered grader (:data:`nemo_disco.rewards.GRADERS`; its parameters' defaults).
        out_dir: if given, write the graded records and tables there (:func:`write_results`).
        regrade: grade every record, replacing stored scores.
        timeout_s: per-item grading limit.
        workers: grading processes.
        replicates: bootstrap replicates of the intervals (0: none).
        seed: bootstrap seed.
        resample_samples: the bootstrap redraws samples within problems too (False: problems only).

    Raises:
        ValueError: a bad line (``FILE:LINE: what``), a problem index the benchmark lacks, nothing to tabulate.
        FileNotFoundError: the file or a needed benchmark file is missing.
    """
    path = result_file(path)
    records, lines = _read_records(path)
    sources = {benchmark_key(b): b for b in benchmarks} if benchmarks is not None else None
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
                try:
                    problems = benchmark_problems(source)
                except FileNotFoundError as err:
                    if sources is not None:
                        raise
                    raise FileNotFoundError(
                        f"{path}:{lines[i]}: benchmark {bench!r} of these results: {err}; name its file with "
                        "--benchmarks"
                    ) from None
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
    kwargs = {"replicates": replicates, "seed": seed, "resample_samples": resample_samples}
    return write_results(records, out_dir, **kwargs) if out_dir is not None else summarize(records, **kwargs)


# ----------------------------------------------------------------------------------------------------------------------
# Generating and grading


def write_results(
    records: Sequence[dict[str, Any]],
    out_dir: str | os.PathLike,
    *,
    replicates: int = DEFAULT_REPLICATES,
    seed: int = 0,
    confidence: float = DEFAULT_CONFIDENCE,
    resample_samples: bool = True,
) -> EvalSummary:
    """Write ``responses.jsonl`` (one record per line) and ``summary.{md,csv,json}`` into ``out_dir``.

    The keyword arguments are :func:`summarize`'s.
    """
    summary = summarize(
        records, replicates=replicates, seed=seed, confidence=confidence, resample_samples=resample_samples
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    order = {b.benchmark: i for i, b in enumerate(summary.rows)}
    ordered = sorted(records, key=lambda r: (order[r["benchmark"]], int(r["problem_index"]), int(r["sample_index"])))
    _write_text(out / RESPONSES_FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ordered))
    _write_tables(summary, out, "summary")
    return summary


def _write_text(path: Path, text: str) -> None:
    """Write a file atomically: a temporary file beside it, flushed, renamed into place.

    Raises:
        WriteError: it could not be written (a full disk): one line naming ``path`` and the free space.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with naming_failed_write(path), tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk keeps no half file
            tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def _write_tables(table: Any, out: Path, stem: str) -> Path:
    """``<stem>.{md,csv,json}`` of a table object (``to_markdown``, ``to_csv``, ``to_dict``); the Markdown path."""
    out.mkdir(parents=True, exist_ok=True)
    _write_text(out / f"{stem}.md", table.to_markdown())
    _write_text(out / f"{stem}.csv", table.to_csv())
    _write_text(out / f"{stem}.json", json.dumps(table.to_dict(), indent=1) + "\n")
    return out / f"{stem}.md"


# ----------------------------------------------------------------------------------------------------------------------
# Several runs of one setting


def write_runs(runs: RunsSummary, out_dir: str | os.PathLike) -> Path:
    """Write ``runs.{md,csv,json}`` into ``out_dir``; returns the Markdown path."""
    return _write_tables(runs, Path(out_dir), "runs")


def write_comparison(comparison: Comparison, out_dir: str | os.PathLike) -> Path:
    """Write ``comparison.{md,csv,json}`` into ``out_dir``; returns the Markdown path."""
    return _write_tables(comparison, Path(out_dir), "comparison")


def read_partial(folder: Path) -> list[dict[str, Any]]:
    """Records appended so far by every process (a line cut short by a kill is skipped)."""
    records = []
    for f in sorted(folder.glob("part-*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def append_records(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """Append records as JSON lines in one write, flushed to disk (a kill loses at most the chunk being written).

    A line left unfinished by a kill is closed first, so the records after it start on a line of their own.

    Raises:
        WriteError: they could not be written (a full disk): one line naming ``path`` and the free space.
    """
    cut = False
    if path.is_file() and path.stat().st_size:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
    with naming_failed_write(path), path.open("a", encoding="utf-8") as f:
        f.write("\n" * cut + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())
