r"""Training and benchmark problems: DeepScaleR-format loaders, the prompt template, a resumable sampler.

Sources accepted by :func:`load_problems`:

- a JSON file holding a list of rows, a JSONL file (one row per line) or a parquet file;
- a folder written by ``datasets.Dataset.save_to_disk`` (a ``DatasetDict`` too: ``split`` picks one);
- a Hugging Face hub dataset name such as ``agentica-org/DeepScaleR-Preview-Dataset``
  (``datasets.load_dataset(name, split=split)``);
- a benchmark name (``aime``, ``aime25``, ``math``, ``amc``, ``minerva``, ``olympiad_bench``): the copy shipped
  in ``nemo_disco/benchmark_data``, see :func:`resolve_benchmark`;
- ``synthetic:arithmetic`` / ``synthetic:arithmetic-heldout``: the CPU demo's task, two disjoint splits.

A row is either DeepScaleR-style (``problem`` and ``answer``) or verl-style (``prompt``: a list of chat
messages whose user turn is the problem, ``reward_model.ground_truth``: the answer). verl-style prompts
carry an instruction already (DeepScaleR's after the problem; DAPO-Math-17k's "Solve the following math
problem step by step. ..." before it and "Remember to put your answer on its own line after "Answer:"."
after it); known instructions are removed so that :func:`format_prompt` adds the recipe's exactly once.
Answers that are JSON numbers become canonical strings (``142.0`` -> ``"142"``); a list of answers
(OlympiadBench) stays a list of strings, any of which is correct. Row numbers in error messages
count from 0, as :attr:`Problem.index` does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nemo_disco.config import PAPER_BENCHMARKS, ConfigError, DataConfig

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE: str = DataConfig.model_fields["prompt_template"].default
# The instruction the DeepScaleR template appends to a problem (verl-style rows carry it already).
_INSTRUCTION = DEFAULT_TEMPLATE.split("{problem}", 1)[1].replace("{{", "{").replace("}}", "}").strip()
# (prefix, suffix) wrappings of the problem in verl-style prompts of known training sets.
_PROMPT_WRAPPERS = (
    ("", _INSTRUCTION),  # DeepScaleR-Preview in verl parquet
    (  # BytedTsinghua-SIA/DAPO-Math-17k
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.",
        'Remember to put your answer on its own line after "Answer:".',
    ),
)

BENCHMARKS = PAPER_BENCHMARKS
BENCHMARK_DIR_ENV = "NEMO_DISCO_BENCHMARK_DIR"
# The six benchmark files ship inside the package (source and licence: benchmark_data/README.md).
SHIPPED_BENCHMARK_DIR = Path(__file__).resolve().parent / "benchmark_data"
SYNTHETIC = ("synthetic:arithmetic", "synthetic:arithmetic-heldout")
_DATA_SUFFIXES = (".json", ".jsonl", ".parquet")


@dataclass(frozen=True)
class Problem:
    """One question with its gold answer(s).

    Attributes:
        problem: the question text (without the prompt template).
        answer: the gold answer, or several equally valid ones.
        index: row of the source (0-based; rows skipped as bad keep their numbers out of the sequence).
        source: file path, dataset name or synthetic task name it came from.
        fields: the row's other columns that JSON can carry (not ``problem``, ``answer``, ``prompt``,
            ``response``), for ``reward.function``.
    """

    problem: str
    answer: str | list[str]
    index: int
    source: str
    #: The row's other JSON-serialisable columns (test cases, a task type ...), passed to a user reward function.
    fields: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


# ----------------------------------------------------------------------------------------------------------------------
# Rows


def _canonical_answer(value: Any) -> str:
    """A JSON answer value as a string: integral floats lose their ``.0``; strings are stripped."""
    if isinstance(value, bool):
        raise TypeError(f"answer is a boolean ({value})")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"answer is {value}")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        return value.strip()
    raise TypeError(f"answer has type {type(value).__name__}")


def _row_problem(row: Any) -> tuple[Any, Any]:
    """(problem, answer) raw values of a DeepScaleR-style or verl-style row."""
    if not isinstance(row, dict):
        raise TypeError(f"row is a {type(row).__name__}, expected an object")
    if "problem" in row:
        return row["problem"], row.get("answer")
    if "prompt" in row:
        messages = row["prompt"]
        if not isinstance(messages, (list, tuple)):
            raise TypeError(f"prompt has type {type(messages).__name__}, expected a list of chat messages")
        users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            raise TypeError("prompt has no user message")
        text = users[-1]
        if isinstance(text, str):
            text = strip_instruction(text)
        reward_model = row.get("reward_model")
        answer = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        return text, answer
    raise TypeError("row has neither 'problem' nor 'prompt'")


def strip_instruction(text: str) -> str:
    """A verl-style user turn without the instruction a known training set wraps around the problem."""
    stripped = text.strip()
    for prefix, suffix in _PROMPT_WRAPPERS:
        head, tail = stripped.startswith(prefix), stripped.endswith(suffix)
        if head and tail:
            return stripped[len(prefix) : len(stripped) - len(suffix)].strip()
    return text


def _parse_row(row: Any, index: int, source: str) -> Problem:
    """Raises TypeError naming what is wrong (the caller adds file and row)."""
    problem, answer = _row_problem(row)
    if not isinstance(problem, str):
        raise TypeError("problem is missing" if problem is None else f"problem has type {type(problem).__name__}")
    if not problem.strip():
        raise TypeError("problem is empty")
    if answer is None:
        raise TypeError("answer is missing")
    if isinstance(answer, (list, tuple)):
        answers = [_canonical_answer(a) for a in answer]
        if not answers or not all(answers):
            raise TypeError("answer list is empty or holds an empty answer")
        return Problem(problem.strip(), answers, index, source, _extra_fields(row))
    text = _canonical_answer(answer)
    if not text:
        raise TypeError("answer is empty")
    return Problem(problem.strip(), text, index, source, _extra_fields(row))


#: Row keys that never reach a reward function as keyword arguments (it receives them positionally or not at all).
_RESERVED = ("problem", "answer", "prompt", "response")


def _extra_fields(row: dict) -> dict[str, Any]:
    out = {}
    for key, value in row.items():
        if key in _RESERVED or not isinstance(key, str) or not key.isidentifier():
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[key] = value
    return out


def _collect(rows: Sequence[Any], source: str, on_bad_row: str) -> tuple[list[Problem], int]:
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row={on_bad_row!r}: expected 'error' or 'skip'")
    problems: list[Problem] = []
    bad: list[str] = []
    for i, row in enumerate(rows):
        try:
            problems.append(_parse_row(row, i, source))
        except TypeError as err:
            where = f"row {i}: {err}"
            if on_bad_row == "error":
                raise ValueError(f"{source}:{where}") from None
            bad.append(where)
    if bad:
        logger.warning("%s: skipped %d bad row(s); first: %s", source, len(bad), bad[0])
    if not problems:
        raise ValueError(f"{source}: no usable rows" + (f" ({len(bad)} bad)" if bad else ""))
    return problems, len(bad)


# ----------------------------------------------------------------------------------------------------------------------
# Files and datasets


def _read_json(path: Path) -> list[Any]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: invalid JSON: {err.msg}") from None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of rows, got a {type(rows).__name__}")
    return rows


def _read_jsonl(path: Path) -> list[Any]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:line {lineno}: invalid JSON: {err.msg}") from None
    return rows


def _read_parquet(path: Path) -> list[Any]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError variants for unreadable files.
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path}: not a readable parquet file: {first}") from None


_SAVED_DATASET_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")
_TRUE = ("1", "true", "yes", "on")


@contextlib.contextmanager
def quiet_hub_logs() -> Iterator[None]:
    """Silence huggingface_hub / datasets / transformers warnings (one per connection retry) during a load.

    A load that fails is reported as one line by the caller; one that succeeds needs no warnings either.
    Import the library before entering: each sets its logger's level when it is first imported.
    """
    import huggingface_hub  # noqa: F401  (configures its logger on import)

    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "datasets", "transformers")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _offline_variable() -> str | None:
    """The variable (``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE``) that forbids contacting the hub, if any."""
    return next((v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if os.environ.get(v, "").lower() in _TRUE), None)


def hub_tried() -> str:
    """What a hub load tried, for error messages."""
    offline = _offline_variable()
    if offline:
        return f"the local Hugging Face cache only ({offline} is set)"
    return "huggingface.co and the local Hugging Face cache"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def open_dataset(source: str | os.PathLike, split: str = "train") -> Any:
    """A ``datasets.Dataset`` from a local folder (``save_to_disk`` output or a folder of data files) or a hub id.

    Raises:
        ValueError: one line naming the source, what was tried and the first line of the cause.
    """
    import datasets

    path = Path(source)
    with quiet_hub_logs():
        if path.is_dir():
            saved = any((path / f).is_file() for f in _SAVED_DATASET_FILES)
            try:
                ds = datasets.load_from_disk(str(path)) if saved else datasets.load_dataset(str(path), split=split)
            except Exception as err:  # any loader failure is reported as one line
                how = "datasets.load_from_disk" if saved else f"datasets.load_dataset (data files, split {split!r})"
                raise ValueError(f"{path}: cannot load the folder with {how}: {_first_line(err)}") from None
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ValueError(f"{path}: no split {split!r} (splits: {', '.join(ds)})")
                ds = ds[split]
            return ds
        try:
            return datasets.load_dataset(str(source), split=split)
        except Exception as err:  # network, auth, unknown name: all surface as one line
            raise ValueError(
                f"cannot load dataset {str(source)!r} (split {split!r}): no local file or folder of that name; "
                f"tried the Hugging Face hub through {hub_tried()}: {_first_line(err)}"
            ) from None


def resolve_benchmark(name_or_path: str | os.PathLike) -> Path:
    """The JSON file of a benchmark name (``aime``, ``aime25``, ``math``, ``amc``, ``minerva``, ``olympiad_bench``).

    An existing file path is returned unchanged. A name resolves to ``$NEMO_DISCO_BENCHMARK_DIR/<name>.json``
    when that variable is set (it then wins: a missing file there is an error, not a fall-back), else to the
    copy shipped with the package (:data:`SHIPPED_BENCHMARK_DIR`, DeepScaleR layout).

    Raises:
        FileNotFoundError: the name is not a benchmark and not a file, or its file is missing.
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    name = str(name_or_path)
    if name not in BENCHMARKS:
        raise FileNotFoundError(f"{name!r} is neither a file nor a benchmark name ({', '.join(BENCHMARKS)})")
    env = os.environ.get(BENCHMARK_DIR_ENV)
    folder = Path(env) if env else SHIPPED_BENCHMARK_DIR
    target = folder / f"{name}.json"
    if not target.is_file():
        how = f"{BENCHMARK_DIR_ENV}={env}" if env else f"the package's folder {folder}, an incomplete install"
        raise FileNotFoundError(
            f"benchmark {name!r}: {target} not found ({how}); set {BENCHMARK_DIR_ENV} to a folder holding "
            f"{', '.join(b + '.json' for b in BENCHMARKS)}"
        )
    return target


def load_problems(
    source: str | os.PathLike,
    *,
    split: str = "train",
    on_bad_row: Literal["error", "skip"] = "error",
    synthetic_size: int = 2000,
    seed: int = 42,
) -> tuple[list[Problem], int]:
    """Load problems from a file, a saved dataset folder, a hub dataset, a benchmark name or a synthetic task.

    Args:
        source: see the module docstring.
        split: dataset split (hub datasets and saved ``DatasetDict`` folders).
        on_bad_row: "error" raises on the first bad row; "skip" drops bad rows, counts them and logs one warning.
        synthetic_size: number of problems of a ``synthetic:*`` task.
        seed: seed of a ``synthetic:*`` task.

    Returns:
        (problems, number of bad rows skipped).

    Raises:
        ValueError: a bad row (``FILE:row N: what``), unreadable file or dataset, unknown synthetic task.
        FileNotFoundError: a missing file or benchmark.
    """
    text = str(source)
    if text.startswith("synthetic:"):
        if text not in SYNTHETIC:
            raise ValueError(f"unknown synthetic task {text!r}; valid: {', '.join(SYNTHETIC)}")
        heldout = text.endswith("-heldout")
        return synthetic_arithmetic(synthetic_size, seed, split="heldout" if heldout else "train"), 0
    path = Path(source)
    if path.is_dir() or (not path.is_file() and text not in BENCHMARKS and looks_like_hub_id(text)):
        return _collect(open_dataset(source, split).to_list(), text, on_bad_row)
    if not path.is_file():
        if text not in BENCHMARKS:
            raise FileNotFoundError(
                f"data file not found: {text} (nor a benchmark name ({', '.join(BENCHMARKS)}), a synthetic task "
                "or an owner/name hub dataset)"
            )
        path = resolve_benchmark(text)
    return _collect(read_rows(path), str(path), on_bad_row)


def looks_like_hub_id(text: str) -> bool:
    """``owner/name`` with no file suffix: what a Hugging Face hub id looks like (a missing path does not)."""
    path = Path(text)
    pathlike = path.suffix.lower() in _DATA_SUFFIXES or path.is_absolute() or text.startswith((".", "~"))
    return not pathlike and text.count("/") == 1


def read_rows(path: str | os.PathLike) -> list[Any]:
    """The rows of a .json (a list), .jsonl or .parquet file.

    Raises:
        ValueError: unreadable file (``FILE:LINE: what`` for JSON), unsupported suffix.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise ValueError(f"{path}: unsupported data file type {suffix or '(none)'!r}; use .json, .jsonl or .parquet")


# ----------------------------------------------------------------------------------------------------------------------
# Prompts


def format_prompt(problem: str | Problem, template: str = DEFAULT_TEMPLATE) -> str:
    r"""The user turn for a problem: ``template.format(problem=...)``.

    The default is DeepScaleR's ``"{problem} Let's think step by step and output the final answer within
    \boxed{}."`` (braces that are not placeholders are doubled in the template, as str.format wants).

    Raises:
        ValueError: the template has no ``{problem}`` placeholder or other fields.
    """
    if "{problem}" not in template:
        raise ValueError(f"prompt template {template!r} has no {{problem}} placeholder")
    text = problem.problem if isinstance(problem, Problem) else problem
    try:
        return template.format(problem=text)
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(
            f"prompt template {template!r} is invalid ({err!r}); write literal braces as {{{{ }}}}"
        ) from None


def encode_prompts(
    tokenizer: Any,
    problems: Sequence[Problem | str],
    *,
    template: str = DEFAULT_TEMPLATE,
    use_chat_template: bool = True,
    max_prompt_tokens: int | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[list[int]], list[int], int]:
    """Tokenise prompts; those longer than ``max_prompt_tokens`` are DROPPED (counted), never truncated.

    With ``use_chat_template`` the formatted problem is the single user turn (no system prompt) of the
    tokenizer's chat template with ``add_generation_prompt=True``; the rendered text is tokenised without
    adding special tokens again (the template writes them). Without it the plain text is tokenised with
    the tokenizer's own special tokens.

    Args:
        tokenizer: a transformers tokenizer.
        problems: problems or problem texts.
        template: see :func:`format_prompt`.
        use_chat_template: wrap in the chat template.
        max_prompt_tokens: longest prompt kept (None: keep all).
        chat_template_kwargs: extra variables for the chat template (``data.chat_template_kwargs``, e.g.
            Qwen3's ``enable_thinking``).

    Returns:
        (token ids of the kept prompts, indices into ``problems`` of the kept ones, number dropped).
    """
    texts = [format_prompt(p, template) for p in problems]
    if use_chat_template:
        rendered = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}],
                tokenize=False,
                add_generation_prompt=True,
                **dict(chat_template_kwargs or {}),
            )
            for t in texts
        ]
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"] if rendered else []
    else:
        ids = tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else []
    kept_ids, kept = [], []
    for i, row in enumerate(ids):
        if max_prompt_tokens is None or len(row) <= max_prompt_tokens:
            kept_ids.append(list(row))
            kept.append(i)
    return kept_ids, kept, len(texts) - len(kept)


# ----------------------------------------------------------------------------------------------------------------------
# Sampling order


class PromptSampler:
    """Deterministic, resumable order of problem indices: ``prompts_per_step`` at a time, epoch after epoch.

    Each epoch is a permutation drawn from ``(seed, epoch)`` (or the identity when ``shuffle`` is False)
    and is cut into ``num_problems // prompts_per_step`` batches; the remainder of an epoch is left out,
    so no batch repeats a problem. ``state_dict()`` is (epoch, position) and restores the exact sequence.
    """

    def __init__(self, num_problems: int, prompts_per_step: int, seed: int, shuffle: bool = True) -> None:
        """Create a sampler at epoch 0, position 0.

        Raises:
            ValueError: ``prompts_per_step`` is not in [1, num_problems].
        """
        if not 1 <= prompts_per_step <= num_problems:
            raise ValueError(f"prompts_per_step={prompts_per_step} must be between 1 and the {num_problems} problems")
        self.num_problems, self.prompts_per_step = num_problems, prompts_per_step
        self.seed, self.shuffle = seed, shuffle
        self.batches_per_epoch = num_problems // prompts_per_step
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, list(range(num_problems))

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            order = list(range(self.num_problems))
            if self.shuffle:
                # A seed from a hash of (seed, epoch): stable across Python versions and processes.
                digest = hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()
                random.Random(int.from_bytes(digest[:8], "little")).shuffle(order)
            self._order_epoch, self._order = epoch, order
        return self._order

    def next_batch(self) -> list[int]:
        """The next ``prompts_per_step`` problem indices."""
        if self.position == self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        b = self.prompts_per_step
        batch = self._epoch_order(self.epoch)[self.position * b : (self.position + 1) * b]
        self.position += 1
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position (epoch, batches consumed in it) and the settings it is valid for."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_problems": self.num_problems,
            "prompts_per_step": self.prompts_per_step,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was taken.

        Raises:
            ValueError: the state belongs to a sampler with other data size, batch size, seed or shuffling.
        """
        for key in ("num_problems", "prompts_per_step", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this run has {key}={getattr(self, key)!r}; "
                    "resuming would not continue the same sequence"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.batches_per_epoch:
            raise ValueError(f"sampler state epoch={epoch} position={position} is out of range")
        self.epoch, self.position = epoch, position


# ----------------------------------------------------------------------------------------------------------------------
# A run's data


def data_kwargs(data: DataConfig, *, val: bool = False) -> dict[str, Any]:
    """Keyword arguments of :func:`load_problems` for a run's ``data.train`` (``val``: ``data.val``).

    Bad rows of ``data.val`` are skipped whatever ``data.on_bad_row`` says.
    """
    return {
        "split": data.split,
        "on_bad_row": "skip" if val else data.on_bad_row,
        "synthetic_size": data.synthetic_size,
        "seed": data.seed,
    }


def _encode_data_prompts(
    tokenizer: Any, problems: Sequence[Problem | str], data: DataConfig, max_prompt_tokens: int
) -> tuple[list[list[int]], list[int], int]:
    return encode_prompts(
        tokenizer,
        problems,
        template=data.prompt_template,
        use_chat_template=data.use_chat_template,
        max_prompt_tokens=max_prompt_tokens,
        chat_template_kwargs=data.chat_template_kwargs,
    )


def encode_run_prompts(
    tokenizer: Any, problems: Sequence[Problem | str], cfg: Any
) -> tuple[list[list[int]], list[int], int]:
    """:func:`encode_prompts` with a run's settings (``cfg``: a :class:`~nemo_disco.config.RunConfig`).

    Reads ``data.prompt_template``, ``data.use_chat_template``, ``data.chat_template_kwargs`` and
    ``generation.max_prompt_tokens``.
    """
    return _encode_data_prompts(tokenizer, problems, cfg.data, cfg.generation.max_prompt_tokens)


@dataclass(frozen=True)
class RunProblems:
    """A run's parsed sources, read once and handed on (start-up check, warm-up, training, validation).

    Attributes:
        train: ``data.train``'s problems, in file order.
        skipped: its bad rows skipped (``data.on_bad_row=skip``).
        val: ``data.val``'s problems (bad rows skipped), None without ``data.val``.
    """

    train: list[Problem]
    skipped: int
    val: list[Problem] | None


def load_run_problems(data: DataConfig) -> RunProblems:
    """Parse ``data.train`` and ``data.val`` once, as every later stage of the run reads them."""
    train, skipped = load_problems(data.train, **data_kwargs(data))
    val = load_problems(data.val, **data_kwargs(data, val=True))[0] if data.val else None
    return RunProblems(train, skipped, val)


def train_problems(
    data: DataConfig,
    tokenizer: Any,
    *,
    max_prompt_tokens: int,
    prompts_per_step: int,
    loaded: RunProblems | None = None,
) -> tuple[list[Problem], list[list[int]], int, int]:
    """The training questions a run samples from (``data.train``), encoded.

    Args:
        data: the run's ``data`` section.
        tokenizer: the policy's tokenizer.
        max_prompt_tokens: longer prompts are dropped.
        prompts_per_step: the least number of usable problems.
        loaded: the run's parsed sources (:func:`load_run_problems`); None: ``data.train`` is parsed here.

    Returns:
        Problems, their prompt ids, bad rows skipped, prompts dropped as longer than ``max_prompt_tokens``.

    Raises:
        ConfigError: fewer usable problems than ``prompts_per_step`` (``algorithm.prompts_per_step``).
    """
    if loaded is None:
        problems, skipped = load_problems(data.train, **data_kwargs(data))
    else:
        problems, skipped = loaded.train, loaded.skipped
    prompt_ids, kept, dropped = _encode_data_prompts(tokenizer, problems, data, max_prompt_tokens)
    problems = [problems[i] for i in kept]
    if len(problems) < prompts_per_step:
        raise ConfigError(
            f"data.train={data.train!r} has {len(problems)} usable problems, fewer than "
            f"algorithm.prompts_per_step={prompts_per_step}"
        )
    return problems, prompt_ids, skipped, dropped


def val_problems(
    data: DataConfig, tokenizer: Any, *, max_prompt_tokens: int, loaded: RunProblems | None = None
) -> tuple[list[Problem], list[list[int]]] | None:
    """The validation problems (the first ``data.val_max_problems`` of ``data.val``) and their prompt ids.

    ``loaded``: the run's parsed sources (:func:`load_run_problems`); None: ``data.val`` is parsed here.
    """
    if not data.val:
        return None
    problems = loaded.val if loaded is not None and loaded.val is not None else None
    if problems is None:
        problems, _ = load_problems(data.val, **data_kwargs(data, val=True))
    if data.val_max_problems:
        problems = problems[: data.val_max_problems]
    ids, kept, _ = _encode_data_prompts(tokenizer, problems, data, max_prompt_tokens)
    return [problems[i] for i in kept], ids


def new_sampler(data: DataConfig, num_problems: int, prompts_per_step: int) -> PromptSampler:
    """A run's deterministic, resumable question order."""
    return PromptSampler(num_problems, prompts_per_step, seed=data.seed, shuffle=data.shuffle)


# ----------------------------------------------------------------------------------------------------------------------
# Synthetic task (CPU demo)


def _is_heldout(text: str, fraction: float) -> bool:
    """A problem's split, from a hash of its text: independent of seed and size, so splits never overlap."""
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return h % 10_000 < round(fraction * 10_000)


def synthetic_arithmetic(
    n: int,
    seed: int,
    *,
    digits: int = 2,
    operators: str = "+-",
    allow_negative: bool = False,
    split: Literal["train", "heldout"] = "train",
    heldout_fraction: float = 0.2,
) -> list[Problem]:
    """``n`` distinct short arithmetic problems such as ``"23+58"`` (answer ``"81"``).

    Every problem ``a<op>b`` with ``0 <= a, b < 10**digits`` belongs to exactly one split (by a hash of its
    text, a share ``heldout_fraction`` to "heldout"), so train and held-out problems are disjoint for any
    seeds and sizes. Texts are short because the demo's tokenizer spends one token per character.

    Args:
        n: number of problems.
        seed: which problems of the split, and their order.
        digits: operand digits (1 to 3).
        operators: any of "+", "-", "*".
        allow_negative: allow ``a - b`` with ``b > a``.
        split: "train" or "heldout".
        heldout_fraction: share of the problem space in the held-out split.

    Raises:
        ValueError: bad settings, or ``n`` larger than the split.
    """
    if not 1 <= digits <= 3:
        raise ValueError(f"digits={digits}: expected 1, 2 or 3")
    if not operators or set(operators) - set("+-*"):
        raise ValueError(f"operators={operators!r}: expected a non-empty subset of '+-*'")
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r}: expected 'train' or 'heldout'")
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction={heldout_fraction}: expected a value in (0, 1)")
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    size = 10**digits
    pool = []
    for op in dict.fromkeys(operators):
        for a in range(size):
            for b in range(size):
                if op == "-" and b > a and not allow_negative:
                    continue
                text = f"{a}{op}{b}"
                if _is_heldout(text, heldout_fraction) == (split == "heldout"):
                    pool.append((text, ops[op](a, b)))
    if not 1 <= n <= len(pool):
        raise ValueError(
            f"synthetic arithmetic ({split}, digits={digits}, operators={operators!r}) has "
            f"{len(pool)} problems; asked for {n}"
        )
    source = "synthetic:arithmetic" + ("-heldout" if split == "heldout" else "")
    chosen = random.Random(seed).sample(pool, n)
    return [Problem(text, str(value), i, source) for i, (text, value) in enumerate(chosen)]
