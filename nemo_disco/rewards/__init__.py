r"""Math grading of model responses: registered graders, a worker-process pool with a hard per-item timeout.

Graders declare themselves once, beside their code (:func:`~nemo_disco.rewards.registry.register_grader`: a name,
``fn(response, ground_truth, **params) -> float``, a parameter model, a line of description); :data:`GRADERS` holds
them by name and :func:`get_grader` finds one. The run config's ``reward.grader`` names one, and the ``reward``
section's other keys are its parameters (checked by its model in :mod:`nemo_disco.parts`). The built-in two, both
returning 1.0 (correct) or 0.0:

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
  Its parameter ``require_think`` (``reward.require_think``): false (the default) grades the whole response when it
  has no ``</think>``; the official grader scores such a response 0 (a "format error"), which true reproduces.

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
An exception, a value that is not a number and NaN or an infinity score 0 and count in ``reward/errors``; the first
one a pool sees is logged with its traceback, the first timeout in a line; ``GraderPool.first_error`` describes the
last call's first failure in one line (the trainer's stop at ``reward.max_error_share`` quotes it).
:func:`load_reward_function` resolves the path in the trainer at start-up (one-line error), the workers again
(the current folder is on their path too). The function runs model output through whatever it does: a code
reward must execute it in a sandbox of its own (docs/rewards.md).
"""

from nemo_disco.rewards.answers import THINK_END, gold_latex, last_boxed
from nemo_disco.rewards.deepscaler import hendrycks_normalize
from nemo_disco.rewards.mathverify import parsed_gold
from nemo_disco.rewards.pool import GraderPool, score_batch
from nemo_disco.rewards.registry import GRADERS, Grader, GraderParams, get_grader, register_grader
from nemo_disco.rewards.scoring import load_reward_function, score_response

__all__ = [
    "GRADERS",
    "THINK_END",
    "Grader",
    "GraderParams",
    "GraderPool",
    "get_grader",
    "gold_latex",
    "hendrycks_normalize",
    "last_boxed",
    "load_reward_function",
    "parsed_gold",
    "register_grader",
    "score_batch",
    "score_response",
]
