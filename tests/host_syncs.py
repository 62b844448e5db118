"""A recorder of the calls that make the host wait for the GPU, usable on CPU (where nothing waits).

On a GPU each of these blocks the Python thread until the device has caught up with its queue: reading a value
(``.item()``, ``float(t)``, ``bool(t)`` and so data-dependent ``if``), copying to the host (``.cpu()``,
``.to("cpu")``, ``.tolist()``, ``.numpy()``), and the ops whose output size depends on the data (``nonzero``,
boolean-mask indexing, ``masked_select``, ``unique``). A hot loop that runs per layer or per chunk should make
none; tests wrap it in :class:`HostSyncs` and assert that ``calls`` stays empty.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor methods that read a value or copy to the host (seen at the Python level: on CPU ``.cpu()`` dispatches
# nothing).
_METHODS = {"item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__", "__complex__"}
# aten ops that read a value or size their output from the data.
_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive"}
# aten ops that sync when an index is a boolean mask (they run nonzero on it).
_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl", "_index_put_impl_"}


def _where() -> str:
    """file:line of the innermost caller in nemo_disco or the tests (the line that asked for the sync)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if ("nemo_disco" in frame.filename or "/tests/" in frame.filename) and not frame.filename.endswith(
            "host_syncs.py"
        ):
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


def _to_host(args: tuple, kwargs: dict) -> bool:
    """``Tensor.to(...)`` arguments that name the CPU as the destination."""
    for a in (*args, kwargs.get("device")):
        if isinstance(a, str | torch.device) and torch.device(a).type == "cpu":
            return True
    return False


class _Methods(TorchFunctionMode):
    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _METHODS or (name == "to" and _to_host(args[1:], kwargs)):
            self.calls.append(f"Tensor.{name} at {_where()}")
        return func(*args, **kwargs)


class _Ops(TorchDispatchMode):
    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        masked = name in _INDEX_OPS and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        )
        if name in _OPS or masked:
            self.calls.append(f"aten.{name}{' (boolean mask)' if masked else ''} at {_where()}")
        return func(*args, **(kwargs or {}))


class HostSyncs:
    """Context manager: ``calls`` lists every host synchronisation made inside it (name and line)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._modes = (_Methods(self.calls), _Ops(self.calls))

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
