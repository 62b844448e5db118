"""The ``deepscaler`` grader: Hendrycks-MATH normalisation, then DeepScaleR's element-wise and symbolic match."""

from __future__ import annotations

import re
from typing import Any

from nemo_disco.rewards.answers import after_think, gold_latex, last_boxed
from nemo_disco.rewards.registry import Grader, GraderParams, register_grader

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


def deepscaler_correct(response: str, truths: list[str], require_think: bool) -> bool:
    """Whether the last boxed answer (after the last ``</think>``) matches any gold answer under DeepScaleR's rules."""
    after = after_think(response)
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


class DeepScaleRParams(GraderParams):
    """The ``deepscaler`` grader's own keys of the ``reward`` section."""

    # The official grader's format rule: a response without </think> scores 0; false grades the whole response then.
    require_think: bool = False


def grade_deepscaler(response: str, ground_truth: list[str], require_think: bool = False) -> float:
    """1.0 if the last boxed answer matches any gold answer under DeepScaleR's rules, else 0.0."""
    return 1.0 if deepscaler_correct(response, ground_truth, require_think) else 0.0


register_grader(
    Grader(
        "deepscaler",
        grade_deepscaler,
        DeepScaleRParams,
        "the DeepScaleR grader the DisCO authors trained with: last \\boxed{}, Hendrycks-MATH rules, sympy",
    )
)
