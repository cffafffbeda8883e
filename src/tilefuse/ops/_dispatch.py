"""The path every public op takes, in this order:

1. argument checks (``_checks``: clear errors before any kernel launches);
2. the call itself: plain eager calls run the op's implementation directly, and plain eager calls autograd
   must record run it inside an ``autograd.Function`` with the op's own autograd formula
   (:func:`register_autograd`); anything else -- inside ``torch.compile`` or ``torch.export``, under a
   dispatch or function mode or a functorch transform, on tensor subclasses -- goes through the op's
   ``torch.library`` registration (its fake implementation for tracing, its autograd formula), which runs
   the same implementation. All give the same result; the direct forms only skip the dispatcher's host
   time (~10 us per call; with autograd, the torch.library wrapper's ~25 us per training step of a
   Linear on a CPU), which is as long as a decode-size kernel runs;
3. in the implementation: the execution path (``runtime``), then the plain PyTorch reference on CPUs
   without the interpreter and for empty inputs, else the family's launch layer (``tilefuse.kernels``),
   on the tensors' own CUDA device.
"""
from __future__ import annotations

import contextlib

import torch

from tilefuse import runtime
from tilefuse.kernels import launches

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # Parameter disables __torch_function__: a plain tensor here
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_grad_enabled = torch.is_grad_enabled
_functorch_active = torch._C._are_functorch_transforms_active


def direct(*tensors) -> bool:
    """Whether this call can run the implementation without the dispatcher (see the module doc)."""
    if _is_compiling() or _dispatch_modes() or _function_modes():
        return False
    grad = _grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or (grad and t.requires_grad)):
            return False
    return True


def _plain(a) -> bool:
    if isinstance(a, torch.Tensor):
        return type(a) in _PLAIN
    if isinstance(a, (list, tuple)):
        return all(_plain(t) for t in a)
    return True


def eager_autograd(*args) -> bool:
    """Whether a call autograd must record can run through the op's own ``autograd.Function``
    (:func:`register_autograd`): eager mode, no dispatch or function mode, no functorch transform, and
    every tensor argument a plain tensor."""
    if _is_compiling() or _dispatch_modes() or _function_modes() or _functorch_active():
        return False
    return all(_plain(a) for a in args)


def register_autograd(op, forward, backward, setup_context):
    """Register ``backward`` and ``setup_context`` as custom op ``op``'s autograd formula, and return the call
    a public function makes when autograd must record it: with :func:`eager_autograd`, an ``autograd.Function``
    of the same formula around ``forward`` (the op's body, taking the op's arguments), else ``op`` itself."""
    op.register_autograd(backward, setup_context=setup_context)

    # The Function's forward takes ctx and calls setup_context itself: a Function with a setup_context of its own
    # has torch bind every call's arguments to forward's signature (inspect.signature, ~30 us a call on a CPU,
    # once per op per training step), and the eager path exists to skip such host time. The inputs setup_context
    # sees are the call's arguments, as the op's registration gives them.
    def forward_with_ctx(ctx, *args):
        output = forward(*args)
        setup_context(ctx, args, output)
        return output

    function = type(f"{op._name}_function", (torch.autograd.Function,),
                    dict(forward=staticmethod(forward_with_ctx), backward=staticmethod(backward)))

    def call(*args):
        return function.apply(*args) if eager_autograd(*args) else op(*args)
    return call


def on_device(t: torch.Tensor):
    """A guard making ``t``'s CUDA device current for the launches (Triton launches on the current one)."""
    if t.is_cuda:
        index = t.device.index
        if index is not None and index != torch.cuda.current_device():
            return torch.cuda.device(index)
    return contextlib.nullcontext()


def record_reference(op: str, path: str) -> None:
    """The launch record of a call answered by the plain PyTorch reference (no kernel launched)."""
    if launches.active():
        launches.record(op, runtime.REFERENCE if path == runtime.REFERENCE else path, "",
                        "plain PyTorch" if path == runtime.REFERENCE else "empty input: no kernel")


# ---- autocast: what torch's op would return ---------------------------------------------------------
_PROBED: dict = {}


def autocast_dtype(x: torch.Tensor):
    """The autocast dtype for ``x``'s device when autocast is on there, else None."""
    device = x.device.type
    if device not in ("cuda", "cpu") or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def cast_floats(dtype, *tensors):
    """``tensors`` with every floating tensor in ``dtype`` (None stays None): how autocast feeds a GEMM."""
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != dtype else t
                 for t in tensors)


def autocast_like(name: str, x: torch.Tensor, torch_op):
    """The dtype torch's own op (``torch_op(tiny tensor)``) returns for an input of x's dtype under the
    current autocast state, or None when autocast is off: the per-device cast lists differ (CUDA runs
    layer_norm and softmax in fp32, CPU keeps the input's dtype), so torch is asked, once per (op, device,
    autocast dtype, input dtype)."""
    dtype = autocast_dtype(x)
    if dtype is None:
        return None
    key = (name, x.device.type, dtype, x.dtype)
    out = _PROBED.get(key) if not _is_compiling() else None
    if out is None:
        out = torch_op(torch.ones((1, 2), dtype=x.dtype, device=x.device)).dtype
        if not _is_compiling():
            _PROBED[key] = out
    return out


def register_autocast(op, positions, torch_op=None, name=None) -> None:
    """Autocast kernels (CUDA and CPU) for custom op ``op``, so a direct ``torch.ops.tilefuse.*`` call under
    ``torch.autocast`` follows the rule the public function applies: the floating tensors at
    ``positions`` are cast to the autocast dtype, or -- with ``torch_op`` (a probe, see
    :func:`autocast_like`) -- to the dtype torch's own op returns under the same autocast state.
    torch.library's ``register_autocast`` casts to one fixed dtype, not the autocast state's, hence
    these kernels of our own."""
    for key in ("AutocastCUDA", "AutocastCPU"):
        excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(*args, _excluded=excluded):
            first = args[positions[0]]
            cast = autocast_like(name, first, torch_op) if torch_op is not None else autocast_dtype(first)
            if cast is not None:
                args = list(args)
                for i, t in zip(positions, cast_floats(cast, *(args[i] for i in positions))):
                    args[i] = t
            with torch._C._ExcludeDispatchKeyGuard(_excluded):
                return op._opoverload(*args)
        op._lib.impl(op._name, kernel, key)
