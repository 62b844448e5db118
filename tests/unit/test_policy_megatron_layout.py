"""How the Megatron policy lays out a micro-batch for the model (padded and packed THD).

The packed layout only runs on GPU with Transformer Engine; its index arithmetic is checked here on CPU.
"""

from __future__ import annotations

import pytest
import torch

from nemo_disco.batch import collate
from nemo_disco.policy.megatron_layout import prepare_microbatch


def _batch():
    # prompts (left-padded to 3) and responses (right-padded to 3); row 2 has an empty response.
    return collate([[11, 12], [13], [14, 15, 16]], [[21, 22, 23], [24], []], [[0.0] * 3, [0.0], []], [0, 1, 2],
                   [1.0] * 3, pad_id=0)  # fmt: skip


@pytest.mark.parametrize("packed", [False, True])
def test_targets_at_the_response_index_are_the_response_tokens(packed):
    batch = _batch()
    mb = prepare_microbatch(batch, torch.arange(3), packed=packed, device=torch.device("cpu"))
    picked = mb.targets.reshape(-1)[mb.response_index]  # [n, r]: the token each predicting position must score
    assert picked[mb.response_mask].tolist() == [21, 22, 23, 24]
    assert mb.response_mask.tolist() == [[True, True, True], [True, False, False], [False, False, False]]


def test_padded_layout_starts_every_sequence_at_position_zero():
    mb = prepare_microbatch(_batch(), torch.arange(3), packed=False, device=torch.device("cpu"))
    # lengths 5, 2, 3 -> width 5; real tokens first, pad id 0 after them.
    assert mb.input_ids.tolist() == [[11, 12, 21, 22, 23], [13, 24, 0, 0, 0], [14, 15, 16, 0, 0]]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4]
    # Row 1 (length 2): query 1 sees keys 0 and 1; keys 2.. are padding; masked = True.
    assert mb.attention_mask[1, 0, 1].tolist() == [False, False, True, True, True]
    # Row 0's first response token (21) is predicted at position 1 = prompt length 2 - 1.
    assert mb.response_index[0].tolist() == [1, 2, 3]


def test_packed_layout_concatenates_real_tokens():
    mb = prepare_microbatch(_batch(), torch.arange(3), packed=True, device=torch.device("cpu"))
    assert mb.input_ids.tolist() == [[11, 12, 21, 22, 23, 13, 24, 14, 15, 16]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2]]
    assert mb.packed.cu_seqlens_q.tolist() == [0, 5, 7, 10] and mb.packed.max_seqlen_q == 5
    assert mb.attention_mask is None
    assert mb.response_index[1, 0].item() == 5  # row 1 starts at 5; its prompt (1 token) predicts 24 there


def test_empty_prompt_is_refused():
    batch = collate([[], [5]], [[6], [7]], [[0.0], [0.0]], [0, 1], [1.0, 1.0], pad_id=0)
    with pytest.raises(ValueError, match="rollout 0 has an empty prompt"):
        prepare_microbatch(batch, torch.arange(2), packed=False, device=torch.device("cpu"))
