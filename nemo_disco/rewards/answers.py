r"""Answer extraction shared by the graders: the text after ``</think>``, the last ``\boxed{...}``, gold LaTeX."""

from __future__ import annotations

import re
from typing import Any

THINK_END = "</think>"


def gold_answers(ground_truth: Any) -> list[str]:
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


def after_think(response: str) -> str | None:
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
