"""Two fixes to Triton 3.6's interpreter (the CPU path, ``TRITON_INTERPRET=1``), installed by :func:`install`.

**Rounding.** Triton 3.6's interpreter casts fp32 to bf16 by truncation; the GPU rounds to nearest even.

On the CPU path (``TRITON_INTERPRET=1``) the kernels would then carry twice the bf16 rounding error they
have on the GPU at every cast: a backward that rounds the pre-activation, g and its outputs lands near
rel-L2 1e-2 instead of 4e-3. :func:`round_bf16_to_nearest` replaces the interpreter's fp32 -> bf16
conversion with round-to-nearest-even (NaN stays a quiet NaN; values past bf16's range round to inf, as
``cvt.rn.bf16.f32`` does), so CPU results carry the GPU's rounding. Every other conversion is untouched.

**Helper calls.** Each call of a ``@triton.jit`` helper from inside a kernel re-patches triton.language for the
interpreter (``inspect.getmembers`` over four namespaces, ~0.4 ms a call, a fifth of a small model's training
step in the interpreter), although the kernel launch around it has patched the same module already and keeps
that patch until it ends. :func:`skip_repatching_in_helpers` makes helper calls skip it while a launch runs; a
helper called outside a launch patches as before. What runs is unchanged.
"""
from __future__ import annotations

import numpy as np

_installed = False
_helpers_installed = False


def _fp32_to_bf16_rne(data: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    out = rounded.astype(np.uint16)
    nan = np.isnan(data)
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


def round_bf16_to_nearest() -> None:
    """Install the rounding fix in the interpreter (idempotent; only ever called on the interpreter path)."""
    global _installed
    if _installed:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            return _fp32_to_bf16_rne(np.asarray(input)).reshape(np.shape(input))
        return original(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert
    _installed = True


def skip_repatching_in_helpers() -> None:
    """Helper calls inside a running interpreter launch skip the re-patch when every language module their
    globals hold (``triton.language`` and/or ``triton.language.core``, the modules the interpreter patches)
    is patched already in this launch (idempotent)."""
    global _helpers_installed
    if _helpers_installed:
        return
    import inspect
    import threading

    import triton.language as tl
    from triton.runtime import interpreter

    state = threading.local()  # .patched: ids of the language modules patched in the running launch, or None
    langs_of: dict = {}  # jit function -> ids of the language modules in its globals
    launch_call = interpreter.GridExecutor.__call__
    helper_call = interpreter.InterpretedFunction.__call__

    def langs(fn):
        found = langs_of.get(fn)
        if found is None:
            found = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                             if inspect.ismodule(v) and v in (tl, tl.core))
        return found

    def launch(self, *args, **kwargs):
        outer = getattr(state, "patched", None)
        state.patched = set(langs(self.fn))
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            state.patched = outer

    def helper(self, *args, **kwargs):
        patched = getattr(state, "patched", None)
        needed = langs(self.fn)
        if patched is None or not needed <= patched:
            if patched is not None:
                patched |= needed
            return helper_call(self, *args, **kwargs)
        fn = self.rewrite()  # what InterpretedFunction.__call__ does after its patch
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = launch
    interpreter.InterpretedFunction.__call__ = helper
    _helpers_installed = True


def install() -> None:
    """Both fixes (only ever called on the interpreter path)."""
    round_bf16_to_nearest()
    skip_repatching_in_helpers()
