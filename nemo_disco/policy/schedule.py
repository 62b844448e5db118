"""Learning-rate schedule shared by the policies.

Unlike the authors' code (a constant schedule with warm-up 0 whose first step has lr factor 0, so the
four updates of the first training step do nothing), update 0 always has a non-zero learning rate.
"""

from __future__ import annotations

import math

from nemo_disco.config import PolicyConfig


def lr_at(update: int, policy: PolicyConfig, total_updates: int) -> float:
    """Learning rate of optimizer update ``update`` (0-based).

    Linear warm-up over ``warmup_updates`` reaching ``lr`` at update ``warmup_updates - 1``
    (update 0 gets ``lr / warmup_updates``), then constant or cosine decay to ``min_lr_ratio * lr``
    at ``total_updates``.
    """
    if update < policy.warmup_updates:
        return policy.lr * (update + 1) / policy.warmup_updates
    if policy.lr_schedule == "constant":
        return policy.lr
    span = max(total_updates - policy.warmup_updates, 1)
    progress = min((update - policy.warmup_updates) / span, 1.0)
    floor = policy.min_lr_ratio * policy.lr
    return floor + (policy.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
