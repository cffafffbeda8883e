"""tilefuse.linear: behaviour beyond the registry grid (edges, NaN, errors, paths)."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse
from helpers import ON_GPU, assert_close
from tilefuse.kernels import switches
from tilefuse.opspec import REL_L2_BOUND
from tilefuse import reference

ACTS = [None, "gelu", "gelu_tanh", "relu", "silu"]


def _rand(*shape, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


@pytest.mark.parametrize("activation", ACTS)
def test_nan_in_gives_nan_out(device, activation):
    x = _rand(5, 7, device=device)
    x[2, 3] = float("nan")
    w = _rand(6, 7, device=device, seed=1)
    out = tilefuse.linear(x, w, None, activation)
    ref = reference.linear(x, w, None, activation)
    assert torch.equal(out.isnan(), ref.isnan())
    assert out[2].isnan().all()  # relu(NaN) is NaN, as in PyTorch


def test_gelu_forms_are_not_swapped(device):
    # The erf and tanh forms differ by ~1e-3 near |x| ~ 2: each must match its own torch form far
    # better than the other one, at fp32.
    x = torch.linspace(-4, 4, 64, device=device).reshape(8, 8)
    w = torch.eye(8, device=device)
    erf, tanh = tilefuse.linear(x, w, None, "gelu"), tilefuse.linear(x, w, None, "gelu_tanh")
    assert (erf - F.gelu(x)).abs().max() < 1e-6
    assert (tanh - F.gelu(x, approximate="tanh")).abs().max() < 1e-6
    assert (erf - tanh).abs().max() > 1e-4


def test_empty_m_and_k(device):
    w = _rand(5, 4, device=device)
    b = _rand(5, device=device, seed=2)
    out = tilefuse.linear(torch.empty(0, 4, device=device), w, b, "gelu")
    assert out.shape == (0, 5)
    x0 = torch.empty(3, 0, device=device)
    w0 = torch.empty(5, 0, device=device)
    out = tilefuse.linear(x0, w0, b, "gelu")  # K = 0: F.linear gives the bias
    assert_close(out, F.gelu(F.linear(x0, w0, b)).double(), 1e-5, "K=0")
    assert tilefuse.linear(x0, w0, None).abs().sum() == 0


def test_large_magnitudes_stay_finite(device):
    x = _rand(9, 33, device=device) * 1e3
    w = _rand(17, 33, device=device, seed=3)
    for act in ACTS:
        out = tilefuse.linear(x, w, None, act)
        ref = reference.linear(x.double(), w.double(), None, act)
        assert_close(out, ref, 1e-5, f"x1e3 {act}")


@pytest.mark.parametrize("bad,exc,match", [
    (dict(x=torch.randn(3, 4), weight=torch.randn(5, 6)), ValueError, "weight.shape\\[1\\]"),
    (dict(x=torch.randn(3, 4), weight=torch.randn(5, 4, 1)), ValueError, "weight must be 2-D"),
    (dict(x=torch.randn(3, 4), weight=torch.randn(5, 4), bias=torch.randn(4)), ValueError, "bias must have shape \\[5\\]"),
    (dict(x=torch.randn(3, 4), weight=torch.randn(5, 4), activation="gelu_erf"), ValueError, "activation"),
    (dict(x=torch.ones(3, 4, dtype=torch.int32), weight=torch.randn(5, 4)), TypeError, "x has dtype int32"),
    (dict(x=torch.randn(3, 4), weight=torch.randn(5, 4, dtype=torch.float16)), TypeError, "weight has dtype"),
    (dict(x=torch.randn(3, 4), weight=torch.randn(5, 4), bias=torch.randn(5, dtype=torch.float64)), TypeError, "bias has dtype"),
    (dict(x=torch.tensor(1.0), weight=torch.randn(5, 1)), ValueError, "0-d"),
    (dict(x=[[1.0]], weight=torch.randn(1, 1)), TypeError, "x must be a torch.Tensor"),
])
def test_bad_input_raises_before_launch(bad, exc, match):
    args = {"bias": None, "activation": None, **bad}
    with pytest.raises(exc, match=match):
        tilefuse.linear(**args)


@pytest.mark.gpu_only
def test_devices_differ():
    with pytest.raises(ValueError, match="weight is on cpu"):
        tilefuse.linear(torch.randn(3, 4, device="cuda"), torch.randn(5, 4))


def test_grad_flows_only_where_asked(device):
    x = _rand(3, 4, device=device).requires_grad_()
    w = _rand(5, 4, device=device)
    y = tilefuse.linear(x, w, None, "gelu")
    assert y.requires_grad and y.grad_fn is not None
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert dx.shape == x.shape and dx.abs().sum() > 0
    with torch.no_grad():
        assert not tilefuse.linear(x, w, None, "gelu").requires_grad


@pytest.mark.usefixtures("tilefuse_backend")
def test_no_copy_of_transposed_weight(device, monkeypatch):
    # A transposed weight view must reach the kernel as is (strides), not via .contiguous().
    w = _rand(4, 6, device=device).t()  # [6, 4] view, stride (1, 6)
    x = _rand(3, 4, device=device, seed=1)
    calls = []
    real = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    out = tilefuse.linear(x, w, None, "silu")
    assert not calls
    assert_close(out, reference.linear(x.double(), w.double(), None, "silu"), 1e-5, "transposed w")


@pytest.mark.gpu_only
def test_fp32_follows_the_tf32_flag():
    # 4096-long dot products: tf32 (10-bit mantissa) errors are ~1e-4, far above the ieee 1e-5 bound.
    x = torch.randn(256, 4096, device="cuda")
    w = torch.randn(256, 4096, device="cuda")
    ref = F.linear(x.double(), w.double())
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert_close(tilefuse.linear(x, w), ref, 1e-5, "ieee fp32")
        torch.backends.cuda.matmul.allow_tf32 = True
        rel = ((tilefuse.linear(x, w).double() - ref).norm() / ref.norm()).item()
        assert 1e-5 < rel < 1e-3, rel
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_cpu_without_interpreter_runs_the_reference():
    # Documented: a CPU tensor without TRITON_INTERPRET runs tilefuse.reference, and `info` says so.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    code = ("import torch, tilefuse; from tilefuse.kernels import launches\n"
            "with launches.recording() as recs:\n"
            "    y = tilefuse.linear(torch.randn(3, 4), torch.randn(5, 4), None, 'gelu')\n"
            "print(recs[0].path, tuple(y.shape))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["reference", "(3,", "5)"]
    info = subprocess.run([sys.executable, "-m", "tilefuse", "info"], env=env, capture_output=True,
                          text=True, check=True)
    assert "path: reference" in info.stdout


@pytest.mark.skipif(ON_GPU, reason="the interpreter path is the CPU path")
def test_interpreter_path_is_used_on_cpu():
    from tilefuse.kernels import launches
    with launches.recording() as recs:
        tilefuse.linear(torch.randn(3, 4), torch.randn(5, 4))
    assert [r.path for r in recs] == ["interpreter"]


@pytest.mark.usefixtures("tilefuse_backend")
@pytest.mark.parametrize("activation", [None, "gelu", "swiglu"])
def test_split_k_path_matches_reference(device, activation, monkeypatch):
    # Small-M GEMMs split K across programs; the last program of each output tile to arrive sums the
    # fp32 partials and applies the epilogue (one launch). Force the split on small shapes (K = 300 ->
    # slices of 128: 3 slices, the last one partial). A second call must give the same bits (the sum
    # runs in slice order) and leave every arrival counter at zero for the next launch.
    from tilefuse.kernels import launches
    from tilefuse.kernels.gemm import launch
    monkeypatch.setattr(launch.forward, "split_k_slices", lambda M, N, K, path, device: 3)
    monkeypatch.setattr(launch.rules, "_WORKSPACES", {})  # this test's workspace comes from poisoned_empty
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):  # the partials workspace and y start as NaN, never stale data
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    x = _rand(5, 300, device=device)
    n = 70
    w = _rand(2 * n if activation == "swiglu" else n, 300, device=device, seed=1) / 17
    b = _rand(w.shape[0], device=device, seed=2)
    with launches.recording() as recs:
        out = tilefuse.linear(x, w, b, activation)
    assert [r.kernel for r in recs] == ["split-k 3"]
    if activation == "swiglu":
        ref = reference.gated_linear(x.double(), w[:n].double(), w[n:].double(), b[:n].double(), b[n:].double(),
                                     "swiglu")
    else:
        ref = reference.linear(x.double(), w.double(), b.double(), activation)
    assert_close(out, ref, 1e-5, f"split-k {activation}")
    assert torch.equal(tilefuse.linear(x, w, b, activation), out)
    counters = [c for c in launch.rules._COUNTERS.values() if c.device.type == torch.device(device).type]
    assert counters and all(int(c.abs().sum()) == 0 for c in counters)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(m=st.integers(1, 70), k=st.integers(1, 90), n=st.integers(1, 70),
       activation=st.sampled_from(ACTS), bias=st.booleans(), transpose_x=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_random_shapes_property(m, k, n, activation, bias, transpose_x, dtype):
    # Any M, K, N (masked tails everywhere) and either x layout match the float64 reference.
    device = "cuda" if ON_GPU else "cpu"
    g = torch.Generator().manual_seed(m * 10007 + k * 101 + n)
    x = torch.randn(k, m, generator=g).t() if transpose_x else torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    x, w = x.to(device, dtype), w.to(device, dtype)
    b = b.to(device, dtype) if b is not None else None
    out = tilefuse.linear(x, w, b, activation)
    ref = reference.linear(x.double(), w.double(), None if b is None else b.double(), activation)
    bound = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert_close(out, ref, bound, f"{m}x{k}x{n} {activation} {dtype}")


def _tma_cases():
    """(config index, activation) for every config of the Hopper GEMM's space that the launch keeps for
    that activation (gated epilogues prune the tiles whose two accumulators would spill)."""
    from tilefuse.kernels.gemm import configs

    space = [configs.tma_config(**c) for c in configs.TMA_GEMM_CONFIGS]
    return [(i, act) for act in ("gelu", "swiglu") for i, c in enumerate(space)
            if c in configs.prune_gated_configs(space, {}, GATED=act == "swiglu")]


@pytest.mark.parametrize("index,activation", _tma_cases())
def test_every_tma_config_matches_float64(tma_launch_device, index, activation):
    """Each config in the Hopper GEMM's space, pinned, on tails in M, N and K: the pinned GPU tests only
    ever run the first, and the tuner may pick any."""
    from tilefuse.kernels.gemm import configs, launch

    config = configs.TMA_GEMM_CONFIGS[index]
    gated = activation == "swiglu"
    dev = tma_launch_device
    M, K, N = 130, 96, 264  # 16-byte rows; tails against every tile size in the space
    x = _rand(M, K, device=dev, dtype=torch.float16)
    w = _rand(N, K, device=dev, dtype=torch.float16, seed=1) * 0.1
    wu = _rand(N, K, device=dev, dtype=torch.float16, seed=2) * 0.1 if gated else None
    b = _rand(N, device=dev, dtype=torch.float16, seed=3)
    bu = _rand(N, device=dev, dtype=torch.float16, seed=4) if gated else None
    y = torch.empty(M, N, dtype=torch.float16, device=dev)
    launch.forward.launch_tma(x, w, b, y, activation, config=config, w_up=wu, b_up=bu)
    if gated:
        ref = reference.gated_linear(x.double(), w.double(), wu.double(), b.double(), bu.double(), activation)
    else:
        ref = reference.linear(x.double(), w.double(), b.double(), activation)
    assert_close(y, ref, REL_L2_BOUND[torch.float16], f"{config} {activation}")


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_strided_bias_views_are_read_as_their_elements(device, activation):
    """A bias that is a strided view (every other element of a buffer) means its elements, not the
    buffer's first N."""
    x = _rand(7, 40, device=device)
    w = _rand(6, 40, device=device, seed=1)
    b = _rand(12, device=device, seed=2)[::2]
    if activation == "swiglu":
        bu = _rand(12, device=device, seed=3)[1::2]
        out = tilefuse.linear(x, (w, 2 * w), (b, bu), activation)
        ref = reference.gated_linear(x.double(), w.double(), 2 * w.double(), b.double(), bu.double(), activation)
    else:
        out = tilefuse.linear(x, w, b, activation)
        ref = reference.linear(x.double(), w.double(), b.double(), activation)
    assert_close(out, ref, 1e-5, "strided bias")


@pytest.mark.gpu_only
@pytest.mark.parametrize("activation,bias,dtype", [("gelu", True, torch.bfloat16), ("none", False, torch.float16),
                                                   ("silu", True, torch.float16)])
@pytest.mark.parametrize("M,K,N", [(130, 96, 264), (1000, 2040, 1032), (2048, 1024, 4096)])
def test_cooperative_gemm_forward_matches_float64(activation, bias, dtype, M, K, N):
    """The cooperative Gluon GEMM (tilefuse.kernels.gemm.coop, through its direct entries) as the forward at every
    config of its table that runs without a slope: tails in M, N and K, more tiles than SMs, the bias as the
    accumulator's initial value; and the gated form, which the launch takes for inference at large M."""
    from tilefuse.kernels.gemm import coop

    x = _rand(M, K, device="cuda", dtype=dtype)
    w = _rand(N, K, device="cuda", dtype=dtype, seed=1) * K ** -0.5
    b = _rand(N, device="cuda", dtype=dtype, seed=3) if bias else None
    ref = reference.linear(x.double(), w.double(), b.double() if bias else None,
                           None if activation == "none" else activation)
    for name in coop.CONFIGS:
        y = coop.linear(x, w, b, activation, name)
        assert_close(y, ref, REL_L2_BOUND[dtype], f"coop ws {name} {activation} {M}x{K}x{N}")
    # The gated form (SwiGLU / GeGLU) on the same shapes, the up projection's weight and bias beside the gate's.
    gated = {"gelu": "geglu", "none": "swiglu", "silu": "swiglu"}[activation]
    wu = _rand(N, K, device="cuda", dtype=dtype, seed=5) * K ** -0.5
    bu = _rand(N, device="cuda", dtype=dtype, seed=6) if bias else None
    ref = reference.gated_linear(x.double(), w.double(), wu.double(), b.double() if bias else None,
                                 bu.double() if bias else None, gated)
    for name in coop.gated_configs():
        y = coop.gated_linear(x, w, wu, b, bu, gated, name)
        assert_close(y, ref, REL_L2_BOUND[dtype], f"coop ws gated {name} {gated} {M}x{K}x{N}")


@pytest.mark.gpu_only
@pytest.mark.parametrize("activation,bias,stacked", [("swiglu", True, True), ("geglu", False, False),
                                                     ("geglu_tanh", True, False)])
@pytest.mark.parametrize("M,K,N", [(1024, 1024, 2816), (1000, 1032, 2824)])
def test_gated_inference_runs_the_cooperative_kernel(activation, bias, stacked, M, K, N):
    """tilefuse.linear with a gated activation under no_grad (no slopes to store) at sizes with an output tile
    per SM (launch.rules.coop_gated), the second with tails in M, N and K: the launch records the cooperative kernel
    and y matches float64; the weight as a pair or one [2N, K] tensor (its halves as views), x 3-D. The same call
    with grad (a training forward: slopes saved) keeps the TMA kernel."""
    from tilefuse import runtime
    from tilefuse.kernels import fastpath, launches
    from tilefuse.kernels.gemm import coop, launch

    dtype = torch.bfloat16
    assert coop.output_tiles(M, N, switches.gemm.COOP_GATED_CONFIG) >= runtime.device_facts(torch.device("cuda"))[1]
    fastpath.clear_all()
    x = _rand(2, M // 2, K, device="cuda", dtype=dtype)
    wg, wu = (_rand(N, K, device="cuda", dtype=dtype, seed=1 + i) * K ** -0.5 for i in range(2))
    bg, bu = (_rand(N, device="cuda", dtype=dtype, seed=3 + i) for i in range(2)) if bias else (None, None)
    weight = torch.cat([wg, wu]) if stacked else (wg, wu)
    b = (torch.cat([bg, bu]) if stacked else (bg, bu)) if bias else None
    ref = reference.gated_linear(x.double(), wg.double(), wu.double(), bg.double() if bias else None,
                                 bu.double() if bias else None, activation)
    with launches.recording() as recs, torch.no_grad():
        y = tilefuse.linear(x, weight, b, activation)
    assert [r.kernel for r in recs if r.op == "linear"] == ["cooperative warp-specialized"]
    assert_close(y, ref, REL_L2_BOUND[dtype], f"coop gated {activation} {M}x{K}x{N}")
    with launches.recording() as recs:
        y = tilefuse.linear(x.clone().requires_grad_(), weight, b, activation)
    assert [r.kernel for r in recs if r.op == "linear"] == ["tma"]
    assert_close(y.detach(), ref, REL_L2_BOUND[dtype], f"tma gated {activation} {M}x{K}x{N}")


@pytest.mark.gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 16, 512, 1000])  # split-K decode, the TMA kernel, a tail in M
def test_replayed_launches_compute_each_calls_inputs(M, dtype):
    """The host's fast path (kernels/fastpath.py): calls with fresh inputs of one signature -- the first
    captures its launches, the others replay them -- each match float64 on their own inputs, and a
    misaligned view of the same shape (another key: another specialization) too."""
    from tilefuse.kernels.gemm import launch
    launch.forward._LINEAR.clear()
    K, N = 4096, 1032
    for seed in range(4):
        x = _rand(M, K, device="cuda", dtype=dtype, seed=seed)
        w = _rand(N, K, device="cuda", dtype=dtype, seed=seed + 10) * K ** -0.5
        b = _rand(N, device="cuda", dtype=dtype, seed=seed + 20)
        y = tilefuse.linear(x, w, b, "gelu")
        if seed == 0:
            assert len(launch.forward._LINEAR) == 1, "the first call captures its launch"
        ref = reference.linear(x.double(), w.double(), b.double(), "gelu")
        assert_close(y, ref, REL_L2_BOUND[dtype], f"replay {seed} M{M} {dtype}")
    flat = _rand(M * K + 1, device="cuda", dtype=dtype, seed=9)
    x_off = flat[1:].view(M, K)
    y = tilefuse.linear(x_off, w, b, "gelu")
    ref = reference.linear(x_off.double(), w.double(), b.double(), "gelu")
    assert_close(y, ref, REL_L2_BOUND[dtype], f"misaligned M{M} {dtype}")
    assert len(launch.forward._LINEAR) == 2


def test_descriptor_allocator_is_set_in_each_thread_that_launches():
    """Triton keeps its allocator in a ContextVar: a thread of its own (the autograd engine's backward
    thread, a serving thread) starts with none, so the TMA launch sets it there too; a user's own
    allocator is left in place."""
    import threading

    import triton
    from triton.runtime import _allocation

    from tilefuse.kernels import tiling

    seen = {}

    def fresh_thread():
        seen["before"] = _allocation._allocator.get()
        tiling.ensure_descriptor_allocator()
        seen["after"] = _allocation._allocator.get()

    def users_thread():
        def mine(size, alignment, stream):
            return torch.empty(size, dtype=torch.int8)
        triton.set_allocator(mine)
        tiling.ensure_descriptor_allocator()
        seen["kept"] = _allocation._allocator.get() is mine

    for target in (fresh_thread, users_thread):
        t = threading.Thread(target=target)
        t.start()
        t.join()
    assert isinstance(seen["before"], _allocation.NullAllocator)
    assert seen["after"] is tiling._descriptor_scratch
    assert seen["kept"]
