"""Zero-size inputs give what torch gives (shapes and values), forward and backward, on every path: the
kernels (compiled on a GPU, the interpreter on a CPU) and the plain-PyTorch reference path."""
import pytest
import torch
import torch.nn.functional as F

import tilefuse
from helpers import ON_GPU


def _paths():
    return ["kernels"] if ON_GPU else ["kernels", "reference"]


def _same(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert torch.allclose(a.double(), b.double(), equal_nan=True, atol=1e-5), (a, b)


@pytest.fixture(params=_paths())
def path(request, monkeypatch):
    if request.param == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    return request.param


@pytest.mark.parametrize("M,K,N", [(0, 8, 5), (3, 0, 5), (3, 8, 0), (0, 0, 0)])
def test_gemms(device, path, M, K, N):
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g).to(device) for s in ((M, K), (N, K), (N,)))
    _same(tilefuse.linear(x, w, b, "gelu"), F.gelu(F.linear(x, w, b)))
    _same(tilefuse.linear(x, (w, w), (b, b), "swiglu"), F.silu(F.linear(x, w, b)) * F.linear(x, w, b))
    if K:  # F.layer_norm over zero elements is torch's own error
        _same(tilefuse.layer_norm_linear(x, None, None, w, b), F.linear(F.layer_norm(x, (K,)), w, b))
    _same(tilefuse.layer_norm_linear(x, None, None, w, b, norm="rms"), F.linear(F.rms_norm(x, (K,)), w, b))


@pytest.mark.parametrize("M,K,N", [(0, 8, 5), (3, 0, 5), (3, 8, 0), (0, 0, 0)])
def test_gemm_gradients(device, path, M, K, N):
    """Backward of the GEMM ops on empty inputs: what torch's autograd gives (zeros of the right shapes,
    and with K = 0 the bias gradient is still the sum of g)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g).to(device) for s in ((M, K), (N, K), (N,)))
    nw = torch.randn(K, generator=g).to(device)
    dy = torch.randn(M, N, generator=g).to(device)
    cases = [
        (lambda x, w, b: tilefuse.linear(x, w, b, "gelu"), lambda x, w, b: F.gelu(F.linear(x, w, b))),
        (lambda x, w, b: tilefuse.linear(x, (w, w), (b, b), "swiglu"),
         lambda x, w, b: F.silu(F.linear(x, w, b)) * F.linear(x, w, b)),
        (lambda x, w, b, nw: tilefuse.layer_norm_linear(x, nw, None, w, b, eps=1e-5, norm="rms", activation="silu"),
         lambda x, w, b, nw: F.silu(F.linear(F.rms_norm(x, (K,), nw, 1e-5), w, b))),
    ]
    for ours, theirs in cases:
        tensors = (x, w, b) if ours.__code__.co_argcount == 3 else (x, w, b, nw)
        a = [t.clone().requires_grad_() for t in tensors]
        c = [t.clone().requires_grad_() for t in tensors]
        got = torch.autograd.grad(ours(*a), a, dy, allow_unused=True)
        want = torch.autograd.grad(theirs(*c), c, dy, allow_unused=True)
        for i, (u, v) in enumerate(zip(got, want)):
            v = torch.zeros_like(c[i]) if v is None else v
            _same(u, v)


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (0, 2, 8)])
def test_norms_and_softmax_forward_and_backward(device, path, shape):
    n = shape[-1]
    x = torch.randn(*shape, device=device)
    w = torch.randn(n, device=device)
    cases = [
        (lambda t, p: tilefuse.layer_norm(t, (n,), p), lambda t, p: F.layer_norm(t, (n,), p)),
        (lambda t, p: tilefuse.rms_norm(t, (n,), p), lambda t, p: F.rms_norm(t, (n,), p)),
        (lambda t, p: tilefuse.softmax(t * p.sum(), -1), lambda t, p: torch.softmax(t * p.sum(), -1)),
    ]
    for ours, theirs in cases:
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
        ya, yb = ours(xa, wa), theirs(xb, wb)
        _same(ya, yb)
        ga = torch.autograd.grad(ya.sum(), [xa, wa], allow_unused=True)
        gb = torch.autograd.grad(yb.sum(), [xb, wb], allow_unused=True)
        for a, b in zip(ga, gb):
            if b is None:
                assert a is None or not a.any()
            else:
                _same(a if a is not None else torch.zeros_like(b), b)


@pytest.mark.parametrize("B,Nq,Nk", [(0, 5, 7), (1, 0, 7), (1, 5, 0)])
def test_attention(device, path, B, Nq, Nk):
    q, k = torch.randn(B, 2, Nq, 16, device=device), torch.randn(B, 2, Nk, 16, device=device)
    v = torch.randn(B, 2, Nk, 16, device=device)
    want = F.scaled_dot_product_attention(q, k, v)
    _same(tilefuse.scaled_dot_product_attention(q, k, v), want)
    out, lse = tilefuse.attention(q, k, v, return_lse=True)
    assert out.shape == want.shape and lse.shape == (B, 2, Nq) and lse.dtype == torch.float32
    if Nk == 0:  # no key at all: out 0, lse -inf (FlashAttention's convention; torch's math gives 0 too)
        assert not out.any() and torch.isneginf(lse).all()
    else:
        _same(out, F.scaled_dot_product_attention(q, k, v, scale=16 ** -0.5))
