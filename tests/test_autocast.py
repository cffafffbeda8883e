"""Inside torch.autocast a tilefuse op returns the dtype torch's op returns (GEMMs and attention in the
autocast dtype; the norms and softmax as torch's per-device autocast lists say), and fused ops without a
torch counterpart run in the autocast dtype. CPU autocast here; the GPU runs the same tests on CUDA."""
import pytest
import torch
import torch.nn.functional as F

import tilefuse
from helpers import ON_GPU, assert_close
from tilefuse.opspec import REL_L2_BOUND

DEV = "cuda" if ON_GPU else "cpu"
BF16 = torch.bfloat16


def _r(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV) * scale


def _cases():
    x, w, b = _r(33, 70), _r(45, 70, seed=1, scale=70 ** -0.5), _r(45, seed=2)
    g = _r(70, seed=3) * 0.5 + 1
    q, k = _r(1, 2, 37, 16, seed=4), _r(1, 2, 50, 16, seed=5)
    return [
        ("linear", lambda: tilefuse.linear(x, w, b, "gelu"), lambda: F.gelu(F.linear(x, w, b))),
        ("swiglu", lambda: tilefuse.linear(x, (w, w), None, "swiglu"), lambda: F.silu(F.linear(x, w)) * F.linear(x, w)),
        ("layer_norm", lambda: tilefuse.layer_norm(x, (70,), g, g), lambda: F.layer_norm(x, (70,), g, g)),
        ("rms_norm", lambda: tilefuse.rms_norm(x, (70,), g, 1e-5), lambda: F.rms_norm(x, (70,), g, 1e-5)),
        ("softmax", lambda: tilefuse.softmax(x, -1), lambda: torch.softmax(x, -1)),
        ("sdpa", lambda: tilefuse.scaled_dot_product_attention(q, k, k),
         lambda: F.scaled_dot_product_attention(q, k, k)),
    ]


@pytest.mark.parametrize("index", range(6))
def test_ops_return_what_torch_returns_under_autocast(index):
    name, ours, theirs = _cases()[index]
    with torch.autocast(DEV, dtype=BF16):
        got, want = ours(), theirs()
    assert got.dtype == want.dtype, f"{name}: {got.dtype} vs torch's {want.dtype}"
    assert_close(got, want.double(), REL_L2_BOUND[BF16], f"{name} under autocast")


def test_fused_ops_without_torch_counterpart_run_in_the_autocast_dtype():
    x, w, g = _r(33, 70), _r(45, 70, seed=1, scale=70 ** -0.5), _r(70, seed=3)
    with torch.autocast(DEV, dtype=BF16):
        out = tilefuse.layer_norm_linear(x, g, None, w, eps=1e-5, norm="rms")
        q = _r(1, 2, 37, 16, seed=4)
        att = tilefuse.attention(q, q, q, causal=True)
    assert out.dtype == BF16 and att.dtype == BF16
    want = F.linear(F.rms_norm(x.double(), (70,), g.double(), 1e-5), w.double())
    assert_close(out, want, REL_L2_BOUND[BF16], "layer_norm_linear under autocast")


def test_a_training_step_under_autocast_matches_eager_autocast():
    torch.manual_seed(0)
    ours, ref = tilefuse.nn.RMSNorm(70, eps=1e-5, device=DEV), torch.nn.RMSNorm(70, eps=1e-5, device=DEV)
    ref.load_state_dict(ours.state_dict())
    x, target = _r(33, 70), _r(33, 70, seed=9)
    for mod in (ours, ref):
        with torch.autocast(DEV, dtype=BF16):
            loss = F.mse_loss(mod(x).float(), target)
        loss.backward()
    assert ours.weight.grad.dtype == torch.float32
    assert_close(ours.weight.grad, ref.weight.grad.double(), REL_L2_BOUND[BF16], "RMSNorm dweight under autocast")


def test_a_linear_training_step_under_autocast_matches_eager_autocast():
    """fp32 parameters, bf16 compute under autocast: gradients arrive in fp32 on the parameters, as torch's."""
    torch.manual_seed(0)
    ours = tilefuse.nn.Linear(70, 45, activation="gelu", device=DEV)
    ref = torch.nn.Linear(70, 45, device=DEV)
    ref.load_state_dict(ours.state_dict())
    x, target = _r(33, 70), _r(33, 45, seed=9)
    for mod, act in ((ours, lambda t: t), (ref, F.gelu)):
        with torch.autocast(DEV, dtype=BF16):
            out = act(mod(x))
            assert out.dtype == BF16
            loss = F.mse_loss(out.float(), target)
        loss.backward()
    for name in ("weight", "bias"):
        got, want = getattr(ours, name).grad, getattr(ref, name).grad
        assert got.dtype == torch.float32
        assert_close(got, want.double(), REL_L2_BOUND[BF16], f"Linear d{name} under autocast")


def test_compiled_under_autocast():
    x, w, b = _r(33, 70), _r(45, 70, seed=1, scale=70 ** -0.5), _r(45, seed=2)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: tilefuse.layer_norm(tilefuse.linear(x, w, b, "gelu"), (45,)), fullgraph=True,
                       backend="inductor" if ON_GPU else "aot_eager")
    with torch.autocast(DEV, dtype=BF16):
        got = fn(x)
        want = F.layer_norm(F.gelu(F.linear(x, w, b)), (45,))
    assert got.dtype == want.dtype
    assert_close(got, want.double(), REL_L2_BOUND[BF16], "compiled under autocast")


def test_direct_torch_ops_calls_follow_the_same_rules():
    """The custom ops carry autocast kernels of their own: a direct torch.ops.tilefuse call under autocast
    returns what the public function returns (GEMMs and attention in the autocast dtype, the norms and
    softmax as torch's own ops under the same autocast state)."""
    x, w, b = _r(33, 70), _r(45, 70, seed=1, scale=70 ** -0.5), _r(45, seed=2)
    g = _r(70, seed=3) * 0.5 + 1
    q = _r(1, 2, 37, 16, seed=4)
    ops = torch.ops.tilefuse
    with torch.autocast(DEV, dtype=BF16):
        pairs = [
            (ops.linear(x, w, b, "gelu", False)[0], tilefuse.linear(x, w, b, "gelu")),
            (ops.gated_linear(x, w, w, None, None, "swiglu", False)[0], tilefuse.linear(x, (w, w), None, "swiglu")),
            (ops.layer_norm_linear(x, g, None, w, b, 1e-5, "rms", None, False)[0],
             tilefuse.layer_norm_linear(x, g, None, w, b, eps=1e-5, norm="rms")),
            (ops.layer_norm(x, None, g, g, [70], 1e-5)[0], tilefuse.layer_norm(x, (70,), g, g)),
            (ops.rms_norm(x, None, g, [70], 1e-5)[0], tilefuse.rms_norm(x, (70,), g, 1e-5)),
            (ops.softmax(x, -1, "auto"), tilefuse.softmax(x, -1)),
            (ops.attention(q, q, q, None, None, True, -1, -1, False)[0], tilefuse.attention(q, q, q)),
        ]
    for i, (direct, public) in enumerate(pairs):
        assert direct.dtype == public.dtype, f"case {i}: {direct.dtype} vs the public function's {public.dtype}"
        assert torch.equal(direct, public), f"case {i}"


@pytest.mark.parametrize("path", ["kernels", "reference"])
def test_the_loss_is_fp32_on_every_path(monkeypatch, path):
    """linear_cross_entropy under autocast: the GEMM in the autocast dtype, the loss fp32 (as documented)
    whether the kernels or the plain-PyTorch reference (a CPU without the interpreter) answer."""
    if path == "reference":
        if ON_GPU:
            pytest.skip("the reference path is a CPU's without the interpreter")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w = _r(33, 70), _r(45, 70, seed=1, scale=70 ** -0.5)
    t = torch.randint(0, 45, (33,), generator=torch.Generator().manual_seed(4)).to(DEV)
    with torch.autocast(DEV, dtype=BF16):
        loss = tilefuse.linear_cross_entropy(x, w, t)
        rows = tilefuse.linear_cross_entropy(x, w, t, reduction="none")
    assert loss.dtype == torch.float32 and rows.dtype == torch.float32
    want = F.cross_entropy(F.linear(x.to(BF16).double(), w.to(BF16).double()), t)
    assert_close(loss, want, 1e-3, f"loss under autocast ({path})")


def test_qkv_projection_runs_its_gemms_in_the_autocast_dtype():
    """qkv_projection follows the GEMM rule (torch's linear under autocast): q, k, v in the autocast dtype,
    fp32 rotary tables and QK-norm weights taken as they are; a direct torch.ops call does the same."""
    B, N, K, H, Hkv, d = 2, 9, 48, 4, 2, 8
    x = _r(B, N, K)
    w = _r((H + 2 * Hkv) * d, K, seed=1, scale=K ** -0.5)
    b = _r((H + 2 * Hkv) * d, seed=2)
    ang = torch.arange(N, dtype=torch.float32, device=DEV)[:, None] * torch.linspace(0.1, 1, d // 2, device=DEV)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    qn, kn = _r(d, seed=3) * 0.2 + 1, _r(d, seed=5) * 0.2 + 1
    with torch.autocast(DEV, dtype=BF16):
        q, k, v = tilefuse.qkv_projection(x, w, b, num_heads=H, num_kv_heads=Hkv, rotary=(cos, sin),
                                          qk_norm=(qn, kn, 1e-6))
        plain = F.linear(x, w, b)
    assert plain.dtype == BF16
    assert q.dtype == k.dtype == v.dtype == BF16
    from tilefuse.reference import qkv_projection as reference_qkv
    xb, wb, bb = (t.to(BF16).double() for t in (x, w, b))
    want = reference_qkv(xb, wb.split([H * d, Hkv * d, Hkv * d]), bb.split([H * d, Hkv * d, Hkv * d]), H, Hkv,
                         (cos.double(), sin.double()), False, (qn.double(), kn.double(), 1e-6))
    for got, ref, name in zip((q, k, v), want, "qkv"):
        assert_close(got, ref, REL_L2_BOUND[BF16], f"{name} under autocast")
