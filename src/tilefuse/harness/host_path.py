"""The host side of a compiled-path call, on any machine: every Triton launch is replaced by a recorder.

A fused kernel of 70 us is host-bound when its Python (checks, dispatch, autotuner lookup, Triton's
launcher) takes longer, and `do_bench` then measures the host. The GPU is lent for minutes, so this
module lets the launch path be exercised and timed on a CPU: inside ``stubbed_launches()`` every op
takes its compiled path (``runtime.execution_path`` says "compiled", ``runtime.device_facts`` gives an
H200's SM count) with CPU tensors, and each kernel launch is recorded -- kernel name, grid, launch
arguments -- instead of run. Triton's own launcher (binding arguments, the C launch) is not timed; on
the H200 it adds its own tens of microseconds (benchmarks/host_overhead.py measures the whole).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from tilefuse import runtime


@dataclass
class Launch:
    kernel: str
    grid: tuple
    kwargs: dict = field(repr=False)


def _launcher_classes():
    from triton.runtime.jit import JITFunction
    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction  # what triton.jit makes under TRITON_INTERPRET
        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover - layout of other triton versions
        pass
    return classes


@contextlib.contextmanager
def stubbed_launches(sms: int = 132, major: int = 9):
    """Yields the list that collects every launch made inside the block (see the module doc)."""
    launches: list[Launch] = []

    def record(self, *args, grid=None, warmup=False, **kwargs):
        meta = {**dict(zip(self.arg_names, args)), **kwargs}
        g = grid(meta) if callable(grid) else grid
        launches.append(Launch(self.fn.__name__, tuple(g), kwargs))

    saved = [(cls, cls.run) for cls in _launcher_classes()]
    saved_path, saved_facts = runtime.execution_path, runtime.device_facts
    own_is_cuda = torch.Tensor.__dict__.get("is_cuda")  # normally inherited from the C base
    try:
        for cls, _ in saved:
            cls.run = record
        runtime.execution_path = lambda t: runtime.COMPILED
        runtime.device_facts = lambda device: (major, sms)
        torch.Tensor.is_cuda = property(lambda self: True)  # the dispatch's "is this a GPU tensor" checks
        yield launches
    finally:
        for cls, run in saved:
            cls.run = run
        runtime.execution_path, runtime.device_facts = saved_path, saved_facts
        if own_is_cuda is None:
            del torch.Tensor.is_cuda
        else:
            torch.Tensor.is_cuda = own_is_cuda
