"""Rules of the Megatron training policy that a CPU can check without a model: its optimizer groups.

The model-level checks (decay sets of both optimizer paths, forward-only reference) run in a Megatron process:
tests/distributed/test_megatron_gpu_rules.py; the model builder's rules are in test_policy_megatron_model.py.
"""

from __future__ import annotations

import torch

from nemo_disco.policy import megatron as mp

# ----------------------------------------------------------------------------------------------------------------------
# Optimizer groups


def test_set_group_hyperparameters_applies_the_multipliers():
    groups = [{"wd_mult": 1.0, "lr_mult": 1.0}, {"wd_mult": 0.0}, {"lr_mult": 0.5}]
    mp.set_group_hyperparameters(groups, lr=2e-6, weight_decay=0.01)
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0, 0.01]
    assert [g["lr"] for g in groups] == [2e-6, 2e-6, 1e-6]


def test_no_weight_decay_rule():
    assert mp.no_weight_decay("decoder.layers.0.self_attention.linear_qkv.bias", torch.zeros(8))
    assert mp.no_weight_decay("decoder.final_layernorm.weight", torch.zeros(8))
    assert not mp.no_weight_decay("decoder.layers.0.mlp.linear_fc2.weight", torch.zeros(8, 8))
