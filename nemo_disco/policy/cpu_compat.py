"""Megatron-Core on a machine without CUDA (0.16.1; 0.17+ on Python 3.12): a testing and laptop aid, never on GPU.

Megatron-Core hard-codes CUDA in a few places that a CPU run with gloo reaches: ``torch.cuda.current_device()``
as the device of buffers (rotary frequencies, the global memory buffer, tensor-parallel gathers, pipeline
p2p tensors), ``device="cuda"`` literals (the pipeline schedules' token counter, the grad-buffer warm-up),
``torch.cuda.synchronize()`` around p2p communication, ``torch.cuda.current_stream()`` in the DDP gradient
sync of megatron-core >= 0.17, and the CUDA RNG tracker that forks dropout randomness. The MoE layer adds a
side stream and an event for its token counts (``torch.cuda.Stream``, ``torch.cuda.stream``,
``record_event().synchronize()`` in the all-to-all token dispatcher, whose split sizes become host lists only
when they come from CUDA tensors). :func:`apply` patches exactly these, and only when
``torch.cuda.is_available()`` is False; it is idempotent. :func:`device_scope` is a context manager that
maps ``device="cuda"`` factory arguments and ``Tensor.cuda()`` to the CPU while Megatron code runs (a no-op
with CUDA). The causal mask that mcore builds on CUDA (``get_default_causal_mask``)
is avoided by always passing an explicit attention mask.

Device placement, which a CPU run cannot otherwise see: on a GPU, mcore creates most parameters on
``torch.cuda.current_device()`` but a few on the host (the MoE router's weight, the local spec's torch norms).
:func:`emulate_device` ("meta") makes ``torch.cuda.current_device()`` and the CUDA literals name PyTorch's
``meta`` device instead of the CPU, and has the policy build as on a GPU (no CPU initialisation): what mcore
puts on "the GPU" lands on ``meta``, what it puts on the host stays on the CPU, so a test can assert that the
built model, its gradient buffers and its exported weights are all on the policy's device. Meta tensors hold
no data: construction, a forward up to the first data-dependent operation and the weight export run; a train
step does not.

With these, GPTModel (local layer spec, ``use_cpu_initialization=True``) runs forward and backward at any
TP x PP x DP over gloo, through the pipeline schedules and Megatron DDP, MoE layers included (all-to-all
dispatcher, any expert-parallel size). What stays GPU-only: the
Transformer Engine layer spec, packed sequences (THD attention), the distributed optimizer and mcore's
gradient clipping (``clip_grads`` asserts CUDA tensors).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
#: Where mcore's "GPU" tensors go on a machine without CUDA: the CPU, or ``meta`` under :func:`emulate_device`.
_DEVICE = torch.device("cpu")

# Factory functions whose ``device=`` keyword Megatron fills with "cuda".
_FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.tensor,
    torch.arange,
    torch.randn,
    torch.rand,
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
}


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` to CPU in factory calls, and makes ``Tensor.cuda()`` / ``.to("cuda")`` no-ops."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204, D105
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and _is_cuda(kwargs.get("device")):
            kwargs["device"] = _DEVICE
            kwargs.pop("pin_memory", None)
        elif func is torch.Tensor.cuda:
            return args[0].to(_DEVICE)
        elif func is torch.Tensor.to:
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = _DEVICE
            args = tuple(_DEVICE if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def device_scope() -> contextlib.AbstractContextManager:
    """Context in which Megatron's CUDA device literals land on the CPU (a null context when CUDA exists)."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    return _CudaToCpu()


def device() -> torch.device:
    """The device that stands for the GPU on a machine without CUDA: the CPU, or ``meta`` when emulated."""
    return _DEVICE


def emulate_device(name: str) -> None:
    """Test aid: place what mcore puts on the GPU on ``name`` ("meta") and build as on a GPU (call before apply).

    Raises:
        RuntimeError: CUDA is available (there is a real device to place things on), or the patches are in place.
    """
    global _DEVICE
    if torch.cuda.is_available() or _APPLIED:
        raise RuntimeError("emulate_device: call it once, on a machine without CUDA, before cpu_compat.apply()")
    _DEVICE = torch.device(name)


def apply() -> bool:
    """Patch Megatron-Core for CPU execution when CUDA is absent (idempotent).

    Returns:
        True when the patches are (already) in place, False when CUDA is available and nothing was done.
    """
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    # Buffers are placed on `torch.cuda.current_device()` throughout mcore; a device string works everywhere
    # an index would be used as a device.
    torch.cuda.current_device = lambda: str(_DEVICE)  # type: ignore[assignment]
    # p2p communication and process-group setup synchronise the (absent) CUDA stream.
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    # megatron-core >= 0.17's DDP gradient sync orders its work on the current stream; the MoE token
    # dispatcher copies its counts to the host on a side stream of its own.
    torch.cuda.current_stream = lambda device=None: _NULL_STREAM  # type: ignore[assignment]
    torch.cuda.Stream = _NullStream  # type: ignore[assignment,misc]  (a class: annotations use `Stream | None`)
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    # Expected on a CPU machine, once per import: say it once in the docs instead of at every start.
    warnings.filterwarnings("ignore", message="(Transformer Engine and Apex are|Apex is) not installed")
    _patch_rng_tracker()
    _patch_moe()
    _APPLIED = True
    return True


class _NullStream:
    """A CUDA stream of a machine without CUDA: ordering calls are no-ops (everything is synchronous)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_event(self, event: object) -> None:  # noqa: D102
        pass

    def wait_stream(self, stream: object) -> None:  # noqa: D102
        pass

    def synchronize(self) -> None:  # noqa: D102
        pass

    def record_event(self, event: object = None) -> _NullEvent:  # noqa: D102
        return _NullEvent()


class _NullEvent:
    """An event on the null stream: already complete."""

    def synchronize(self) -> None:  # noqa: D102
        pass

    def wait(self, stream: object = None) -> None:  # noqa: D102
        pass

    def query(self) -> bool:  # noqa: D102
        return True


_NULL_STREAM = _NullStream()


def _patch_moe() -> None:
    """The MoE layer on CPU: the dispatcher's split sizes as host lists.

    (0.16.1's undefined ``te_general_gemm`` is not a CPU matter: ``megatron.define_missing_te_names`` defines it
    wherever Transformer Engine is absent, GPU included.)
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # The all-to-all dispatcher copies its split sizes to the host "as numpy" (lists for all_to_all_single)
    # only when they are CUDA tensors; on the CPU they would stay tensors, which all_to_all_single refuses.
    to_host = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_rng_tracker() -> None:
    """The model-parallel RNG tracker (dropout forks, activation recomputation) keeps CPU generator states."""
    from megatron.core.tensor_parallel import random as mp_random

    # Recomputation saves and restores "the CUDA state" next to the CPU one; both are the CPU generator here.
    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)

    def add(self: Any, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self: Any, name: str = mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

    mp_random.CudaRNGStatesTracker.add = add
    mp_random.CudaRNGStatesTracker.fork = fork
