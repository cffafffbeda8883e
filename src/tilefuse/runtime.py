"""Which execution path a tensor takes, decided in one place.

- ``compiled``: a CUDA tensor runs the compiled Triton kernel.
- ``interpreter``: a CPU tensor with ``TRITON_INTERPRET=1`` set (before triton is imported) runs the
  same Triton kernel in Triton's interpreter -- slow, for tests on machines without a GPU.
- ``reference``: a CPU tensor without the interpreter runs the plain PyTorch reference
  (``tilefuse.reference``). This is documented behaviour, and ``tilefuse info`` prints it.

Also which implementation an op may take (:func:`backend`, set by ``TILEFUSE_BACKEND`` or
:func:`use_backend`): tilefuse's kernels, the vendor's libraries through PyTorch, or ``auto``, a measured choice
per shape (the family's launch module asks and decides).

Also the version checks that must pass before a Triton kernel module is imported
(:func:`check_triton`) or the interpreter is relied on (:func:`interpreter_numpy_problem`). They read
triton's version from its distribution metadata, so calling them does not import triton (and fix the
interpreter setting too early) unless no installed distribution is named triton.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import os
import re
import sys

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


def precision_for(dtype: torch.dtype, is_cuda: bool) -> str:
    """tl.dot's input precision for operands of ``dtype``: fp32 is full precision ("ieee") unless torch allows
    TF32 matmuls (``torch.backends.cuda.matmul.allow_tf32``) on a CUDA tensor. A launch that reads it keys its
    fast-path plans on it, since the flag can change between two calls of the same shapes."""
    if dtype == torch.float32:
        return "tf32" if (is_cuda and torch.backends.cuda.matmul.allow_tf32) else "ieee"
    return "tf32"  # ignored by tl.dot for 16-bit operands


# ----------------------------------------------------------------------------------------------------
# Backends. ``auto``: each op takes, per shape bucket, the faster of tilefuse's kernels and the vendor's
# composition of the same math through PyTorch, by measurement on the GPU; ``tilefuse``: tilefuse's kernels only;
# ``vendor``: the vendor compositions only (an op or a call with none runs tilefuse's kernels).

AUTO, TILEFUSE, VENDOR = "auto", "tilefuse", "vendor"
BACKENDS = (AUTO, TILEFUSE, VENDOR)
BACKEND_ENV = "TILEFUSE_BACKEND"
# The use_backend blocks in force, innermost last: process-wide, as torch's own backend flags are, so that the
# threads autograd runs a CUDA backward on see the block the backward was called in.
_BACKEND_BLOCKS: list = []


def _check_backend(name, what: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, BACKENDS))}, got {name!r}")
    return name


@functools.lru_cache(maxsize=None)
def _backend_from_env(value: str) -> str:
    return _check_backend(value.strip().lower() or AUTO, f"the environment variable {BACKEND_ENV}")


def backend() -> str:
    """The backend ops take now: the innermost :func:`use_backend` block's, else ``TILEFUSE_BACKEND``
    (default ``auto``). A bad value raises ValueError naming the variable at the first op that asks."""
    blocks = _BACKEND_BLOCKS
    return blocks[-1][0] if blocks else _backend_from_env(os.environ.get(BACKEND_ENV, AUTO))


@contextlib.contextmanager
def stacked(blocks: list, block):
    """``block`` on the process-wide stack ``blocks`` while the with-block runs, then that very object removed
    (not whatever is last: blocks of other threads may have ended out of order). ``block`` must be an object of
    its own identity (a list or dict made for this block)."""
    blocks.append(block)
    try:
        yield
    finally:
        for i in range(len(blocks) - 1, -1, -1):
            if blocks[i] is block:
                del blocks[i]
                break


def use_backend(name: str):
    """``with tilefuse.use_backend("tilefuse"):`` -- ops called inside take that backend (``auto``,
    ``tilefuse`` or ``vendor``), whatever ``TILEFUSE_BACKEND`` says. Process-wide while the block runs, like
    ``torch.backends`` flags: a backward that autograd runs on its own device thread takes it too."""
    return stacked(_BACKEND_BLOCKS, [_check_backend(name, "use_backend's name")])


_DEVICE_FACTS: dict = {}


def device_facts(device: torch.device) -> tuple[int, int]:
    """(major compute capability, SM count) of a CUDA device, cached: the driver queries cost
    microseconds, and launchers ask on every call."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _DEVICE_FACTS:
        props = torch.cuda.get_device_properties(key)
        _DEVICE_FACTS[key] = (props.major, props.multi_processor_count)
    return _DEVICE_FACTS[key]


_SHARED_MEMORY: dict = {}


def shared_memory_per_sm(device: torch.device) -> int:
    """Bytes of shared memory one SM of a CUDA device holds (what bounds how many programs of a pipelined kernel
    share it), cached. Drivers torch cannot ask get the Hopper / Ampere figures by compute capability."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SHARED_MEMORY:
        props = torch.cuda.get_device_properties(key)
        fallback = {9: 228, 8: 164}.get(props.major, 96) * 1024
        _SHARED_MEMORY[key] = int(getattr(props, "shared_memory_per_multiprocessor", 0) or fallback)
    return _SHARED_MEMORY[key]


# ----------------------------------------------------------------------------------------------------
# Versions tilefuse runs on. pyproject.toml states the same bounds for pip.

SUPPORTED_TRITON = (3, 6)  # major, minor: the kernels are tested on triton 3.6.x only; the Gluon kernels
#                            use an experimental API that changes between triton releases.
SUPPORTED_TRITON_TEXT = "%d.%d.x" % SUPPORTED_TRITON
TRITON_REQUIREMENT = "triton>=%d.%d,<%d.%d" % (*SUPPORTED_TRITON, SUPPORTED_TRITON[0], SUPPORTED_TRITON[1] + 1)
INTERPRETER_NUMPY_LIMIT = (2, 4)  # triton 3.6's interpreter fails on numpy >= 2.4 (array -> scalar casts)
ALLOW_UNTESTED_TRITON_ENV = "TILEFUSE_ALLOW_UNTESTED_TRITON"


class UnsupportedTritonError(ImportError):
    """triton is missing, or is a version tilefuse's kernels are not tested on."""


class InterpreterNumpyError(RuntimeError):
    """The Triton interpreter (TRITON_INTERPRET=1, the kernels' CPU path) cannot run with the installed numpy."""


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: "3.6.0+git1a2b" -> (3, 6, 0)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


def triton_version() -> str | None:
    """The installed triton's version, or None when there is none. Imports triton only when no
    distribution metadata names it (e.g. a source build), so TRITON_INTERPRET can still be set after."""
    module = sys.modules.get("triton")
    if module is not None and getattr(module, "__version__", None):
        return module.__version__
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        pass
    if importlib.util.find_spec("triton") is None:
        return None
    import triton  # provided by another distribution (e.g. pytorch-triton): ask the module itself

    return getattr(triton, "__version__", None) or "unknown"


def numpy_version() -> str:
    import numpy

    return numpy.__version__


def triton_problem() -> str | None:
    """Why tilefuse's Triton kernels cannot run with the installed triton, as one sentence, or None."""
    version = triton_version()
    if version is None:
        return (f"tilefuse's Triton kernels need triton {SUPPORTED_TRITON_TEXT}, and triton is not installed: "
                f"pip install '{TRITON_REQUIREMENT}'")
    if version_tuple(version)[:2] == SUPPORTED_TRITON:
        return None
    if os.environ.get(ALLOW_UNTESTED_TRITON_ENV, "") not in ("", "0"):
        return None
    return (f"tilefuse's kernels are tested on triton {SUPPORTED_TRITON_TEXT} only (its Gluon kernels use an "
            f"experimental API that changes between triton versions), and triton {version} is installed: "
            f"pip install '{TRITON_REQUIREMENT}' (or set {ALLOW_UNTESTED_TRITON_ENV}=1 to try it anyway)")


_TRITON_CHECKED = False


def check_triton() -> None:
    """Raise :class:`UnsupportedTritonError` (an ImportError) naming the installed and the supported
    triton versions unless the installed one is supported, and with the interpreter on
    (``TRITON_INTERPRET=1``), :class:`InterpreterNumpyError` when the installed numpy breaks it (the raw
    error from inside the interpreter would name neither). Every op calls it before its first kernel launch;
    after the first success it costs one global read."""
    global _TRITON_CHECKED
    if _TRITON_CHECKED:
        return
    problem = triton_problem()
    if problem is not None:
        raise UnsupportedTritonError(problem)
    if interpreter_enabled():
        problem = interpreter_numpy_problem()
        if problem is not None:
            raise InterpreterNumpyError(problem)
    _TRITON_CHECKED = True


def interpreter_numpy_problem() -> str | None:
    """Why the Triton interpreter (the CPU path of the kernels) cannot run with the installed numpy, as
    one sentence, or None."""
    version = numpy_version()
    if version_tuple(version)[:2] < INTERPRETER_NUMPY_LIMIT:
        return None
    limit = ".".join(map(str, INTERPRETER_NUMPY_LIMIT))
    triton = "%d.%d" % SUPPORTED_TRITON
    return (f"on a machine without a GPU the kernels run in Triton {triton}'s interpreter, which needs "
            f"numpy < {limit} (you have numpy {version}): pip install 'numpy<{limit}'")
