"""Running an evaluation: sample a model's responses to benchmark problems, grade them, write the result.

:func:`evaluate_model` cuts the problems into chunks, each sampled with its own seed (:func:`chunk_seed`) and
appended, graded, to ``partial/`` as soon as it is done, so that an interrupted evaluation continues where it
stopped and one split over data-parallel engines (one process per GPU under torchrun or srun) equals the
single-engine result record for record; process 0 merges the chunks into ``responses.jsonl`` and the tables.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from nemo_disco.config import OWN_GPU_MEMORY_UTILIZATION
from nemo_disco.data import DEFAULT_TEMPLATE, encode_prompts, quiet_hub_logs
from nemo_disco.evaluation.records import (
    RESPONSES_FILE,
    append_records,
    benchmark_key,
    benchmark_problems,
    read_partial,
    write_results,
)
from nemo_disco.evaluation.summary import EvalSummary
from nemo_disco.files import WriteError
from nemo_disco.generation.factory import build_generator, choose_backend, stop_token_ids
from nemo_disco.models import check_model
from nemo_disco.stats import DEFAULT_REPLICATES

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CHUNK_PROBLEMS",
    "EXIT_TERMINATED",
    "Terminated",
    "chunk_seed",
    "evaluate_model",
    "sigterm_as_ctrl_c",
]


EVAL_PARTIAL = "partial"
EVAL_SETTINGS = "settings.json"
DEFAULT_CHUNK_PROBLEMS = 32
#: how long a process that has finished its share waits for the others (a barrier) before giving up.
_WAIT_MINUTES = 24 * 60


#: Exit code after SIGTERM: the shell's "terminated" (128 + 15), as 130 (128 + 2) after Ctrl-C.
EXIT_TERMINATED = 143


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, ``scancel``, a Slurm time limit) met as Ctrl-C is: the written responses are kept."""

    signal_name = "SIGTERM"
    exit_code = EXIT_TERMINATED


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """Inside, a first SIGTERM raises :class:`Terminated` (a ``KeyboardInterrupt``); a second one ends at once.

    Without it SIGTERM ends the process silently, with nothing said about the responses kept in ``partial/``.
    The previous handler is restored on the way out. Outside the main thread (where Python runs signal
    handlers) nothing is installed.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM during the clean-up ends at once
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def chunk_seed(seed: int, benchmark: str, chunk: int) -> int:
    """The sampling seed of one chunk of a benchmark: from (seed, benchmark, chunk index) only.

    A chunk's responses therefore do not depend on which process generates it, in which order, or whether
    the evaluation was interrupted before it: a resumed or data-parallel evaluation equals a plain one.
    """
    digest = hashlib.sha256(f"{seed}/{benchmark}/{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**31)


@dataclass(frozen=True)
class _Chunk:
    benchmark: str
    index: int
    problems: list[Any]
    prompt_ids: list[list[int]]

    @property
    def key(self) -> tuple[str, int]:
        return (self.benchmark, self.index)


def _chunks(sets: Sequence[tuple[str, list[Any], list[list[int]]]], size: int) -> list[_Chunk]:
    """Every benchmark's kept problems cut into chunks of ``size`` (the last one shorter), benchmark by benchmark."""
    return [
        _Chunk(bench, k, problems[start : start + size], ids[start : start + size])
        for bench, problems, ids in sets
        for k, start in enumerate(range(0, len(problems), size))
    ]


def _complete(records: Sequence[dict[str, Any]], chunks: Sequence[_Chunk], samples: int) -> dict[tuple, list[dict]]:
    """The chunks all of whose ``samples`` records per problem are written: chunk key -> its records."""
    where = {(c.benchmark, p.index): c.key for c in chunks for p in c.problems}
    unique: dict[tuple[str, int, int], dict[str, Any]] = {}
    for r in records:
        key = (r.get("benchmark"), r.get("problem_index"), r.get("sample_index"))
        if (key[0], key[1]) in where and isinstance(key[2], int) and 0 <= key[2] < samples:
            unique[key] = r
    by_chunk: dict[tuple, list[dict]] = {}
    for (bench, problem, _), r in unique.items():
        by_chunk.setdefault(where[(bench, problem)], []).append(r)
    sizes = {c.key: len(c.problems) * samples for c in chunks}
    return {k: rs for k, rs in by_chunk.items() if len(rs) == sizes[k]}


def _prepare_out(out: Path, settings: dict[str, Any], overwrite: bool) -> None:
    """Rank 0: check ``out`` can be written, refuse to replace a finished result, and open (or reopen) ``partial/``.

    A ``partial/`` that holds no record (an evaluation that failed before its first chunk was written) is
    started over, whatever its settings.

    Raises:
        OutputError: ``out`` cannot be written; it holds a finished result and not ``overwrite``; it holds an
            interrupted evaluation with other settings and not ``overwrite``. One line each.
    """
    from nemo_disco.files import OutputError, check_writable

    check_writable(out, "--out folder")
    partial = out / EVAL_PARTIAL
    if overwrite:
        shutil.rmtree(partial, ignore_errors=True)
    elif (out / RESPONSES_FILE).is_file():
        raise OutputError(
            f"{out} already holds an evaluation ({RESPONSES_FILE}): pass --overwrite to replace it, or choose "
            "another --out"
        )
    saved = partial / EVAL_SETTINGS
    if saved.is_file() and not read_partial(partial):
        shutil.rmtree(partial)  # an evaluation that stopped before its first record: nothing to continue
    if saved.is_file():
        old = json.loads(saved.read_text())
        changed = [k for k in sorted(set(old) | set(settings)) if old.get(k) != settings.get(k)]
        if changed:
            k = changed[0]
            raise OutputError(
                f"{out} holds an interrupted evaluation with {k}={old.get(k)!r} (this command: {settings.get(k)!r}): "
                "rerun it with the same settings to continue it, or pass --overwrite to start over"
            )
        return
    partial.mkdir(parents=True, exist_ok=True)
    tmp = saved.with_suffix(".tmp")
    tmp.write_text(json.dumps(settings, indent=1) + "\n")
    os.replace(tmp, saved)


def _eval_group(world: int) -> Any:
    """A gloo group over every process for the evaluation's own coordination (long timeout: shares differ)."""
    from nemo_disco import distributed

    if world == 1:
        return None
    distributed.init(timeout_minutes=_WAIT_MINUTES)
    return distributed.new_gloo_group(_WAIT_MINUTES)


def evaluate_model(
    model_dir: str | os.PathLike,
    benchmarks: Sequence[str],
    *,
    samples: int = 16,
    temperature: float = 0.6,
    top_p: float = 0.95,
    max_tokens: int = 8192,
    backend: Literal["auto", "hf", "vllm"] = "auto",
    out_dir: str | os.PathLike = "eval_results",
    grader: str = "math_verify",
    seed: int = 0,
    max_problems: int | None = None,
    template: str = DEFAULT_TEMPLATE,
    use_chat_template: bool = True,
    max_prompt_tokens: int | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    timeout_s: float = 5.0,
    workers: int = 2,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = OWN_GPU_MEMORY_UTILIZATION,
    enforce_eager: bool = False,
    generator: Any | None = None,
    replicates: int = DEFAULT_REPLICATES,
    bootstrap_seed: int = 0,
    resample_samples: bool = True,
    chunk_problems: int = DEFAULT_CHUNK_PROBLEMS,
    overwrite: bool = False,
) -> EvalSummary | None:
    """Sample ``samples`` responses per benchmark problem, grade them, write and return the pass@k table.

    Nothing is lost: the problems are cut into chunks of ``chunk_problems``; each chunk's graded records are
    appended to ``out_dir/partial/part-<engine>.jsonl`` (flushed) as soon as it is done, and a rerun with the
    same settings continues from the chunks already written (one log line says how many). Each chunk is
    sampled with its own seed (:func:`chunk_seed`), so an interrupted and continued evaluation, or one split
    over data-parallel engines, gives exactly the records of an uninterrupted single-engine run. At the end
    ``responses.jsonl`` and ``summary.{md,csv,json}`` are written and ``partial/`` removed. A folder that holds
    a finished result is refused unless ``overwrite``. An evaluation that fails (or is interrupted) before its
    first record is written leaves no ``partial/`` behind.

    Data parallel: launched by torchrun / srun with W processes (one per GPU), the job runs W / ``tensor_
    parallel_size`` engines, each generating every E-th remaining chunk; process 0 merges. Every process calls
    this function; only process 0 returns the table (the others None).

    Args:
        model_dir: Hugging Face model folder (weights + tokenizer).
        benchmarks: benchmark names (``aime``, ``math``, ...) or DeepScaleR-format files.
        samples: responses per problem (the paper: 16).
        temperature: sampling temperature (the paper: 0.6).
        top_p: nucleus sampling (the authors' evaluation: 0.95).
        max_tokens: longest response (the paper: 8192 or 32768).
        backend: "vllm", "hf" (transformers generate) or "auto" (vLLM where it imports and finds a device,
            else hf; :func:`~nemo_disco.generation.factory.choose_backend`) when ``generator`` is None.
        out_dir: where the records and the tables are written.
        grader: "math_verify" or "deepscaler".
        seed: sampling seed (each chunk's seed derives from it, the benchmark and the chunk's index).
        max_problems: only the first N problems of each benchmark (smoke tests).
        template: prompt template (:func:`nemo_disco.data.format_prompt`).
        use_chat_template: wrap prompts in the tokenizer's chat template.
        max_prompt_tokens: drop (and log) longer prompts; None keeps all.
        chat_template_kwargs: extra chat-template variables (Qwen3: ``{"enable_thinking": True}``), as
            ``data.chat_template_kwargs`` in training.
        timeout_s: per-item grading limit.
        workers: grading processes (per engine).
        tensor_parallel_size: vLLM tensor parallelism (processes per engine).
        gpu_memory_utilization: vLLM's share of each GPU (the engine has it to itself: no sleep mode).
        enforce_eager: vLLM without CUDA graphs (slower decoding; a way round a graph capture problem).
        generator: an already built Generator (then ``backend`` is unused and it is not shut down here).
        replicates: bootstrap replicates of the intervals (0: none).
        bootstrap_seed: bootstrap seed.
        resample_samples: the bootstrap redraws samples within problems too (False: problems only).
        chunk_problems: problems per generation call: the unit of progress, resumption and data-parallel
            sharing. Part of the sampling: another value draws other responses.
        overwrite: replace a finished result in ``out_dir``, or an interrupted one with other settings.

    Raises:
        ValueError / FileNotFoundError: a model that cannot be loaded (one line naming it and what was
            tried), bad benchmark names, files or settings, an ``out_dir`` that cannot be written or holds
            another evaluation, ``backend="vllm"`` where vLLM cannot run (all before any work).
    """
    from transformers import AutoTokenizer

    from nemo_disco import distributed
    from nemo_disco.generation.base import SamplingParams
    from nemo_disco.rewards import GraderPool

    if samples < 1 or max_tokens < 1 or chunk_problems < 1:
        raise ValueError(f"samples={samples}, max_tokens={max_tokens} and chunk_problems={chunk_problems} must be >= 1")
    env = distributed.read_env()
    if generator is None:  # before any work: a --backend vllm that cannot run is refused here
        backend, why = choose_backend(backend, model_dir)
    if env.world_size % tensor_parallel_size:
        raise ValueError(
            f"--tp {tensor_parallel_size} does not divide the {env.world_size} processes of the job (one per GPU)"
        )
    engines, engine, tp_rank = (
        env.world_size // tensor_parallel_size,
        env.rank // tensor_parallel_size,
        env.rank % tensor_parallel_size,
    )
    out = Path(out_dir)
    check_model(model_dir)
    with quiet_hub_logs():
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    sets = []
    for bench in benchmarks:
        problems = benchmark_problems(bench)
        problems = problems[:max_problems] if max_problems else problems
        ids, kept, dropped = encode_prompts(
            tokenizer,
            problems,
            template=template,
            use_chat_template=use_chat_template,
            max_prompt_tokens=max_prompt_tokens,
            chat_template_kwargs=chat_template_kwargs,
        )
        if dropped and env.is_main:
            logger.warning("%s: %d prompts over %s tokens left out", bench, dropped, max_prompt_tokens)
        sets.append((benchmark_key(bench), [problems[i] for i in kept], ids))
    chunks = _chunks(sets, chunk_problems)
    settings = json.loads(
        json.dumps(
            {
                "model": str(Path(model_dir).resolve()) if Path(model_dir).is_dir() else str(model_dir),
                "benchmarks": {bench: [p.index for p in problems] for bench, problems, _ in sets},
                "samples": samples,
                "temperature": temperature,
                "top_p": top_p,
                "max_tokens": max_tokens,
                "backend": backend if generator is None else type(generator).__name__,
                "grader": grader,
                "seed": seed,
                "template": template,
                "use_chat_template": use_chat_template,
                "chat_template_kwargs": dict(chat_template_kwargs or {}),
                "chunk_problems": chunk_problems,
            }
        )
    )
    group = _eval_group(env.world_size)
    # Process 0 checks and opens the output before any engine starts; the others learn the outcome from it.
    problem = None
    done: set[tuple] = set()
    if env.is_main:
        try:
            _prepare_out(out, settings, overwrite)
            done = set(_complete(read_partial(out / EVAL_PARTIAL), chunks, samples))
        except ValueError as err:
            problem = str(err)
    if group is not None:
        problem, done = distributed.broadcast_object((problem, done), src=0, group=group)
    if problem is not None:
        from nemo_disco.files import OutputError

        raise OutputError(problem)
    todo = [c for c in chunks if c.key not in done]
    if env.is_main and generator is None:
        print(f"evaluation backend: {backend} ({why})", file=sys.stderr)
    if env.is_main:
        print(
            f"evaluation into {out}: graded responses are appended to {out / EVAL_PARTIAL} as they are made",
            file=sys.stderr,
        )
    if done and env.is_main:
        print(
            f"resuming the evaluation in {out}: {len(done)} of {len(chunks)} chunks already written "
            f"({EVAL_PARTIAL}/), generating the other {len(todo)}",
            file=sys.stderr,
        )
    mine = todo[engine::engines]
    writer = tp_rank == 0
    part_file = out / EVAL_PARTIAL / f"part-{engine}.jsonl"
    longest = max((len(p) for _, _, ids in sets for p in ids), default=0)
    # Every process builds its engine, even one with no chunk left to it: vLLM's external launcher creates its
    # process groups collectively over the whole job.
    own = generator is None and bool(todo)
    try:
        if own:
            generator = build_generator(
                model_dir,
                backend,
                seed=seed,
                max_model_len=longest + max_tokens,
                tensor_parallel_size=tensor_parallel_size,
                engine={
                    "gpu_memory_utilization": gpu_memory_utilization,
                    "enforce_eager": enforce_eager,
                    "sleep_level": 0,
                },
            )
        sampling = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids(tokenizer),
            seed=seed,
        )
        who = f"engine {engine + 1}/{engines}: " if engines > 1 else ""
        start = time.monotonic()
        with GraderPool(grader, timeout_s=timeout_s, workers=workers) if writer and mine else nullcontext() as pool:
            for n, chunk in enumerate(mine, 1):
                chunk_sampling = replace(sampling, seed=chunk_seed(seed, chunk.benchmark, chunk.index))
                rollouts = generator.generate(chunk.prompt_ids, samples, chunk_sampling)  # [P][samples]
                if not writer:
                    continue
                append_records(part_file, _graded(chunk, rollouts, tokenizer, pool, samples))
                first = chunk.problems[0].index
                logger.info(
                    "%s%s problems %d-%d: %d responses graded and written; %d/%d chunks, %.0f s",
                    who,
                    chunk.benchmark,
                    first,
                    chunk.problems[-1].index,
                    len(chunk.problems) * samples,
                    n,
                    len(mine),
                    time.monotonic() - start,
                )
    except BaseException as err:
        # A partial/ that holds no record is removed (process 0): a retry, with any settings, starts afresh.
        empty = env.is_main and not read_partial(out / EVAL_PARTIAL)
        if empty:
            shutil.rmtree(out / EVAL_PARTIAL, ignore_errors=True)
        if isinstance(err, KeyboardInterrupt) and writer:
            # Ctrl-C and SIGTERM (Terminated) alike; the CLI's next line names the signal and the exit code.
            if empty:
                print(f"interrupted before any response was written: {out / EVAL_PARTIAL} removed", file=sys.stderr)
            else:
                print(
                    f"interrupted: the responses written so far are kept in {out / EVAL_PARTIAL}; rerun the same "
                    "command to continue",
                    file=sys.stderr,
                )
        if isinstance(err, WriteError) and not empty:  # a full disk: the line also says what is kept
            raise _kept(err, out / EVAL_PARTIAL) from err
        raise
    finally:
        if own and generator is not None:
            generator.shutdown()
    if group is not None:
        distributed.barrier(group)
    if not env.is_main:
        return None
    complete = _complete(read_partial(out / EVAL_PARTIAL), chunks, samples)
    missing = [c.key for c in chunks if c.key not in complete]
    if missing:
        raise RuntimeError(f"{out / EVAL_PARTIAL}: chunks {missing[:3]} are missing after generation")
    records = [r for c in chunks for r in complete[c.key]]
    try:
        summary = write_results(
            records, out, replicates=replicates, seed=bootstrap_seed, resample_samples=resample_samples
        )
    except WriteError as err:
        raise _kept(err, out / EVAL_PARTIAL) from err
    shutil.rmtree(out / EVAL_PARTIAL, ignore_errors=True)
    return summary


def _kept(err: WriteError, partial: Path) -> WriteError:
    """A failed write's one line, saying that the responses in ``partial`` are kept for a rerun to continue."""
    return WriteError(
        f"{err}; the responses written so far are kept in {partial}: make room and rerun the same command to continue"
    )


def _graded(chunk: _Chunk, rollouts: list[list[Any]], tokenizer: Any, pool: Any, samples: int) -> list[dict]:
    """The records of one chunk: decoded, graded."""
    texts = [tokenizer.decode(r.token_ids, skip_special_tokens=True) for rs in rollouts for r in rs]
    scores, metrics = pool.score(texts, [p.answer for p in chunk.problems for _ in range(samples)])
    if metrics["reward/timeouts"] or metrics["reward/errors"]:
        logger.warning(
            "%s: grading had %d timeouts, %d errors (scored 0)",
            chunk.benchmark,
            metrics["reward/timeouts"],
            metrics["reward/errors"],
        )
    flat = [(p, j, r) for p, rs in zip(chunk.problems, rollouts, strict=True) for j, r in enumerate(rs)]
    return [
        {
            "benchmark": chunk.benchmark,
            "problem_index": p.index,
            "sample_index": j,
            "response": text,
            "score": score,
            "answer": p.answer,
            "finish_reason": r.finish_reason,
            "response_tokens": len(r.token_ids),
        }
        for (p, j, r), text, score in zip(flat, texts, scores, strict=True)
    ]
