"""The compiled-path dispatch on a CPU, with kernel launches recorded instead of run (tests/tools/host_path.py):
every op reaches its kernels with a config, the launch layer's fast path (kernels/fastpath.py) replays
exactly what the full path launches -- same kernels, grids, constexprs and configs, the new call's
pointers -- and any change in what the dispatch reads takes the full path."""
from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import triton

from tilefuse.kernels import switches
from tilefuse import registry, sizes, tuning
from tilefuse.harness.report import render_markdown
from tilefuse.kernels import fastpath, launches
from tilefuse.ops.attention import _attention_impl, _broadcast_shape
from tools.host_path import stubbed_launches

ON_GPU = torch.cuda.is_available()
# tilefuse's own launch path is what this checks, so it pins the tilefuse backend.
pytestmark = [pytest.mark.skipif(ON_GPU, reason="CPU-side check of the launch path; the GPU runs it for real"),
              pytest.mark.usefixtures("tilefuse_backend")]

# One small case per op (bench_cases[0] with this shape) and the kernels one call must launch.
CASES = {
    "linear": ((512, 1024, 1024), ["linear_tma_kernel"]),
    "linear decode": ((16, 4096, 4096), ["decode_linear_kernel"]),  # the decode kernel: the weight read once
    "gated_linear": ((512, 1024, 1024), ["linear_tma_kernel"]),
    "layer_norm": ((64, 4096), ["norm_fwd_kernel"]),
    "rms_norm": ((64, 4096), ["norm_fwd_kernel"]),
    "softmax": ((64, 4096), ["softmax_fwd_kernel"]),
    # Hopper form: gamma folded into W, the rows' statistics, then the TMA GEMM, which normalizes in its epilogue
    "layer_norm_linear": ((256, 1024, 1024), ["weight_fold_kernel", "norm_fwd_kernel", "linear_tma_kernel"]),
    # bf16, d = 64, no mask: the warp-specialized Gluon kernel on sm_90
    "attention": ((1, 4, 4, 128, 128), ["attention_fwd_ws_kernel"]),
    "sdpa": ((1, 2, 2, 128, 128, 64), ["attention_fwd_kernel"]),
    # bf16, d = 128, K a multiple of 8: the Hopper TMA kernel, one launch per projection
    "qkv_projection": ((1, 128, 256, 4, 4, 128), ["qkv_projection_tma_kernel"] * 3),
}


def _strip(kwargs):
    return {k: v for k, v in kwargs.items() if k != "grid"}


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
        # The second call (replayed or through the tuner's settled key) launches exactly what the first chose.
        assert a.grid == b.grid and all(g > 0 for g in a.grid)
        assert _strip(a.kwargs) == _strip(b.kwargs)
    assert len(slow_runs) <= len(kernels), "the second call must not go through the slow path again"
    outputs = first if isinstance(first, tuple) else (first,)
    assert all(isinstance(t, torch.Tensor) for t in outputs) and type(first) is type(second)


def test_every_family_replays_where_its_launches_touch_only_the_calls_tensors(pinned_tuners):
    """Which bench-like calls the fast path replays: those whose launches read and write only the call's
    inputs and outputs (and the split-K buffers kept for the process): every family's. layer_norm_linear's
    Hopper form replays its three launches (the fold, the statistics, the GEMM): its temporaries (the folded
    weight, its sums, the row statistics) are outputs of the plan, allocated by each replay. qkv_projection
    replays its three launches, outputs in head layout included."""
    replayed = {}
    for op in sorted(CASES):
        shape, _ = CASES[op]
        spec = registry.get(op.split()[0])
        inputs = spec.make_inputs(dict(spec.bench_cases[0], shape=shape), torch.device("cpu"), 0)
        with torch.no_grad(), stubbed_launches() as launches:
            spec.fused(**inputs)
            n = len(launches)
            spec.fused(**inputs)
        replayed[op] = all(launch.replay for launch in launches[n:])
    assert replayed == {op: True for op in CASES}


def test_hot_path_forgets_settled_configs_when_the_cache_is_replaced(pinned_tuners):
    from tilefuse.kernels.norms import launch
    tuner = launch.norm_fwd_tuned
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
    assert not launches[-1].replay, "a plan captured under the old cache must not replay"
    assert launches[-1].kwargs["BLOCK_M"] == wanted.kwargs["BLOCK_M"] != first


def test_host_integer_helpers_match_triton():
    for a in range(0, 300):
        for b in (1, 2, 3, 7, 64, 128):
            assert sizes.cdiv(a, b) == triton.cdiv(a, b)
    for n in range(1, 5000):
        assert sizes.next_pow2(n) == triton.next_power_of_2(n)
    assert sizes.next_pow2(0) == 1


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


def test_attention_kernel_choice_reaches_the_portable_kernel(pinned_tuners):
    """The report's "tilefuse.attention.portable" anchor: kernel="portable" on a bf16 d = 64 call (which the
    warp-specialized kernel takes otherwise) launches the portable kernel; its plan is its own (the
    choice is part of the key); an unknown kernel name is refused. (q, k and v are distinct tensors: a call
    whose inputs share memory makes no plan, since a launch argument must name one input.)"""
    q, k, v = (torch.randn(1, 4, 128, 64, dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad(), stubbed_launches() as launches:
        for _ in range(2):
            _attention_impl(q, k, v, None, None, True, -1, 0, False, kernel="portable")
            _attention_impl(q, k, v, None, None, True, -1, 0, False)
    assert [launch.kernel for launch in launches] == ["attention_fwd_kernel", "attention_fwd_ws_kernel"] * 2
    assert [launch.replay for launch in launches] == [False, False, True, True]
    with pytest.raises(ValueError, match="kernel must be"):
        _attention_impl(q, k, v, None, None, True, -1, 0, False, kernel="fast")
    fastpath.clear_all()
    with torch.no_grad(), stubbed_launches() as launches:
        for _ in range(2):
            _attention_impl(q, q, q, None, None, True, -1, 0, False)
    assert [launch.replay for launch in launches] == [False, False]


def _linear_inputs(M, K, N, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype),
            torch.randn(N, generator=g).to(dtype))


@pytest.mark.parametrize("M", [512, 16])  # the TMA kernel; the split-K decode kernel
def test_linear_replays_its_launch_on_new_tensors(M, pinned_tuners):
    """A second call with inputs of the same shapes, strides, dtypes and alignment replays the first
    call's compiled launch with the second call's tensors: same grid and kernel arguments, the new
    pointers, none of the first call's (a stale pointer would read freed memory)."""
    import tilefuse
    x1, w1, b1 = _linear_inputs(M, 4096, 4096, seed=0)
    x2, w2, b2 = _linear_inputs(M, 4096, 4096, seed=1)
    with torch.no_grad(), stubbed_launches() as launches:
        y1 = tilefuse.linear(x1, w1, b1, "gelu")
        y2 = tilefuse.linear(x2, w2, b2, "gelu")
    first, second = launches
    assert not first.replay and second.replay
    assert first.kernel == second.kernel and first.grid == second.grid
    assert _strip(first.kwargs) == second.kwargs
    assert len(first.pointers) == len(second.pointers)
    assert {x2.data_ptr(), w2.data_ptr(), b2.data_ptr(), y2.data_ptr()} <= set(second.pointers)
    assert not {x1.data_ptr(), w1.data_ptr(), b1.data_ptr(), y1.data_ptr()} & set(second.pointers)
    assert y2.shape == (M, 4096) and y2.dtype == torch.bfloat16 and y2.data_ptr() != y1.data_ptr()


def test_a_choice_times_tilefuses_candidate_as_its_replays_run(pinned_tuners, monkeypatch, tmp_path):
    """A backend choice times each candidate as the calls after it run: tilefuse's first timed call takes the full
    launch path, every later one reissues that launch through the C launcher (a replay), as the fast path replays
    it; a candidate with no launch of tilefuse's (a vendor composition) is called in full each time. Timed on
    the full path, tilefuse's host-bound candidates lost to cuBLAS's by host time only a first call pays."""
    from tilefuse.kernels.gemm import launch as gemm_launch
    from tilefuse.tuning import choices
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU 9000")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tuning.autotuner, "_tune_missing_keys", True)
    monkeypatch.setattr(tuning.autotuner, "autotune_enabled", lambda: True)
    choices._CHOICES.pop("test_timed_as_replayed", None)
    choice = tuning.BackendChoice("test_timed_as_replayed", ("tilefuse", "torch"))
    x, w, b = _linear_inputs(512, 1024, 1024)
    vendor_calls = []

    def run(candidate):  # as linear's entry runs a candidate: tilefuse's full launch path, no plan lookup
        if candidate == "tilefuse":
            precision = gemm_launch.forward.precision_for(x.dtype, True)
            return gemm_launch.forward.forward_kernels(x, w, b, None, None, "gelu", precision, "compiled", False)
        vendor_calls.append(candidate)
        return torch.nn.functional.linear(x, w, b)

    with torch.no_grad(), stubbed_launches() as launches:
        def do_bench(fn, **kwargs):
            before = len(launches)
            for _ in range(3):
                fn()
            return 0.1 if len(launches) > before else 0.5  # tilefuse's launches: the faster
        monkeypatch.setattr(triton.testing, "do_bench", do_bench)
        key = lambda: tuning.ChoiceKey(N=1024, dtype=torch.bfloat16)  # noqa: E731
        fastpath.run_chosen(choice, "auto", choice.candidates, key, torch.device("cuda"), run)
    assert [launch.kernel for launch in launches] == ["linear_tma_kernel"] * 4
    # timed: the full path once, then two replays; then the call itself, on the full path as its entry runs it
    assert [launch.replay for launch in launches] == [False, True, True, False]
    assert launches[1].pointers == launches[0].pointers and _strip(launches[0].kwargs) == launches[1].kwargs
    assert vendor_calls == ["torch"] * 3


def test_linear_replays_only_calls_that_match_the_captured_one(pinned_tuners):
    """Anything the dispatch reads takes the full path again: another shape, dtype, alignment (Triton
    specializes pointers on 16 bytes; TMA needs it), bias presence, activation; and bad input still gets
    its error after a replay exists (the checks run before the launch layer)."""
    import tilefuse
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
        n = len(launches)
        tilefuse.linear(x, w_grad, b, "gelu")  # grad mode on: the op also saves the pre-activation
        assert launches[n:] and not any(launch.replay for launch in launches[n:])
        with torch.no_grad(), pytest.raises(ValueError, match="weight"):
            tilefuse.linear(x[:, :128], w, b, "gelu")


def test_linear_replay_forgets_a_replaced_tuner_cache(pinned_tuners):
    """A launch captured under one tuner cache is not replayed after the cache object is replaced: the
    config the tuner would choose may differ (the same rule as the tuner's own hot path)."""
    import tilefuse
    from tilefuse.kernels.gemm import launch
    x, w, b = _linear_inputs(512, 1024, 1024)
    with torch.no_grad(), stubbed_launches() as launches:
        tilefuse.linear(x, w, b, "gelu")
        launch.forward.linear_tma_tuned.cache = {}
        tilefuse.linear(x, w, b, "gelu")
        tilefuse.linear(x, w, b, "gelu")
    assert [launch.replay for launch in launches] == [False, False, True]


def test_capture_refuses_launches_that_touch_a_temporary(pinned_tuners, monkeypatch):
    """A launch whose tensor argument is neither one of the call's inputs or outputs nor a buffer kept for
    the process (here: a copy of x made inside the launch layer) would replay a dead address: no plan."""
    import tilefuse
    from tilefuse.kernels.gemm import launch
    real = launch.rules.row_addressing
    monkeypatch.setattr(launch.forward, "row_addressing", lambda x: real(x.clone()))
    x, w, b = _linear_inputs(512, 1024, 1024)
    with torch.no_grad(), stubbed_launches() as launches:
        tilefuse.linear(x, w, b, "gelu")
        tilefuse.linear(x, w, b, "gelu")
    assert [launch.replay for launch in launches] == [False, False] and len(launch.forward._LINEAR) == 0


def _where(ptr, tensors):
    """(index, byte offset) of the tensor whose memory holds ``ptr``, or None (an output, a buffer)."""
    for i, t in enumerate(tensors):
        if t is not None and t.numel() and t.data_ptr() <= ptr < t.data_ptr() + t.untyped_storage().nbytes():
            return i, ptr - t.data_ptr()
    return None


def _t(*shape, dtype=torch.bfloat16, seed=0, offset=0, transpose=False):
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    flat = torch.randn(n + offset, generator=g).to(dtype)
    t = flat[offset:].view(*(shape[::-1] if transpose else shape))
    return t.t() if transpose else t


def _variants():
    """(op name, call(seed) -> (inputs, run)) pairs: a base call and the calls that differ from it in one
    thing the dispatch reads. ``run()`` makes the call; ``inputs`` are its input tensors."""
    import tilefuse

    def linear(M, K, N, act="gelu", bias=True, dtype=torch.bfloat16, offset=0, transpose=False):
        def make(seed):
            x = _t(M, K, dtype=dtype, seed=seed, offset=offset, transpose=transpose)
            w = _t(N, K, dtype=dtype, seed=seed + 1)
            b = _t(N, dtype=dtype, seed=seed + 2) if bias else None
            return (x, w, b), lambda: tilefuse.linear(x, w, b, act)
        return make

    def gated(M, K, N, act="swiglu", dtype=torch.bfloat16):
        def make(seed):
            x, w = _t(M, K, dtype=dtype, seed=seed), _t(2 * N, K, dtype=dtype, seed=seed + 1)
            return (x, w), lambda: tilefuse.linear(x, w, None, act)
        return make

    def norm(M, N, rms=False, residual=False, eps=1e-5, dtype=torch.bfloat16, offset=0):
        def make(seed):
            x = _t(M, N, dtype=dtype, seed=seed, offset=offset)
            w = _t(N, dtype=dtype, seed=seed + 1)
            r = _t(M, N, dtype=dtype, seed=seed + 2) if residual else None
            if rms:
                return (x, w, r), lambda: tilefuse.rms_norm(x, (N,), w, eps, residual=r)
            return (x, w, r), lambda: tilefuse.layer_norm(x, (N,), w, None, eps, residual=r)
        return make

    def softmax(R, N, dim=-1, algorithm="auto", dtype=torch.bfloat16, transpose=False):
        def make(seed):
            x = _t(R, N, dtype=dtype, seed=seed, transpose=transpose)
            return (x,), lambda: tilefuse.softmax(x, dim, algorithm=algorithm)
        return make

    def attention(Nq, Nk, d=64, causal=True, window=None, dtype=torch.bfloat16, hkv=4, lse=False):
        def make(seed):
            q = _t(1, 4, Nq, d, dtype=dtype, seed=seed)
            k, v = _t(1, hkv, Nk, d, dtype=dtype, seed=seed + 1), _t(1, hkv, Nk, d, dtype=dtype, seed=seed + 2)
            return (q, k, v), lambda: tilefuse.attention(q, k, v, causal=causal, window=window, return_lse=lse)
        return make

    def sdpa(L, S, mask_kind=None, causal=False, dtype=torch.bfloat16):
        def make(seed):
            q, k, v = (_t(2, 2, n, 64, dtype=dtype, seed=seed + i) for i, n in enumerate((L, S, S)))
            mask = None
            if mask_kind == "bool":
                mask = _t(L, S, dtype=torch.float32, seed=seed + 5) > 0
            elif mask_kind == "float":
                mask = _t(2, 1, L, S, dtype=dtype, seed=seed + 5)
            return (q, k, v, mask), lambda: tilefuse.scaled_dot_product_attention(q, k, v, mask, is_causal=causal)
        return make

    def norm_backward(M, N, rms=False, residual=False, weight=True, dtype=torch.bfloat16):
        def make(seed):
            x = _t(M, N, dtype=dtype, seed=seed).requires_grad_()
            w = _t(N, dtype=dtype, seed=seed + 1).requires_grad_() if weight else None
            r = _t(M, N, dtype=dtype, seed=seed + 2).requires_grad_() if residual else None
            dy, dh = _t(M, N, dtype=dtype, seed=seed + 3), _t(M, N, dtype=dtype, seed=seed + 4)
            leaves = [t for t in (x, w, r) if t is not None]

            def run():
                with torch.enable_grad():
                    out = (tilefuse.rms_norm(x, (N,), w, 1e-6, residual=r) if rms
                           else tilefuse.layer_norm(x, (N,), w, None, 1e-5, residual=r))
                    outs, grads = (list(out), [dy, dh]) if residual else ([out], [dy])
                    return torch.autograd.grad(outs, leaves, grads)
            return (x, w, r, dy, dh), run
        return make

    def softmax_backward(R, N, dim=-1, dtype=torch.bfloat16):
        def make(seed):
            x = _t(R, N, dtype=dtype, seed=seed).requires_grad_()
            dy = _t(R, N, dtype=dtype, seed=seed + 1)

            def run():
                with torch.enable_grad():
                    return torch.autograd.grad(tilefuse.softmax(x, dim), [x], [dy])
            return (x, dy), run
        return make

    return {
        "norm_backward": [norm_backward(64, 4096), norm_backward(64, 4096, rms=True),
                          norm_backward(64, 4096, residual=True), norm_backward(64, 4096, weight=False),
                          norm_backward(128, 4096), norm_backward(64, 2048), norm_backward(4, 70001),
                          norm_backward(64, 4096, dtype=torch.float32)],
        "softmax_backward": [softmax_backward(64, 4096), softmax_backward(64, 4096, dim=0),
                             softmax_backward(2, 1 << 20), softmax_backward(32, 1000)],
        "linear": [linear(512, 1024, 1024), linear(256, 1024, 1024), linear(512, 1024, 1024, act="relu"),
                   linear(512, 1024, 1024, bias=False), linear(512, 1024, 1024, dtype=torch.float16),
                   linear(512, 1024, 1024, offset=8), linear(512, 1024, 1024, transpose=True),
                   linear(16, 4096, 4096), linear(16, 4096, 2048), linear(64, 2048, 4096, act=None),
                   linear(33, 70, 45, dtype=torch.float32)],
        "gated": [gated(512, 1024, 512), gated(512, 1024, 512, act="geglu"), gated(16, 4096, 1024),
                  gated(512, 1024, 512, dtype=torch.float16)],
        "norm": [norm(64, 4096), norm(64, 4096, rms=True), norm(64, 4096, residual=True), norm(64, 4096, eps=1e-3),
                 norm(128, 4096), norm(64, 2048), norm(64, 4096, dtype=torch.float32), norm(64, 4096, offset=8),
                 norm(4, 70001), norm(2, 1 << 20)],
        "softmax": [softmax(64, 4096), softmax(64, 4096, algorithm="two_pass"), softmax(64, 4096, dim=0),
                    softmax(64, 4096, transpose=True), softmax(64, 16384), softmax(2, 1 << 20),
                    softmax(64, 4096, dtype=torch.float32), softmax(32, 1000)],
        "attention": [attention(128, 128), attention(128, 128, causal=False), attention(128, 300),
                      attention(128, 128, window=(31, 0)), attention(128, 128, d=80), attention(128, 128, hkv=2),
                      attention(128, 128, lse=True), attention(128, 128, dtype=torch.float16),
                      attention(128, 128, dtype=torch.float32)],
        "sdpa": [sdpa(70, 90), sdpa(70, 90, "bool"), sdpa(70, 90, "float"), sdpa(70, 90, causal=True)],
    }


@pytest.mark.parametrize("family", sorted(_variants()))
def test_a_changed_input_never_replays_another_calls_launches(family, pinned_tuners):
    """For each family: warm every plan with one call of every variant, then call each variant again on
    fresh tensors. Each launch must equal what the full path launches for that call with no plan at all
    (kernel, grid, constexprs, config; every pointer into the call's own inputs at the same offset) --
    whether it was replayed or not. A key that missed something the dispatch reads would replay another
    variant's kernel, grid or config here."""
    makers = _variants()[family]
    with torch.no_grad(), stubbed_launches() as launches:
        for make in makers:  # warm: the first call of each variant captures its plan
            make(0)[1]()
        replayed = 0
        for i, make in enumerate(makers):
            inputs, run = make(100 + i)
            n = len(launches)
            run()
            fast = launches[n:]
            fastpath.clear_all()
            n = len(launches)
            run()
            full = launches[n:]
            assert full and not any(launch.replay for launch in full)
            assert [(a.kernel, a.grid, _strip(a.kwargs)) for a in fast] == \
                [(b.kernel, b.grid, _strip(b.kwargs)) for b in full], f"variant {i}"
            for a, b in zip(fast, full):
                assert len(a.pointers) == len(b.pointers)
                assert [_where(p, inputs) for p in a.pointers] == [_where(p, inputs) for p in b.pointers], \
                    f"variant {i}: pointer arguments"
            replayed += all(launch.replay for launch in fast)
            for make_again in makers:  # re-warm every plan before the next variant
                make_again(0)[1]()
    assert replayed, "no variant replayed: the test would prove nothing"

def test_nested_recordings_close_their_own_lists():
    with launches.recording() as outer:
        with launches.recording() as inner:
            pass
        launches.record("x", "compiled", "k", "c")
    assert [r.op for r in outer] == ["x"] and inner == [] and not launches.active()


def test_a_replay_on_another_thread_sets_that_threads_allocator():
    """Triton's allocator is per thread (a ContextVar) and its launcher takes a kernel's global scratch from
    it: a plan captured on one thread and replayed on another (autograd's backward thread, a gradient-
    checkpointing recompute) sets that thread's allocator first. On the H200 a checkpointed backward failed
    with "no allocator was set" before this."""
    import threading
    import types

    from triton.runtime import _allocation

    from tilefuse.kernels import fastpath

    seen = []

    class Compiled:
        function = packed_metadata = None
        metadata = types.SimpleNamespace(global_scratch_size=128)

        def launch_metadata(self, *args):
            return None

        def run(self, *args):
            seen.append(not isinstance(_allocation._allocator.get(), _allocation.NullAllocator))

    step = fastpath._Step(Compiled(), (1, 1, 1), [], [], [], None)
    plan = fastpath.Plan([((1,), (1,), torch.float32)], [step], 0, [], True)
    worker = threading.Thread(target=plan, args=((torch.zeros(1),),))
    worker.start()
    worker.join()
    assert seen == [True]


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_qkv_projection_reads_a_conv1d_weight_in_place_and_replays(pinned_tuners, layout):
    """GPT-2's c_attn keeps W^T [K, 3K]; tilefuse.patch passes ``weight.t()``. The kernels read that view where
    it lies (each launch's weight pointer is inside the parameter: no per-call copy), on Hopper through the TMA
    kernel's [K, rows] tiles, and the second call replays the first one's launches with the new outputs."""
    import tilefuse
    B, N, K, H, d = 2, 64, 256, 4, 64  # M = 128: one full row tile of the TMA kernel
    x = torch.randn(B, N, K).bfloat16()
    c_attn = torch.randn(K, 3 * H * d).bfloat16()  # Conv1D's weight layout
    bias = torch.randn(3 * H * d).bfloat16()
    span = (c_attn.data_ptr(), c_attn.data_ptr() + c_attn.numel() * c_attn.element_size())
    with torch.no_grad(), stubbed_launches() as launches:
        tilefuse.qkv_projection(x, c_attn.t(), bias, num_heads=H, layout=layout)
        n = len(launches)
        q, k, v = tilefuse.qkv_projection(x, c_attn.t(), bias, num_heads=H, layout=layout)
    assert [launch.kernel for launch in launches] == ["qkv_projection_tma_kernel"] * 6
    assert all(launch.kwargs["W_KN"] for launch in launches)
    assert all(launch.replay for launch in launches[n:]) and not any(launch.replay for launch in launches[:n])
    for launch in launches:
        w_ptr = launch.pointers[1]  # parameter order: x, w, ...
        assert span[0] <= w_ptr < span[1], "the weight must be read in place, not copied"
    for t in (q, k, v):
        assert t.shape == ((B, H, N, d) if layout == "bhnd" else (B, N, H, d)) and t.is_contiguous()


def test_qkv_projection_at_decode_size_keeps_the_pointer_kernel(pinned_tuners):
    """Fewer rows than one TMA row tile (M = 16): the one-loop pointer kernel, one 64-row program per head."""
    import tilefuse
    x = torch.randn(1, 16, 256).bfloat16()
    w = torch.randn(3 * 4 * 64, 256).bfloat16()
    with torch.no_grad(), stubbed_launches() as launches:
        tilefuse.qkv_projection(x, w, None, num_heads=4)
    assert [launch.kernel for launch in launches] == ["qkv_projection_head_kernel"] * 3
    assert all(launch.grid == (1, 4) for launch in launches)


def test_linear_backward_without_an_activation_replays_and_sums_db_outside_the_plan(pinned_tuners):
    """Without an activation g is dy, and db its column sum (a torch reduction): the sum runs outside the fast
    path's plan, so a second training step on new tensors replays the dx and dW GEMMs (qkv_projection's backward
    is such a call), and db is still dy's column sum."""
    import tilefuse

    M, K, N = 512, 1024, 1024
    with stubbed_launches() as launches_, launches.recording() as recs:
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(M, K, generator=g).to(torch.bfloat16).requires_grad_()
            w = torch.randn(N, K, generator=g).to(torch.bfloat16).requires_grad_()
            b = torch.randn(N, generator=g).to(torch.bfloat16).requires_grad_()
            dy = torch.randn(M, N, generator=g).to(torch.bfloat16)
            n = len(launches_)
            _, _, db = torch.autograd.grad(tilefuse.linear(x, w, b), (x, w, b), dy)
            torch.testing.assert_close(db, dy.float().sum(0).to(torch.bfloat16))
    backward = [(r.kernel, r.replayed) for r in recs if r.op == "linear_backward"]
    assert len(backward) == 4 and not any(done for _, done in backward[:2]) and all(done for _, done in backward[2:])
    assert all(launch.replay for launch in launches_[n:]), [(launch.kernel, launch.replay) for launch in launches_[n:]]


class _Allocations(TorchDispatchMode):
    """Element counts of the tensors every factory op inside the block makes (empty, zeros, full, ...)."""

    def __init__(self):
        super().__init__()
        self.numels = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        factory = not any(isinstance(a, torch.Tensor) for a in args)  # empty, zeros, full, ... from sizes
        if isinstance(out, torch.Tensor) and (factory or func.__name__.startswith(
                ("empty_like", "zeros_like", "new_empty", "new_zeros"))):
            self.numels.append(out.numel())
        return out


@pytest.mark.parametrize("shape", [(2048, 1024, 4096), (512, 1024, 1024)], ids=["cooperative", "tma"])
def test_swiglu_allocates_its_output_and_no_other_m_by_n_tensor(shape, pinned_tuners, monkeypatch):
    """The gate and up products stay on chip: on the compiled path a SwiGLU call allocates one tensor of
    M x N elements (y) and nothing else that large, on the cooperative kernel (large N) and on the TMA one.
    The reference path, which materializes gate and up, shows the recorder sees such intermediates."""
    from tilefuse import runtime
    from tilefuse.ops.linear import _gated_linear_impl

    M, K, N = shape
    x = torch.randn(M, K, dtype=torch.bfloat16)
    w_gate, w_up = (torch.randn(N, K, dtype=torch.bfloat16) for _ in range(2))
    with torch.no_grad(), stubbed_launches() as launched:
        recorder = _Allocations()
        with recorder:
            y, _, _ = _gated_linear_impl(x, w_gate, w_up, None, None, "swiglu", False)
    assert launched and tuple(y.shape) == (M, N)
    assert [n for n in recorder.numels if n >= M * N] == [M * N], recorder.numels
    monkeypatch.setattr(runtime, "execution_path", lambda t: runtime.REFERENCE)
    with torch.no_grad():
        small = (torch.randn(5, 7), torch.randn(6, 7), torch.randn(6, 7))
        recorder = _Allocations()
        with recorder:
            _gated_linear_impl(*small, None, None, "swiglu", False)  # the CPU reference: gate, up and y
    assert len([n for n in recorder.numels if n >= 5 * 6]) >= 3, recorder.numels


def test_warp_specialized_attention_replays_with_descriptors_at_the_new_calls_addresses(pinned_tuners, monkeypatch):
    """The attention forward past the in-kernel descriptors' waves and the backward's Gluon passes take host TMA
    descriptors. A second forward and backward on new tensors replays every launch, and each descriptor it hands
    the launcher views the second call's tensor exactly as the full path's descriptor on those tensors does (same
    tensor, shape and strides); D, which every backward pass reads, comes with the plan."""
    from tilefuse import runtime
    from tilefuse.kernels.attention import launch as attention_launch

    monkeypatch.setattr(fastpath, "REPLAY_HOST_DESCRIPTORS", True)
    monkeypatch.setattr(switches.attention, "BACKWARD_REPLAY", True)
    B, H, N, d = 2, 16, 4096, 64  # 1024 query tiles of 64 rows: past the in-kernel descriptors' 528 CTAs

    def call():
        q, k, v, dout = (torch.empty(B, H, N, d, dtype=torch.bfloat16) for _ in range(4))
        out, lse = attention_launch.forward(q, k, v, None, 0.125, 0, -1, -1, True, runtime.COMPILED)
        dq, dk, dv = attention_launch.backward(dout, q, k, v, out, lse, None, None, 0.125, 0, -1, -1, runtime.COMPILED)
        return dict(q=q, k=k, v=v, dout=dout, out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    def named(runs, tensors):
        names = {t.data_ptr(): name for name, t in tensors.items()}
        return [(r.kernel, r.grid, [(names.get(ptr, "?"), shape, strides) for ptr, shape, strides in r.descriptors])
                for r in runs]

    with torch.no_grad(), stubbed_launches() as runs:
        call()
        n = len(runs)
        second = call()
        replayed = runs[n:]
        fastpath.clear_all()
        m = len(runs)
        third = call()
        full = runs[m:]
    assert [r.kernel for r in full] == ["attention_fwd_ws_kernel", "attention_bwd_rowdot_kernel",
                                        "attention_bwd_dkdv_ws_kernel", "attention_bwd_dq_ws_kernel"], full
    assert not any(r.replay for r in full) and all(r.replay for r in replayed), replayed
    assert full[0].descriptors and all(name != "?" for _, _, ds in named(full, third) for name, _, _ in ds)
    assert named(replayed, second) == named(full, third)
    assert sum(len(r.descriptors) for r in replayed) == 4 + 6 + 5  # q, k, v, out; q, k, v, dout, dk, dv; q, k, v, dout, dq


def test_the_portable_attention_backward_replays_with_d_in_its_plan(pinned_tuners, monkeypatch):
    """With a bool mask (broadcast over batch and heads) the backward runs the portable passes, whose arguments
    are all tensors: D, the row-dot kernel's output that both passes read, is an output of the plan, so a second
    call replays all three launches on its own tensors."""
    from tilefuse import runtime
    from tilefuse.kernels.attention import launch as attention_launch

    monkeypatch.setattr(switches.attention, "BACKWARD_REPLAY", True)
    B, H, N, d = 2, 4, 300, 64

    def call():
        q, k, v, dout, out = (torch.empty(B, H, N, d, dtype=torch.bfloat16) for _ in range(5))
        lse = torch.empty(B, H, N)
        mask = torch.ones(N, N, dtype=torch.bool).tril().expand(B, H, N, N)
        grads = attention_launch.backward(dout, q, k, v, out, lse, None, mask, 0.125, 0, -1, -1, runtime.COMPILED)
        return [t.data_ptr() for t in (q, k, v, dout, *grads)], grads

    with torch.no_grad(), stubbed_launches() as runs:
        call()
        n = len(runs)
        ptrs, grads = call()
    assert [r.kernel for r in runs[n:]] == ["attention_bwd_rowdot_kernel", "attention_bwd_dkdv_kernel",
                                            "attention_bwd_dq_kernel"]
    assert all(r.replay for r in runs[n:]) and len(grads) == 3
    assert set(ptrs) <= {p for r in runs[n:] for p in r.pointers}  # the second call's inputs and gradients


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_patched_models_training_step_replays_every_launch_but_the_fused_loss(family, pinned_tuners, monkeypatch):
    """A patched Hugging Face model's training step (bf16, head dim 64: the Gluon attention passes) with the
    attention backward's plans and host-descriptor replays switched on: from the second step every tilefuse launch
    replays a plan, except the fused loss's (linear_cross_entropy's chunk temporaries keep it on the full path);
    with them off, the attention backward's launches take the full path too."""
    import transformers

    import tilefuse

    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=2, n_positions=64, vocab_size=256,
                                         bos_token_id=0, eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0,
                                         embd_pdrop=0.0)  # dropout in training runs HF's own attention
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(config)
    model = model.to(torch.bfloat16)
    tilefuse.patch(model, verify=False)
    model.train()
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))

    def full_path_kernels(switched_on):
        monkeypatch.setattr(switches.attention, "BACKWARD_REPLAY", switched_on)
        monkeypatch.setattr(fastpath, "REPLAY_HOST_DESCRIPTORS", switched_on)
        fastpath.clear_all()
        with stubbed_launches() as runs:
            for _ in range(2):
                model(input_ids=ids, labels=ids).loss.backward()
            n = len(runs)
            model(input_ids=ids, labels=ids).loss.backward()
        step = runs[n:]
        assert any(r.kernel.startswith("attention_bwd") for r in step), step
        return {r.kernel for r in step if not r.replay}

    assert {k for k in full_path_kernels(True) if not k.startswith("lce_")} == set()
    assert {"attention_bwd_rowdot_kernel", "attention_bwd_dkdv_ws_kernel", "attention_bwd_dq_ws_kernel"} \
        <= full_path_kernels(False)


def test_a_vendor_composition_replays_without_the_launch_modules_decisions(pinned_tuners, monkeypatch):
    """A call that took a vendor composition keeps a plan that calls the composition again on the next call's own
    tensors: the launch module's decisions (its candidates, the choice) are skipped, the vendor kernels still run
    and record what ran, and the result is the next call's. A kernel of tilefuse's launched inside the composition
    (the gated form's gate kernel) runs again through it. Forgetting the choices (clear_choices) ends the plans made
    through a choice among candidates."""
    import tilefuse
    from tilefuse.kernels.gemm import launch
    from tilefuse.tuning import choices

    decisions = []
    original = launch.forward._linear_chosen

    def counting(*args):
        decisions.append(args[-1])
        return original(*args)

    monkeypatch.setattr(launch.forward, "_linear_chosen", counting)
    x1, w, b = _linear_inputs(64, 256, 128, seed=0)
    x2, _, _ = _linear_inputs(64, 256, 128, seed=1)
    with torch.no_grad(), stubbed_launches() as stub, launches.recording() as recs, tilefuse.use_backend("vendor"):
        y1 = tilefuse.linear(x1, w, b, "gelu")
        y2 = tilefuse.linear(x2, w, b, "gelu")
        assert decisions == ["vendor"], "the second call replayed"
        assert [r.kernel for r in recs] == ["cublas", "cublas"]
        ref = torch.nn.functional.gelu(torch.nn.functional.linear(x2.float(), w.float(), b.float()))
        assert (y2.float() - ref).norm() / ref.norm() < 1e-2 and not torch.equal(y1, y2)
        with tilefuse.use_backend("auto"):  # two candidates on this CPU: the choice answers tilefuse's
            tilefuse.linear(x1, w, b, "gelu")
            tilefuse.linear(x1, w, b, "gelu")
            assert decisions == ["vendor", "auto"] and stub[-1].replay
            choices.clear_choices()
            tilefuse.linear(x1, w, b, "gelu")
            assert decisions == ["vendor", "auto", "auto"] and not stub[-1].replay
        gate_launches = len(stub)
        for _ in range(2):
            tilefuse.linear(x1, (w, w), (b, b), activation="swiglu")
        assert [s.kernel for s in stub[gate_launches:]] == ["glu_gate_kernel"] * 2 and not any(
            s.replay for s in stub[gate_launches:])
        gated = launch.gated._GATED._plans
        assert any(type(p).__name__ == "VendorPlan" for p in gated.values())


@pytest.mark.parametrize("rotate", [False, True])
def test_the_fp8_pre_pass_replays_its_five_launches_on_new_tensors(rotate, pinned_tuners):
    """quantize_qkv is one plan: a second call on new tensors of the first's shapes replays its five launches
    (Q's and K's block pass, V's amax, scale and cast passes) with the new call's inputs and its own fresh
    outputs, none of the first call's pointers; V^T keeps its padded rows (1000 keys, 1008 a row)."""
    import tilefuse

    def qkv(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(shape, generator=g).to(torch.bfloat16)
                for shape in ((1, 4, 256, 128), (1, 2, 1000, 128), (1, 2, 1000, 128))]
    first_in, second_in = qkv(0), qkv(1)
    with torch.no_grad(), stubbed_launches() as launches:
        first = tilefuse.quantize_qkv(*first_in, rotate=rotate)
        n = len(launches)
        second = tilefuse.quantize_qkv(*second_in, rotate=rotate)
    full, fast = launches[:n], launches[n:]
    assert [a.kernel for a in full] == ["quantize_blocks_kernel"] * 2 + [
        "channel_amax_kernel", "channel_scale_kernel", "quantize_transposed_kernel"]
    assert all(a.replay for a in fast) and not any(a.replay for a in full)
    assert [(a.kernel, a.grid) for a in fast] == [(a.kernel, a.grid) for a in full]
    old = {t.data_ptr() for t in (*first_in, first.q, first.k, first.v, first.q_scale, first.k_scale, first.v_scale)}
    assert not old & {p for a in fast for p in a.pointers}
    assert {t.data_ptr() for t in second_in} <= {p for a in fast for p in a.pointers}
    assert second.v.stride() == first.v.stride() == (2 * 128 * 1008, 128 * 1008, 1, 1008)


def test_fp8_attention_replays_its_warp_specialized_launch_on_new_tensors(pinned_tuners):
    """The FP8 forward is one plan: a second call on new e4m3 tensors of the first's layout (quantize_qkv's, V^T's
    rows padded at 1000 keys) replays the warp-specialized kernel with the new call's pointers and records it as
    the first call did."""
    import tilefuse

    def quantized(seed):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(shape, generator=g).to(torch.bfloat16)
                   for shape in ((1, 4, 256, 128), (1, 2, 1000, 128), (1, 2, 1000, 128)))
        return tilefuse.quantize_qkv(q, k, v)

    with torch.no_grad(), stubbed_launches() as stub:
        first, second = quantized(0), quantized(1)
        n = len(stub)
        with launches.recording() as recs:
            for r in (first, second):
                tilefuse.attention(r.q, r.k, r.v, causal=True, fp8=True, q_scale=r.q_scale, k_scale=r.k_scale,
                                   v_scale=r.v_scale)
    calls = stub[n:]
    assert [a.kernel for a in calls] == ["attention_fp8_ws_kernel"] * 2, calls
    assert not calls[0].replay and calls[1].replay and calls[0].grid == calls[1].grid
    assert second.q.data_ptr() in calls[1].pointers and first.q.data_ptr() not in calls[1].pointers
    assert [rec.kernel for rec in recs if rec.op == "attention_fp8"] == ["ws", "ws"], recs
