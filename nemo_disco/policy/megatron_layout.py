"""How the Megatron policy lays out a micro-batch for the model: padded with an explicit mask, or packed (THD).

Every sequence is laid out from position 0 (prompt then response, padding after it), as the generator sees it,
so positions and RoPE angles match Hugging Face's forward exactly. Which rows form a micro-batch is
:func:`nemo_disco.batch.split_microbatches`'s choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nemo_disco.batch import RolloutBatch


@dataclass
class MicroBatch:
    """One micro-batch laid out for the model; every sequence starts at position 0."""

    rows: torch.Tensor  # [n] indices into the batch
    input_ids: torch.Tensor  # [n, S] (padded) or [1, T] (packed)
    position_ids: torch.Tensor  # same shape
    attention_mask: torch.Tensor | None  # [n, 1, S, S] bool, True = masked (padded layout only)
    packed: Any  # PackedSeqParams or None
    targets: torch.Tensor  # like input_ids: the next token at every position
    response_index: torch.Tensor  # [n, r] flat token index of the logits predicting response token t
    response_mask: torch.Tensor  # [n, r] bool
    token_mask: torch.Tensor  # like input_ids, on the CPU: True on real tokens (False on padding)
    #: A copy run only to keep an expert-parallel group's forward passes in step (output discarded).
    filler: bool = False


def _row_lengths(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    return batch.prompt_mask.sum(1), batch.response_mask.sum(1)


def prepare_microbatch(
    batch: RolloutBatch, rows: torch.Tensor, packed: bool, device: torch.device, seq_multiple: int = 1
) -> MicroBatch:
    """One micro-batch laid out for the model.

    ``seq_multiple``: the sequence length (packed: the total length) is padded to a multiple of it (sequence
    parallelism splits the sequence over the TP ranks). Padding follows every real token of a row (packed: it
    extends the last sequence), where causal attention keeps it away from the real tokens.
    """
    sub = batch.select(rows)
    n, width = sub.prompt_ids.shape
    p_len, r_len = _row_lengths(sub)
    if bool((p_len == 0).any()):
        bad = int(rows[int(torch.nonzero(p_len == 0)[0])])
        raise ValueError(f"rollout {bad} has an empty prompt: its first response token has no context")
    lens = p_len + r_len  # [n]
    r_eff = max(1, int(r_len.max()))
    ids = sub.input_ids  # [n, P + R]; the real tokens of row i are contiguous from column P - p_len[i]
    t = torch.arange(r_eff)
    response_mask = t.unsqueeze(0) < r_len.unsqueeze(1)  # [n, r]
    # Logits at position p_len - 1 + t predict response token t.
    pred = torch.where(response_mask, (p_len - 1).unsqueeze(1) + t, torch.zeros_like(t))  # [n, r]
    if packed:
        from megatron.core.packed_seq_params import PackedSeqParams

        tokens = [ids[i, width - int(p_len[i]) : width + int(r_len[i])] for i in range(n)]
        extra = -int(lens.sum()) % seq_multiple
        flat = torch.cat([*tokens, ids.new_zeros(extra)]).unsqueeze(0)  # [1, T]
        real = torch.arange(flat.shape[1]).unsqueeze(0) < int(lens.sum())  # [1, T]
        cu = torch.zeros(n + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        cu[-1] += extra
        positions = torch.cat([torch.arange(int(x)) for x in lens[:-1]] + [torch.arange(int(lens[-1]) + extra)])
        positions = positions.unsqueeze(0)  # [1, T]
        targets = torch.cat([flat[:, 1:], flat.new_zeros(1, 1)], dim=1)  # crosses sequence ends only where unused
        longest = max(int(lens.max()), int(lens[-1]) + extra)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu.to(device),
            cu_seqlens_kv=cu.to(device),
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
        index = cu[:-1].long().unsqueeze(1) + pred  # [n, r]
        return MicroBatch(
            rows=rows,
            input_ids=flat.to(device),
            position_ids=positions.to(device),
            attention_mask=None,
            packed=params,
            targets=targets.to(device),
            response_index=index.to(device),
            response_mask=response_mask.to(device),
            token_mask=real,
        )
    seq = -(-int(lens.max()) // seq_multiple) * seq_multiple
    pos = torch.arange(seq)
    gather = ((width - p_len).unsqueeze(1) + pos).clamp(max=ids.shape[1] - 1)  # [n, S]
    valid = pos.unsqueeze(0) < lens.unsqueeze(1)  # [n, S]
    tokens = torch.where(valid, ids.gather(1, gather), torch.zeros_like(gather))
    targets = torch.cat([tokens[:, 1:], tokens.new_zeros(n, 1)], dim=1)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)  # [S, S] True above the diagonal
    mask = (causal.unsqueeze(0) | ~valid.unsqueeze(1)).unsqueeze(1)  # [n, 1, S, S]: future or padding keys
    index = torch.arange(n).unsqueeze(1) * seq + pred  # [n, r]
    return MicroBatch(
        rows=rows,
        input_ids=tokens.to(device),
        position_ids=pos.expand(n, seq).contiguous().to(device),
        attention_mask=mask.to(device),
        packed=None,
        targets=targets.to(device),
        response_index=index.to(device),
        response_mask=response_mask.to(device),
        token_mask=valid,
    )
