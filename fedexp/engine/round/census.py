"""A census of a round's work: the tensor operations it dispatches and its host reads.

Two properties decide whether a round runs well on an accelerator, and both can be checked on
the CPU: the number of tensor operations it dispatches must not grow with the cohort (each op is
a kernel launch on a GPU; an op per client makes the round's cost the launch latency times the
clients, whatever the chip), and it must read the device from the host a fixed number of times
(each read waits for every queued kernel).

:class:`Census` counts both while it is active:

- **ops**: every ATen operation dispatched (``torch.utils._python_dispatch.TorchDispatchMode``),
  by name; views and in-place ops included, since each is a launch or a Python-side cost;
- **host reads**: what would wait on a GPU: ``aten._local_scalar_dense`` (``.item()``,
  ``bool(t)``, ``int(t)``, ``float(t)``), ``aten.nonzero`` and its relatives whose output size
  depends on values (``masked_select``, ``unique``, boolean-mask indexing), and the Python-side
  copies ``Tensor.tolist``, ``Tensor.numpy`` and ``Tensor.cpu`` (on a CPU run these dispatch
  nothing, so they are counted by wrapping the methods; a ``.cpu()`` of a tensor that lives on
  the host anyway is counted too: the census cannot tell which tensors a GPU run keeps on the
  device, so it errs on the side of counting).

Used by ``tests/test_round_census.py`` (ops and reads of a round at 10 and 1,000 clients, for
every algorithm, codec and privacy mode) and ``scripts/bench_device.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: ATen ops whose result's size (or value) the host must read from the device.
_READS = {
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.nonzero_static.default",
    "aten.masked_select.default",
    "aten._unique2.default",
    "aten.unique_consecutive.default",
    "aten.unique_dim.default",
}
#: Tensor methods that copy to the host without dispatching an op on a CPU run.
_METHODS = ("tolist", "numpy", "cpu")


class Census(TorchDispatchMode):
    """Count the ops and host reads dispatched while active (``with Census() as c:``).

    Attributes:
        ops: op name -> times dispatched.
        reads: what read the host -> times (an op name, or ``Tensor.tolist`` and the like;
            with ``where``, followed by `` @ file:line`` of the innermost fedexp frame).

    Args:
        where: name each read's place in fedexp's code (slower: a stack walk per read).
    """

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.where = where
        self.ops: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()
        self._saved: dict[str, Callable[..., Any]] = {}

    @property
    def total_ops(self) -> int:
        """Every op dispatched."""
        return sum(self.ops.values())

    @property
    def total_reads(self) -> int:
        """Every host read."""
        return sum(self.reads.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = str(func)
        self.ops[name] += 1
        if name in _READS or (name == "aten.index.Tensor" and _bool_index(args)):
            self.reads[self._named(name)] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> Census:
        for method in _METHODS:
            original = getattr(torch.Tensor, method)
            self._saved[method] = original
            setattr(torch.Tensor, method, self._counting(method, original))
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for method, original in self._saved.items():
                setattr(torch.Tensor, method, original)
            self._saved.clear()

    def _counting(self, method: str, original: Callable[..., Any]) -> Callable[..., Any]:
        reads = self.reads

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            reads[self._named(f"Tensor.{method}")] += 1
            return original(tensor, *args, **kwargs)

        return counted

    def _named(self, what: str) -> str:
        """``what``, with the place in fedexp's code that asked for it when :attr:`where`."""
        if not self.where:
            return what
        import sys

        frame = sys._getframe(2)
        while frame is not None:
            file = frame.f_code.co_filename
            if "/fedexp/" in file and not file.endswith("census.py"):
                return f"{what} @ {file.split('/fedexp/')[-1]}:{frame.f_lineno}"
            frame = frame.f_back
        return what

    def summary(self, top: int = 10) -> str:
        """One line: the totals and the most frequent ops and reads."""
        ops = ", ".join(f"{k.removeprefix('aten.')} {v}" for k, v in self.ops.most_common(top))
        reads = ", ".join(f"{k.removeprefix('aten.')} {v}" for k, v in self.reads.most_common())
        return f"{self.total_ops} ops ({ops}); {self.total_reads} host reads ({reads})"


def _bool_index(args: tuple) -> bool:
    """Whether an ``aten.index.Tensor`` call indexes by a boolean mask (a hidden nonzero)."""
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices if i is not None
    )
