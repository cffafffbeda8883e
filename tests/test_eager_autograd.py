"""Eager training calls run each op's own autograd.Function (ops/_dispatch.py: register_autograd) instead of the
torch.library wrapper: the same formula, so the same gradients bit for bit, and the op itself wherever the
dispatcher must see the call."""
import pytest
import torch

import tilefuse
from tilefuse.ops import _dispatch

DTYPE = torch.float32


def _r(*shape, seed=0, device):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, DTYPE)


CALLS = {
    "linear": (lambda t: tilefuse.linear(t[0], t[1], t[2], "gelu"), [(2, 7, 24), (20, 24), (20,)]),
    "swiglu": (lambda t: tilefuse.linear(t[0], (t[1], t[2]), None, "swiglu"), [(9, 24), (16, 24), (16, 24)]),
    "layer_norm": (lambda t: tilefuse.layer_norm(t[0], (24,), t[1], t[2]), [(5, 24), (24,), (24,)]),
    "softmax": (lambda t: tilefuse.softmax(t[0], dim=-1), [(6, 40)]),
    "attention": (lambda t: tilefuse.attention(t[0], t[1], t[2], causal=True), [(1, 2, 9, 16), (1, 1, 9, 16),
                                                                                (1, 1, 9, 16)]),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_eager_function_matches_the_custom_op(name, device, monkeypatch):
    fn, shapes = CALLS[name]
    inputs = [_r(*s, seed=i, device=device) for i, s in enumerate(shapes)]

    def grads(eager):
        monkeypatch.setattr(_dispatch, "eager_autograd", lambda *args: eager)
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = fn(leaves)
        assert ("_function" in type(out.grad_fn).__name__) == eager, type(out.grad_fn).__name__
        out.backward(_r(*out.shape, seed=9, device=device))
        return out.detach(), [t.grad for t in leaves]

    out_f, grads_f = grads(True)
    out_op, grads_op = grads(False)
    assert torch.equal(out_f, out_op)
    for a, b in zip(grads_f, grads_op):
        assert torch.equal(a, b)


def test_the_dispatcher_sees_calls_under_a_mode_or_a_subclass(device):
    """Under a dispatch mode or with a tensor subclass the call goes through the op (its fake and autograd
    registrations), not the eager Function."""
    x = _r(3, 8, device=device).requires_grad_()
    w = _r(4, 8, seed=1, device=device).requires_grad_()
    assert _dispatch.eager_autograd(x, w, None, "gelu", True)

    class Sub(torch.Tensor):
        pass

    assert not _dispatch.eager_autograd(x.as_subclass(Sub), w)
    assert not _dispatch.eager_autograd([x, w.as_subclass(Sub)])
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        assert not _dispatch.eager_autograd(x, w)
