"""Megatron-Core on a machine without CUDA (policy/cpu_compat.py): the patches and the device scope."""

from __future__ import annotations

import pytest
import torch

from nemo_disco.policy import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shim does nothing where CUDA exists")


def test_apply_is_idempotent_and_patches_the_cuda_calls_mcore_makes():
    assert cpu_compat.apply() is True
    assert cpu_compat.apply() is True  # a second call changes nothing
    assert torch.cuda.current_device() == "cpu"  # mcore places buffers on it
    torch.cuda.synchronize()  # a no-op, not "Torch not compiled with CUDA"
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        event = torch.cuda.current_stream().record_event()
    assert event.query() is True


def test_device_scope_maps_cuda_literals_to_the_cpu():
    cpu_compat.apply()
    with cpu_compat.device_scope():
        a = torch.zeros(3, device="cuda")
        b = torch.arange(4, device=torch.device("cuda", 0))
        c = torch.ones(2).cuda()
        d = torch.ones(2).to("cuda")
        e = torch.ones(2).to(device="cuda")
    assert {t.device.type for t in (a, b, c, d, e)} == {"cpu"}
    assert b.tolist() == [0, 1, 2, 3]
    with pytest.raises((AssertionError, RuntimeError)):  # outside the scope CUDA literals fail as before
        torch.zeros(1, device="cuda")


def test_emulated_device_takes_the_cuda_literals_and_is_refused_once_patched(monkeypatch):
    monkeypatch.setattr(cpu_compat, "_DEVICE", cpu_compat._DEVICE)  # restored after the test
    monkeypatch.setattr(cpu_compat, "_APPLIED", False)
    cpu_compat.emulate_device("meta")
    assert cpu_compat.device() == torch.device("meta")
    with cpu_compat.device_scope():
        assert torch.empty(2, device="cuda").device.type == "meta"
    monkeypatch.setattr(cpu_compat, "_APPLIED", True)
    with pytest.raises(RuntimeError, match="before cpu_compat.apply"):
        cpu_compat.emulate_device("meta")


def test_rng_tracker_forks_cpu_states_and_restores_the_outer_one():
    cpu_compat.apply()
    from megatron.core.tensor_parallel import random as mp_random

    tracker = mp_random.CudaRNGStatesTracker()
    tracker.add("dropout", 1234)
    with pytest.raises(Exception, match="already exists"):
        tracker.add("other", 1234)
    torch.manual_seed(0)
    outer = torch.get_rng_state()
    with tracker.fork("dropout"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outer)  # the caller's stream is untouched
    with tracker.fork("dropout"):
        second = torch.rand(3)
    assert torch.equal(first, torch.rand(3, generator=torch.Generator().manual_seed(1234)))
    assert not torch.equal(first, second)  # the forked state advances between forks
    with pytest.raises(Exception, match="is not added"):
        with tracker.fork("absent"):
            pass


def test_moe_dispatcher_split_sizes_become_host_arrays():
    cpu_compat.apply()
    from megatron.core.transformer.moe import moe_utils

    sizes = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert sizes.tolist() == [3, 1] and not torch.is_tensor(sizes)
    kept = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([3, 1]))
    assert torch.is_tensor(kept)
