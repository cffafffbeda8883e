"""tilefuse.nn.LayerNorm / RMSNorm: drop-ins for torch.nn (state dicts, flags, outputs, gradients)."""
import pytest
import torch

import tilefuse.nn as tnn
from helpers import assert_close


def _pair(kind, shape, device, **kwargs):
    torch.manual_seed(0)
    ours = getattr(tnn, kind)(shape, device=device, **kwargs)
    theirs = getattr(torch.nn, kind)(shape, device=device, **kwargs)
    with torch.no_grad():  # non-trivial parameters so a swapped weight/bias would show
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p))
    return ours, theirs


@pytest.mark.parametrize("kind,kwargs", [
    ("LayerNorm", {}), ("LayerNorm", {"bias": False}), ("LayerNorm", {"elementwise_affine": False}),
    ("LayerNorm", {"eps": 1e-3}), ("RMSNorm", {}), ("RMSNorm", {"elementwise_affine": False}),
    ("RMSNorm", {"eps": 1e-6}),
])
def test_state_dict_round_trip_and_same_output(device, kind, kwargs):
    ours, theirs = _pair(kind, (5, 7), device, **kwargs)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())  # a torch state dict loads unchanged (strict)
    back = getattr(torch.nn, kind)((5, 7), device=device, **kwargs)
    back.load_state_dict(ours.state_dict())  # and ours loads into torch
    for a, b in zip(back.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    assert repr(ours).split("(", 1)[1] == repr(theirs).split("(", 1)[1]

    x = (torch.randn(3, 4, 5, 7) * 2 + 0.5).to(device).requires_grad_()
    y = ours(x)
    x64 = x.detach().double().requires_grad_()
    ref = theirs.double()(x64)
    assert_close(y, ref, 1e-5, f"{kind} {kwargs} forward")
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *ours.parameters()], dy)
    want = torch.autograd.grad(ref, [x64, *theirs.parameters()], dy.double())
    for g, w in zip(got, want):
        assert_close(g, w, 1e-5, f"{kind} {kwargs} grad")


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_residual_keyword(device, kind):
    ours, theirs = _pair(kind, 33, device)
    ours.load_state_dict(theirs.state_dict())
    x, r = torch.randn(4, 33, device=device), torch.randn(4, 33, device=device)
    y, h = ours(x, residual=r)
    assert torch.equal(h, x + r)
    assert_close(y, theirs.double()((x + r).double()), 1e-5, "residual")


def test_module_trains_one_step(device):
    # The parameters receive gradients through the module (an optimizer step changes them).
    norm = tnn.RMSNorm(16, device=device)
    opt = torch.optim.SGD(norm.parameters(), lr=0.1)
    before = norm.weight.detach().clone()
    loss = norm(torch.randn(8, 16, device=device)).pow(2).mean()
    loss.backward()
    opt.step()
    assert not torch.equal(before, norm.weight.detach())
