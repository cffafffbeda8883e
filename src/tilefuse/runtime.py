"""Which execution path a tensor takes, decided in one place.

- ``compiled``: a CUDA tensor runs the compiled Triton kernel.
- ``interpreter``: a CPU tensor with ``TRITON_INTERPRET=1`` set (before triton is imported) runs the
  same Triton kernel in Triton's interpreter -- slow, for tests on machines without a GPU.
- ``reference``: a CPU tensor without the interpreter runs the plain PyTorch reference
  (``tilefuse.reference``). This is documented behaviour, and ``tilefuse info`` prints it.
"""
from __future__ import annotations

import os

import torch

COMPILED = "compiled"
INTERPRETER = "interpreter"
REFERENCE = "reference"


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def execution_path(t: torch.Tensor) -> str:
    if t.is_cuda:
        return COMPILED
    if t.device.type == "cpu":
        return INTERPRETER if interpreter_enabled() else REFERENCE
    raise ValueError(f"tensors on device {t.device} are not supported (expected cuda or cpu)")


def default_path() -> str:
    return COMPILED if torch.cuda.is_available() else (INTERPRETER if interpreter_enabled() else REFERENCE)


_DEVICE_FACTS: dict = {}


def device_facts(device: torch.device) -> tuple[int, int]:
    """(major compute capability, SM count) of a CUDA device, cached: the driver queries cost
    microseconds, and launchers ask on every call."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _DEVICE_FACTS:
        props = torch.cuda.get_device_properties(key)
        _DEVICE_FACTS[key] = (props.major, props.multi_processor_count)
    return _DEVICE_FACTS[key]
