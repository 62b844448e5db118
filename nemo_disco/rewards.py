r"""Math grading of model responses: two graders, a worker-process pool with a hard per-item timeout.

Graders (``GRADERS``), both returning 1.0 (correct) or 0.0:

- ``math_verify``: Hugging Face math-verify 0.9.0. The gold answer is wrapped in ``\boxed{...}`` before
  parsing (a bare gold string such as ``\left( 1, 2 \right)`` parses to a fragment otherwise); plain
  scientific notation in gold answers (``3.3e12``) is rewritten as ``3.3\times 10^{12}``. The response is
  parsed with math-verify's default LaTeX + expression extraction (rightmost match first); when it holds
  ``</think>`` only the text after the last ``</think>`` is graded. (math-verify hands sympy's
  ``parse_expr`` only strings its regex limits to digits, operators, brackets and spaces; LaTeX goes
  through latex2sympy2_extended's grammar. Neither runs text from the response as code.)
- ``deepscaler``: the rules of the DeepScaleR grader that the DisCO authors trained with: the LAST
  ``\boxed{...}`` (brace-matched; ``\fbox{...}`` as fallback) after the last ``</think>`` is the answer;
  it is correct if, for any gold answer, (a) the Hendrycks-MATH string normalisations are equal, or
  (b) after unit / ``\text`` / thousands-separator normalisation and splitting tuples and intervals
  element-wise, every element matches: two fractions only if numerator and denominator are literally
  equal (an unreduced fraction is wrong), an integer only by an integer of equal value, anything else if
  sympy proves ``gold - given == 0``. The symbolic step parses LaTeX with latex2sympy2_extended (an ANTLR
  grammar that builds sympy objects) and never evaluates text as Python (no ``eval``, ``exec``,
  ``sympify`` of a string, ``parse_expr``); inputs that could blow up (power towers, huge literals) are
  refused before parsing.
  ``require_think=False`` (default) grades the whole response when it has no ``</think>``; the official
  grader scores such a response 0 (a "format error"), which ``require_think=True`` reproduces.

Model output is untrusted: a response such as ``\boxed{9^{9^{9^{9}}}}`` keeps sympy busy for minutes, and
code in C extensions (gmpy2 arithmetic, for one) need not return to the interpreter to notice a signal.
:class:`GraderPool` therefore grades in worker PROCESSES (plain ``subprocess`` workers speaking JSON lines
over pipes, so it works even when the main program is read from stdin, where ``spawn`` / ``forkserver``
pools fail). Each item has ``timeout_s``: the worker interrupts itself at ``timeout_s`` (``SIGALRM`` in its
main thread; enough for code that checks signals), and the parent kills and replaces a worker whose item
is still running ``kill_grace_s`` later. A timed-out item scores 0 and is counted in ``reward/timeouts``;
a grading exception scores 0 and is counted in ``reward/errors``. A worker that dies (killed from outside,
out of memory, a crash in C code) has its item graded again on a fresh worker, once: the scores do not
depend on a worker's death; an item whose second worker dies too scores 0 and counts in ``reward/errors``.
``reward/restarts`` counts replaced workers. math-verify's own ``signal.alarm`` timeouts are disabled (they
need the main thread and integer seconds).

Any verifier as a reward (``reward.function: "package.module:function"``): the pool's workers call
``fn(response, answer, problem=..., **row_fields) -> float`` instead of a math grader, with the same timeout,
kill-and-replace and death handling. ``row_fields`` are the data row's other columns (``data.Problem.fields``).
An exception scores 0 and counts in ``reward/errors``; the first one a pool sees is logged with its traceback.
:func:`load_reward_function` resolves the path in the trainer at start-up (one-line error), the workers again
(the current folder is on their path too). The function runs model output through whatever it does: a code
reward must execute it in a sandbox of its own (docs/rewards.md).
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GRADERS = ("math_verify", "deepscaler")
THINK_END = "</think>"

# ----------------------------------------------------------------------------------------------------------------------
# Shared helpers


def _truths(ground_truth: Any) -> list[str]:
    """Gold answers as a list of non-empty strings (numbers are written canonically: 142.0 -> "142")."""
    items = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    out = []
    for g in items:
        if isinstance(g, float) and g.is_integer():
            g = int(g)
        s = str(g).strip()
        if s:
            out.append(s)
    return out


def _after_think(response: str) -> str | None:
    """The text after the last ``</think>``, or None when there is none."""
    head, sep, tail = response.rpartition(THINK_END)
    return tail if sep else None


def last_boxed(text: str) -> str | None:
    r"""Content of the LAST ``\boxed{...}`` (brace-matched), else of the last ``\fbox{...}``; None if absent.

    ``\boxed 5`` (no braces) gives ``5``. Unbalanced braces give None.
    """
    for command in ("\\boxed", "\\fbox"):
        start = text.rfind(command)
        if start >= 0:
            break
    else:
        return None
    rest = text[start + len(command) :]
    if rest.startswith(" "):
        # "\boxed 5$" form: the argument runs to the next "$" or the end.
        return rest[1:].split("$", 1)[0].strip() or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None


_SCI_RE = re.compile(r"(-?\d+(?:\.\d+)?)[eE]([+-]?\d+)")


def gold_latex(answer: str) -> str:
    r"""A gold answer as LaTeX: surrounding ``$`` removed, plain ``3.3e12`` written ``3.3\times 10^{12}``."""
    s = answer.strip()
    if len(s) >= 2 and s.startswith("$") and s.endswith("$"):
        s = s.strip("$").strip()
    m = _SCI_RE.fullmatch(s)
    if m:
        s = f"{m.group(1)}\\times 10^{{{int(m.group(2))}}}"
    return s


# ----------------------------------------------------------------------------------------------------------------------
# math_verify grader


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns that its own timeouts are off; the pool enforces them, so the warning is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


@functools.cache
def _math_verify() -> Any:
    import math_verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
    return math_verify


@functools.lru_cache(maxsize=4096)
def _parsed_gold(answer: str) -> list:
    """Parsed gold answer (cached: every rollout of a question shares it)."""
    mv = _math_verify()
    latex = gold_latex(answer)
    if "\\boxed" not in latex:
        latex = f"\\boxed{{{latex}}}"
    return mv.parse(latex, parsing_timeout=None)


def _math_verify_correct(response: str, truths: list[str]) -> bool:
    mv = _math_verify()
    after = _after_think(response)
    pred = mv.parse(response if after is None else after, parsing_timeout=None)
    if not pred:
        return False
    return any(mv.verify(_parsed_gold(g), pred, timeout_seconds=None) for g in truths)


# ----------------------------------------------------------------------------------------------------------------------
# deepscaler grader: (a) Hendrycks-MATH string normalisation


def _fix_fracs(s: str) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}``, ``\frac1{7}`` -> ``\frac{1}{7}``."""
    head, *parts = s.split("\\frac")
    out = head
    for part in parts:
        out += "\\frac"
        if not part or part[0] == "{":
            out += part
            continue
        if len(part) < 2:
            return s
        num, rest = part[0], part[1:]
        if rest[0] == "{":
            out += "{" + num + "}" + rest
        else:
            out += "{" + num + "}{" + rest[0] + "}" + rest[1:]
    return out


def _fix_sqrt(s: str) -> str:
    r"""``\sqrt3`` -> ``\sqrt{3}``."""
    return re.sub(r"\\sqrt(?=[^{\[\\\s])(.)", r"\\sqrt{\1}", s)


def hendrycks_normalize(answer: str) -> str:
    r"""The Hendrycks-MATH answer normalisation (``\text{...}`` unwrapped, units, ``\left``, spaces, fractions)."""
    s = answer.strip()
    m = re.fullmatch(r"\\text\{(.+?)\}", s)
    if m:
        s = m.group(1)
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    # Units written as "\text{ cm}" (leading space) are dropped with everything after them.
    s = s.split("\\text{ ", 1)[0]
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    lhs, eq, rhs = s.partition("=")
    if eq and "=" not in rhs and len(lhs) <= 2:  # "x = 5" -> "5"
        s = rhs
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    return s


# ----------------------------------------------------------------------------------------------------------------------
# deepscaler grader: (b) normalisation for the element-wise / symbolic check

_UNIT_WORDS = (
    "degree|degrees|cm|centimeters?|mm|millimeters?|km|kilometers?|meters?|metres?|miles?|inch(?:es)?|foot|feet|"
    "yards?|seconds?|minutes?|hours?|days?|weeks?|months?|years?|units?|square|sq|cubic|dollars?|cents?|"
    "grams?|kilograms?|kg|liters?|litres?|mph|points?|ways?|students?|people|percent"
)
_UNITS_RE = re.compile(rf"(?<![A-Za-z\\])(?:{_UNIT_WORDS})(?![A-Za-z])")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mbox|mathrm|textrm|operatorname)\s*\{([^{}]*)\}")


def _normalize(answer: str) -> str:
    s = answer.strip()
    s = _TEXT_RE.sub(r"\1", s)
    for old, new in (
        ("\n", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\:", ""),
        ("\\ ", " "),
        ("\\quad", " "),
        ("\\displaystyle", ""),
        ("\\left", ""),
        ("\\right", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
        ("$", ""),
        ("\\%", ""),
        ("%", ""),
    ):
        s = s.replace(old, new)
    s = _UNITS_RE.sub("", s).strip()
    s = s.rstrip(".").strip()
    lhs, eq, rhs = s.partition("=")
    if eq and "=" not in rhs and len(lhs.strip()) <= 2:  # "x = 5" -> "5"
        s = rhs.strip()
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):  # thousands separators
        s = s.replace(",", "")
    m = re.fullmatch(r"(-?\d+)\.0*", s)  # integer-valued float
    if m:
        s = m.group(1)
    return s


def _split_top_level(s: str) -> list[str]:
    """Split at commas outside any bracket or brace."""
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur).strip())
    return parts


def _tuple_parts(s: str) -> tuple[str, str, list[str]]:
    """(opening bracket, closing bracket, elements) of a tuple / interval / list; one element otherwise."""
    if len(s) > 2 and s[0] in "([" and s[-1] in ")]":
        inner = _split_top_level(s[1:-1])
        if len(inner) > 1:
            return s[0], s[-1], inner
    parts = _split_top_level(s)
    return "", "", parts if len(parts) > 1 else [s]


_INT_RE = re.compile(r"[-+]?\d+")
_FRAC_RE = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}|(-?\d+)/(\d+)")


def _fraction(s: str) -> tuple[int, int] | None:
    """(numerator, denominator) of a literal fraction, NOT reduced; None if ``s`` is not one."""
    m = _FRAC_RE.fullmatch(s.replace(" ", ""))
    if not m:
        return None
    if m.group(2) is not None:
        sign = -1 if m.group(1) else 1
        return sign * int(m.group(2)), int(m.group(3))
    return int(m.group(4)), int(m.group(5))


def _exponent_args(s: str) -> list[str]:
    """The argument of every ``^`` (a brace group or one character)."""
    args = []
    for i, ch in enumerate(s):
        if ch != "^":
            continue
        rest = s[i + 1 :].lstrip()
        if rest.startswith("{"):
            depth = 0
            for j, c in enumerate(rest):
                depth += (c == "{") - (c == "}")
                if depth == 0:
                    args.append(rest[1:j])
                    break
            else:
                args.append(rest)
        else:
            args.append(rest[:1])
    return args


def _safe_for_symbolic(s: str) -> bool:
    """Refuse inputs whose evaluation could explode: power towers, huge literals, big factorials, long text."""
    if len(s) > 200 or re.search(r"\d{31,}", s) or re.search(r"\d{4,}\s*!", s):
        return False
    return not any("^" in arg or "**" in arg for arg in _exponent_args(s)) and "**" not in s


def _to_sympy(latex: str) -> Any:
    from latex2sympy2_extended import latex2sympy

    return latex2sympy(latex, convert_degrees=False)


def _symbolic_equal(gold: str, given: str) -> bool:
    """Sympy proves gold - given == 0 (both parsed from LaTeX, never evaluated as Python)."""
    if not (_safe_for_symbolic(gold) and _safe_for_symbolic(given)):
        return False
    import sympy

    try:
        a, b = _to_sympy(gold), _to_sympy(given)
    except Exception:  # latex2sympy raises many exception types on malformed LaTeX.
        return False
    if a == b:
        return True
    if isinstance(a, sympy.MatrixBase) or isinstance(b, sympy.MatrixBase):
        if not (isinstance(a, sympy.MatrixBase) and isinstance(b, sympy.MatrixBase)) or a.shape != b.shape:
            return False
        return bool(sympy.simplify(a - b).is_zero_matrix)
    if not (isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr)):
        return False
    return sympy.simplify(a - b) == 0


def _element_equal(gold: str, given: str) -> bool:
    gold_frac, given_frac = _fraction(gold), _fraction(given)
    if gold_frac is not None and given_frac is not None:
        return gold_frac == given_frac  # an unreduced fraction is wrong (DeepScaleR rule)
    gold_int, given_int = _INT_RE.fullmatch(gold), _INT_RE.fullmatch(given)
    if bool(gold_int) != bool(given_int):
        return False  # an integer gold answer needs a literal integer (no simplification)
    if gold_int:
        return int(gold) == int(given)
    return _symbolic_equal(gold, given)


def _deepscaler_match(given: str, gold: str) -> bool:
    if hendrycks_normalize(given) == hendrycks_normalize(gold):
        return True
    gold_n, given_n = _normalize(gold), _normalize(given)
    if not gold_n or not given_n:
        return False
    if gold_n == given_n:
        return True
    g_open, g_close, gold_parts = _tuple_parts(gold_n)
    a_open, a_close, given_parts = _tuple_parts(given_n)
    if len(gold_parts) != len(given_parts) or (len(gold_parts) > 1 and (g_open, g_close) != (a_open, a_close)):
        return False
    return all(_element_equal(g, a) for g, a in zip(gold_parts, given_parts, strict=True))


def _deepscaler_correct(response: str, truths: list[str], require_think: bool) -> bool:
    after = _after_think(response)
    if after is None and require_think:
        return False
    given = last_boxed(response if after is None else after)
    if given is None or not given.strip():
        return False
    for gt in truths:
        gold = last_boxed(gt) if "\\boxed" in gt else gold_latex(gt)
        if gold and _deepscaler_match(given, gold):
            return True
    return False


# ----------------------------------------------------------------------------------------------------------------------
# Public scoring


def _check_grader(grader: str) -> None:
    if grader not in GRADERS:
        raise ValueError(f"unknown grader {grader!r}; valid graders: {', '.join(GRADERS)}")


def _grade(response: str, ground_truth: Any, grader: str, require_think: bool) -> float:
    """Score one response; exceptions propagate (the worker counts them as errors)."""
    truths = _truths(ground_truth)
    if not isinstance(response, str) or not truths:
        return 0.0
    if grader == "math_verify":
        return 1.0 if _math_verify_correct(response, truths) else 0.0
    return 1.0 if _deepscaler_correct(response, truths, require_think) else 0.0


def score_response(
    response: str, ground_truth: str | list[str], grader: str = "math_verify", *, require_think: bool = False
) -> float:
    """Score one response in this process: 1.0 if it matches any gold answer, else 0.0. Never raises on input.

    No time limit applies here: grade untrusted model output with :class:`GraderPool` / :func:`score_batch`.

    Args:
        response: the decoded model response (reasoning and answer).
        ground_truth: one gold answer or several (any of them counts).
        grader: "math_verify" or "deepscaler".
        require_think: deepscaler only: score 0 when the response has no ``</think>`` (the official rule).

    Raises:
        ValueError: unknown grader name (a programming error, not an input).
    """
    _check_grader(grader)
    try:
        return _grade(response, ground_truth, grader, require_think)
    except Exception:  # Model output can trip any parser error; a wrong answer scores 0.
        logger.debug("grading raised", exc_info=True)
        return 0.0


# ----------------------------------------------------------------------------------------------------------------------
# User reward functions

_FUNCTION_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def load_reward_function(path: str) -> Callable[..., Any]:
    """The callable named ``"package.module:function"`` (the current folder is importable too).

    Raises:
        ValueError: one line naming ``reward.function``: a malformed path, a module that does not import (its
            error), a missing attribute or an attribute that is not callable.
    """
    if not _FUNCTION_PATH.match(path):
        raise ValueError(f"reward.function={path!r}: expected 'package.module:function'")
    module_name, attr = path.split(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001  (any import-time error of user code)
        raise ValueError(
            f"reward.function={path!r}: module {module_name!r} does not import ({type(err).__name__}: {err}); is "
            "its folder the current one or on PYTHONPATH?"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward.function={path!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward.function={path!r}: {attr!r} is a {type(fn).__name__}, not a callable")
    return fn


def _call_reward(fn: Callable[..., Any], response: str, truth: Any, problem: str, fields: dict[str, Any]) -> float:
    value = fn(response, truth, problem=problem, **fields)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"the reward function returned a {type(value).__name__}, expected a float")
    return float(value)


# ----------------------------------------------------------------------------------------------------------------------
# Worker process


class _SoftTimeout(BaseException):
    """Raised by the worker's SIGALRM handler; a BaseException so that ``except Exception`` in parsers lets it pass."""


def _on_alarm(signum: int, frame: object) -> None:
    raise _SoftTimeout


def _ignore_job_signals() -> None:
    """Slurm signals every process of a job step; grading workers leave SIGUSR1 / SIGTERM / SIGINT to the trainer.

    (Ignored dispositions survive exec, so the worker is covered from its first instruction; the parent
    still stops a stuck worker with SIGKILL, and a worker exits on its own when its stdin closes.)
    """
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _worker_main() -> None:
    """Worker loop: one JSON request per stdin line, one JSON result per line on the original stdout."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints from libraries go to stderr, not into the protocol
    cfg = json.loads(os.environ["NEMO_DISCO_GRADER"])
    limit_mb = cfg["memory_limit_mb"]
    if limit_mb:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit_mb << 20, limit_mb << 20))
    logging.basicConfig(level=logging.ERROR)
    user = load_reward_function(cfg["function"]) if cfg.get("function") else None
    if user is None:
        # Imports and the parsers' first-call set-up are paid before "ready", not out of the first item's budget.
        _grade("so \\boxed{\\frac{1}{2}}", "0.5", cfg["grader"], False)
    signal.signal(signal.SIGALRM, _on_alarm)
    out.write('{"ready": true}\n')
    for line in sys.stdin:
        req = json.loads(line)
        result: dict[str, Any] = {"score": 0.0}
        try:
            signal.setitimer(signal.ITIMER_REAL, cfg["soft_timeout_s"])  # 0 = no soft limit
            try:
                if user is None:
                    result["score"] = _grade(req["response"], req["truth"], cfg["grader"], cfg["require_think"])
                else:
                    args = (req["response"], req["truth"], req.get("problem", ""), req.get("fields") or {})
                    result["score"] = _call_reward(user, *args)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _SoftTimeout:
            result["timeout"] = True
        except Exception as err:  # any grading failure is an error that scores 0, the worker carries on
            # Only the type: str() of a sympy object in the message can itself run for minutes.
            result["error"] = type(err).__name__
            if user is not None:  # user code: its traceback is what its author needs (logged once by the pool)
                import traceback

                result["traceback"] = traceback.format_exc(limit=-8)[-4000:]
        out.write(json.dumps(result) + "\n")


# ----------------------------------------------------------------------------------------------------------------------
# Parent side: the pool


class _Worker:
    """One grading subprocess and its read buffer."""

    def __init__(self, env: dict[str, str]) -> None:
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from nemo_disco.rewards import _worker_main; _worker_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
            preexec_fn=_ignore_job_signals,
        )
        assert self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buffer = b""
        self.ready = False
        self.started = time.monotonic()
        self.item: int | None = None
        self.deadline = 0.0

    def send(self, payload: bytes) -> bool:
        """Write one request; False if the worker is gone."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(payload)
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def read_lines(self) -> tuple[list[bytes], bool]:
        """Complete lines available now, and whether the worker closed its output (exited)."""
        eof = False
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                eof = True
                break
            self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return lines, eof

    def stderr_tail(self) -> str:
        self.stderr.seek(0)
        lines = self.stderr.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(no output)"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()  # type: ignore[union-attr]
            except OSError:
                pass
        self.stderr.close()


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        try:
            w.proc.stdin.close()  # type: ignore[union-attr]  (EOF: the worker loop ends)
        except OSError:
            pass
    deadline = time.monotonic() + 2.0
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        w.kill()
    workers.clear()


class GraderPool:
    r"""Persistent grading workers with a hard per-item timeout; reuse one across training steps.

    Starting a worker costs about 0.6 s (process start + ``import math_verify``); workers start in the
    background when the pool is created and are replaced when one is killed.

    Example:
        >>> with GraderPool("math_verify", timeout_s=5.0, workers=2) as pool:
        ...     scores, metrics = pool.score(["so \\boxed{2}"], ["2"])
    """

    def __init__(
        self,
        grader: str = "math_verify",
        timeout_s: float = 5.0,
        workers: int = 2,
        *,
        require_think: bool = False,
        kill_grace_s: float = 0.5,
        memory_limit_mb: int | None = 4096,
        startup_timeout_s: float = 120.0,
        soft_timeout: bool = True,
        function: str | None = None,
    ) -> None:
        """Start the workers.

        Args:
            grader: "math_verify" or "deepscaler" (unused with ``function``).
            timeout_s: time budget of one item; the worker stops itself at ``timeout_s``.
            workers: number of worker processes.
            require_think: deepscaler only: a response without ``</think>`` scores 0 (the official rule).
            kill_grace_s: the parent kills a worker whose item runs past ``timeout_s + kill_grace_s``.
            memory_limit_mb: address-space limit of each worker (None: unlimited).
            startup_timeout_s: a worker that is not ready after this long is a fatal error.
            soft_timeout: let the worker interrupt itself at ``timeout_s`` (SIGALRM). With False only the
                parent's kill at ``timeout_s + kill_grace_s`` limits an item (each costs a worker restart).
            function: ``reward.function`` ("package.module:function"): the workers call it instead of a grader.

        Raises:
            ValueError: unknown grader, non-positive sizes, or a ``function`` that does not load (one line).
        """
        _check_grader(grader)
        if function is not None:
            load_reward_function(function)  # fail here, in one line, not in every worker's start-up
        if timeout_s <= 0 or workers < 1 or kill_grace_s < 0:
            raise ValueError(
                f"GraderPool needs timeout_s > 0, workers >= 1, kill_grace_s >= 0 (got {timeout_s}, "
                f"{workers}, {kill_grace_s})"
            )
        self.grader, self.timeout_s, self.kill_grace_s = grader, float(timeout_s), float(kill_grace_s)
        self.startup_timeout_s = startup_timeout_s
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        env["NEMO_DISCO_GRADER"] = json.dumps(
            {
                "grader": grader,
                "soft_timeout_s": self.timeout_s if soft_timeout else 0.0,
                "require_think": require_think,
                "memory_limit_mb": memory_limit_mb,
                "function": function,
            }
        )
        if function is not None:  # the workers import it from the trainer's current folder too
            env["PYTHONPATH"] = os.pathsep.join((env["PYTHONPATH"], os.getcwd()))
        self.function = function
        self._error_logged = False
        self._env = env
        self._workers: list[_Worker] = [_Worker(env) for _ in range(workers)]
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        self.restarts = 0

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (they change when a stuck worker is replaced)."""
        return [w.proc.pid for w in self._workers]

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self._env)
        self._workers[self._workers.index(worker)] = fresh
        self.restarts += 1
        return fresh

    def _lost(self, worker: _Worker, item: int, pending: deque, retried: set[int], scores: list[float]) -> int:
        """``worker`` died holding ``item``: replace it and queue the item again once; returns the errors to count."""
        code = worker.proc.poll()
        worker.item = None
        self._replace(worker)
        if item in retried:
            scores[item] = 0.0
            logger.warning(
                "grader worker died (exit %s) on item %d a second time: scored 0 (reward/errors)", code, item
            )
            return 1
        retried.add(item)
        pending.appendleft(item)
        logger.warning("grader worker died (exit %s) while grading item %d: graded again on a fresh worker", code, item)
        return 0

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str | list[str]],
        problems: Sequence[str] | None = None,
        fields: Sequence[dict[str, Any]] | None = None,
    ) -> tuple[list[float], dict[str, float]]:
        """Grade ``responses[i]`` against ``ground_truths[i]``; order is preserved.

        ``problems`` and ``fields`` (the question text and the row's other columns of each item) reach a
        ``reward.function``; the math graders ignore them.

        Returns:
            scores (1.0 / 0.0 each) and metrics ``reward/timeouts``, ``reward/errors``, ``reward/restarts``.

        Raises:
            ValueError: the two sequences differ in length.
            RuntimeError: the pool is closed or a worker cannot start (its last stderr line is quoted).
        """
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        if not self._finalizer.alive:
            raise RuntimeError("GraderPool is closed")
        n = len(responses)
        scores = [0.0] * n
        timeouts = errors = 0
        restarts_before = self.restarts
        pending = deque(range(n))
        retried: set[int] = set()
        done = 0
        sel = selectors.DefaultSelector()
        try:
            while done < n:
                now = time.monotonic()
                for w in self._workers:
                    if w.ready and w.item is None and pending:
                        i = pending.popleft()
                        request: dict[str, Any] = {"response": responses[i], "truth": ground_truths[i]}
                        if self.function is not None:
                            request["problem"] = problems[i] if problems is not None else ""
                            request["fields"] = fields[i] if fields is not None else {}
                        payload = json.dumps(request) + "\n"
                        w.item, w.deadline = i, time.monotonic() + self.timeout_s + self.kill_grace_s
                        if not w.send(payload.encode()):  # the worker is gone
                            errors += self._lost(w, i, pending, retried, scores)
                            done += i not in pending
                    elif not w.ready and now - w.started > self.startup_timeout_s:
                        raise RuntimeError(
                            f"grader worker not ready after {self.startup_timeout_s:.0f} s: {w.stderr_tail()}"
                        )
                if done == n:
                    break
                busy = [w.deadline for w in self._workers if w.item is not None]
                wait = max(0.0, min(busy) - time.monotonic()) if busy else 1.0
                for w in self._workers:
                    sel.register(w.fd, selectors.EVENT_READ, w)
                events = sel.select(timeout=wait)
                for key in list(sel.get_map().values()):
                    sel.unregister(key.fileobj)
                for key, _ in events:
                    w = key.data
                    lines, eof = w.read_lines()
                    for line in lines:
                        msg = json.loads(line)
                        if msg.get("ready"):
                            w.ready = True
                            continue
                        i, w.item = w.item, None
                        if i is None:
                            continue
                        scores[i] = float(msg["score"])
                        timeouts += bool(msg.get("timeout"))
                        errors += "error" in msg
                        if "traceback" in msg and not self._error_logged:
                            self._error_logged = True
                            logger.warning(
                                "reward.function %s raised on an item (scored 0, counted in reward/errors; logged "
                                "once):\n%s",
                                self.function,
                                msg["traceback"],
                            )
                        done += 1
                    if eof:
                        if not w.ready:
                            code = w.proc.wait()
                            raise RuntimeError(f"grader worker exited during start-up (code {code}): {w.stderr_tail()}")
                        if w.item is not None:  # died mid-item (killed, out of memory, a crash in C code)
                            i = w.item
                            errors += self._lost(w, i, pending, retried, scores)
                            done += i not in pending
                        else:
                            self._replace(w)
                now = time.monotonic()
                for w in list(self._workers):
                    if w.item is not None and now >= w.deadline:
                        timeouts += 1
                        done += 1
                        self._replace(w)
        finally:
            sel.close()
            # Interrupted (e.g. KeyboardInterrupt): a busy worker's late answer must not be read as the next
            # call's result, so busy workers are replaced.
            for w in list(self._workers):
                if w.item is not None:
                    self._replace(w)
        return scores, {
            "reward/timeouts": float(timeouts),
            "reward/errors": float(errors),
            "reward/restarts": float(self.restarts - restarts_before),
        }


def score_batch(
    responses: Sequence[str],
    ground_truths: Sequence[str | list[str]],
    *,
    grader: str = "math_verify",
    timeout_s: float = 5.0,
    workers: int = 2,
    require_think: bool = False,
) -> tuple[list[float], dict[str, float]]:
    """Grade a batch in a temporary :class:`GraderPool` (hard per-item timeout); order is preserved.

    Returns:
        scores and metrics (``reward/timeouts``, ``reward/errors``, ``reward/restarts``).
    """
    with GraderPool(grader, timeout_s=timeout_s, workers=workers, require_think=require_think) as pool:
        return pool.score(responses, ground_truths)
