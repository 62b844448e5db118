"""The rollout batch: typed records and their collation; the micro-batcher (what rows cost under each layout)."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import torch

from nemo_disco.batch import (
    QuestionRollouts,
    RolloutBatch,
    StepRows,
    collate,
    collate_questions,
    split_microbatches,
    step_rows,
)


def _batch(group_ids: list[int] | None = None):
    # prompts (left-padded to P = 3) and responses (right-padded to R = 3); row 2 has an empty response.
    # Real lengths (prompt, response): (2, 3), (1, 1), (3, 0).
    return collate([[11, 12], [13], [14, 15, 16]], [[21, 22, 23], [24], []], [[0.0] * 3, [0.0], []],
                   group_ids or [0, 1, 2], [1.0] * 3, pad_id=0)  # fmt: skip


def _split(batch, max_tokens: int, layout: str) -> list[list[int]]:
    return [rows.tolist() for rows in split_microbatches(batch, max_tokens, layout)]


def test_trimmed_layout_costs_rows_times_the_longest_prompt_and_response():
    # Rows 0+1 cost 2 x (2 + 3) = 10 tokens; adding row 2 costs 3 x (3 + 3) = 18 > 12.
    assert _split(_batch(), 12, "trimmed") == [[0, 1], [2]]
    assert _split(_batch(), 18, "trimmed") == [[0, 1, 2]]


def test_packed_layout_costs_the_real_tokens():
    # Real tokens 5 + 2 = 7 <= 8; + 3 = 10 > 8.
    assert _split(_batch(), 8, "packed") == [[0, 1], [2]]
    assert _split(_batch(), 10, "packed") == [[0, 1, 2]]


def test_batch_width_layout_costs_every_row_at_the_padded_width():
    # Every row costs P + R = 6 tokens whatever its real length: 12 tokens hold two rows, 17 still two.
    assert _split(_batch(), 12, "batch_width") == [[0, 1], [2]]
    assert _split(_batch(), 17, "batch_width") == [[0, 1], [2]]
    assert _split(_batch(), 18, "batch_width") == [[0, 1, 2]]


@pytest.mark.parametrize("layout", ["batch_width", "trimmed", "packed"])
def test_a_budget_below_one_row_still_gives_one_row_per_microbatch(layout):
    assert _split(_batch(), 1, layout) == [[0], [1], [2]]


@pytest.mark.parametrize("layout", ["batch_width", "trimmed", "packed"])
def test_a_question_stays_in_one_microbatch_where_it_fits(layout):
    # Rows 1 and 2 are one question: with room for two rows they move together rather than row 1 joining row 0.
    # (trimmed: rows 1+2 cost 2 x (3 + 1) = 8; packed: 2 + 3 = 5; batch_width: 2 x 6 = 12.)
    budget = {"batch_width": 12, "trimmed": 10, "packed": 7}[layout]
    assert _split(_batch([0, 1, 1]), budget, layout) == [[0], [1, 2]]


def test_batch_width_never_exceeds_budget_over_width_rows():
    # The transformers policy's rule: max(1, budget // width) rows per micro-batch, questions kept together.
    gen = torch.Generator().manual_seed(0)
    n = 11
    batch = collate([[1] * 2] * n, [[2] * 3] * n, [[0.0] * 3] * n, [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4], [1.0] * n,
                    pad_id=0)  # fmt: skip
    for budget in torch.randint(1, 60, (20,), generator=gen).tolist():
        rows = max(1, budget // 5)
        for part in split_microbatches(batch, budget, "batch_width"):
            assert 1 <= len(part) <= rows


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="'thd' is not one of"):
        split_microbatches(_batch(), 8, "thd")


def _records() -> list[QuestionRollouts]:
    return [
        QuestionRollouts(7, [5, 6], [[1, 2, 3], []], [[-0.1, -0.2, -0.3], []], ["stop", "stop"], [1.0, 0.0]),
        QuestionRollouts(2, [4], [[8], [9, 9]], [[-0.5], [-0.6, -0.7]], ["length", "stop"], [0.0, 0.5]),
    ]


def test_collate_questions_keeps_a_questions_rollouts_adjacent_and_numbers_groups_by_position():
    batch = collate_questions(_records(), pad_id=0)
    assert batch.group_ids.tolist() == [0, 0, 1, 1]  # the k-th question's rows, not its problem index
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0, 0.5]
    # Prompts left-padded to 2 tokens, responses right-padded to 3.
    assert batch.prompt_ids.tolist() == [[5, 6], [5, 6], [0, 4], [0, 4]]
    assert batch.response_ids.tolist() == [[1, 2, 3], [0, 0, 0], [8, 0, 0], [9, 9, 0]]
    assert batch.response_mask.sum(1).tolist() == [3, 0, 1, 2]
    assert torch.allclose(batch.gen_logprobs[3], torch.tensor([-0.6, -0.7, 0.0]))


@pytest.mark.parametrize("rows", [[2, 3], [1, 2], [0], [3, 0]])
def test_a_ranks_rows_collate_alone_as_the_whole_batch_would_lay_them_out(rows):
    # A data-parallel rank pads only its own rows, to the whole batch's widths (P 2, R 3: rows 2 and 3 alone have
    # prompts of 1 token and responses of at most 2): tensor for tensor the rows of the whole batch.
    whole = collate_questions(_records(), pad_id=0)
    mine = collate_questions(_records(), pad_id=0, rows=rows)
    for f in fields(RolloutBatch):
        a, b = getattr(mine, f.name), getattr(whole.select(rows), f.name)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), f.name


def test_step_rows_are_the_whole_batchs_rows_without_their_tokens():
    whole, rows = collate_questions(_records(), pad_id=0), step_rows(_records())
    assert len(rows) == len(whole) == 4
    for f in fields(StepRows):
        a, b = getattr(rows, f.name), getattr(whole, f.name)
        assert a.dtype == b.dtype and torch.equal(a, b), f.name
        assert torch.equal(getattr(rows.select(slice(1, 3)), f.name), b[1:3])
    with pytest.raises(ValueError, match="rollout 0 has 3 tokens but 2 log-probs"):
        step_rows([QuestionRollouts(0, [5], [[1, 2, 3]], [[-0.1, -0.2]], ["stop"], [1.0])])


def test_records_survive_the_checkpoints_json():
    records = _records()
    assert [QuestionRollouts.from_dict(json.loads(json.dumps(r.to_dict()))) for r in records] == records
