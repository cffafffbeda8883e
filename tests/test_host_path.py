"""The compiled-path dispatch on a CPU, with kernel launches recorded instead of run
(tilefuse.harness.host_path): every op reaches its kernels with a config, the autotuner's hot path
launches exactly what its slow path chose, and the host helpers agree with triton's and torch's."""
from __future__ import annotations

import random

import pytest
import torch
import triton

from tilefuse import registry, tuning
from tilefuse.harness.host_path import stubbed_launches
from tilefuse.harness.report import render_markdown
from tilefuse.kernels.tiling import cdiv, next_pow2
from tilefuse.ops.attention import _broadcast_shape

ON_GPU = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU-side check of the launch path; the GPU runs it for real")

# One small case per op (bench_cases[0] with this shape) and the kernels one call must launch.
CASES = {
    "linear": ((512, 1024, 1024), ["linear_tma_kernel"]),
    "linear decode": ((16, 4096, 4096), ["linear_epilogue_kernel"]),  # split-K, one launch
    "gated_linear": ((512, 1024, 1024), ["linear_tma_kernel"]),
    "layer_norm": ((64, 4096), ["norm_fwd_kernel"]),
    "rms_norm": ((64, 4096), ["norm_fwd_kernel"]),
    "softmax": ((64, 4096), ["softmax_fwd_kernel"]),
    # Hopper form: gamma folded into W, then the TMA GEMM, which sums the rows and normalizes in its epilogue
    "layer_norm_linear": ((256, 1024, 1024), ["weight_fold_kernel", "linear_tma_kernel"]),
    # bf16, d = 64, no mask: the warp-specialized Gluon kernel on sm_90
    "attention": ((1, 4, 4, 128, 128), ["attention_fwd_ws_kernel"]),
    "sdpa": ((1, 2, 2, 128, 128, 64), ["attention_fwd_kernel"]),
}


@pytest.fixture
def pinned_tuners(monkeypatch):
    """Every autotuner picks its first pruned config, as the GPU tests do (TILEFUSE_AUTOTUNE=0), with
    fresh in-process caches so this test settles its own keys."""
    from tilefuse.kernels import attention, gemm_epilogue, gemm_tma, norm_linear, norms, softmax  # noqa: F401
    tuners = list(tuning._TUNERS.values())
    for t in tuners:
        monkeypatch.setattr(t, "pinned", True)
        monkeypatch.setattr(t, "cache", {})
    return tuners


@pytest.mark.parametrize("op", sorted(CASES))
def test_compiled_dispatch_launches_the_same_kernels_every_call(op, pinned_tuners, monkeypatch):
    shape, kernels = CASES[op]
    spec = registry.get(op.split()[0])
    inputs = spec.make_inputs(dict(spec.bench_cases[0], shape=shape), torch.device("cpu"), 0)
    slow_runs = []
    original = tuning.TableAutotuner._run_and_settle

    def counting(self, args, kwargs):
        slow_runs.append(self.name)
        return original(self, args, kwargs)

    monkeypatch.setattr(tuning.TableAutotuner, "_run_and_settle", counting)
    with torch.no_grad(), stubbed_launches() as launches:
        first = spec.fused(**inputs)
        n = len(launches)
        second = spec.fused(**inputs)
    assert [launch.kernel for launch in launches[:n]] == kernels
    assert launches[n:] and [launch.kernel for launch in launches[n:]] == kernels
    for a, b in zip(launches[:n], launches[n:]):
        # The hot path (second call) launches with exactly the config and grid the slow path chose.
        assert a.grid == b.grid and all(g > 0 for g in a.grid)
        assert {k: v for k, v in a.kwargs.items() if k != "grid"} == {k: v for k, v in b.kwargs.items() if k != "grid"}
    assert len(slow_runs) <= len(kernels), "the second call must not go through the slow path again"
    outputs = first if isinstance(first, tuple) else (first,)
    assert all(isinstance(t, torch.Tensor) for t in outputs) and type(first) is type(second)


def test_hot_path_forgets_settled_configs_when_the_cache_is_replaced(pinned_tuners):
    from tilefuse.kernels import norms
    tuner = norms.norm_fwd_autotuned
    spec = registry.get("layer_norm")
    inputs = spec.make_inputs(dict(spec.bench_cases[0], shape=(8, 4096)), torch.device("cpu"), 0)
    with torch.no_grad(), stubbed_launches() as launches:
        spec.fused(**inputs)
        assert tuner._settled
        first = launches[-1].kwargs["BLOCK_M"]
        wanted = next(c for c in tuner.configs if c.kwargs["BLOCK_N"] == 4096 and c.kwargs["BLOCK_M"] != first
                      and c.kwargs["SINGLE_PASS"])
        key = next(iter(tuner.cache))
        tuner.cache = {key: wanted}  # a new cache object holding another choice for the same key
        spec.fused(**inputs)
    assert launches[-1].kwargs["BLOCK_M"] == wanted.kwargs["BLOCK_M"] != first


def test_host_integer_helpers_match_triton():
    for a in range(0, 300):
        for b in (1, 2, 3, 7, 64, 128):
            assert cdiv(a, b) == triton.cdiv(a, b)
    for n in range(1, 5000):
        assert next_pow2(n) == triton.next_power_of_2(n)
    assert next_pow2(0) == 1


def test_broadcast_shape_matches_torch():
    rng = random.Random(0)
    for _ in range(2000):
        shapes = [tuple(rng.choice([0, 1, 2, 3]) for _ in range(rng.randint(0, 4)))
                  for _ in range(rng.randint(1, 3))]
        try:
            expected = tuple(torch.broadcast_shapes(*shapes))
        except RuntimeError:
            expected = None
        assert _broadcast_shape(*shapes) == expected, shapes


def _gpu_result(ms, host):
    env = dict(device="NVIDIA H200", path="compiled", torch="t", triton="t", python="p", time_utc="now")
    ceil = dict(copy_TBps=4.2, read_TBps=4.0, gemm_bf16_TFLOPs=700, gemm_fp16_TFLOPs=660, gemm_fp32_TFLOPs=50)
    row = dict(case="M64 N4096", dtype="bf16", ms=ms, host_us=host, tflops=0.0, tbps=1.0, roofline_pct=20.0,
               anchors={"eager unfused": 0.05}, speedup={"eager unfused": 0.05 / ms}, rel_l2=1e-3, config="c",
               hbm_bytes={"fused": 1e6, "unfused": 2e6})
    op = dict(summary="s", accuracy=[], speed=[row])
    return dict(environment=env, ceilings=ceil, seeds=20, ops={"layer_norm": op})


def test_report_marks_rows_whose_time_may_be_the_hosts():
    bound = render_markdown(_gpu_result(ms=0.090, host=85.0))
    assert "| 0.0900 † | 85 | – |" in bound and "host µs" in bound
    free = render_markdown(_gpu_result(ms=0.090, host=30.0))
    assert "| 0.0900 | 30 | – |" in free


@pytest.mark.parametrize("d", [64, 80])  # the warp-specialized kernel, and the portable one
def test_attention_grid_fits_cuda_limits_in_batched_decode(d, pinned_tuners):
    """B * Hq = 131072 (4096 sequences of 32 heads, one query each): CUDA's second and third grid axes stop
    at 65535, so the attention launches put every (query block, head) on the first axis (FLAT_GRID), and
    keep the two-axis grid below that."""
    q = torch.randn(4096, 32, 1, d, dtype=torch.bfloat16)
    k = torch.randn(4096, 8, 16, d, dtype=torch.bfloat16)
    with torch.no_grad(), stubbed_launches() as launches:
        registry.get("attention").fused(q=q, k=k, v=k, causal=False, window=None, scale=None, return_lse=False)
    assert launches and all(len(launch.grid) == 1 and launch.grid[0] == 4096 * 32 for launch in launches), launches
    assert all(launch.kwargs["FLAT_GRID"] for launch in launches)
    with torch.no_grad(), stubbed_launches() as launches:
        registry.get("attention").fused(q=q[:2], k=k[:2], v=k[:2], causal=False, window=None, scale=None,
                                        return_lse=False)
    assert [launch.grid for launch in launches] == [(1, 64)] and not launches[0].kwargs["FLAT_GRID"]


def test_forward_kernel_portable_reaches_the_portable_kernel(pinned_tuners):
    """The report's "tilefuse.attention.portable" anchor: inside forward_kernel("portable") a bf16 d = 64 call
    (which the warp-specialized kernel takes otherwise) launches the portable kernel; the choice is restored
    after the block, and a name other than "auto" / "portable" is refused."""
    from tilefuse.ops.attention import forward_kernel

    q = torch.randn(1, 4, 128, 64, dtype=torch.bfloat16)
    spec = registry.get("attention")
    args = dict(q=q, k=q, v=q, causal=True, window=None, scale=None, return_lse=False)
    with torch.no_grad(), stubbed_launches() as launches:
        with forward_kernel("portable"):
            spec.fused(**args)
        spec.fused(**args)
    assert [launch.kernel for launch in launches] == ["attention_fwd_kernel", "attention_fwd_ws_kernel"]
    with pytest.raises(ValueError, match="kernel must be"):
        with forward_kernel("ws"):
            pass


def _linear_inputs(M, K, N, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype),
            torch.randn(N, generator=g).to(dtype))


@pytest.mark.parametrize("M", [512, 16])  # the TMA kernel; the split-K decode kernel
def test_linear_replays_its_launch_on_new_tensors(M, pinned_tuners):
    """A second call with inputs of the same shapes, strides, dtypes and alignment replays the first
    call's compiled launch (kernels/relaunch.py) with the second call's tensors: same grid and kernel
    arguments, the new pointers, none of the first call's (a stale pointer would read freed memory)."""
    import tilefuse
    from tilefuse.ops import linear as linear_op
    linear_op.clear_launch_plans()
    x1, w1, b1 = _linear_inputs(M, 4096, 4096, seed=0)
    x2, w2, b2 = _linear_inputs(M, 4096, 4096, seed=1)
    with torch.no_grad(), stubbed_launches() as launches:
        y1 = tilefuse.linear(x1, w1, b1, "gelu")
        y2 = tilefuse.linear(x2, w2, b2, "gelu")
    first, second = launches
    assert not first.replay and second.replay
    assert first.kernel == second.kernel and first.grid == second.grid
    assert {k: v for k, v in first.kwargs.items() if k != "grid"} == second.kwargs
    assert len(first.pointers) == len(second.pointers)
    assert {x2.data_ptr(), w2.data_ptr(), b2.data_ptr(), y2.data_ptr()} <= set(second.pointers)
    assert not {x1.data_ptr(), w1.data_ptr(), b1.data_ptr(), y1.data_ptr()} & set(second.pointers)
    assert y2.shape == (M, 4096) and y2.dtype == torch.bfloat16 and y2.data_ptr() != y1.data_ptr()


def test_linear_replays_only_calls_that_match_the_captured_one(pinned_tuners):
    """Anything the checks or the dispatch read takes the full path again: another shape, dtype,
    alignment (Triton specializes pointers on 16 bytes; TMA needs it), bias presence, activation,
    grad mode; and bad input still gets its error after a replay exists."""
    import tilefuse
    from tilefuse.ops import linear as linear_op
    linear_op.clear_launch_plans()
    x, w, b = _linear_inputs(64, 256, 128)
    flat = torch.randn(64 * 256 + 1).to(torch.bfloat16)
    misaligned = flat[1:].view(64, 256)  # x's shape and strides, its address 2 bytes off 16
    assert misaligned.stride() == x.stride() and misaligned.data_ptr() % 16 == 2
    variants = [
        lambda: tilefuse.linear(x[:32], w, b, "gelu"),
        lambda: tilefuse.linear(x.half(), w.half(), b.half(), "gelu"),
        lambda: tilefuse.linear(misaligned, w, b, "gelu"),
        lambda: tilefuse.linear(x, w, None, "gelu"),
        lambda: tilefuse.linear(x, w, b, "relu"),
    ]
    with stubbed_launches() as launches:
        with torch.no_grad():
            tilefuse.linear(x, w, b, "gelu")
            tilefuse.linear(x, w, b, "gelu")
            assert launches[-1].replay
            for call in variants:
                n = len(launches)
                call()
                assert launches[n:] and not any(launch.replay for launch in launches[n:])
        w_grad = w.clone().requires_grad_(True)
        with pytest.raises(NotImplementedError, match="no backward"):
            tilefuse.linear(x, w_grad, b, "gelu")  # grad mode on and a weight that needs grad
        with torch.no_grad(), pytest.raises(ValueError, match="weight"):
            tilefuse.linear(x[:, :128], w, b, "gelu")


def test_linear_replay_forgets_a_replaced_tuner_cache(pinned_tuners):
    """A launch captured under one tuner cache is not replayed after the cache object is replaced: the
    config the tuner would choose may differ (the same rule as the tuner's own hot path)."""
    import tilefuse
    from tilefuse.kernels import gemm_tma
    from tilefuse.ops import linear as linear_op
    linear_op.clear_launch_plans()
    x, w, b = _linear_inputs(512, 1024, 1024)
    with torch.no_grad(), stubbed_launches() as launches:
        tilefuse.linear(x, w, b, "gelu")
        gemm_tma.linear_tma_autotuned.cache = {}
        tilefuse.linear(x, w, b, "gelu")
        tilefuse.linear(x, w, b, "gelu")
    assert [launch.replay for launch in launches] == [False, False, True]


def test_capture_refuses_a_launch_that_is_not_its_own(pinned_tuners, monkeypatch):
    """If another thread launches through the same tuner between a capture's launch and its read of the
    tuner's record, the record holds that thread's arguments: no replay is made from it."""
    import tilefuse
    from tilefuse.kernels import gemm_tma
    from tilefuse.ops import linear as linear_op
    linear_op.clear_launch_plans()
    x, w, b = _linear_inputs(512, 1024, 1024)
    tuner = gemm_tma.linear_tma_autotuned
    real_run = type(tuner).run

    def run_then_other_thread(self, *args, **kwargs):
        ret = real_run(self, *args, **kwargs)
        if self.keep_last_launch:
            compiled, launched, kw, config = self.last_launch
            self.last_launch = (compiled, (launched[0].clone(),) + launched[1:], kw, config)
        return ret

    monkeypatch.setattr(type(tuner), "run", run_then_other_thread)
    with torch.no_grad(), stubbed_launches() as launches:
        tilefuse.linear(x, w, b, "gelu")
        tilefuse.linear(x, w, b, "gelu")
    assert [launch.replay for launch in launches] == [False, False] and not linear_op._PLANS
