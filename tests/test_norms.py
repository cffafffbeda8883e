"""tilefuse.layer_norm / rms_norm / layer_norm_linear: behaviour beyond the registry grid (edges, NaN,
gradients with the residual, determinism, errors)."""
import pytest
import torch
import torch.nn.functional as F

import tilefuse
from helpers import ON_GPU, assert_close
from tilefuse.opspec import REL_L2_BOUND
from tilefuse.reference import norms as reference

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _rand(*shape, device, dtype=FP32, seed=0, mean=0.0, std=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * std + mean).to(device=device, dtype=dtype)


def _grads_vs_float64(op, x, weight, bias, residual, dy, dh, eps):
    """Gradients of the tilefuse op and of the float64 reference for the same inputs."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias, residual)]
    leaves64 = [t.detach().double().requires_grad_() for t in (x, weight, bias, residual)]
    shape = (x.shape[-1],)
    if op == "layer":
        out = tilefuse.layer_norm(leaves[0], shape, leaves[1], leaves[2], eps, residual=leaves[3])
        ref = reference.layer_norm(leaves64[0], shape, leaves64[1], leaves64[2], eps, residual=leaves64[3])
    else:
        leaves, leaves64 = leaves[:2] + leaves[3:], leaves64[:2] + leaves64[3:]
        out = tilefuse.rms_norm(leaves[0], shape, leaves[1], eps, residual=leaves[2])
        ref = reference.rms_norm(leaves64[0], shape, leaves64[1], eps, residual=leaves64[2])
    got = torch.autograd.grad(out, leaves, (dy, dh))
    want = torch.autograd.grad(ref, leaves64, (dy.double(), dh.double()))
    return out, ref, got, want


@pytest.mark.parametrize("op", ["layer", "rms"])
@pytest.mark.parametrize("N", [70, 300])  # 300 loops over chunks in the interpreter (cap 128)
@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_residual_forward_and_every_gradient(device, op, N, dtype):
    M = 9
    x = _rand(M, N, device=device, dtype=dtype, mean=0.5, std=2.0)
    residual = _rand(M, N, device=device, dtype=dtype, seed=1)
    weight = _rand(N, device=device, dtype=dtype, seed=2, mean=1.0, std=0.5)
    bias = _rand(N, device=device, dtype=dtype, seed=3)
    dy, dh = _rand(M, N, device=device, dtype=dtype, seed=4), _rand(M, N, device=device, dtype=dtype, seed=5)
    eps = torch.finfo(dtype).eps if op == "rms" else 1e-5
    (y, h), (y_ref, h_ref), got, want = _grads_vs_float64(op, x, weight, bias, residual, dy, dh, eps)
    bound = REL_L2_BOUND[dtype]
    assert_close(h, h_ref, bound, "h = x + residual")
    assert_close(y, y_ref, bound, "y")
    names = ["dx", "dweight", "dbias", "dresidual"] if op == "layer" else ["dx", "dweight", "dresidual"]
    for name, g, w in zip(names, got, want):
        assert g.dtype == dtype, name
        assert_close(g, w, bound, name)


@pytest.mark.usefixtures("tilefuse_backend")
def test_layer_norm_row_of_one(device):
    # A row of one element normalizes to 0: y is the bias, and dx, dweight are exactly 0.
    x = _rand(5, 1, device=device).requires_grad_()
    w = _rand(1, device=device, seed=1).requires_grad_()
    b = _rand(1, device=device, seed=2).requires_grad_()
    y = tilefuse.layer_norm(x, (1,), w, b)
    assert torch.equal(y.detach(), b.detach().expand(5, 1))
    dx, dw, db = torch.autograd.grad(y, (x, w, b), torch.ones_like(y))
    assert dx.abs().max() == 0 and dw.abs().max() == 0
    assert db.item() == 5.0
    r = tilefuse.rms_norm(x.detach(), (1,), None, 1e-6)
    assert_close(r, F.rms_norm(x.detach().double(), (1,), None, 1e-6), 1e-5, "rms N=1")


@pytest.mark.parametrize("op", ["layer", "rms"])
def test_zero_rows(device, op):
    x = torch.empty(0, 3, 8, device=device).requires_grad_()
    w = torch.ones(8, device=device).requires_grad_()
    res = torch.empty(0, 3, 8, device=device)
    if op == "layer":
        y, h = tilefuse.layer_norm(x, (8,), w, None, residual=res)
    else:
        y, h = tilefuse.rms_norm(x, (8,), w, residual=res)
    assert y.shape == (0, 3, 8) and h.shape == (0, 3, 8)
    dx, dw = torch.autograd.grad(y, (x, w), torch.empty_like(y))
    assert dx.shape == x.shape and torch.equal(dw, torch.zeros_like(w))


@pytest.mark.parametrize("rows", [0, 5])
@pytest.mark.parametrize("affine", ["weight", "bias", "both"])
def test_layer_norm_parameter_gradients_each_alone_and_together(device, rows, affine):
    """dweight and dbias come out of one fp32 partial buffer and one cast: each must land on its own
    parameter, in its dtype and shape (normalized over two dims), whether asked for alone or together,
    and as zeros for zero rows."""
    x = _rand(rows, 4, 6, device=device, dtype=BF16, mean=0.5).requires_grad_()
    w = _rand(4, 6, device=device, dtype=BF16, seed=1, mean=1.0).requires_grad_() if affine != "bias" else None
    b = _rand(4, 6, device=device, dtype=BF16, seed=2).requires_grad_() if affine != "weight" else None
    dy = _rand(rows, 4, 6, device=device, dtype=BF16, seed=3)
    params = [t for t in (w, b) if t is not None]
    got = torch.autograd.grad(tilefuse.layer_norm(x, (4, 6), w, b), params, dy)
    ref_params = [t.detach().double().requires_grad_() for t in params]
    rw = ref_params[0] if w is not None else None
    rb = ref_params[-1] if b is not None else None
    ref = torch.autograd.grad(F.layer_norm(x.detach().double(), (4, 6), rw, rb), ref_params, dy.double())
    for g, r, p in zip(got, ref, params):
        assert g.dtype == p.dtype and g.shape == p.shape
        if rows == 0:
            assert torch.equal(g, torch.zeros_like(p))
        else:
            assert_close(g, r, REL_L2_BOUND[BF16], f"{affine} grad")


@pytest.mark.parametrize("op", ["layer", "rms"])
def test_nan_stays_in_its_row(device, op):
    x = _rand(6, 300, device=device)  # chunked path: the NaN must not leak into other rows
    x[2, 150] = float("nan")
    y = tilefuse.layer_norm(x, (300,)) if op == "layer" else tilefuse.rms_norm(x, (300,))
    assert y[2].isnan().all()
    assert not y[[0, 1, 3, 4, 5]].isnan().any()


def test_chunked_variance_is_stable_with_a_large_mean(device):
    # |mean| / std = 1e4 in fp32: a sum / sum-of-squares variance would lose every digit; the
    # per-chunk (count, mean, M2) merge must stay at the fp32 bound.
    x = _rand(4, 300, device=device, mean=1e4, std=1.0)
    y = tilefuse.layer_norm(x, (300,))
    assert_close(y, F.layer_norm(x.double(), (300,)), 1e-3, "large mean")


def test_rms_default_eps_is_the_dtype_eps(device):
    # Tiny inputs make eps matter: mean(x^2) ~ 1e-8 against finfo(fp32).eps ~ 1.2e-7.
    x = _rand(7, 33, device=device, std=1e-4)
    y = tilefuse.rms_norm(x, (33,))
    assert_close(y, F.rms_norm(x.double(), (33,), None, torch.finfo(FP32).eps), 1e-5, "finfo eps")
    assert (y.double() - F.rms_norm(x.double(), (33,), None, 1e-6)).abs().max() > 0.1


def test_multi_dim_normalized_shape_gradients(device):
    x = _rand(3, 4, 5, 7, device=device).requires_grad_()
    w = _rand(5, 7, device=device, seed=1).requires_grad_()
    b = _rand(5, 7, device=device, seed=2).requires_grad_()
    dy = _rand(3, 4, 5, 7, device=device, seed=3)
    y = tilefuse.layer_norm(x, (5, 7), w, b)
    got = torch.autograd.grad(y, (x, w, b), dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    want = torch.autograd.grad(F.layer_norm(leaves[0], (5, 7), leaves[1], leaves[2]), leaves, dy.double())
    for name, g, r in zip(("dx", "dweight", "dbias"), got, want):
        assert g.shape == r.shape, name
        assert_close(g, r, 1e-5, name)


def test_non_contiguous_x_is_handled(device):
    # A transposed x has no unit-stride rows: documented to be copied once, result unchanged.
    x = _rand(40, 9, device=device).t()  # [9, 40] view
    w = _rand(40, device=device, seed=1)
    assert_close(tilefuse.rms_norm(x, (40,), w, 1e-6), F.rms_norm(x.double(), (40,), w.double(), 1e-6),
                 1e-5, "transposed x")


def test_only_some_inputs_need_grad(device):
    x = _rand(5, 70, device=device)
    w = _rand(70, device=device, seed=1).requires_grad_()
    b = _rand(70, device=device, seed=2)
    y = tilefuse.layer_norm(x, (70,), w, b)
    (dw,) = torch.autograd.grad(y, (w,), _rand(5, 70, device=device, seed=3))
    leaves = w.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(F.layer_norm(x.double(), (70,), leaves, b.double()), (leaves,),
                                  _rand(5, 70, device=device, seed=3).double())
    assert_close(dw, want, 1e-5, "dweight only")


@pytest.mark.parametrize("N", [70, 300])
def test_weight_gradient_is_deterministic(device, N):
    x = _rand(37, N, device=device, dtype=BF16).requires_grad_()
    w = _rand(N, device=device, dtype=BF16, seed=1).requires_grad_()
    dy = _rand(37, N, device=device, dtype=BF16, seed=2)
    first = torch.autograd.grad(tilefuse.rms_norm(x, (N,), w), (x, w), dy)
    second = torch.autograd.grad(tilefuse.rms_norm(x, (N,), w), (x, w), dy)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("call,exc,match", [
    (lambda: tilefuse.layer_norm(torch.randn(3, 4), (5,)), ValueError, "trailing dims"),
    (lambda: tilefuse.layer_norm(torch.randn(3, 4), (4,), torch.randn(5)), ValueError, "weight must have shape"),
    (lambda: tilefuse.layer_norm(torch.randn(3, 4), (4,), None, torch.randn(3)), ValueError, "bias must have shape"),
    (lambda: tilefuse.rms_norm(torch.randn(3, 4), (4,), residual=torch.randn(3, 5)), ValueError, "residual"),
    (lambda: tilefuse.layer_norm(torch.randn(3, 4), (4,), eps=-1.0), ValueError, "eps"),
    (lambda: tilefuse.layer_norm(torch.randn(3, 4), ()), ValueError, "at least one"),
    (lambda: tilefuse.layer_norm(torch.ones(3, 4, dtype=torch.int32), (4,)), TypeError, "x has dtype int32"),
    # another float dtype than x is torch's mixed-precision rule (tests/test_mixed_dtypes.py); float64 is refused
    (lambda: tilefuse.rms_norm(torch.randn(3, 4), (4,), torch.randn(4, dtype=torch.float64)), TypeError,
     "weight has dtype"),
    (lambda: tilefuse.rms_norm(torch.randn(3, 4), (4,), residual=torch.randn(3, 4).double()), TypeError, "residual"),
    (lambda: tilefuse.layer_norm([[1.0]], (1,)), TypeError, "x must be a torch.Tensor"),
])
def test_norm_bad_input_raises(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ---- layer_norm_linear ----------------------------------------------------------------------------

@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_norm_linear_equals_norm_then_linear(device, norm):
    x = _rand(2, 17, 130, device=device, dtype=BF16, mean=0.5, std=2.0)  # 3-D x, K over 4 K-steps
    gw, gb = _rand(130, device=device, dtype=BF16, seed=1, mean=1.0), _rand(130, device=device, dtype=BF16, seed=2)
    w, b = _rand(9, 130, device=device, dtype=BF16, seed=3, std=0.1), _rand(9, device=device, dtype=BF16, seed=4)
    out = tilefuse.layer_norm_linear(x, gw, gb, w, b, norm=norm, activation="gelu_tanh")
    eps = torch.finfo(BF16).eps if norm == "rms" else 1e-5
    ref = reference.layer_norm_linear(*(t.double() for t in (x, gw, gb, w, b)), eps=eps, norm=norm,
                                      activation="gelu_tanh")
    assert out.shape == (2, 17, 9)
    assert_close(out, ref, REL_L2_BOUND[BF16], f"{norm} prologue")


def test_norm_linear_nan_row(device):
    x = _rand(5, 40, device=device)
    x[3, 7] = float("nan")
    out = tilefuse.layer_norm_linear(x, None, None, _rand(6, 40, device=device, seed=1))
    assert out[3].isnan().all() and not out[[0, 1, 2, 4]].isnan().any()


def test_norm_linear_edges(device):
    w = _rand(6, 40, device=device)
    assert tilefuse.layer_norm_linear(torch.empty(0, 40, device=device), None, None, w).shape == (0, 6)
    out = tilefuse.layer_norm_linear(_rand(3, 1, device=device), None, None, _rand(4, 1, device=device),
                                     _rand(4, device=device, seed=5))
    assert_close(out, _rand(4, device=device, seed=5).double().expand(3, 4), 1e-5, "K=1 gives the bias")


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(norm="batch"), ValueError, "norm must be"),
    (dict(activation="gelu_erf"), ValueError, "activation"),
    (dict(weight=torch.randn(6, 5)), ValueError, "weight.shape\\[1\\]"),
    (dict(norm_weight=torch.randn(5)), ValueError, "norm_weight must have shape \\[4\\]"),
    (dict(norm_bias=torch.randn(5)), ValueError, "norm_bias must have shape \\[4\\]"),
    (dict(bias=torch.randn(4)), ValueError, "bias must have shape \\[6\\]"),
    (dict(weight=torch.randn(6, 4, dtype=FP16)), TypeError, "weight has dtype"),
    (dict(norm_weight=torch.randn(4).double()), TypeError, "norm_weight has dtype"),
])
def test_norm_linear_bad_input_raises(kwargs, exc, match):
    args = dict(x=torch.randn(3, 4), norm_weight=None, norm_bias=None, weight=torch.randn(6, 4), bias=None)
    args.update(kwargs)
    x, nw, nb, w, b = (args.pop(k) for k in ("x", "norm_weight", "norm_bias", "weight", "bias"))
    with pytest.raises(exc, match=match):
        tilefuse.layer_norm_linear(x, nw, nb, w, b, **args)


def test_norm_linear_grad_flows_only_where_asked(device):
    x = _rand(3, 4, device=device).requires_grad_()
    w = _rand(5, 4, device=device)
    y = tilefuse.layer_norm_linear(x, None, None, w)
    (dx,) = torch.autograd.grad(y.square().sum(), x)
    assert dx.shape == x.shape and dx.abs().sum() > 0
    with torch.no_grad():
        assert not tilefuse.layer_norm_linear(x, None, None, w).requires_grad


@pytest.mark.parametrize("norm,affine,has_bias,activation", [
    ("layer", True, True, "gelu"), ("layer", False, False, None), ("layer", True, False, "silu"),
    ("rms", True, True, None), ("rms", False, False, "relu"), ("rms", False, True, "gelu_tanh"),
])
def test_norm_linear_epilogue_form_matches_float64(tma_launch_device, norm, affine, has_bias, activation):
    """The Hopper form (gamma folded into W, the rows' statistics from the pre-pass applied after the GEMM)
    on tails in M, N and K (K = 96 is one and a half 64-wide steps: the zero-filled half must not
    count), rows whose mean is 8x their spread and rows with one huge element: centring after the GEMM must not
    cancel precision away. A NaN in x gives NaN in its row and nowhere else."""
    from tilefuse.kernels.gemm import launch

    dev = tma_launch_device
    M, K, N = 37, 96, 40  # 16-byte rows for TMA; none a multiple of its tile
    x = _rand(M, K, device=dev, dtype=FP16, mean=4.0, std=0.5)
    x[3, 0], x[5, 70] = 900.0, -700.0  # outlier channels, as LLM activations have: first element and mid-row
    x[6, 20] = float("nan")  # its row only comes out NaN, as torch's
    gw = _rand(K, device=dev, dtype=FP16, seed=1, mean=1.0) if affine else None
    gb = _rand(K, device=dev, dtype=FP16, seed=2) if affine and norm == "layer" else None
    w = _rand(N, K, device=dev, dtype=FP16, seed=3, std=0.1)
    b = _rand(N, device=dev, dtype=FP16, seed=4) if has_bias else None
    eps = torch.finfo(FP16).eps if norm == "rms" else 1e-5
    y = torch.empty(M, N, dtype=FP16, device=dev)
    launch.norm._norm_linear_tma(x, norm == "rms", eps, gw, gb, w, b, y, activation,
                                       config=dict(bm=16, bn=32, bk=64, stages=1, warps=4))
    ref = reference.layer_norm_linear(*(None if t is None else t.double() for t in (x, gw, gb, w, b)), eps=eps,
                                      norm=norm, activation=activation)
    assert_close(y, ref, REL_L2_BOUND[FP16], f"{norm} epilogue form")


def test_strided_parameter_views_are_read_as_their_elements(device):
    """Norm weights and biases given as strided views (every other element of a buffer), forward and
    backward (the gradient reaches the viewed elements), and the same for layer_norm_linear."""
    x = _rand(7, 40, device=device, mean=1.0)
    w_buf = _rand(80, device=device, seed=1, mean=1.0).requires_grad_()
    b_buf = _rand(80, device=device, seed=2).requires_grad_()
    w, b = w_buf[::2], b_buf[1::2]
    y = tilefuse.layer_norm(x, (40,), w, b)
    ref = F.layer_norm(x.double(), (40,), w.double(), b.double())
    assert_close(y, ref, REL_L2_BOUND[FP32], "layer_norm strided weight/bias")
    y.sum().backward()
    ref_w = w.detach().double().requires_grad_()
    F.layer_norm(x.double(), (40,), ref_w, b.detach().double()).sum().backward()
    assert_close(w_buf.grad[::2], ref_w.grad, REL_L2_BOUND[FP32], "dweight reaches the view")
    assert not w_buf.grad[1::2].any()
    with torch.no_grad():
        assert_close(tilefuse.rms_norm(x, (40,), w, 1e-6), F.rms_norm(x.double(), (40,), w.double(), 1e-6),
                     REL_L2_BOUND[FP32], "rms_norm strided weight")
        lin_w = _rand(6, 40, device=device, seed=3)
        lin_b = _rand(12, device=device, seed=4)[::2]
        out = tilefuse.layer_norm_linear(x, w, b, lin_w, lin_b)
        ref = reference.layer_norm_linear(x.double(), w.double(), b.double(), lin_w.double(), lin_b.double(),
                                          eps=1e-5)
        assert_close(out, ref, REL_L2_BOUND[FP32], "layer_norm_linear strided vectors")


def test_norm_linear_byte_model_counts_the_fold_it_runs():
    """The Hopper form's fold (kernels/gemm/launch/ ``fold_weight``) reads W whenever it runs and writes
    W' only with gamma: RMSNorm with gamma moves 2*N*K elements (once counted as N*K), without gamma
    nothing; LayerNorm reads W for its column sums either way. The statistics pre-pass reads x and writes
    (and the GEMM reads) 8 bytes a row."""
    from tilefuse import registry

    spec = registry.REGISTRY["layer_norm_linear"]
    M, K, N = 64, 256, 96
    s = BF16.itemsize

    def fused(norm, affine):
        return spec.hbm_bytes(dict(shape=(M, K, N), dtype=BF16, norm=norm, affine=affine, bias=False))["fused"]

    vec_rms = K * s  # gamma, counted with the vectors whether or not the row uses it
    gemm = (M * K + N * K + M * N) * s
    stats = M * K * s + 16 * M
    assert fused("rms", False) == gemm + vec_rms + stats
    assert fused("rms", True) == gemm + vec_rms + stats + 2 * N * K * s + 8 * N
    assert fused("layer", True) - fused("layer", False) == N * K * s


@pytest.mark.parametrize("name,params", [
    ("layer_norm_backward", dict(shape=(7, 300), dtype=BF16)),
    ("layer_norm_backward", dict(shape=(33, 70), dtype=FP32, residual=True)),
    ("rms_norm_backward", dict(shape=(33, 70), dtype=FP16, affine="none", layout="multi_dim")),
])
def test_backward_kernels_only_gives_autograds_gradients(device, name, params):
    """The report's GPU-only column times a backward row through the spec's "kernels_only" callable,
    which runs ``_NormFunction.backward`` on the forward's node without the autograd engine. It must be
    the same computation: the same gradients, in the same order, bit for bit, call after call."""
    from tilefuse import registry

    spec = registry.REGISTRY[name]
    inputs = spec.make_inputs(params, device, 0)
    expected = spec.fused(**inputs)
    for _ in range(2):
        got = spec.extra["kernels_only"](**inputs)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert g.shape == e.shape and g.dtype == e.dtype
            assert torch.equal(g, e)


@pytest.mark.skipif(ON_GPU, reason="the plain-PyTorch reference path is the CPU path without the interpreter")
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_reference_path_gradients_match_torch(monkeypatch, rms, residual):
    """A CPU without TRITON_INTERPRET answers with the plain PyTorch reference, forward and backward (the
    backward recomputes the norm from h, so the gradient through mean and rstd is kept); empty rows too."""
    from tilefuse.kernels import launches
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    g = torch.Generator().manual_seed(3)
    x, r, dy = (torch.randn(6, 9, generator=g) for _ in range(3))
    w, b = torch.randn(9, generator=g), torch.randn(9, generator=g)
    leaves = [t.clone().requires_grad_() for t in (x, w, b, r)]
    ref_leaves = [t.double().requires_grad_() for t in (x, w, b, r)]

    def run(xl, wl, bl, rl, lib):
        h = xl + rl if residual else xl
        if lib:
            out = (tilefuse.rms_norm(xl, (9,), wl, 1e-5, residual=rl if residual else None) if rms else
                   tilefuse.layer_norm(xl, (9,), wl, bl, 1e-5, residual=rl if residual else None))
            return out[0] if residual else out
        return F.rms_norm(h, (9,), wl, 1e-5) if rms else F.layer_norm(h, (9,), wl, bl, 1e-5)

    used = leaves[:2] + ([] if rms else leaves[2:3]) + (leaves[3:] if residual else [])
    ref_used = ref_leaves[:2] + ([] if rms else ref_leaves[2:3]) + (ref_leaves[3:] if residual else [])
    with launches.recording() as recs:
        got = torch.autograd.grad(run(*leaves, True), used, dy)
    want = torch.autograd.grad(run(*ref_leaves, False), ref_used, dy.double())
    assert recs and all(rec.path == "reference" for rec in recs), recs
    for i, (a, e) in enumerate(zip(got, want)):
        assert_close(a, e, REL_L2_BOUND[FP32], f"reference-path gradient {i}")
    empty = torch.empty(0, 9, requires_grad=True)
    (gx,) = torch.autograd.grad(tilefuse.layer_norm(empty, (9,)).sum(), [empty])
    assert gx.shape == (0, 9)


@pytest.mark.skipif(ON_GPU, reason="the plain-PyTorch reference path is the CPU path without the interpreter")
def test_reference_path_modules_backward(monkeypatch):
    """tilefuse.nn modules (whose weights are Parameters) train on the reference path as on the kernels'."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for cls, ref_cls in ((tilefuse.nn.RMSNorm, torch.nn.RMSNorm), (tilefuse.nn.LayerNorm, torch.nn.LayerNorm)):
        mod, ref = cls(9, eps=1e-5), ref_cls(9, eps=1e-5)
        with torch.no_grad():
            mod.weight.normal_()
            ref.weight.copy_(mod.weight)
        x = torch.randn(5, 9, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        (mod(x) * torch.arange(9.0)).sum().backward()
        (ref(xr) * torch.arange(9.0)).sum().backward()
        assert_close(x.grad, xr.grad, REL_L2_BOUND[FP32], f"{cls.__name__} dx")
        assert_close(mod.weight.grad, ref.weight.grad, REL_L2_BOUND[FP32], f"{cls.__name__} dweight")
