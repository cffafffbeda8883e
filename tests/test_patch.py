"""tilefuse.patch on a hand-built model the patcher has never seen: a renamed RMSNorm, a gate/up/down MLP,
a Sequential MLP with GELU, torch's LayerNorm, and parts it must refuse (Gemma's 1 + w norm, LoRA)."""
import copy
import io

import pytest
import torch
import torch.nn.functional as F

import tilefuse
from helpers import ON_GPU, assert_close, train_losses
from tilefuse.opspec import REL_L2_BOUND

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
DEV = "cuda" if ON_GPU else "cpu"
H = 64 if ON_GPU else 24


class MyRMSNorm(torch.nn.Module):  # Hugging Face's pattern, under another name
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(n) + 0.5)
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class GemmaLikeRMSNorm(MyRMSNorm):  # scales by 1 + weight: a plain RMSNorm must not replace it
    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class SiLUActivation(torch.nn.Module):  # a foreign activation class, recognised by what it computes
    def forward(self, x):
        return F.silu(x)


class GateUpDown(torch.nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(h, i, bias=False), torch.nn.Linear(h, i, bias=False)
        self.down_proj, self.act_fn = torch.nn.Linear(i, h, bias=False), SiLUActivation()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LoraLinear(torch.nn.Linear):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.lora_A = torch.nn.Linear(self.in_features, 2, bias=False)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.mlp1 = MyRMSNorm(H), GateUpDown(H, 2 * H)
        self.norm2 = torch.nn.LayerNorm(H)
        self.mlp2 = torch.nn.Sequential(torch.nn.Linear(H, 3 * H), torch.nn.GELU(approximate="tanh"),
                                        torch.nn.Linear(3 * H, H))
        self.norm3 = GemmaLikeRMSNorm(H)
        self.adapter = torch.nn.Sequential(LoraLinear(H, H), torch.nn.ReLU())

    def forward(self, x):
        x = x + self.mlp1(self.norm1(x))
        x = x + self.mlp2(self.norm2(x))
        return self.adapter(self.norm3(x))


def _model():
    torch.manual_seed(0)
    return Block().to(DEV, DTYPE)


def test_patch_replaces_what_it_recognises_and_keeps_the_outputs():
    model = _model()
    ref = copy.deepcopy(model).double()  # the same (rounded) parameters, computed in float64
    x = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(1)).to(DEV, DTYPE)
    with torch.no_grad():
        want = ref(x.double())
    report = tilefuse.patch(model)
    replaced = {path: new for path, _, new, _ in report.replaced}
    assert replaced == {"norm1": "RMSNormModule", "mlp1": "GatedMLP", "norm2": "LayerNorm", "mlp2.0": "Linear",
                        "mlp2.1": "Identity"}, f"the 1 + w norm must fail its check, the rest pass:\n{report}"
    skipped = dict(report.skipped)
    assert "rel-L2" in skipped["norm3"]
    assert "LoRA" in skipped["adapter.0"]
    assert isinstance(model.mlp1, tilefuse.nn.GatedMLP) and model.mlp2[0].activation == "gelu_tanh"
    with torch.no_grad():
        got = model(x)
    assert_close(got, want, REL_L2_BOUND[DTYPE], "patched vs the float64 model")
    assert "replaced" in str(report) and "skipped" in str(report)


@pytest.mark.parametrize("backend", ["auto", "tilefuse", "vendor"])
def test_the_report_names_the_backend_in_force(backend):
    with tilefuse.use_backend(backend):
        report = tilefuse.patch(_model())
    assert report.backend == backend
    assert str(report).splitlines()[0].endswith(f"(backend {backend}: {tilefuse.patching.BACKEND_MEANING[backend]})")


def test_parameters_are_shared_and_state_dicts_unchanged():
    model = _model()
    before = {k: v for k, v in model.state_dict().items()}
    tilefuse.patch(model)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k].data_ptr() == before[k].data_ptr() for k in before)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    fresh = _model()
    tilefuse.patch(fresh)
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf))


def test_gradients_flow_and_training_matches():
    losses = []
    for patched in (False, True):
        model = _model()
        if patched:
            tilefuse.patch(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(2)).to(DEV, DTYPE)
        losses.append(train_losses(lambda: model(x).float().square().mean(), opt, 3))
    tol = 1e-2 if DTYPE == torch.bfloat16 else 1e-4
    for a, b in zip(*losses):
        assert abs(a - b) <= tol * abs(b), losses


def test_patching_twice_is_a_no_op_and_unpatch_restores_the_originals():
    model = _model()
    originals = {name: m for name, m in model.named_children()}
    mlp2_linear = model.mlp2[0]
    tilefuse.patch(model)
    again = tilefuse.patch(model)
    assert not again.replaced and "already patched" in again.skipped[0][1]
    tilefuse.unpatch(model)
    assert all(getattr(model, name) is m for name, m in originals.items())
    assert model.mlp2[0] is mlp2_linear and isinstance(model.mlp2[1], torch.nn.GELU)
    assert not tilefuse.unpatch(model).replaced  # a no-op now


class ResidualGELUBlock(torch.nn.Module):
    """A Linear and an activation side by side whose forward does not feed one into the other."""

    def __init__(self, n):
        super().__init__()
        self.dense, self.act = torch.nn.Linear(n, n), torch.nn.GELU()

    def forward(self, x):
        return self.act(x) + self.dense(x)


class DropoutMLP(torch.nn.Module):
    """BERT's intermediate with a dropout after it: a fusable pair inside a module with dropout."""

    def __init__(self, n):
        super().__init__()
        self.dense, self.act, self.drop = torch.nn.Linear(n, 2 * n), torch.nn.GELU(), torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.act(self.dense(x)))


def test_a_model_in_training_mode_is_probed_without_dropout_and_unproven_pairs_are_reported():
    """Patched in training mode: the probes run with dropout off (the fusable pair is replaced, and every
    module's mode is what it was), and a Linear + activation the probe cannot prove fusable is listed in the
    report's skipped entries with its reason."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(DropoutMLP(H), ResidualGELUBlock(2 * H)).to(DEV, DTYPE).train()
    model[1].eval()  # a mixed-mode model keeps each module's own mode
    report = tilefuse.patch(model)
    replaced = {path for path, *_ in report.replaced}
    assert {"0.dense", "0.act"} <= replaced, str(report)
    assert "1.dense" not in replaced
    skipped = dict(report.skipped)
    assert "1" in skipped and "dense" in skipped["1"] and "GELU" in skipped["1"], str(report)
    assert str(report).startswith(f"tilefuse.patch: {len(report.replaced)} replaced, {len(report.skipped)} skipped")
    assert model.training and model[0].training and model[0].drop.training and not model[1].training
