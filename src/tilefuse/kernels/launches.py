"""What ran: one record per op call that launched kernels, for the report, tests and benchmarks.

``with recording() as records:`` collects a :class:`LaunchRecord` for every op call that launches
kernels while the block is open, in any thread: also when the op runs inside its registered custom
op, a compiled graph, or autograd's backward (which the engine runs on a thread of its own for CUDA
tensors). Outside a ``recording`` block nothing is built (one list check per call). Imports no
triton, so ``import tilefuse`` stays triton-free.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

_ACTIVE: list[list] = []  # the lists of the open recording blocks


@dataclass(frozen=True)
class LaunchRecord:
    op: str         # the op family's launch entry, e.g. "linear", "norm_forward", "attention"
    path: str       # "compiled" | "interpreter" | "reference"
    kernel: str     # which kernel ran, e.g. "tma", "split-k 4", "ws", "block"
    config: str     # the config that ran, as text
    replayed: bool = False  # issued by the launch layer's fast path (kernels/fastpath.py)

    def describe(self) -> str:
        text = f"{self.path} {self.kernel}: {self.config}" if self.kernel else f"{self.path}: {self.config}"
        return text + (" (replayed)" if self.replayed else "")


def active() -> bool:
    return bool(_ACTIVE)


@contextlib.contextmanager
def recording():
    """Yields the list that collects the records of every op call made while the block is open."""
    records: list[LaunchRecord] = []
    _ACTIVE.append(records)
    try:
        yield records
    finally:
        # By identity: list.remove compares by value, and nested recordings often hold equal lists.
        del _ACTIVE[next(i for i, r in enumerate(_ACTIVE) if r is records)]


@contextlib.contextmanager
def paused():
    """No recording while inside (every thread's): for work an op does besides its call, such as timing its
    candidate implementations once (``tuning.choices``)."""
    saved = _ACTIVE[:]
    _ACTIVE.clear()
    try:
        yield
    finally:
        _ACTIVE[:] = saved + _ACTIVE


def record(op: str, path: str, kernel: str, config) -> LaunchRecord | None:
    """Adds a record to every active ``recording`` (and returns it), or does nothing when none is active.
    ``config``: text, or a callable giving it (built only when someone records)."""
    if not _ACTIVE:
        return None
    rec = LaunchRecord(op, path, kernel, config() if callable(config) else str(config))
    emit(rec)
    return rec


def emit(rec: LaunchRecord) -> None:
    for records in list(_ACTIVE):
        records.append(rec)
