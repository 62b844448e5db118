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
from typing import Any

from nemo_disco import config as config_lib
from nemo_disco.config import EvalConfig
from nemo_disco.data import encode_prompts, quiet_hub_logs
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

logger = logging.getLogger(__name__)

__all__ = [
    "EXIT_TERMINATED",
    "Terminated",
    "chunk_seed",
    "converted_model",
    "evaluate_model",
    "load_config",
    "results_dir",
    "run_checkpoint",
    "sigterm_as_ctrl_c",
]


EVAL_PARTIAL = "partial"
EVAL_SETTINGS = "settings.json"
#: The file a Hugging Face folder converted from a run's checkpoint names its source in (:func:`converted_model`).
CONVERTED_FROM = "converted_from.json"
#: The results folder without ``out``, for a model (a run's checkpoint: ``<run>/eval/<checkpoint>``).
DEFAULT_RESULTS = "eval_results"
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


def load_config(
    recipe: str | os.PathLike | None,
    overrides: Sequence[str] = (),
    flags: Mapping[str, tuple[str, Any]] | None = None,
) -> EvalConfig:
    """An evaluation's config: :func:`nemo_disco.config.load_eval`, with a run's checkpoint's settings.

    For ``run`` (a training run's folder), the checkpoint's saved ``config.yaml`` gives the prompt template,
    chat-template settings and lengths (:data:`~nemo_disco.config.RUN_KEYS`) over the recipe's, unless the command
    line gives them; ``checkpoint`` is resolved (null: the run's newest complete one) and ``out`` defaults to
    ``<run>/eval/<checkpoint>``.

    Raises:
        ConfigError: one line naming the file and line, or the override or flag, and the key.
        ValueError / FileNotFoundError: no such run or checkpoint (one line naming what the run holds).
    """
    cfg = config_lib.load_eval(recipe, overrides, flags=dict(flags or {}))
    if cfg.run is None:
        return cfg
    step = run_checkpoint(cfg.run, cfg.checkpoint)
    run_dir = step.parent.parent
    saved = next((f for f in (step / "config.yaml", run_dir / "config.yaml") if f.is_file()), None)
    if saved is None:
        raise FileNotFoundError(
            f"{step}: no config.yaml with the checkpoint or in {run_dir}: is it a run's checkpoint?"
        )
    values = config_lib.run_values(saved)
    if cfg.checkpoint is None:
        values["checkpoint"] = step.name
    if cfg.out is None:
        values["out"] = str(Path(cfg.run) / "eval" / step.name)
    return config_lib.load_eval(recipe, overrides, run=values, flags=dict(flags or {}))


def run_checkpoint(run: str | os.PathLike, checkpoint: str | None) -> Path:
    """The folder of a run's checkpoint: ``step_N`` (or ``N``) in ``<run>/checkpoints``; None: the newest complete one.

    Raises:
        FileNotFoundError: no such run folder.
        ValueError: no such checkpoint (one line naming those the run holds).
    """
    from nemo_disco import checkpoint as checkpoints

    run_dir = Path(run)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run folder not found: {run_dir}")
    if checkpoint is None:
        newest = checkpoints.latest_checkpoint(run_dir)
        if newest is None:
            raise ValueError(f"run {run_dir} holds no complete checkpoint ({checkpoints.checkpoint_root(run_dir)})")
        return newest
    name = checkpoint if checkpoint.startswith("step_") else f"step_{checkpoint}"
    path = checkpoints.checkpoint_root(run_dir) / name
    if not path.is_dir():
        held = ", ".join(p.name for _, p in checkpoints.list_checkpoints(run_dir)) or "none"
        raise ValueError(f"run {run_dir} has no checkpoint {name} (it holds: {held})")
    return path


def converted_model(step: Path) -> Path:
    """A Hugging Face folder of a run's checkpoint, ``<run>/hf/<step_N>``: converted now, or reused if it was before.

    A folder converted from this checkpoint before (:data:`CONVERTED_FROM` names the checkpoint's manifest) is
    reused; otherwise the checkpoint is verified and converted (:func:`nemo_disco.convert.checkpoint_to_hf`, either
    policy backend) into a temporary folder beside it, moved into place once complete. Launched with several
    processes (data-parallel engines), every process takes part (a Megatron checkpoint converts collectively) and
    process 0 writes.

    Raises:
        ValueError: not a checkpoint, or a damaged one (one line naming it).
    """
    from nemo_disco import convert, distributed, files

    out = step.parent.parent / "hf" / step.name
    manifest = step / "manifest.json"
    source = {
        "checkpoint": str(step.resolve()),
        "manifest_sha256": hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None,
    }
    marker = out / CONVERTED_FROM
    if marker.is_file() and source["manifest_sha256"] and json.loads(marker.read_text()) == source:
        if distributed.read_env().is_main:
            print(f"evaluating {out} (converted from {step} before)", file=sys.stderr)
        return out
    env = distributed.read_env()
    if env.world_size > 1:
        distributed.init(timeout_minutes=_WAIT_MINUTES)
    tmp = out.with_name(f".{out.name}.partial")
    if env.is_main and tmp.exists():
        shutil.rmtree(tmp)
    distributed.barrier()
    try:
        convert.checkpoint_to_hf(step, tmp)
    except BaseException:
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if env.is_main:
        (tmp / CONVERTED_FROM).write_text(json.dumps(source, indent=1) + "\n")
        files.replace_folder(tmp, out)
        print(f"converted {step} to {out}", file=sys.stderr)
    distributed.barrier()
    return out


def results_dir(cfg: EvalConfig) -> Path:
    """The results folder: ``out``; else ``<run>/eval/<checkpoint>`` for a checkpoint, or :data:`DEFAULT_RESULTS`."""
    if cfg.out is not None:
        return Path(cfg.out)
    if cfg.run is not None:
        return Path(cfg.run) / "eval" / run_checkpoint(cfg.run, cfg.checkpoint).name
    return Path(DEFAULT_RESULTS)


def evaluate_model(
    cfg: EvalConfig,
    model_dir: str | os.PathLike | None = None,
    *,
    generator: Any | None = None,
    overwrite: bool = False,
) -> EvalSummary | None:
    """Sample ``generation.samples`` responses per benchmark problem, grade them, write and return the pass@k table.

    Nothing is lost: the problems are cut into chunks of ``generation.chunk_problems``; each chunk's graded records
    are appended to ``<out>/partial/part-<engine>.jsonl`` (flushed) as soon as it is done, and a rerun with the
    same settings continues from the chunks already written (one log line says how many). Each chunk is
    sampled with its own seed (:func:`chunk_seed`), so an interrupted and continued evaluation, or one split
    over data-parallel engines, gives exactly the records of an uninterrupted single-engine run. At the end
    ``responses.jsonl`` and ``summary.{md,csv,json}`` are written and ``partial/`` removed. A folder that holds
    a finished result is refused unless ``overwrite``. An evaluation that fails (or is interrupted) before its
    first record is written leaves no ``partial/`` behind.

    Data parallel: launched by torchrun / srun with W processes (one per GPU), the job runs W /
    ``generation.tensor_parallel_size`` engines, each generating every E-th remaining chunk; process 0 merges.
    Every process calls this function; only process 0 returns the table (the others None).

    Args:
        cfg: the evaluation (:class:`~nemo_disco.config.EvalConfig`: every setting and its default); a run's
            checkpoint (``cfg.run``) is converted to a Hugging Face folder first (:func:`converted_model`).
        model_dir: the Hugging Face folder to evaluate instead of ``cfg.model`` / ``cfg.run``'s checkpoint.
        generator: an already built Generator (then ``generation.backend`` is unused and it is not shut down here).
        overwrite: replace a finished result in the results folder, or an interrupted one with other settings.

    Raises:
        ValueError / FileNotFoundError: a model that cannot be loaded (one line naming it and what was
            tried), bad benchmark names, files or settings, a results folder that cannot be written or holds
            another evaluation, ``generation.backend=vllm`` where vLLM cannot run (all before any work).
    """
    from transformers import AutoTokenizer

    from nemo_disco import distributed
    from nemo_disco.generation.base import SamplingParams
    from nemo_disco.rewards import GraderPool

    g, d = cfg.generation, cfg.data
    samples, max_tokens, seed, tensor_parallel_size = g.samples, g.max_response_tokens, g.seed, g.tensor_parallel_size
    env = distributed.read_env()
    step = run_checkpoint(cfg.run, cfg.checkpoint) if model_dir is None and cfg.run is not None else None
    model_dir = model_dir if model_dir is not None else cfg.model
    if model_dir is None and step is None:
        raise ValueError("nothing to evaluate: give a model (--model HF_DIR) or a run's checkpoint (--run RUN_DIR)")
    if generator is None:  # before any work (a conversion too): a --backend vllm that cannot run is refused here
        backend, why = choose_backend(g.backend, step / "policy" if step is not None else model_dir)
    if env.world_size % tensor_parallel_size:
        raise ValueError(
            f"--tp {tensor_parallel_size} (generation.tensor_parallel_size) does not divide the {env.world_size} "
            "processes of the job (one per GPU)"
        )
    if step is not None:
        model_dir = converted_model(step)
    engines, engine, tp_rank = (
        env.world_size // tensor_parallel_size,
        env.rank // tensor_parallel_size,
        env.rank % tensor_parallel_size,
    )
    out = Path(results_dir(cfg))
    check_model(model_dir)
    with quiet_hub_logs():
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    sets = []
    for bench in cfg.benchmark_names:
        problems = benchmark_problems(bench)
        problems = problems[: d.max_problems] if d.max_problems else problems
        ids, kept, dropped = encode_prompts(
            tokenizer,
            problems,
            template=d.prompt_template,
            use_chat_template=d.use_chat_template,
            max_prompt_tokens=g.max_prompt_tokens,
            chat_template_kwargs=d.chat_template_kwargs,
        )
        if dropped and env.is_main:
            logger.warning("%s: %d prompts over %s tokens left out", bench, dropped, g.max_prompt_tokens)
        sets.append((benchmark_key(bench), [problems[i] for i in kept], ids))
    chunks = _chunks(sets, g.chunk_problems)
    settings = json.loads(
        json.dumps(
            {
                "model": str(Path(model_dir).resolve()) if Path(model_dir).is_dir() else str(model_dir),
                "benchmarks": {bench: [p.index for p in problems] for bench, problems, _ in sets},
                "samples": samples,
                "temperature": g.temperature,
                "top_p": g.top_p,
                "max_tokens": max_tokens,
                "backend": backend if generator is None else type(generator).__name__,
                "grader": cfg.reward.grader,
                "seed": seed,
                "template": d.prompt_template,
                "use_chat_template": d.use_chat_template,
                "chat_template_kwargs": dict(d.chat_template_kwargs),
                "chunk_problems": g.chunk_problems,
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
                    "gpu_memory_utilization": g.gpu_memory_utilization,
                    "enforce_eager": g.enforce_eager,
                    "sleep_level": 0,
                },
            )
        sampling = SamplingParams(
            temperature=g.temperature,
            top_p=g.top_p,
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids(tokenizer),
            seed=seed,
        )
        who = f"engine {engine + 1}/{engines}: " if engines > 1 else ""
        start = time.monotonic()
        r = cfg.reward
        grading = GraderPool(r.grader, timeout_s=r.timeout_s, workers=r.workers) if writer and mine else nullcontext()
        with grading as pool:
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
        b = cfg.bootstrap
        summary = write_results(records, out, replicates=b.replicates, seed=b.seed, resample_samples=b.resample_samples)
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
