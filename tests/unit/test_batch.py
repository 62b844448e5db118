"""Typed rollout records and their collation into the padded batch."""

from __future__ import annotations

import json

import torch

from nemo_disco.batch import QuestionRollouts, collate_questions


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


def test_records_survive_the_checkpoints_json():
    records = _records()
    assert [QuestionRollouts.from_dict(json.loads(json.dumps(r.to_dict()))) for r in records] == records
