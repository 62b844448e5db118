"""The rollout batch that flows from the generator to the policy and the losses.

Layout (verl-style): prompts LEFT-padded to P tokens, responses RIGHT-padded to R tokens, the model
input is ``cat(prompt_ids, response_ids)``; every per-token tensor the losses see is ``[N, R]``,
aligned with ``response_ids`` (``logprobs[i, t] = log pi(response_ids[i, t] | prompt_i, response_i[:t])``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

import torch


@dataclass(frozen=True)
class RolloutBatch:
    """N rollouts (prompt + response) and what the trainer attaches to them.

    Attributes:
        prompt_ids: [N, P] int64, left-padded with ``pad_id``.
        prompt_mask: [N, P] bool, True on real prompt tokens.
        response_ids: [N, R] int64, right-padded with ``pad_id``.
        response_mask: [N, R] bool, True on generated tokens (EOS included).
        group_ids: [N] int64 question ids (rollouts of one prompt share an id).
        rewards: [N] float.
        gen_logprobs: [N, R] float, the generator's per-token sampling log-probs (0 on padding).
        old_logprobs: [N, R] float, pi_old's log-probs from the training policy (filled by the trainer).
        ref_logprobs: [N, R] float or None, reference-policy log-probs (GRPO's KL regulariser).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    group_ids: torch.Tensor
    rewards: torch.Tensor
    gen_logprobs: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def input_ids(self) -> torch.Tensor:
        """[N, P + R] model input."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """[N, P + R] bool, True on real tokens."""
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def position_ids(self) -> torch.Tensor:
        """[N, P + R] positions counted from each sequence's first real token."""
        return (self.attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)

    @property
    def num_tokens(self) -> int:
        """Real tokens (prompt + response) in the batch."""
        return int(self.attention_mask.sum())

    def select(self, index: torch.Tensor | Sequence[int] | slice) -> RolloutBatch:
        """Rows ``index`` of every tensor (a view for slices)."""
        if not isinstance(index, slice):
            index = torch.as_tensor(index, dtype=torch.long)
        return replace(self, **{f.name: _take(getattr(self, f.name), index) for f in fields(self)})

    def with_(self, **changes: torch.Tensor | None) -> RolloutBatch:
        """A copy with some fields replaced."""
        return replace(self, **changes)


def question_runs(group_ids: torch.Tensor) -> list[tuple[int, int]]:
    """``(begin, end)`` of each run of equal consecutive ids (a question's adjacent rollouts), in order."""
    n = int(group_ids.numel())
    if n == 0:
        return []
    starts = [0] + (torch.nonzero(group_ids[1:] != group_ids[:-1]).squeeze(1) + 1).tolist()
    return list(zip(starts, starts[1:] + [n], strict=True))


def whole_questions(group_ids: torch.Tensor, parts: Sequence[torch.Tensor]) -> bool:
    """Whether every id of ``group_ids`` [N] has all its rows in one of ``parts`` (row indices)."""
    inv = torch.unique(group_ids, return_inverse=True)[1]  # [N] dense question index
    total = torch.bincount(inv)  # [Q] rollouts of each question
    for rows in parts:
        present, count = torch.unique(inv[rows], return_counts=True)
        if bool((total[present] != count).any()):
            return False
    return True


def pack_questions(group_ids: torch.Tensor, fits: Callable[[int, int], bool]) -> list[torch.Tensor]:
    """Consecutive micro-batches that keep each question's rollouts together wherever they fit, greedily.

    Args:
        group_ids: [N] question ids; a question's rollouts are a run of equal ids (:func:`question_runs`).
        fits: ``fits(start, stop)``: whether rows ``start:stop`` fit one micro-batch's budget. A question that
            does not fit alone is split row by row (every micro-batch has at least one row).

    Returns:
        Row indices of each micro-batch, in order, covering every row once.
    """
    out: list[torch.Tensor] = []
    start = 0
    for begin, end in question_runs(group_ids):
        if fits(start, end):
            continue  # the question joins the current micro-batch
        if begin > start:
            out.append(torch.arange(start, begin))
            start = begin
        if fits(start, end):
            continue
        while True:  # too large alone: row by row; its last rows stay open for the next question
            stop = start + 1
            while stop < end and fits(start, stop + 1):
                stop += 1
            if stop == end:
                break
            out.append(torch.arange(start, stop))
            start = stop
    if start < len(group_ids):
        out.append(torch.arange(start, len(group_ids)))
    return out


#: How a policy lays out a micro-batch, which decides what its rows cost against ``policy.microbatch_tokens``.
MicrobatchLayout = Literal["batch_width", "trimmed", "packed"]


def split_microbatches(batch: RolloutBatch, max_tokens: int, layout: MicrobatchLayout) -> list[torch.Tensor]:
    """Row indices of consecutive micro-batches whose model input fits ``max_tokens`` tokens (at least one row each).

    What a group of rows costs depends on how the policy lays it out:
      - ``batch_width``: every row at the batch's padded width P + R (the transformers policy runs the rows as
        they are);
      - ``trimmed``: rows x (longest prompt + longest response) of the group (the Megatron policy's padded layout);
      - ``packed``: the sum of the rows' real lengths (the Megatron policy's packed THD layout).
    A question's rollouts (a run of equal ``group_ids``) stay in one micro-batch wherever they fit the budget
    together, so that a loss coupling only the rollouts of a question is exact in one pass
    (:mod:`nemo_disco.update`); a question that does not fit alone is split row by row (:func:`pack_questions`).
    """
    if layout == "batch_width":
        width = max(batch.prompt_ids.shape[1] + batch.response_ids.shape[1], 1)
        rows = max(1, max_tokens // width)
        return pack_questions(batch.group_ids, lambda start, stop: stop - start <= rows)
    if layout not in ("trimmed", "packed"):
        raise ValueError(f"micro-batch layout {layout!r} is not one of {MicrobatchLayout.__args__}")
    p_len, r_len = batch.prompt_mask.sum(1), batch.response_mask.sum(1)  # [N] each

    def fits(start: int, stop: int) -> bool:
        if layout == "packed":
            return int((p_len[start:stop] + r_len[start:stop]).sum()) <= max_tokens
        return (stop - start) * (int(p_len[start:stop].max()) + int(r_len[start:stop].max())) <= max_tokens

    return pack_questions(batch.group_ids, fits)


def _widths(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The padded widths (P, R) of a batch: its longest prompt, its longest response (at least 1)."""
    return max((len(p) for p in prompts), default=0), max(1, max((len(r) for r in responses), default=1))


def _take(t: torch.Tensor | None, index: torch.Tensor | slice) -> torch.Tensor | None:
    return None if t is None else t[index]


def collate(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    gen_logprobs: Sequence[Sequence[float]],
    group_ids: Sequence[int],
    rewards: Sequence[float],
    pad_id: int,
    widths: tuple[int, int] | None = None,
) -> RolloutBatch:
    """Pad token lists into a :class:`RolloutBatch` (prompts left, responses right).

    A response may be empty (the generator stopped at once); its mask row is all False. ``widths``: the padded
    widths (P, R) of a larger batch these rows belong to (None: the longest prompt and response here).
    """
    n = len(prompts)
    if not (len(responses) == len(gen_logprobs) == len(group_ids) == len(rewards) == n):
        raise ValueError("collate: prompts, responses, gen_logprobs, group_ids and rewards differ in length")
    if widths is None:
        widths = _widths(prompts, responses)
    p_len, r_len = widths
    prompt_ids = torch.full((n, p_len), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, p_len), dtype=torch.bool)
    response_ids = torch.full((n, r_len), pad_id, dtype=torch.long)
    response_mask = torch.zeros((n, r_len), dtype=torch.bool)
    lp = torch.zeros((n, r_len), dtype=torch.float32)
    for i, (p, r, g) in enumerate(zip(prompts, responses, gen_logprobs, strict=True)):
        if len(g) != len(r):
            raise ValueError(f"collate: rollout {i} has {len(r)} tokens but {len(g)} log-probs")
        if p:
            prompt_ids[i, p_len - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            prompt_mask[i, p_len - len(p) :] = True
        if r:
            response_ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
            response_mask[i, : len(r)] = True
            lp[i, : len(r)] = torch.as_tensor(g, dtype=torch.float32)
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        group_ids=torch.as_tensor(list(group_ids), dtype=torch.long),
        rewards=torch.as_tensor(list(rewards), dtype=torch.float32),
        gen_logprobs=lp,
    )


@dataclass
class QuestionRollouts:
    """One question's graded rollouts, as the rollout side hands them to the trainer (G rollouts).

    Attributes:
        question: the problem's index among the run's training problems.
        prompt: its prompt token ids.
        responses: [G] each rollout's generated token ids (the stop token included when it was sampled).
        logprobs: [G] the generator's sampling log-prob of each generated token (as long as its response).
        finish: [G] "stop" or "length".
        rewards: [G] each rollout's reward (after overlong shaping).
    """

    question: int
    prompt: list[int]
    responses: list[list[int]]
    logprobs: list[list[float]]
    finish: list[str]
    rewards: list[float]

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable (a checkpoint keeps the rollouts made ahead)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuestionRollouts:
        """The inverse of :meth:`to_dict`."""
        return cls(**d)


def collate_questions(
    records: Sequence[QuestionRollouts], pad_id: int, rows: torch.Tensor | Sequence[int] | None = None
) -> RolloutBatch:
    """A step's rollouts as one batch, question by question.

    The rollouts of a question are adjacent rows; those of the ``k``-th question have group id ``k``.

    Args:
        records: the step's questions.
        pad_id: the padding token.
        rows: only these rows (a data-parallel rank's), padded to the whole batch's widths: equal to
            ``collate_questions(records, pad_id).select(rows)`` without padding the other rows' tokens.
    """
    prompts, responses, lps, gids, rewards = _flatten(records)
    if rows is None:
        return collate(prompts, responses, lps, gids, rewards, pad_id=pad_id)
    widths = _widths(prompts, responses)
    take = [int(i) for i in rows]
    return collate(
        [prompts[i] for i in take],
        [responses[i] for i in take],
        [lps[i] for i in take],
        [gids[i] for i in take],
        [rewards[i] for i in take],
        pad_id=pad_id,
        widths=widths,
    )


def _flatten(records: Sequence[QuestionRollouts]) -> tuple[list, list, list, list[int], list[float]]:
    """Prompts, responses, generator log-probs, group ids and rewards of every rollout, question by question."""
    prompts, responses, lps, gids, rewards = [], [], [], [], []
    for k, rec in enumerate(records):
        for resp, lp, r in zip(rec.responses, rec.logprobs, rec.rewards, strict=True):
            prompts.append(rec.prompt)
            responses.append(resp)
            lps.append(lp)
            gids.append(k)
            rewards.append(r)
    return prompts, responses, lps, gids, rewards


@dataclass(frozen=True)
class StepRows:
    """What the whole-batch objective and a step's metrics read of every rollout: no token ids.

    Every rank holds these for the whole step (the mini-batch objective couples its rows across ranks); its own
    rows' tokens are in a :class:`RolloutBatch` (:func:`collate_questions` with ``rows``). The fields are those
    of :class:`RolloutBatch` of the same names, at the whole batch's response width R.

    Attributes:
        response_mask: [N, R] bool.
        group_ids: [N] int64.
        rewards: [N] float.
        gen_logprobs: [N, R] float32.
    """

    response_mask: torch.Tensor
    group_ids: torch.Tensor
    rewards: torch.Tensor
    gen_logprobs: torch.Tensor

    def __len__(self) -> int:
        return int(self.response_mask.shape[0])

    def select(self, index: torch.Tensor | Sequence[int] | slice) -> StepRows:
        """Rows ``index`` of every tensor (a view for slices)."""
        if not isinstance(index, slice):
            index = torch.as_tensor(index, dtype=torch.long)
        return replace(self, **{f.name: getattr(self, f.name)[index] for f in fields(self)})


def step_rows(records: Sequence[QuestionRollouts]) -> StepRows:
    """Every rollout's :class:`StepRows`, as :func:`collate_questions` lays them out (the same rows and width)."""
    _, responses, lps, gids, rewards = _flatten(records)
    n, r_len = len(responses), max(1, max((len(r) for r in responses), default=1))
    mask = torch.zeros((n, r_len), dtype=torch.bool)
    lp = torch.zeros((n, r_len), dtype=torch.float32)
    for i, (r, g) in enumerate(zip(responses, lps, strict=True)):
        if len(g) != len(r):
            raise ValueError(f"collate: rollout {i} has {len(r)} tokens but {len(g)} log-probs")
        if r:
            mask[i, : len(r)] = True
            lp[i, : len(r)] = torch.as_tensor(g, dtype=torch.float32)
    return StepRows(
        response_mask=mask,
        group_ids=torch.as_tensor(gids, dtype=torch.long),
        rewards=torch.as_tensor(rewards, dtype=torch.float32),
        gen_logprobs=lp,
    )
