"""Test tool: the host side of a compiled-path call, on any machine, with every Triton launch recorded.

A fused kernel of 70 us is host-bound when its Python (checks, dispatch, autotuner lookup, Triton's
launcher) takes longer, and `do_bench` then measures the host. The GPU is lent for minutes, so this
module lets the launch path be exercised and timed on a CPU: inside ``stubbed_launches()`` every op
takes its compiled path (``runtime.execution_path`` says "compiled", ``runtime.device_facts`` gives an
H200's SM count) with CPU tensors, and each kernel launch is recorded -- kernel name, grid, launch
arguments -- instead of run; so are the launch layer's replays (kernels/fastpath.py). Triton's own launcher (binding arguments, the C launch) is not timed; on
the H200 it adds its own tens of microseconds (benchmarks/host_overhead.py measures the whole).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from triton.runtime.driver import driver

from tilefuse import runtime


@dataclass
class Launch:
    kernel: str
    grid: tuple
    kwargs: dict = field(repr=False)
    replay: bool = False  # issued by the launch layer's fast path (kernels/fastpath.py), not Triton's
    pointers: tuple = ()  # the address of every pointer argument, in parameter order
    descriptors: tuple = ()  # (base address, shape, strides) of every host TMA descriptor, in parameter order


def _pointers(values) -> tuple:
    return tuple(v.data_ptr() for v in values if isinstance(v, torch.Tensor))


def _is_descriptor(value) -> bool:
    return hasattr(value, "base") and hasattr(value, "strides")  # Gluon's TensorDescriptor, or a replay's


def _descriptor_facts(v) -> tuple:
    return v.base.data_ptr(), tuple(v.shape), tuple(v.strides)


class StandInDriver:
    """What Triton's launch path asks of the active driver, for device 0 (an sm_``major``0 GPU) on
    stream 0, on a machine without one."""

    def __init__(self, major: int = 9):
        self.major = major

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", self.major * 10, 32)

    def get_device_interface(self):
        return torch.cuda


class StubCompiledKernel:
    """What a launch returns once compiled, as far as kernels/fastpath.py uses it: its ``run`` -- the C
    launcher's call, every parameter in order, pointers as addresses -- records a Launch (the kernel's
    own keyword arguments read back from the positions the replay filled, and its launch options)
    instead of launching."""

    function = None
    packed_metadata = None

    def __init__(self, name, arg_names, kwargs, grid_rank, launches, tensor_positions, descriptor_positions):
        self.name, self.arg_names, self.grid_rank, self.launches = name, list(arg_names), grid_rank, launches
        self.kwarg_names = [k for k in kwargs if k in self.arg_names]
        self.options = {k: v for k, v in kwargs.items() if k not in self.arg_names}
        self.tensor_positions = tensor_positions
        self.descriptor_positions = descriptor_positions  # where the compiling call passed host descriptors

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, grid_0, grid_1, grid_2, stream, function, packed_metadata, launch_metadata, enter_hook,
            exit_hook, *args):
        assert len(args) == len(self.arg_names), "a replay passes every parameter, constexprs included"
        values = dict(zip(self.arg_names, args))
        kwargs = {k: values[k] for k in self.kwarg_names}
        pointers = tuple(int(args[i]) for i in self.tensor_positions)
        self.launches.append(Launch(self.name, (grid_0, grid_1, grid_2)[:self.grid_rank],
                                    {**kwargs, **self.options}, replay=True, pointers=pointers,
                                    descriptors=tuple(_descriptor_facts(args[i]) for i in self.descriptor_positions)))


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
        g = tuple(grid(meta) if callable(grid) else grid)
        ordered = [meta.get(name) for name in self.arg_names]
        descriptor_positions = [i for i, v in enumerate(ordered) if _is_descriptor(v)]
        launches.append(Launch(self.fn.__name__, g, kwargs, pointers=_pointers(ordered),
                               descriptors=tuple(_descriptor_facts(ordered[i]) for i in descriptor_positions)))
        positions = [i for i, v in enumerate(ordered) if isinstance(v, torch.Tensor)]
        return StubCompiledKernel(self.fn.__name__, self.arg_names, kwargs, len(g), launches, positions,
                                  descriptor_positions)

    saved = [(cls, cls.run) for cls in _launcher_classes()]
    saved_path, saved_facts = runtime.execution_path, runtime.device_facts
    saved_driver, saved_device = driver._active, torch.cuda.current_device
    own_is_cuda = torch.Tensor.__dict__.get("is_cuda")  # normally inherited from the C base
    try:
        for cls, _ in saved:
            cls.run = record
        runtime.execution_path = lambda t: runtime.COMPILED
        runtime.device_facts = lambda device: (major, sms)
        torch.Tensor.is_cuda = property(lambda self: True)  # the dispatch's "is this a GPU tensor" checks
        driver.set_active(StandInDriver(major))  # what the fast path's key and replays ask for
        torch.cuda.current_device = lambda: 0
        yield launches
    finally:
        for cls, run in saved:
            cls.run = run
        runtime.execution_path, runtime.device_facts = saved_path, saved_facts
        driver.set_active(saved_driver)
        torch.cuda.current_device = saved_device
        if own_is_cuda is None:
            del torch.Tensor.is_cuda
        else:
            torch.Tensor.is_cuda = own_is_cuda
