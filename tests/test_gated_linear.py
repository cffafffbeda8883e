"""Gated (GLU) epilogues of tilefuse.linear: argument forms, errors, NaN, no weight copies."""
import pytest
import torch

import tilefuse
from helpers import assert_close
from tilefuse import reference


def _rand(*shape, device, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "geglu_tanh"])
def test_pair_and_concat_forms_agree(device, activation):
    x = _rand(9, 24, device=device)
    w = _rand(2 * 13, 24, device=device, seed=1) / 5
    b = _rand(2 * 13, device=device, seed=2)
    y_cat = tilefuse.linear(x, w, b, activation)
    y_pair = tilefuse.linear(x, (w[:13], w[13:]), (b[:13], b[13:]), activation)
    assert y_cat.shape == (9, 13)
    assert torch.equal(y_cat, y_pair)
    ref = reference.gated_linear(x.double(), w[:13].double(), w[13:].double(), b[:13].double(),
                                 b[13:].double(), activation)
    assert_close(y_cat, ref, 1e-5, activation)


def test_gate_forms_are_distinct(device):
    # geglu (erf) and geglu_tanh must each match their own torch form, not each other.
    x = torch.linspace(-4, 4, 64, device=device).reshape(8, 8)
    eye = torch.eye(8, device=device)
    ones = torch.zeros(8, 8, device=device)
    b_up = torch.ones(8, device=device)
    erf = tilefuse.linear(x, (eye, ones), (torch.zeros(8, device=device), b_up), "geglu")
    tanh = tilefuse.linear(x, (eye, ones), (torch.zeros(8, device=device), b_up), "geglu_tanh")
    assert (erf - torch.nn.functional.gelu(x)).abs().max() < 1e-6
    assert (tanh - torch.nn.functional.gelu(x, approximate="tanh")).abs().max() < 1e-6
    assert (erf - tanh).abs().max() > 1e-4


def test_nan_in_gate_or_up_gives_nan(device):
    x = _rand(4, 8, device=device)
    x[1, 2] = float("nan")
    w = _rand(2 * 5, 8, device=device, seed=3)
    out = tilefuse.linear(x, w, None, "swiglu")
    assert out[1].isnan().all() and not out[[0, 2, 3]].isnan().any()


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(weight=torch.randn(9, 4)), ValueError, r"\[2N, K\]"),
    (dict(weight=(torch.randn(5, 4), torch.randn(6, 4))), ValueError, "must have one shape"),
    (dict(weight=(torch.randn(5, 4),)), ValueError, "pair"),
    (dict(weight=torch.randn(10, 4), bias=torch.randn(5)), ValueError, r"shape \[10\]"),
    (dict(weight=torch.randn(10, 4), bias=(torch.randn(5), None)), ValueError, "pair"),
    (dict(weight=(torch.randn(5, 4), torch.randn(5, 4, dtype=torch.float16))), TypeError, "W_up has dtype"),
    (dict(weight=(torch.randn(5, 3), torch.randn(5, 3))), ValueError, "W_up is"),
    (dict(weight=(torch.randn(5, 4), torch.randn(5, 4)), activation="gelu"), ValueError, "needs a gated"),
])
def test_bad_gated_input_raises(kwargs, exc, match):
    args = dict(x=torch.randn(3, 4), bias=None, activation="swiglu")
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        tilefuse.linear(**args)


def test_concatenated_weight_is_not_copied(device, monkeypatch):
    x = _rand(3, 8, device=device)
    w = _rand(2 * 6, 8, device=device, seed=4)
    calls = []
    real = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    tilefuse.linear(x, w, None, "swiglu")
    monkeypatch.setattr(torch.Tensor, "contiguous", real)
    assert not calls
