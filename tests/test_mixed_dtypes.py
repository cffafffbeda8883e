"""torch's dtype rules for the norms: parameters of any float dtype beside fp16/bf16 activations (as
mixed-precision training keeps them), output in the input's dtype, each gradient in its parameter's own
dtype; what torch refuses stays a TypeError. On the interpreter (or GPU) path and on the plain-PyTorch
reference path."""
import pytest
import torch
import torch.nn.functional as F

import tilefuse
from helpers import ON_GPU, assert_close
from tilefuse.opspec import REL_L2_BOUND

PAIRS = [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.bfloat16, torch.float16)]


def _paths():
    return ["kernels"] if ON_GPU else ["kernels", "reference"]


def _inputs(device, x_dtype, p_dtype, n=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(33, n, generator=g) * 2 + 0.5).to(device, x_dtype)
    r = torch.randn(33, n, generator=g).to(device, x_dtype)
    w = (torch.randn(n, generator=g) * 0.5 + 1).to(device, p_dtype)
    b = torch.randn(n, generator=g).to(device, p_dtype)
    dy = torch.randn(33, n, generator=g).to(device, x_dtype)
    return x, r, w, b, dy


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("x_dtype,p_dtype", PAIRS)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_norm_parameters_of_another_float_dtype(device, monkeypatch, path, x_dtype, p_dtype, rms, residual):
    if path == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, r, w, b, dy = _inputs(device, x_dtype, p_dtype)
    leaves = [t.clone().requires_grad_() for t in (x, w, b, r)]
    xl, wl, bl, rl = leaves
    if rms:
        out = tilefuse.rms_norm(xl, (70,), wl, 1e-5, residual=rl if residual else None)
    else:
        out = tilefuse.layer_norm(xl, (70,), wl, bl, 1e-5, residual=rl if residual else None)
    y = out[0] if residual else out
    assert y.dtype == x_dtype
    used = [xl, wl] + ([] if rms else [bl]) + ([rl] if residual else [])
    grads = torch.autograd.grad(y, used, dy)
    assert [g.dtype for g in grads] == [t.dtype for t in used]
    # float64 truth
    ref = [t.double().requires_grad_() for t in (x, w, b, r)]
    h = ref[0] + ref[3] if residual else ref[0]
    want_y = F.rms_norm(h, (70,), ref[1], 1e-5) if rms else F.layer_norm(h, (70,), ref[1], ref[2], 1e-5)
    ref_used = [ref[0], ref[1]] + ([] if rms else [ref[2]]) + ([ref[3]] if residual else [])
    want = torch.autograd.grad(want_y, ref_used, dy.double())
    bound = REL_L2_BOUND[x_dtype]
    assert_close(y, want_y, bound, "output")
    for i, (got, exp) in enumerate(zip(grads, want)):
        assert_close(got, exp, REL_L2_BOUND[got.dtype] if got.dtype != torch.float32 else bound, f"grad {i}")


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_layer_norm_linear_norm_parameters_of_another_dtype(device, monkeypatch, path, norm):
    if path == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, _, nw, nb, _ = _inputs(device, torch.bfloat16, torch.float32)
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(45, 70, generator=g) / 70 ** 0.5).to(device, torch.bfloat16)
    out = tilefuse.layer_norm_linear(x, nw, nb, w, None, eps=1e-5, norm=norm)
    assert out.dtype == torch.bfloat16
    xn = F.rms_norm(x.double(), (70,), nw.double(), 1e-5) if norm == "rms" else \
        F.layer_norm(x.double(), (70,), nw.double(), nb.double(), 1e-5)
    assert_close(out, F.linear(xn, w.double()), REL_L2_BOUND[torch.bfloat16], f"layer_norm_linear {norm}")
    # Gradients: each in its parameter's dtype, as torch's autograd gives them.
    leaves = [t.clone().requires_grad_() for t in (x, nw, nb, w)]
    dy = torch.randn(out.shape, generator=g).to(device, torch.bfloat16)
    lx, lnw, lnb, lw = leaves
    tilefuse.layer_norm_linear(lx, lnw, lnb if norm == "layer" else None, lw, None, eps=1e-5, norm=norm).backward(dy)
    ref = [t.detach().double().requires_grad_() for t in (x, nw, nb, w)]
    rxn = F.rms_norm(ref[0], (70,), ref[1], 1e-5) if norm == "rms" else \
        F.layer_norm(ref[0], (70,), ref[1], ref[2], 1e-5)
    F.linear(rxn, ref[3]).backward(dy.double())
    for name, got, want, like in zip(("x", "norm_weight", "norm_bias", "weight"), leaves, ref, (x, nw, nb, w)):
        if name == "norm_bias" and norm == "rms":
            assert got.grad is None
            continue
        assert got.grad.dtype == like.dtype, name
        assert_close(got.grad, want.grad, REL_L2_BOUND[torch.bfloat16], f"layer_norm_linear {norm} d{name}")


def test_what_torch_refuses_stays_a_type_error(device):
    x = torch.randn(4, 8, device=device, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="x has dtype int64"):
        tilefuse.layer_norm(torch.ones(4, 8, dtype=torch.int64, device=device), (8,))
    with pytest.raises(TypeError, match="weight has dtype int32"):
        tilefuse.rms_norm(x, (8,), torch.ones(8, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="dtype"):  # a linear weight of another dtype than x: torch refuses too
        tilefuse.linear(x, torch.randn(3, 8, device=device))
    with pytest.raises(TypeError, match="residual has dtype"):
        tilefuse.layer_norm(x, (8,), residual=x.float())
