"""The colocated rollout source (:mod:`nemo_disco.rollouts.local`): the order of one generation phase (free the
optimizer state, refit, move weights back) and when a refit happens."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from recorder import Recorder

from nemo_disco import config
from nemo_disco.generation.hf import HFGenerator
from nemo_disco.metrics import Timer
from nemo_disco.policy.hf import HFPolicy
from nemo_disco.rollouts.local import generation_phase

torch.set_num_threads(1)


def _trainer(tiny_qwen2, log: list[str], stale: bool) -> SimpleNamespace:
    cfg = config.load(
        config.Path(__file__).resolve().parents[2] / "recipes" / "disco.yaml",
        ["policy.backend=hf", "policy.dtype=float32", "cluster.gpus_per_node=1", "generation.backend=hf"],
    )
    policy = HFPolicy.from_run_config(cfg, tiny_qwen2)
    with torch.no_grad():  # the policy has moved since the generator loaded the folder
        for p in policy.model.parameters():
            p.add_(0.01)
    return SimpleNamespace(
        cfg=cfg,
        policy=Recorder("policy", policy, log),
        ref_policy=Recorder("ref", HFPolicy.from_run_config(cfg, tiny_qwen2, trainable=False), log),
        generator=Recorder("generator", HFGenerator(tiny_qwen2), log),
        generator_stale=stale,
    )


def test_colocated_order_frees_optimizer_state_before_the_refit_and_weights_after(tiny_qwen2):
    log: list[str] = []
    tr = _trainer(tiny_qwen2, log, stale=True)
    with generation_phase(tr, Timer(), colocated=True):
        log.append("generate")
    assert log == [
        "policy.offload(weights=False)",  # gradients + optimizer state leave before the refit reads the weights
        "ref.offload()",
        "generator.wake_up(['weights'])",
        "policy.export_weights()",
        "generator.update_weights()",
        "policy.offload()",  # the weights, once the refit has read them
        "generator.wake_up(['kv_cache'])",
        "generate",
        "generator.sleep()",
        "policy.onload()",
    ]
    assert tr.generator_stale is False
    generated = dict(tr.generator._obj.model.named_parameters())
    for name, p in tr.policy._obj.model.named_parameters():
        assert torch.equal(generated[name], p), name  # the refit really moved the weights


def test_no_refit_when_the_generator_is_current_and_nothing_moves_when_not_colocated(tiny_qwen2):
    log: list[str] = []
    tr = _trainer(tiny_qwen2, log, stale=False)
    with generation_phase(tr, Timer(), colocated=True):
        pass
    assert "generator.update_weights()" not in log and "policy.export_weights()" not in log
    log.clear()
    tr.generator_stale = True
    with generation_phase(tr, Timer(), colocated=False):
        pass
    assert log == ["policy.export_weights()", "generator.update_weights()"]
