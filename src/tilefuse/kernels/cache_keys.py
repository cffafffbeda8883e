"""A kernel's Triton disk-cache key, the same in every process.

A JITFunction's key (``cache_key``, computed once) folds in the ``tl.constexpr`` globals its callees read, but
triton 3.6 merges a callee's globals before it computes the callee's own key: a helper keyed for the first time
inside a kernel's key contributes none of its constants. The key then depends on which kernel a process happened
to key first, and a kernel compiled in one process misses the disk cache in another (a report worker built
``linear_tma_kernel``, the timing process compiled it again: its helpers' GELU constants were in one key and not
in the other). :func:`settle` keys a module's JIT functions when the module is imported, again until nothing
changes (a helper calling a later one needs a pass per level), so every key that reads them later is complete
and the same everywhere. Modules whose helpers read constexpr globals call it last."""
from __future__ import annotations

from triton.runtime.jit import JITFunction

from tilefuse import runtime

_MAX_PASSES = 8


def settle(namespace: dict) -> None:
    """Key every JIT function defined in the module whose ``globals()`` is ``namespace``, until the keys stop
    changing. Nothing under the interpreter: its functions have no disk-cache key (and a Gluon kernel, still a
    JITFunction there, could not key the interpreted helpers it calls)."""
    if runtime.interpreter_enabled():
        return
    fns = [v for v in namespace.values() if isinstance(v, JITFunction) and v.__module__ == namespace["__name__"]]
    keys = [f.cache_key for f in fns]
    for _ in range(_MAX_PASSES):
        for f in fns:
            f.hash = None  # triton's memo of the key: recomputed now that every callee's globals are known
        again = [f.cache_key for f in fns]
        if again == keys:
            return
        keys = again
