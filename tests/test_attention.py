"""tilefuse.attention / scaled_dot_product_attention beyond the registry grid: both load paths, lse,
rows that see no key, NaN, layouts, torch SDPA parity, errors, memory."""
import pytest
import torch
import torch.nn.functional as F

import tilefuse  # noqa: F401  (public surface imports)
from helpers import ON_GPU, assert_close
from tilefuse.kernels import launches
from tilefuse.kernels.attention import ws
from tilefuse.ops.attention import _attention_impl, attention, scaled_dot_product_attention
from tilefuse.reference import attention as ref
from tilefuse.opspec import REL_L2_BOUND

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _rand(*shape, device, dtype=FP32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def _qkv(B, Hq, Hkv, Nq, Nk, d, device, dtype=FP32, seed=0):
    return (_rand(B, Hq, Nq, d, device=device, dtype=dtype, seed=seed),
            _rand(B, Hkv, Nk, d, device=device, dtype=dtype, seed=seed + 1),
            _rand(B, Hkv, Nk, d, device=device, dtype=dtype, seed=seed + 2))


def _f64(*ts):
    return [t.double() for t in ts]


@pytest.mark.parametrize("dtype", [FP32, FP16, BF16])
@pytest.mark.parametrize("Nq,Nk,d,causal,window", [
    (17, 130, 40, True, None), (130, 70, 64, False, (30, 10)), (70, 70, 128, True, (40, -1))])
def test_descriptor_and_pointer_paths_agree_with_reference(device, dtype, Nq, Nk, d, causal, window):
    """The TMA-descriptor path (GPU default) and the pointer path (interpreter default), forced each way."""
    from tilefuse.kernels.attention.launch import _launch as launch_attention

    q, k, v = _qkv(1, 4, 2, Nq, Nk, d, device, dtype)
    ro, rl = ref.attention(*_f64(q, k, v), causal=causal, window=window, return_lse=True)
    left, right = window if window else (-1, -1)
    for use_desc in (False, True):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((1, 4, Nq), float("nan"), device=device)
        launch_attention(q, k, v, out, lse, None, scale=d ** -0.5, pos_offset=Nk - Nq, window_left=left,
                         window_right=0 if causal else right, input_precision="ieee",
                         interpret=not ON_GPU, use_desc=use_desc)
        assert_close((out, lse), (ro, rl), REL_L2_BOUND[dtype], f"use_desc={use_desc}")


def test_flat_grid_matches_reference(device, monkeypatch):
    """The one-axis grid that B * Hq > 65535 takes (batched decode), forced on a small shape by lowering the
    limit: program -> (head, query block) must cover every block once, heaviest first."""
    from tilefuse.kernels.attention import launch as K

    monkeypatch.setattr(K, "MAX_GRID_Y", 3)
    q, k, v = _qkv(2, 4, 2, 130, 70, 16, device)
    out, lse = _attention_impl(q, k, v, None, None, True, -1, 0, True, kernel="portable")
    ro, rl = ref.attention(*_f64(q, k, v), causal=True, return_lse=True)
    assert_close((out, lse), (ro, rl), REL_L2_BOUND[FP32], "flat grid")


def test_rows_that_see_no_key_give_zero_and_minus_inf_lse(device):
    # Bottom-right causal with Nq > Nk: rows i < Nq - Nk sit before key 0 and see nothing.
    q, k, v = _qkv(1, 2, 1, 30, 9, 16, device)
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    empty = slice(0, 21)
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    assert torch.isneginf(lse[:, :, empty]).all()
    ro, rl = ref.attention(*_f64(q, k, v), causal=True, return_lse=True)
    assert_close((out, lse), (ro, rl), 1e-5, "causal Nq > Nk")
    # window=(0, 0): row i sees only key i - 21, so the same rows are empty.
    out, lse = attention(q, k, v, window=(0, 0), return_lse=True)
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    assert not out.isnan().any()


def test_lse_values_with_large_logits(device):
    q, k, v = _qkv(1, 2, 2, 33, 47, 64, device)
    q = q * 100  # scores with std ~ 100: the max subtraction must be exact
    out, lse = attention(q, k, v, return_lse=True)
    s = (q.double() @ k.double().transpose(-1, -2)) * 64 ** -0.5
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 33)
    assert_close(lse, torch.logsumexp(s, -1), 1e-5, "lse x100")
    assert_close(out, torch.softmax(s, -1) @ v.double(), 1e-5, "out x100")


def test_nan_in_q_gives_nan_in_that_row_only(device):
    q, k, v = _qkv(1, 2, 1, 20, 33, 32, device)
    q[0, 1, 5, 3] = float("nan")
    out = attention(q, k, v, causal=True)
    assert out[0, 1, 5].isnan().all()
    out[0, 1, 5] = 0
    assert not out.isnan().any()


def test_strided_inputs_bshd_layout(device):
    """Hugging Face keeps [B, N, H, d] and transposes: a non-contiguous view must work without copies."""
    q = _rand(2, 37, 4, 48, device=device).transpose(1, 2)
    k = _rand(2, 50, 2, 48, device=device, seed=1).transpose(1, 2)
    v = _rand(2, 50, 2, 48, device=device, seed=2).transpose(1, 2)
    out = attention(q, k, v, causal=True, scale=0.3)
    assert_close(out, ref.attention(*_f64(q, k, v), causal=True, scale=0.3), 1e-5, "bshd")


def test_deterministic_is_accepted_and_the_forward_is_bitwise_repeatable(device):
    q, k, v = _qkv(1, 2, 1, 37, 45, 16, device)
    a = attention(q, k, v, causal=True, deterministic=True)
    assert torch.equal(a, attention(q, k, v, causal=True, deterministic=True))
    assert torch.equal(a, attention(q, k, v, causal=True))
    with pytest.raises(TypeError, match="deterministic"):
        attention(q, k, v, deterministic=1)


def test_attention_equals_sdpa_when_square(device):
    q, k, v = _qkv(1, 4, 2, 65, 65, 32, device)
    a = attention(q, k, v, causal=True)
    b = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_close(a, b.double(), 1e-6, "attention vs sdpa")


# ---- torch parity for the SDPA surface (torch's own float64 CPU implementation) -----------------
def _torch_sdpa(*args, **kw):
    out_dev = args[0].device
    cpu = [a.detach().double().cpu() if isinstance(a, torch.Tensor) and a.is_floating_point() else
           (a.cpu() if isinstance(a, torch.Tensor) else a) for a in args]
    kw = {k: (v.cpu().double() if isinstance(v, torch.Tensor) and v.is_floating_point()
              else v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return F.scaled_dot_product_attention(*cpu, **kw).to(out_dev)


@pytest.mark.parametrize("case", ["bool_empty_rows", "hf_finite_min", "causal_L_gt_S", "causal_L_lt_S",
                                  "bcast_5d", "2d", "mask_bcast_heads"])
def test_sdpa_matches_torch(device, case):
    L, S = (40, 23) if case == "causal_L_gt_S" else (23, 40)
    q, k, v = _qkv(2, 2, 2, L, S, 32, device)
    kw = {}
    if case == "bool_empty_rows":
        m = _rand(2, 1, L, S, device=device, seed=7) > 0
        m[:, :, 4] = False  # torch (math backend since 2.5): a fully masked row gives 0
        kw["attn_mask"] = m
    elif case == "hf_finite_min":
        m = torch.zeros(2, 1, 1, S, device=device)
        m[1] = torch.finfo(FP32).min  # a fully padded sequence: uniform average, as torch gives
        m[0, ..., S // 2:] = torch.finfo(FP32).min
        kw["attn_mask"] = m
    elif case.startswith("causal"):
        kw["is_causal"] = True
    elif case == "bcast_5d":
        q = _rand(2, 3, 2, L, 32, device=device)
        k, v = k[:1, None].expand(1, 3, 2, S, 32), v[:1, None]
    elif case == "2d":
        q, k, v = q[0, 0], k[0, 0], v[0, 0]
    elif case == "mask_bcast_heads":
        kw["attn_mask"] = _rand(L, S, device=device, seed=9)
    out = scaled_dot_product_attention(q, k, v, **kw)
    expect = _torch_sdpa(q, k, v, **kw)
    assert out.shape == expect.shape
    assert_close(out, expect, 1e-5, case)
    assert_close(ref.scaled_dot_product_attention(*_f64(q, k, v), **{
        kk: (vv.double() if isinstance(vv, torch.Tensor) and vv.is_floating_point() else vv)
        for kk, vv in kw.items()}), expect, 1e-12, f"reference {case}")
    if case == "hf_finite_min":
        assert_close(out[1], v[1].double().mean(-2, keepdim=True).expand(2, L, 32), 1e-5, "uniform row")


def test_reference_chunks_match_unchunked(monkeypatch):
    q, k, v = _qkv(1, 2, 1, 50, 30, 16, "cpu", torch.float64)
    whole = ref.attention(q, k, v, causal=True, return_lse=True)
    monkeypatch.setattr(ref, "CHUNK_BYTES", 30 * 8 * 2 * 3 * 7)  # ~7 rows per chunk
    chunked = ref.attention(q, k, v, causal=True, return_lse=True)
    assert torch.allclose(whole[0], chunked[0]) and torch.equal(whole[1].isinf(), chunked[1].isinf())
    m = torch.rand(1, 1, 50, 30) > 0.5
    assert torch.allclose(ref.scaled_dot_product_attention(q, k.expand(1, 2, 30, 16), v.expand(1, 2, 30, 16), m),
                          F.scaled_dot_product_attention(q, k.expand(1, 2, 30, 16), v.expand(1, 2, 30, 16), m))


# ---- errors -------------------------------------------------------------------------------------
def _t(*shape, dtype=FP32):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("args,kw,exc,match", [
    ((_t(1, 3, 4, 16), _t(1, 2, 4, 16), _t(1, 2, 4, 16)), {}, ValueError, "multiple of k/v heads"),
    ((_t(1, 2, 4, 16), _t(1, 2, 4, 32), _t(1, 2, 4, 32)), {}, ValueError, "head dim"),
    ((_t(1, 1, 4, 300), _t(1, 1, 4, 300), _t(1, 1, 4, 300)), {}, ValueError, "head dim must be in"),
    ((_t(2, 4, 16), _t(2, 4, 16), _t(2, 4, 16)), {}, ValueError, "4-D"),
    ((_t(1, 1, 4, 16), _t(1, 1, 5, 16), _t(1, 1, 4, 16)), {}, ValueError, "v must have k's shape"),
    ((_t(2, 1, 4, 16), _t(1, 1, 4, 16), _t(1, 1, 4, 16)), {}, ValueError, "batch"),
    ((_t(1, 1, 4, 16),) * 3, {"window": (3,)}, ValueError, "window"),
    ((_t(1, 1, 4, 16),) * 3, {"window": (-2, 0)}, ValueError, "window"),
    ((_t(1, 1, 4, 16),) * 3, {"scale": float("nan")}, ValueError, "scale"),
    ((_t(1, 1, 4, 16), _t(1, 1, 4, 16, dtype=FP16), _t(1, 1, 4, 16)), {}, TypeError, "k has dtype"),
    ((_t(1, 1, 4, 16, dtype=torch.float64),) * 3, {}, TypeError, "q has dtype float64"),
    ((_t(1, 1, 4, 16), torch.empty(1, 1, 4, 16, device="meta"), _t(1, 1, 4, 16)), {}, ValueError, "k is on"),
])
def test_attention_bad_input(args, kw, exc, match):
    with pytest.raises(exc, match=match):
        attention(*args, **kw)


def _sdpa_args(**kw):
    args = dict(query=_t(2, 4, 4, 16), key=_t(2, 2, 6, 16), value=_t(2, 2, 6, 16), enable_gqa=True)
    return {**args, **kw}


@pytest.mark.parametrize("args,exc,match", [
    (_sdpa_args(dropout_p=0.1), NotImplementedError, "dropout"),
    (_sdpa_args(attn_mask=torch.ones(5, 7, dtype=torch.bool)), ValueError, "attn_mask of shape"),
    (_sdpa_args(attn_mask=torch.ones(4, 6, dtype=torch.int32)), TypeError, "attn_mask has dtype"),
    (_sdpa_args(value=_t(2, 2, 6, 8)), NotImplementedError, "value head dim"),
    (_sdpa_args(key=_t(2, 3, 6, 16), value=_t(2, 3, 6, 16)), ValueError, "enable_gqa"),
    (_sdpa_args(key=_t(3, 4, 6, 16), value=_t(3, 4, 6, 16), enable_gqa=False), ValueError, "do not broadcast"),
    (_sdpa_args(enable_gqa=False), ValueError, "do not broadcast"),
    (_sdpa_args(key=_t(2, 2, 6, 16, dtype=BF16)), TypeError, "key has dtype"),
])
def test_sdpa_bad_input(args, exc, match):
    with pytest.raises(exc, match=match):
        scaled_dot_product_attention(**args)


def test_a_float_mask_that_requires_grad_is_refused():
    q, k, v = _t(1, 1, 4, 16), _t(1, 1, 6, 16), _t(1, 1, 6, 16)
    mask = torch.zeros(4, 6, device=q.device, dtype=q.dtype, requires_grad=True)
    with pytest.raises(NotImplementedError, match="attn_mask that requires grad"):
        scaled_dot_product_attention(q.requires_grad_(), k, v, attn_mask=mask)
    with torch.no_grad():
        scaled_dot_product_attention(q, k, v, attn_mask=mask)


# ---- GPU only -----------------------------------------------------------------------------------
@pytest.mark.gpu_only
def test_no_allocation_grows_with_n_squared():
    B, H, N, d = 1, 8, 32768, 128
    q, k, v = _qkv(B, H, H, N, N, d, "cuda", BF16)
    # Compile / autotune outside the measurement, with the same arguments: autotuning benchmarks with
    # triton's do_bench, which allocates a 256 MB cache-flush buffer, and return_lse changes the key.
    attention(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    expected = out.numel() * out.element_size() + lse.numel() * 4
    # One [N, N] fp32 score tile of a single head would already be 4 GiB.
    assert extra <= expected + (16 << 20), f"peak grew by {extra / 2**20:.1f} MiB, expected ~{expected / 2**20:.1f}"


@pytest.mark.gpu_only
def test_gpu_window_long_sequence():
    q, k, v = _qkv(1, 4, 2, 8192, 8192, 128, "cuda", BF16)
    out = attention(q, k, v, causal=True, window=(1023, 0))
    assert_close(out, ref.attention(*_f64(q, k, v), causal=True, window=(1023, 0)), 1e-2, "sliding 1024")


@pytest.mark.gpu_only
@pytest.mark.parametrize("d,causal", [(128, False), (128, True), (64, True)])
def test_register_capped_tiles_match_reference(d, causal, monkeypatch):
    """The maxnreg tiles (2-3 CTAs per SM) are tuner candidates that the pinned GPU tests never reach:
    force each, on a shape large enough for the tuner's path, and check the result."""
    from tilefuse.kernels.attention import launch as K

    q, k, v = _qkv(2, 4, 2, 640, 600, d, "cuda", BF16)
    kept = K._prune(K.GPU_CONFIGS, {"q_ptr": q}, BLOCK_D=d, USE_DESC=True, HAS_MASK=False, INPUT_PRECISION="tf32")
    capped = [c for c in kept if c.maxnreg is not None]
    tuner = K.attention_fwd_tuned
    monkeypatch.setattr(tuner, "pinned", True)
    monkeypatch.setattr(tuner, "configs", capped)
    monkeypatch.setattr(tuner, "cache", {})
    with launches.recording() as recs:  # d = 64 / 128 bf16 would take the warp-specialized kernel: forced off
        out, _ = _attention_impl(q, k, v, None, None, True, -1, 0 if causal else -1, False, kernel="portable")
    assert capped and f" r{capped[0].maxnreg}" in recs[-1].config, recs
    assert_close(out, ref.attention(*_f64(q, k, v), causal=causal), REL_L2_BOUND[BF16], f"capped d={d}")


@pytest.mark.gpu_only
@pytest.mark.parametrize("pingpong,device_desc", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("dtype", [FP16, BF16])
@pytest.mark.parametrize("d", [64, 96, 128, 256])  # 96: a 128-wide tile, zero-filled past d
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,causal,window", [
    (2, 4, 4, 1000, 1000, False, None),      # ragged last tiles (1000 = 7 * 128 + 104)
    (1, 8, 2, 257, 1000, True, None),        # GQA 4, bottom-right causal, Nq < Nk
    (1, 4, 1, 300, 64, True, None),          # Nq > Nk: the first 236 rows see no key (a CTA with none)
    (1, 4, 2, 1, 777, False, None),          # one query row (decode)
    (2, 4, 2, 700, 900, False, (300, 100)),  # two-sided window
    (1, 4, 4, 2048, 2048, True, (1023, 0)),  # sliding window: tiles before the window are skipped
    (1, 2, 2, 64, 4096, False, (-1, 7)),     # right-only window
])
def test_warp_specialized_kernel_matches_reference(pingpong, device_desc, dtype, d, B, Hq, Hkv, Nq, Nk, causal,
                                                   window):
    """The Gluon kernel (a TMA producer warp, two consumer warpgroups), in both consumer schedules and with
    descriptors made on the host or the device, against the float64 reference, output and lse, on
    shapes that cut every tile boundary."""
    from tilefuse.kernels.attention import launch as K

    q, k, v = _qkv(B, Hq, Hkv, Nq, Nk, d, "cuda", dtype)
    ro, rl = ref.attention(*_f64(q, k, v), causal=causal, window=window, return_lse=True)
    left, right = window if window else (-1, -1)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, Hq, Nq), float("nan"), device="cuda")
    K._launch_ws(q, k, v, out, lse, qk_scale=d ** -0.5 * 1.4426950408889634, pos_offset=Nk - Nq,
                        window_left=left, window_right=0 if causal else right,
                        config=dict(PINGPONG=pingpong, DEVICE_DESC=device_desc))
    assert_close((out, lse), (ro, rl), REL_L2_BOUND[dtype], f"ws d={d} pingpong={pingpong} device_desc={device_desc}")


@pytest.mark.gpu_only
def test_warp_specialized_kernel_strided_and_refusals():
    """kernel="ws" through launch_attention; "auto" picks it for the BSHD layout (heads interleaved in
    memory: the 4-D descriptors take the strides) and for d = 80, 160 and 192 (tiles wider than d); d = 72
    takes the portable kernel under "auto" and raises under "ws"."""
    from tilefuse.kernels.attention.launch import _launch as launch_attention

    q, k, v = _qkv(1, 8, 2, 333, 555, 64, "cuda", FP16)
    out, lse = torch.empty_like(q), torch.empty(1, 8, 333, device="cuda")
    cfg = launch_attention(q, k, v, out, lse, None, scale=0.125, pos_offset=222, window_left=-1, window_right=0,
                           input_precision="tf32", interpret=False, kernel="ws")
    assert cfg.get("WARP_SPECIALIZE"), cfg
    ro, rl = ref.attention(*_f64(q, k, v), causal=True, return_lse=True)
    assert_close((out, lse), (ro, rl), REL_L2_BOUND[FP16], "launch_attention kernel='ws'")
    B, N, H, d = 2, 600, 4, 128
    x = _rand(3, B, N, H, d, device="cuda", dtype=BF16)
    q, k, v = (t.transpose(1, 2) for t in x.unbind(0))
    with launches.recording() as recs:
        out = attention(q, k, v, causal=True)
    assert [r.kernel for r in recs] == ["ws"], recs
    assert_close(out, ref.attention(*_f64(q, k, v), causal=True), REL_L2_BOUND[BF16], "ws BSHD")
    for d_wide in (80, 160, 192):
        qw, kw, vw = _qkv(1, 4, 2, 333, 555, d_wide, "cuda", BF16)
        with launches.recording() as recs:
            out = attention(qw, kw, vw, causal=True)
        assert [r.kernel for r in recs] == ["ws"], (d_wide, recs)
        assert_close(out, ref.attention(*_f64(qw, kw, vw), causal=True), REL_L2_BOUND[BF16], f"ws d={d_wide}")
    q72, k72, v72 = _qkv(1, 2, 2, 200, 200, 72, "cuda", BF16)
    with launches.recording() as recs:
        attention(q72, k72, v72)
    assert [r.kernel for r in recs] == ["portable"], recs
    out72 = torch.empty_like(q72)
    with pytest.raises(ValueError, match="warp-specialized"):
        launch_attention(q72, k72, v72, out72, None, None, scale=1.0, pos_offset=0, window_left=-1,
                         window_right=-1, input_precision="tf32", interpret=False, kernel="ws")


@pytest.mark.gpu_only
@pytest.mark.parametrize("d", [64, 128])
def test_warp_specialized_kernel_nan_and_large_logits(d):
    """NaN in one query row gives NaN in that row only (as torch), and x1e4 logits stay finite, on the
    Gluon kernel's default path (both schedules: ping-pong at d = 128, plain at d = 64)."""
    q, k, v = _qkv(1, 2, 1, 300, 333, d, "cuda", BF16)
    q[0, 1, 5, 3] = float("nan")
    with launches.recording() as recs:
        out = attention(q, k, v, causal=True)
    assert [r.kernel for r in recs] == ["ws"], recs
    assert out[0, 1, 5].isnan().all()
    out[0, 1, 5] = 0
    assert not out.isnan().any()
    q, k, v = _qkv(1, 2, 1, 300, 333, d, "cuda", BF16)
    big = q * 1e4
    out, lse = attention(big, k, v, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ro, rl = ref.attention(*_f64(big, k, v), return_lse=True)
    assert_close((out, lse), (ro, rl), REL_L2_BOUND[BF16], "x1e4 logits")


@pytest.mark.gpu_only
@pytest.mark.parametrize("d", [64, 80, 48])  # the warp-specialized kernel (d 64, 80), and the portable one (d 48)
def test_batched_decode_past_the_grid_axis_limit(d):
    """4096 sequences x 32 heads, one query each: B * Hq = 131072 > 65535 takes the one-axis grid."""
    q = _rand(4096, 32, 1, d, device="cuda", dtype=BF16)
    k = _rand(4096, 8, 16, d, device="cuda", dtype=BF16, seed=1)
    v = _rand(4096, 8, 16, d, device="cuda", dtype=BF16, seed=2)
    with launches.recording() as recs:
        out, lse = attention(q, k, v, return_lse=True)
    assert [r.kernel for r in recs] == ["ws" if d in ws.SUPPORTED_HEAD_DIMS else "portable"], recs
    ro, rl = ref.attention(*_f64(q, k, v), return_lse=True)
    assert_close((out, lse), (ro, rl), REL_L2_BOUND[BF16], f"decode B*Hq=131072 d={d}")


@pytest.mark.gpu_only
def test_flipping_allow_tf32_between_fp32_calls_changes_the_precision_of_the_next_call():
    """fp32 attention reads torch.backends.cuda.matmul.allow_tf32 at each call, forward and backward: the host
    fast path keys its plans on it, so a flip between two calls of the same shapes never replays the other
    precision's kernels. Each call, flipped back and forth with the plans kept, equals bit for bit what the full
    path gives under that flag; with the flag off that meets fp32's bound against float64, and with it on tf32
    ran (the error shows it; its size is not this test's subject: NOTES, 2026-12-02 fifth session)."""
    from tilefuse.kernels import fastpath

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=g).cuda() for _ in range(3))
    dout = torch.randn(1, 2, 256, 64, generator=g).cuda()
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    want = ref.attend(*ref_in, None, 64 ** -0.5, 0, -1, -1)[0]
    want.backward(dout.double())

    def call():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in leaves]

    before = torch.backends.cuda.matmul.allow_tf32
    try:
        full = {}
        for allow in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = allow
            fastpath.clear_all()
            full[allow] = call()
        for allow in (False, True, False, True):  # plans of both precisions warm from here on
            torch.backends.cuda.matmul.allow_tf32 = allow
            got = call()
            assert all(torch.equal(a, b) for a, b in zip(got, full[allow])), f"allow_tf32={allow} replayed another plan"
        errs = {allow: [float((a.double() - b).norm() / b.norm()) for a, b in
                        zip(full[allow], [want] + [r.grad for r in ref_in])] for allow in (False, True)}
        assert max(errs[False]) <= REL_L2_BOUND[torch.float32], errs
        assert min(errs[True]) > 2e-5, errs
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
