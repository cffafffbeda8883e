"""Where the launch layer takes the cooperative warp-specialized GEMM (kernels/gemm/coop.py), on any machine.

The Gluon kernel cannot run in the interpreter, so its numbers are checked on the GPU (tests/test_linear.py,
tests/test_linear_backward.py); here the decisions (``launch.rules.coop_backward``, ``launch.rules.coop_gated``) on meta
tensors of the measured shapes and layouts, and the launches the public training and inference calls make with
the compiled path stubbed (tests/tools/host_path.py): kernel, grid and constexprs, and what the records say.
"""
from __future__ import annotations

import pytest
import torch

import tilefuse
from tilefuse.kernels import switches
from tilefuse import runtime
from tilefuse.kernels import launches
from tilefuse.kernels.gemm import coop, launch
from tools.host_path import stubbed_launches

# These check where the launch layer takes one of tilefuse's GEMM kernels: they pin the tilefuse backend.
pytestmark = pytest.mark.usefixtures("tilefuse_backend")

ON_GPU = torch.cuda.is_available()
BF16 = torch.bfloat16
SMS = 132  # the H200's SM count
COMPILED = runtime.COMPILED


@pytest.fixture
def hopper(monkeypatch):
    """An sm_90 device of SMS SMs that takes any tensor as TMA-capable (meta tensors: no memory)."""
    monkeypatch.setattr(runtime, "device_facts", lambda device: (9, SMS))
    monkeypatch.setattr(launch.rules, "tma_device", lambda t: True)


def _t(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _backward(M, K, N, dtype=BF16, slope=True, conv1d=False, path=COMPILED):
    """(dx takes the cooperative kernel, dW does) for a non-gated Linear backward of x [M, K], W [N, K] as the
    launch lays its operands out: dy and the slope [M, N], dx [M, K], dW like W."""
    dy, x = _t(M, N, dtype=dtype), _t(M, K, dtype=dtype)
    w = _t(K, N, dtype=dtype).t() if conv1d else _t(N, K, dtype=dtype)  # Conv1D: the [K, N] storage's view
    s = _t(M, N, dtype=dtype) if slope else None
    dw = torch.empty_like(w)  # the launch's dW: the weight's own layout
    return (launch.rules.coop_backward(_t(M, K, dtype=dtype), dy, s, w, path, "dx"),
            launch.rules.coop_backward(dw, dy, s, x, path, "dW"))


# The backward GEMMs' bench shapes (M, K, N) and where the cooperative kernel measured faster than the launch's
# other kernels (benchmarks/NOTES.md); the rule (dx: an output tile per SM, dW: one per two SMs; a reduction
# >= 2048) takes it on the first four shapes for both: at (8192, 1024, 4096) and (16384, 768, 3072) dW has 128
# and 72 output tiles of 128 x 256.
@pytest.mark.parametrize("M,K,N,dx,dw", [
    (8192, 4096, 16384, True, True), (2048, 4096, 11008, True, True), (8192, 1024, 4096, True, True),
    (16384, 768, 3072, True, True), (512, 4096, 4096, False, False), (1000, 520, 1288, False, False),
    (2100, 2056, 4360, True, True)])  # tails on every tile dim, rows still 16-byte multiples
def test_backward_takes_coop_with_a_tile_per_sm_and_a_long_reduction(hopper, M, K, N, dx, dw):
    assert _backward(M, K, N) == (dx, dw)


def test_backward_thresholds(hopper):
    """Exactly the minimum output tiles (dx: one per SM, dW: one per two SMs) and a reduction of exactly
    COOP_MIN_REDUCTION take it; one tile or a 16-byte row step less does not (dx: tiles cdiv(M, 128) *
    cdiv(K, 256), reduction N)."""
    assert launch.rules.COOP_MIN_REDUCTION == 2048
    m = 128 * SMS
    assert _backward(m, 256, 2048)[0]
    assert not _backward(m - 128, 256, 2048)[0]
    assert not _backward(m, 256, 2040)[0]
    # dW: tiles cdiv(N, 128) * cdiv(K, 256), at least half the SM count; reduction M
    assert _backward(2048, 256, 128 * SMS // 2)[1]
    assert not _backward(2040, 256, 128 * SMS // 2)[1]
    assert not _backward(2048, 256, 128 * SMS // 2 - 128)[1]


@pytest.mark.parametrize("case", ["fp32", "fp16", "no slope", "interpreter", "switch off", "sm100", "conv1d"])
def test_backward_keeps_todays_path_outside_its_cases(hopper, monkeypatch, case):
    """fp16 takes it like bf16; fp32, no activation (no slope: not measured), the interpreter, COOP_BACKWARD
    off and a GPU other than sm_90 do not; a Conv1D weight (a unit row stride) keeps dx on the pointer kernel and
    dW^T on the TMA kernel."""
    shape = (8192, 4096, 16384)
    want = (False, False)
    if case == "fp32":
        got = _backward(*shape, dtype=torch.float32)
    elif case == "fp16":
        got, want = _backward(*shape, dtype=torch.float16), (True, True)
    elif case == "no slope":
        got = _backward(*shape, slope=False)
    elif case == "interpreter":
        got = _backward(*shape, path=runtime.INTERPRETER)
    elif case == "switch off":
        monkeypatch.setattr(switches.gemm, "COOP_BACKWARD", False)
        got = _backward(*shape)
    elif case == "sm100":
        monkeypatch.setattr(runtime, "device_facts", lambda device: (10, SMS))
        got = _backward(*shape)
    else:
        got = _backward(*shape, conv1d=True)
    assert got == want


def test_backward_needs_tma_able_dense_rows(hopper):
    """Every operand of the GEMM: one 16-bit dtype, unit inner stride, 16-byte-aligned base and rows, rows that
    do not overlap (a broadcast dy)."""
    M, K, N = 4096, 4096, 4096
    dy, s, w, dx = _t(M, N), _t(M, N), _t(N, K), _t(M, K)
    assert launch.rules.coop_backward(dx, dy, s, w, COMPILED, "dx")
    assert not launch.rules.coop_backward(dx, dy, s, _t(N, K, dtype=torch.float16), COMPILED, "dx")  # mixed dtypes
    assert not launch.rules.coop_backward(dx, _t(M, N + 8)[:, 1:N + 1], s, w, COMPILED, "dx")  # base off 16 bytes
    assert not launch.rules.coop_backward(dx, dy, s, _t(N, K + 4)[:, :K], COMPILED, "dx")  # W rows 8-byte aligned
    assert not launch.rules.coop_backward(dx, _t(N, M).t(), s, w, COMPILED, "dx")  # dy column-major
    assert not launch.rules.coop_backward(dx, _t(1, N).expand(M, N), s, w, COMPILED, "dx")  # one dy row for all
    assert launch.rules.coop_backward(dx, _t(M, N + 8)[:, :N], s, w, COMPILED, "dx")  # padded rows are fine


@pytest.mark.parametrize("M,K,N,save_slope,want", [
    (2048, 4096, 11008, False, True), (8192, 4096, 11008, False, True), (1024, 1024, 2816, False, True),
    (2048, 4096, 11008, True, False),  # a training forward stores slopes: the TMA kernel
    (256, 4096, 11008, False, True), (128, 4096, 11008, False, False),  # 172 and 86 output tiles
    (512, 1024, 2048, False, False), (16, 4096, 4096, False, False)])
def test_gated_takes_coop_without_slopes_at_a_tile_per_sm(hopper, M, K, N, save_slope, want):
    """Output tiles of 128 x 128 (COOP_GATED_CONFIG), at least one per SM."""
    x, wg, wu, y = _t(M, K), _t(N, K), _t(N, K), _t(M, N)
    assert launch.rules.coop_gated(x, wg, wu, y, save_slope, COMPILED) == want


def test_gated_keeps_todays_path_outside_its_cases(hopper, monkeypatch):
    M, K, N = 2048, 4096, 11008
    x, wg, wu, y = _t(M, K), _t(N, K), _t(N, K), _t(M, N)
    assert launch.rules.coop_gated(x, wg, wu, y, False, COMPILED)
    f32 = [_t(*t.shape, dtype=torch.float32) for t in (x, wg, wu, y)]
    assert not launch.rules.coop_gated(*f32, False, COMPILED)
    assert not launch.rules.coop_gated(x, wg, wu, y, False, runtime.INTERPRETER)
    assert not launch.rules.coop_gated(x, _t(K, N).t(), wu, y, False, COMPILED)  # a transposed weight
    monkeypatch.setattr(switches.gemm, "COOP_GATED", False)
    assert not launch.rules.coop_gated(x, wg, wu, y, False, COMPILED)


# ---- the public calls, compiled path stubbed -----------------------------------------------------------
def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


def _train_step(M, K, N, activation="gelu"):
    """Forward and backward of tilefuse.linear (x [2, M / 2, K], bias, ``activation``; y [2, M / 2, N], so a gated
    activation's one weight [2N, K]) under stubbed launches: (forward launches, backward launches, backward
    records)."""
    rows = 2 * N if activation in ("swiglu", "geglu", "geglu_tanh") else N
    x, w, b = (_r(2, M // 2, K).requires_grad_(), _r(rows, K, seed=1).requires_grad_(),
               _r(rows, seed=2).requires_grad_())
    dy = _r(2, M // 2, N, seed=3)
    with stubbed_launches(sms=SMS) as runs, launches.recording() as recs:
        y = tilefuse.linear(x, w, b, activation)
        n = len(runs)
        grads = torch.autograd.grad(y, (x, w, b), dy)
    assert [g.shape for g in grads] == [x.shape, w.shape, b.shape]
    return runs[:n], runs[n:], [r.kernel for r in recs if r.op == "linear_backward"]


@pytest.mark.skipif(ON_GPU, reason="CPU-side check of the launch path; the GPU runs it for real")
def test_training_backward_launches_the_cooperative_kernel(pinned_tuners):
    """At (2100, 2056, 4360) both backward GEMMs take it: dx = g @ W (153 output tiles over N 4360) and
    dW = g^T x with db (315 tiles over M 2100), one CTA per SM; the forward stays on the TMA kernel."""
    fwd, bwd, kinds = _train_step(2100, 2056, 4360)
    assert [r.kernel for r in fwd] == ["linear_tma_kernel"]
    assert [r.kernel for r in bwd] == ["gemm_coop_ws_kernel"] * 2
    assert [r.grid for r in bwd] == [(SMS,), (SMS,)]
    common = dict(HAS_SLOPE=True, B_KMAJOR=False, HAS_BIAS=False, ACTIVATION="none", GATED=False,
                  NUM_SMS=SMS, **{k: v for k, v in coop.CONFIGS[switches.gemm.COOP_BACKWARD_CONFIG].items()
                                  if k in ("STAGES", "GROUP_M")})
    for run, trans_a in zip(bwd, (False, True)):
        assert {k: run.kwargs[k] for k in common} == common
        assert run.kwargs["TRANS_A"] == trans_a and run.kwargs["HAS_DB"] == trans_a
    assert kinds == ["grad input (cooperative warp-specialized), g = dy * slope in its loads",
                     "grad weight (cooperative warp-specialized) + bias, g = dy * slope in its loads"]


@pytest.mark.skipif(ON_GPU, reason="CPU-side check of the launch path; the GPU runs it for real")
def test_training_backward_on_the_cooperative_kernel_replays(pinned_tuners):
    """The cooperative kernel makes its descriptors in the kernel, so the launch layer's fast path keeps the
    backward's plan: a second step of the same shapes (fresh tensors) replays both GEMMs, as it does the
    forward."""
    M, K, N = 2100, 2056, 4360
    with stubbed_launches(sms=SMS) as runs, launches.recording() as recs:
        for step in range(2):
            x, w, b = (_r(2, M // 2, K, seed=step).requires_grad_(), _r(N, K, seed=1).requires_grad_(),
                       _r(N, seed=2).requires_grad_())
            torch.autograd.grad(tilefuse.linear(x, w, b, "gelu"), (x, w, b), _r(2, M // 2, N, seed=3))
    assert [(r.kernel, r.replay) for r in runs] == [
        ("linear_tma_kernel", False), ("gemm_coop_ws_kernel", False), ("gemm_coop_ws_kernel", False),
        ("linear_tma_kernel", True), ("gemm_coop_ws_kernel", True), ("gemm_coop_ws_kernel", True)], runs
    assert [r.replayed for r in recs] == [False] * 3 + [True] * 3


@pytest.mark.skipif(ON_GPU, reason="CPU-side check of the launch path; the GPU runs it for real")
@pytest.mark.parametrize("case", ["small", "no activation", "switch off"])
def test_training_backward_keeps_todays_kernels_elsewhere(pinned_tuners, monkeypatch, case):
    """Below the thresholds, without an activation and with COOP_BACKWARD off, the backward launches what it
    launched before: the tuned pointer dx and the TMA dW."""
    M, K, N = (512, 1024, 1024) if case == "small" else (2100, 2056, 4360)
    if case == "switch off":
        monkeypatch.setattr(switches.gemm, "COOP_BACKWARD", False)
    activation = None if case == "no activation" else "gelu"
    _, bwd, kinds = _train_step(M, K, N, activation)
    assert [r.kernel for r in bwd] == ["grad_input_kernel", "grad_weight_tma_kernel"]
    assert not any("cooperative" in k for k in kinds)


@pytest.mark.skipif(ON_GPU, reason="CPU-side check of the launch path; the GPU runs it for real")
def test_gated_training_backward_with_the_gated_dx_switched_off_takes_the_cooperative_kernel_for_each_dw(pinned_tuners, monkeypatch):
    """SwiGLU at (2100, 2056, 4360) with COOP_GATED_DX switched off: dx sums two products (g_gate @ W_gate +
    g_up @ W_up) on the tuned pointer kernel; each branch's dW (+ db) is one product g_branch^T x, with its own
    slope, and takes the cooperative kernel as the plain dW does."""
    monkeypatch.setattr(switches.gemm, "COOP_GATED_DX", False)
    _, bwd, kinds = _train_step(2100, 2056, 4360, "swiglu")
    assert [r.kernel for r in bwd] == ["grad_input_kernel", "gemm_coop_ws_kernel", "gemm_coop_ws_kernel"]
    assert all(r.kwargs["TRANS_A"] and r.kwargs["HAS_DB"] and r.kwargs["HAS_SLOPE"] for r in bwd[1:])
    # the two dW launches read the two slopes (different tensors) and write the two dW halves
    assert bwd[1].pointers != bwd[2].pointers
    assert kinds == ["grad input, g = dy * slope in its loads"] + [
        "grad weight (cooperative warp-specialized) + bias, g = dy * slope in its loads"] * 2


@pytest.mark.skipif(ON_GPU, reason="CPU-side check of the launch path; the GPU runs it for real")
def test_gated_dx_takes_the_cooperative_gated_form(pinned_tuners):
    """The gated dx at (2100, 2056, 4360) is one cooperative launch of the GATED_DX form (COOP_GATED_DX, on): dy
    with both slopes (s_gate, s_up: the two halves the forward saved) and both weights (the [2N, K] weight's two
    halves, row-major as dx reads them) into one dx, on the plain dx's config and grid; the dW launches are
    unchanged."""
    assert switches.gemm.COOP_GATED_DX
    _, bwd, kinds = _train_step(2100, 2056, 4360, "swiglu")
    assert [r.kernel for r in bwd] == ["gemm_coop_ws_kernel"] * 3
    dx = bwd[0]
    cfg = coop.CONFIGS[switches.gemm.COOP_BACKWARD_CONFIG]
    want = dict(GATED_DX=True, HAS_SLOPE=True, TRANS_A=False, B_KMAJOR=False, GATED=False, HAS_DB=False,
                **{k: v for k, v in cfg.items() if k != "FORWARD_ONLY"})
    assert {k: dx.kwargs[k] for k in want} == want and dx.grid == (SMS,)
    a, s, su, b, bu = dx.pointers[:5]
    assert a not in (s, su) and s != su and b != bu  # dy, the two slopes, the two weight halves
    assert not any(r.kwargs["GATED_DX"] for r in bwd[1:])
    assert kinds[0] == "grad input gated (cooperative warp-specialized), g = dy * slope for each branch in its loads"


@pytest.mark.skipif(ON_GPU, reason="CPU-side check of the launch path; the GPU runs it for real")
def test_gated_inference_launches_the_cooperative_kernel_and_training_the_tma_kernel(pinned_tuners):
    """SwiGLU at (1000, 1032, 2824) (184 output tiles of 128 x 128) under no_grad: the cooperative kernel, both
    weights K-major, the second call a replay of the first (its descriptors are made in the kernel, so the fast
    path keeps the plan); with grad (slopes saved) the TMA kernel."""
    M, K, N = 1000, 1032, 2824
    x, w, b = _r(M, K), _r(2 * N, K, seed=1), _r(2 * N, seed=2)
    with stubbed_launches(sms=SMS) as runs, launches.recording() as recs:
        with torch.no_grad():
            tilefuse.linear(x, w, b, "swiglu")
            tilefuse.linear(x, w, b, "swiglu")
        tilefuse.linear(x, w.requires_grad_(), b, "swiglu")
    assert [r.kernel for r in runs] == ["gemm_coop_ws_kernel"] * 2 + ["linear_tma_kernel"]
    assert [r.replay for r in runs] == [False, True, False]
    cfg = coop.CONFIGS[switches.gemm.COOP_GATED_CONFIG]
    want = dict(TRANS_A=False, HAS_SLOPE=False, B_KMAJOR=True, HAS_BIAS=True, ACTIVATION="swiglu", GATED=True,
                HAS_DB=False, STAGES=cfg["STAGES"], GROUP_M=cfg["GROUP_M"], NUM_SMS=SMS)
    assert {k: runs[0].kwargs[k] for k in want} == want and runs[0].grid == (SMS,)
    assert runs[2].kwargs["SAVE_SLOPE"]
    assert [r.kernel for r in recs if r.op == "linear"] == ["cooperative warp-specialized"] * 2 + ["tma"]
