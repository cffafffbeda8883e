"""tilefuse.nn.Linear / GatedMLP / LayerNormLinear: state dicts as torch's, shared parameters, outputs and
gradients against the torch modules' eager composition in float64.

Each case pairs a tilefuse module with the torch modules it stands for (``nn.Linear``; a ModuleDict of
``gate_proj``/``up_proj``/``down_proj``, the Llama MLP layout; a ModuleDict of ``norm``/``linear``).
Shapes are tiny: on a CPU the kernels run in the Triton interpreter.
"""
import copy
from typing import Callable, NamedTuple, Optional

import pytest
import torch
import torch.nn.functional as F

import tilefuse.nn as tnn
from helpers import assert_close

H, I = 24, 40  # in/hidden and out/intermediate features
BOUND = 1e-5  # fp32 against float64

ACT = {None: lambda t: t, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu,
       "silu": F.silu}


class Case(NamedTuple):
    eager: Callable[[], torch.nn.Module]  # the torch modules (fp32, CPU)
    ours: Optional[Callable[[], torch.nn.Module]]  # the tilefuse constructor giving the same state dict
    share: Callable[[torch.nn.Module], torch.nn.Module]  # the tilefuse from_* wrapping the eager modules
    ref: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]  # eager forward of the torch modules


def _linear(act, bias=True):
    return Case(lambda: torch.nn.Linear(H, I, bias=bias),
                lambda: tnn.Linear(H, I, bias=bias, activation=act),
                lambda m: tnn.Linear.from_linear(m, activation=act),
                lambda m, x: ACT[act](m(x)))


def _mlp(act, bias=False, down_bias=None, ctor=True):
    down_bias = bias if down_bias is None else down_bias

    def eager():
        return torch.nn.ModuleDict({"gate_proj": torch.nn.Linear(H, I, bias=bias),
                                    "up_proj": torch.nn.Linear(H, I, bias=bias),
                                    "down_proj": torch.nn.Linear(I, H, bias=down_bias)})
    return Case(eager, (lambda: tnn.GatedMLP(H, I, activation=act, bias=bias)) if ctor else None,
                lambda m: tnn.GatedMLP.from_modules(m["gate_proj"], m["up_proj"], m["down_proj"], activation=act),
                lambda m, x: m["down_proj"](ACT[act](m["gate_proj"](x)) * m["up_proj"](x)))


def _norm_linear(kind, act, linear_bias=True, eps=1e-5, ctor=True, **norm_kwargs):
    """norm_kwargs go to the torch norm only (elementwise_affine, bias): no tilefuse constructor for those."""
    def eager():
        norm = (torch.nn.LayerNorm if kind == "layer" else torch.nn.RMSNorm)(H, eps=eps, **norm_kwargs)
        return torch.nn.ModuleDict({"norm": norm, "linear": torch.nn.Linear(H, I, bias=linear_bias)})
    return Case(eager,
                (lambda: tnn.LayerNormLinear(H, I, bias=linear_bias, eps=eps, norm=kind, activation=act)) if ctor
                else None,
                lambda m: tnn.LayerNormLinear.from_modules(m["norm"], m["linear"], activation=act),
                lambda m, x: ACT[act](m["linear"](m["norm"](x))))


CASES = {
    "Linear-none": _linear(None),
    "Linear-gelu": _linear("gelu"),
    "Linear-gelu_tanh-nobias": _linear("gelu_tanh", bias=False),
    "Linear-relu": _linear("relu"),
    "Linear-silu-nobias": _linear("silu", bias=False),
    "GatedMLP-silu": _mlp("silu"),
    "GatedMLP-gelu-bias": _mlp("gelu", bias=True),
    "GatedMLP-gelu_tanh": _mlp("gelu_tanh"),
    "GatedMLP-silu-down_bias_only": _mlp("silu", down_bias=True, ctor=False),
    "GatedMLP-gelu-gate_up_bias_only": _mlp("gelu", bias=True, down_bias=False, ctor=False),
    "LayerNormLinear-layer-gelu": _norm_linear("layer", "gelu"),
    "LayerNormLinear-layer-eps1e-3-nobias": _norm_linear("layer", None, linear_bias=False, eps=1e-3),
    "LayerNormLinear-layer-no_affine-relu": _norm_linear("layer", "relu", ctor=False, elementwise_affine=False),
    "LayerNormLinear-layer-no_norm_bias-silu": _norm_linear("layer", "silu", ctor=False, bias=False),
    "LayerNormLinear-rms-silu": _norm_linear("rms", "silu", eps=1e-6),
    "LayerNormLinear-rms-eps_none-gelu_tanh": _norm_linear("rms", "gelu_tanh", eps=None),
    "LayerNormLinear-rms-no_affine": _norm_linear("rms", None, ctor=False, elementwise_affine=False),
}
WITH_CTOR = [name for name, c in CASES.items() if c.ours is not None]


def _eager(case, device):
    """The torch modules with non-trivial parameters (a swapped weight/bias or gate/up would show)."""
    torch.manual_seed(0)
    m = case.eager()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + (0.3 if p.dim() == 1 else 0.0))
    return m.to(device)


def _input(device, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 5, H, generator=g) * 2 + 0.5).to(device)  # nonzero mean: the norms' centring shows


def _shapes(module):
    return [(k, tuple(v.shape)) for k, v in module.state_dict().items()]


@pytest.mark.parametrize("name", WITH_CTOR)
def test_state_dict_is_torchs_and_loads_both_ways(device, name):
    case = CASES[name]
    eager, ours = _eager(case, device), case.ours().to(device)
    assert _shapes(ours) == _shapes(eager)  # keys (in order) and shapes; the activation is no entry
    ours.load_state_dict(eager.state_dict())  # torch -> tilefuse (strict)
    back = case.eager().to(device)
    back.load_state_dict(ours.state_dict())  # tilefuse -> torch (strict)
    for (k, a), (_, b) in zip(back.state_dict().items(), eager.state_dict().items()):
        assert torch.equal(a, b), k


def test_gated_mlp_uses_the_llama_names():
    assert list(tnn.GatedMLP(H, I).state_dict()) == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    assert list(tnn.GatedMLP(H, I, bias=True).state_dict()) == [
        "gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias", "down_proj.weight", "down_proj.bias"]
    assert list(tnn.LayerNormLinear(H, I, norm="rms").state_dict()) == ["norm.weight", "linear.weight", "linear.bias"]


def test_linear_is_a_torch_linear_with_activation_in_repr():
    lin = tnn.Linear(H, I, activation="gelu")
    assert isinstance(lin, torch.nn.Linear) and lin.activation == "gelu"
    assert repr(lin) == f"Linear(in_features={H}, out_features={I}, bias=True, activation='gelu')"


@pytest.mark.parametrize("name", WITH_CTOR)
def test_forward_matches_torch(device, name):
    case = CASES[name]
    eager, ours = _eager(case, device), case.ours().to(device)
    ours.load_state_dict(eager.state_dict())
    x = _input(device)
    with torch.no_grad():
        y = ours(x)
        ref = case.ref(copy.deepcopy(eager).double(), x.double())
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert_close(y, ref, BOUND, f"{name} forward")


@pytest.mark.parametrize("name", list(CASES))
def test_from_modules_shares_the_parameters(device, name):
    case = CASES[name]
    eager = _eager(case, device)
    ours = case.share(eager)
    assert _shapes(ours) == _shapes(eager)
    params = dict(ours.named_parameters())
    assert params.keys() == dict(eager.named_parameters()).keys()
    for k, p in eager.named_parameters():
        assert params[k] is p, k  # the very Parameter objects, not copies
    assert all(p.device.type != "meta" for p in ours.parameters())
    if isinstance(eager, torch.nn.Linear):
        assert (ours.in_features, ours.out_features) == (eager.in_features, eager.out_features)
    else:
        for child in eager:
            assert getattr(ours, child) is eager[child]
    # The shared module computes with the originals' values (forward only: no grad needed here).
    x = _input(device)
    with torch.no_grad():
        assert_close(ours(x), case.ref(copy.deepcopy(eager).double(), x.double()), BOUND, f"{name} shared forward")


@pytest.mark.parametrize("name", list(CASES))
def test_backward_matches_torch(device, name):
    case = CASES[name]
    eager = _eager(case, device)
    eager64 = copy.deepcopy(eager).double()
    ours = case.share(eager)
    x = _input(device).requires_grad_()
    y = ours(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(device)
    (y * dy).sum().backward()

    x64 = x.detach().double().requires_grad_()
    y64 = case.ref(eager64, x64)
    (y64 * dy.double()).sum().backward()
    assert_close(y, y64, BOUND, f"{name} forward")
    assert_close(x.grad, x64.grad, BOUND, f"{name} dx")
    for (k, p), (_, p64) in zip(eager.named_parameters(), eager64.named_parameters()):
        assert p.grad is not None, f"{name}: no gradient for {k}"
        assert_close(p.grad, p64.grad, BOUND, f"{name} d{k}")


@pytest.mark.parametrize("name", ["Linear-gelu", "GatedMLP-gelu-bias", "LayerNormLinear-layer-gelu"])
def test_optimizer_on_the_originals_trains_through_tilefuse(device, name):
    case = CASES[name]
    eager = _eager(case, device)
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)  # built before the tilefuse module exists
    ours = case.share(eager)
    before = {k: p.detach().clone() for k, p in eager.named_parameters()}
    ours(_input(device)).pow(2).mean().backward()
    opt.step()
    for k, p in eager.named_parameters():
        assert not torch.equal(before[k], p.detach()), f"{name}: {k} not updated"
        assert_close(before[k] - 0.1 * p.grad, p.detach(), 1e-6, f"{name} {k} step")


@pytest.mark.parametrize("build", [
    lambda: tnn.Linear(H, I, activation="tanh"),
    lambda: tnn.Linear(H, I, activation="swiglu"),  # gated: GatedMLP's job
    lambda: tnn.GatedMLP(H, I, activation="relu"),
    lambda: tnn.GatedMLP(H, I, activation="swiglu"),  # the gate's function is named, not the GLU
    lambda: tnn.GatedMLP(H, I, activation=None),
    lambda: tnn.LayerNormLinear(H, I, activation="geglu"),
    lambda: tnn.LayerNormLinear.from_modules(torch.nn.LayerNorm(H), torch.nn.Linear(H, I), activation="tanh"),
], ids=["Linear-tanh", "Linear-swiglu", "GatedMLP-relu", "GatedMLP-swiglu", "GatedMLP-None", "LayerNormLinear-geglu",
        "LayerNormLinear.from_modules-tanh"])
def test_bad_activation_is_refused(build):
    with pytest.raises(ValueError, match="activation"):
        build()


def test_bad_norm_is_refused():
    with pytest.raises(ValueError, match="norm"):
        tnn.LayerNormLinear(H, I, norm="batch")


def _lin(i, o, bias=False):
    return torch.nn.Linear(i, o, bias=bias)


@pytest.mark.parametrize("build,match", [
    (lambda: tnn.Linear.from_linear(torch.nn.Conv1d(H, I, 1)), "TypeError:linear"),
    (lambda: tnn.GatedMLP.from_modules(_lin(H, I), _lin(H, I + 1), _lin(I, H)), "up_proj"),
    (lambda: tnn.GatedMLP.from_modules(_lin(H, I), _lin(H, I), _lin(I, H + 1)), "down_proj"),
    (lambda: tnn.GatedMLP.from_modules(_lin(H, I), _lin(H, I), _lin(H, I)), "down_proj"),
    (lambda: tnn.GatedMLP.from_modules(_lin(H, I, bias=True), _lin(H, I), _lin(I, H)), "bias"),
    (lambda: tnn.GatedMLP.from_modules(_lin(H, I), torch.nn.Identity(), _lin(I, H)), "TypeError:up_proj"),
    (lambda: tnn.LayerNormLinear.from_modules(torch.nn.LayerNorm(H + 1), _lin(H, I)), "normalized_shape"),
    (lambda: tnn.LayerNormLinear.from_modules(torch.nn.LayerNorm((2, H)), _lin(H, I)), "normalized_shape"),
    (lambda: tnn.LayerNormLinear.from_modules(torch.nn.RMSNorm(H + 1), _lin(H, I)), "normalized_shape"),
    (lambda: tnn.LayerNormLinear.from_modules(torch.nn.BatchNorm1d(H), _lin(H, I)), "TypeError:norm"),
    (lambda: tnn.LayerNormLinear.from_modules(torch.nn.LayerNorm(H), torch.nn.Identity()), "TypeError:linear"),
], ids=["Linear-not_a_linear", "GatedMLP-up_shape", "GatedMLP-down_shape", "GatedMLP-down_not_transposed",
        "GatedMLP-bias_on_gate_only", "GatedMLP-not_a_linear", "LayerNormLinear-width", "LayerNormLinear-2d_norm",
        "LayerNormLinear-rms_width", "LayerNormLinear-batch_norm", "LayerNormLinear-not_a_linear"])
def test_from_modules_refuses_mismatches(build, match):
    """A module of the wrong kind is a TypeError, one of the wrong shape a ValueError; both name it."""
    exc = TypeError if match.startswith("TypeError:") else ValueError
    with pytest.raises(exc, match=match.removeprefix("TypeError:")):
        build()
