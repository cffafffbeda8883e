"""The decode kernel (kernels/gemm/decode.py): correct at every M it takes, with tails on N and K, bias and
activations (the kernel itself: the interpreter on a CPU, the shipped configs on a GPU); where the launch takes it
(the public call with the compiled path stubbed, on a CPU); and the public call on a GPU."""
import pytest
import torch
import torch.nn.functional as F

import tilefuse
from helpers import ON_GPU, assert_close
from tilefuse.kernels import switches
from tilefuse.kernels import launches
from tilefuse.kernels.gemm import launch
from tilefuse.opspec import REL_L2_BOUND
from tools.host_path import stubbed_launches

# These check tilefuse's decode kernel and where its launch takes it: they pin the tilefuse backend.
pytestmark = pytest.mark.usefixtures("tilefuse_backend")

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
ACT = {"gelu": F.gelu, "silu": F.silu, None: lambda t: t}


def _r(M, K, N, bias, device, dtype=DTYPE, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if bias else None
    return x, w, b


def _want(x, w, b, activation):
    return ACT[activation](F.linear(x.double(), w.double(), None if b is None else b.double()))


@pytest.mark.parametrize("M", [1, 5, 16, 33, 64])
@pytest.mark.parametrize("activation,bias", [("gelu", True), (None, False), ("silu", True)])
def test_decode_kernel_matches_float64(M, activation, bias, device):
    K, N = (300, 70) if device.type == "cpu" else (1100, 4232)  # tails on both: neither a multiple of a tile
    x, w, b = _r(M, K, N, bias, device, seed=M)
    y = torch.full((M, N), float("nan"), dtype=x.dtype, device=device)
    launch.forward._launch_decode(x, w, b, y, activation, interpret=device.type == "cpu")
    assert_close(y, _want(x, w, b, activation), REL_L2_BOUND[DTYPE], f"M{M}")


def _kernel_for(M, K, N, activation="gelu", dtype=torch.bfloat16, x_view=None, grad=False):
    x, w, b = _r(M, K, N, True, "cpu", dtype=dtype)
    if x_view is not None:
        x = x_view(x)
    if grad:
        w.requires_grad_()
    with stubbed_launches(sms=132) as runs, launches.recording() as recs:
        tilefuse.linear(x, w, b, activation)
        tilefuse.linear(x, w, b, activation)
    return [r.kernel for r in runs], [r.replay for r in runs], [r.kernel for r in recs]


@pytest.mark.skipif(ON_GPU, reason="CPU-side check of the launch path; the GPU runs it for real")
@pytest.mark.parametrize("M", [1, 16, 64])
def test_decode_shapes_take_the_decode_kernel_and_replay(pinned_tuners, M):
    """The measured shapes (K = N = 4096, bf16): one launch of the decode kernel, the second call a replay; the
    shipped config by the row tile."""
    kernels, replays, recs = _kernel_for(M, 4096, 4096)
    assert kernels == ["decode_linear_kernel"] * 2 and replays == [False, True] and recs == ["decode"] * 2


@pytest.mark.skipif(ON_GPU, reason="CPU-side check of the launch path; the GPU runs it for real")
@pytest.mark.parametrize("case", ["narrow N", "short K", "fp32", "gated", "training", "strided x", "M 65",
                                  "switch off"])
def test_other_small_m_calls_keep_split_k_or_their_path(pinned_tuners, monkeypatch, case):
    """Too few programs for a wave (N 2048: 64 of 132), K < 1024, fp32, a gated activation, a training forward
    (slopes to store), x with a non-unit inner stride, M past 64 and DECODE_KERNEL off: not the decode kernel."""
    M, K, N, kw = 16, 4096, 4096, {}
    if case == "narrow N":
        N = 2048
    elif case == "short K":
        K = 512
    elif case == "fp32":
        kw = dict(dtype=torch.float32)
    elif case == "gated":
        kw = dict(activation="swiglu")
    elif case == "training":
        kw = dict(grad=True)
    elif case == "strided x":
        kw = dict(x_view=lambda x: x.t().contiguous().t())
    elif case == "M 65":
        M = 65
    else:
        monkeypatch.setattr(switches.gemm, "DECODE_KERNEL", False)
    kernels, _, recs = _kernel_for(M, K, N, **kw)
    assert "decode_linear_kernel" not in kernels and "decode" not in recs, (kernels, recs)


@pytest.mark.gpu_only
@pytest.mark.parametrize("M", [1, 16, 33, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_linear_through_the_public_call(M, dtype):
    """tilefuse.linear at decode shapes (3-D x as a serving loop passes it) runs the decode kernel and matches
    float64, at K = N = 4096 and on tails (N 4232, K 1100)."""
    for K, N in ((4096, 4096), (1100, 4232)):
        x, w, b = _r(M, K, N, True, "cuda", dtype=dtype, seed=M)
        with launches.recording() as recs:
            y = tilefuse.linear(x.view(1, M, K), w, b, "gelu")
        assert [r.kernel for r in recs] == ["decode"], recs
        assert_close(y.view(M, N), _want(x, w, b, "gelu"), REL_L2_BOUND[dtype], f"M{M} K{K} N{N}")


@pytest.mark.gpu_only
def test_decode_linear_replays_in_a_cuda_graph():
    """A decode step as a serving loop captures it: tilefuse.linear at M 16, K = N = 4096 (the decode kernel)
    captured in a CUDA graph and replayed on new rows matches an eager call on them."""
    x, w, b = _r(16, 4096, 4096, True, "cuda", seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile outside the capture
            tilefuse.linear(x, w, b, "gelu")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with launches.recording() as recs, torch.cuda.graph(graph):
        y = tilefuse.linear(x, w, b, "gelu")
    assert [r.kernel for r in recs] == ["decode"], recs
    for seed in (2, 3):
        x.copy_(_r(16, 4096, 4096, True, "cuda", seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        assert_close(y, _want(x, w, b, "gelu"), REL_L2_BOUND[torch.bfloat16], f"replay {seed}")
