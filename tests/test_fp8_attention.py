"""tilefuse.attention(..., fp8=True) and tilefuse.quantize_qkv: the FP8 kernels in the interpreter against the
same math in PyTorch (reference/fp8_attention.py), against float64, and their argument checks."""
import pytest
import torch

import tilefuse
from tilefuse.kernels import switches
from tilefuse.ops import _checks
from tilefuse.ops.fp8_attention import quantize_qkv
from tilefuse.reference import attention as ref_attention
from tilefuse.reference import fp8_attention as ref_fp8

FP8 = torch.float8_e4m3fn


def _qkv(B, Hq, Hkv, Nq, Nk, d, seed=0, dtype=torch.bfloat16, outliers=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, d, generator=g)
    k, v = (torch.randn(B, Hkv, Nk, d, generator=g) for _ in range(2))
    if outliers:  # 1% of the channels (at least one) x20 in Q, K and V, as LLM activations have
        channels = torch.randperm(d, generator=g)[:max(1, round(0.01 * d))]
        for t in (q, k, v):
            t[..., channels] *= 20
    return tuple(t.to(dtype) for t in (q, k, v))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _truth(q, k, v, causal=False, window=None):
    g = q.shape[1] // k.shape[1]
    return ref_attention.attention(q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1),
                                   causal=causal, window=window)


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,d,causal,window,descriptors", [
    (1, 2, 1, 70, 133, 64, False, None, False),     # GQA, ragged tiles, Nq < Nk (bottom-right aligned)
    (2, 2, 2, 130, 130, 40, True, None, False),     # head dim masked to 64, causal across a scale block edge
    (1, 2, 2, 33, 200, 32, False, (50, 10), False),  # a window on both sides
    (1, 2, 1, 100, 144, 64, True, (40, -1), True),  # causal with a left window, through descriptors
    (1, 1, 1, 1, 300, 16, True, None, False),       # one query row (decode)
])
def test_kernel_matches_the_same_math(B, Hq, Hkv, Nq, Nk, d, causal, window, descriptors, monkeypatch):
    """The portable FP8 kernel (pointer loads, or descriptors as on sm_90) and the tile-by-tile emulation take
    the same e4m3 inputs and agree to fp32 rounding (the exp2s and the dot's summation order differ): well below
    e4m3's own ~3% step."""
    from tilefuse.kernels.attention import launch
    monkeypatch.setattr(switches.attention, "FP8_DESCRIPTORS", descriptors)
    q, k, v = _qkv(B, Hq, Hkv, Nq, Nk, d)
    r = quantize_qkv(q, k, v)
    out = tilefuse.attention(r.q, r.k, r.v, causal=causal, window=window, fp8=True, q_scale=r.q_scale,
                             k_scale=r.k_scale, v_scale=r.v_scale, out_dtype=torch.float32)
    left, right = window if window else (-1, -1)
    right = 0 if causal else right
    emu = ref_fp8.attention_fp8_tiled(r.q, r.q_scale, r.k, r.k_scale, r.v, r.v_scale, d ** -0.5, Nk - Nq, left, right)
    assert out.dtype == torch.float32 and out.shape == (B, Hq, Nq, d)
    assert _rel(out, emu) < 2e-4


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the warp-specialized FP8 kernel runs on sm_90")
@pytest.mark.parametrize("fma_softmax", [False, True], ids=["scaled", "fma"])
@pytest.mark.parametrize("Nq,Nk,causal,window", [(1024, 1024, True, None), (512, 1000, False, None),
                                                 (700, 700, False, (200, 50))])
def test_warp_specialized_kernel_matches_the_same_math(Nq, Nk, causal, window, fma_softmax, monkeypatch):
    """The warp-specialized kernel in either softmax form (switches.attention.FP8_FMA_SOFTMAX) against the tile-by-tile
    emulation on the same e4m3 inputs, bf16 out: within the output's rounding and P's e4m3 cast of the same numbers
    (its exp2s round differently), far below e4m3's own step."""
    from tilefuse.kernels import launches
    monkeypatch.setattr(switches.attention, "FP8_FMA_SOFTMAX", fma_softmax)
    q, k, v = (t.cuda() for t in _qkv(2, 4, 2, Nq, Nk, 128))
    r = quantize_qkv(q, k, v)
    with launches.recording() as recs:
        out = tilefuse.attention(r.q, r.k, r.v, causal=causal, window=window, fp8=True, q_scale=r.q_scale,
                                 k_scale=r.k_scale, v_scale=r.v_scale, out_dtype=torch.bfloat16)
    assert [rec.kernel for rec in recs if rec.op == "attention_fp8"] == ["ws"], recs
    left, right = window if window else (-1, -1)
    right = 0 if causal else right
    emu = ref_fp8.attention_fp8_tiled(r.q, r.q_scale, r.k, r.k_scale, r.v, r.v_scale, 128 ** -0.5, Nk - Nq, left, right)
    assert torch.isfinite(out).all() and _rel(out, emu) < 1e-2


@pytest.mark.parametrize("rotate", [False, True])
def test_quantize_matches_reference(rotate):
    """The pre-pass gives the reference's e4m3 values and scales: bit-equal without the rotation; with it, the
    rotation's fp32 sums may round differently, so at most a few values move by one e4m3 step."""
    q, k, v = _qkv(2, 2, 1, 200, 150, 64, seed=1)
    r = quantize_qkv(q, k, v, rotate=rotate)
    rot = ref_fp8.hadamard_signs(64, "cpu") if rotate else None
    for got, got_scale, (want, want_scale) in ((r.q, r.q_scale, ref_fp8.quantize_blocks(q, rot)),
                                               (r.k, r.k_scale, ref_fp8.quantize_blocks(k, rot))):
        assert got.dtype == FP8 and got_scale.shape == want_scale.shape
        torch.testing.assert_close(got_scale, want_scale, rtol=1e-6, atol=0)
        moved = (got.float() != want.float()).float().mean().item()
        assert moved <= (1e-3 if rotate else 0.0)
    v8, vs = ref_fp8.quantize_channels(v)
    assert r.v.dtype == FP8 and r.v.stride(2) == 1 and r.v.shape == v.shape  # keys contiguous
    assert r.v.stride(3) == 160  # 150 keys a row padded to 16 bytes' multiple: V^T TMA-able (the fast kernel)
    assert torch.equal(r.v.float(), v8.float()) and torch.equal(r.v_scale, vs)
    # Dequantized, the rotation undone, Q comes back within e4m3's step.
    back = r.q.float() * r.q_scale.repeat_interleave(128, 2)[:, :, :200, None]
    if rotate:
        back = back @ (rot.t() / 8.0)
    assert _rel(back, q) < 0.04


@pytest.mark.parametrize("causal", [False, True])
def test_accuracy_against_float64(causal):
    """Gaussian inputs: within the issue's 6e-2 of float64 (e4m3 rounding of Q, K, V and P alone costs ~5e-2),
    from bf16 inputs through the pre-pass, with and without the rotation; the output in the inputs' dtype."""
    q, k, v = _qkv(1, 2, 2, 256, 256, 64, seed=2)
    truth = _truth(q, k, v, causal)
    for rotate in (False, True):
        out = tilefuse.attention(q, k, v, causal=causal, fp8=True, rotate=rotate)
        assert out.dtype == torch.bfloat16
        assert _rel(out, truth) <= 6e-2


def test_rotation_beats_per_tensor_on_outliers():
    """Outlier channels (1% x20 in Q, K, V): the rotated per-block FP8 is at least 2x closer to float64 than the
    plain per-tensor FP8 baseline (the issue's bar), and the rotation itself pays over per-block alone."""
    q, k, v = _qkv(1, 2, 2, 256, 256, 128, seed=3, outliers=True)
    truth = _truth(q, k, v)
    baseline = _rel(ref_fp8.attention_fp8_per_tensor(q, k, v), truth)
    plain = _rel(tilefuse.attention(q, k, v, fp8=True, rotate=False), truth)
    rotated = _rel(tilefuse.attention(q, k, v, fp8=True, rotate=True), truth)
    assert rotated * 2 <= baseline, (rotated, plain, baseline)
    assert rotated < plain, (rotated, plain, baseline)


def test_scales_given_per_head_and_per_tensor():
    """Scales as one number or one per head expand to per-block ones: same output as the full tensors."""
    q, k, v = _qkv(1, 2, 2, 64, 64, 32, seed=4)
    q8, k8 = (t.float().div(0.05).to(FP8) for t in (q, k))
    v8 = v.float().div(0.02).to(FP8)
    one = tilefuse.attention(q8, k8, v8, fp8=True, q_scale=0.05, k_scale=torch.tensor(0.05), v_scale=0.02,
                             out_dtype=torch.float32)
    per_head = tilefuse.attention(q8, k8, v8, fp8=True, q_scale=torch.full((1, 2), 0.05),
                                  k_scale=torch.full((1, 2), 0.05), v_scale=torch.full((1, 2), 0.02),
                                  out_dtype=torch.float32)
    assert torch.equal(one, per_head)
    # The inputs are exact in e4m3 here, so only P's rounding (e4m3's ~3% step, averaged over keys) is left.
    assert _rel(one, _truth(q8.float() * 0.05, k8.float() * 0.05, v8.float() * 0.02)) < 3e-2


def test_nan_stays_in_its_row_and_empty_inputs():
    q, k, v = _qkv(1, 1, 1, 130, 64, 32, seed=5)
    q[0, 0, 7, 3] = float("nan")
    out = tilefuse.attention(q, k, v, fp8=True)
    assert out[0, 0, 7].isnan().all()
    assert not out[0, 0, :7].isnan().any() and not out[0, 0, 8:].isnan().any()
    empty_q = tilefuse.attention(q[:, :, :0], k, v, fp8=True)
    assert empty_q.shape == (1, 1, 0, 32)
    no_keys = tilefuse.attention(q, k[:, :, :0], v[:, :, :0], fp8=True)
    assert no_keys.shape == q.shape and not no_keys.any()


def test_bad_inputs():
    q, k, v = _qkv(1, 2, 1, 16, 16, 32)
    r = quantize_qkv(q, k, v)
    with pytest.raises(TypeError, match="all float8_e4m3fn"):
        tilefuse.attention(r.q, k, v, fp8=True)
    with pytest.raises(ValueError, match="q_scale is required"):
        tilefuse.attention(r.q, r.k, r.v, fp8=True, k_scale=r.k_scale, v_scale=r.v_scale)
    with pytest.raises(ValueError, match=r"k_scale must have shape"):
        tilefuse.attention(r.q, r.k, r.v, fp8=True, q_scale=r.q_scale, k_scale=torch.ones(1, 2, 1),
                           v_scale=r.v_scale)
    with pytest.raises(ValueError, match=r"v_scale must have shape .*\[1, 1, 32\]"):
        tilefuse.attention(r.q, r.k, r.v, fp8=True, q_scale=r.q_scale, k_scale=r.k_scale, v_scale=torch.ones(3))
    with pytest.raises(TypeError, match="q_scale must be a float tensor"):
        tilefuse.attention(r.q, r.k, r.v, fp8=True, q_scale=r.q_scale.to(torch.int32), k_scale=r.k_scale,
                           v_scale=r.v_scale)
    with pytest.raises(ValueError, match="only for float8_e4m3fn inputs"):
        tilefuse.attention(q, k, v, fp8=True, q_scale=r.q_scale)
    with pytest.raises(ValueError, match="q_scale is only for fp8=True"):
        tilefuse.attention(q, k, v, q_scale=r.q_scale)
    with pytest.raises(ValueError, match="rotate is only for fp8=True"):
        tilefuse.attention(q, k, v, rotate=True)
    with pytest.raises(ValueError, match="rotate=True applies while quantizing"):
        tilefuse.attention(r.q, r.k, r.v, fp8=True, rotate=True, q_scale=1.0, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        quantize_qkv(*_qkv(1, 1, 1, 8, 8, 40), rotate=True)
    for kwargs in (dict(return_lse=True), dict(softcap=30.0)):
        with pytest.raises(NotImplementedError, match="fp8=True does not support"):
            tilefuse.attention(q, k, v, fp8=True, **kwargs)
    with pytest.raises(TypeError, match="fp8 must be a bool"):
        tilefuse.attention(q, k, v, fp8="yes")
    with pytest.raises(TypeError, match="out_dtype"):
        tilefuse.attention(q, k, v, fp8=True, out_dtype=torch.int8)
    with pytest.raises(NotImplementedError, match="no backward"):
        tilefuse.attention(q.requires_grad_(), k, v, fp8=True)


def test_fp8_needs_fp8_tensor_cores(monkeypatch):
    """A CUDA tensor on a GPU older than sm_89 is refused before any launch (the check test_fp8_linear.py
    covers capability by capability); attention names its q."""
    class OnOldGpu:
        is_cuda, device = True, torch.device("cuda", 0)
    monkeypatch.setattr(tilefuse.runtime, "device_facts", lambda device: (8, 108))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(NotImplementedError, match=r"q: fp8=True needs a GPU with FP8 tensor cores"):
        _checks.check_fp8_device("q", OnOldGpu())


def test_ops_register_fake_matches():
    """The registered ops' fake implementations give the real outputs' shapes, dtypes and strides
    (torch.compile traces them)."""
    q, k, v = _qkv(1, 2, 1, 20, 24, 16)
    torch.library.opcheck(torch.ops.tilefuse.quantize_qkv_fp8, (q, k, v, False),
                          test_utils=("test_faketensor",))
    r = quantize_qkv(q, k, v)
    torch.library.opcheck(torch.ops.tilefuse.attention_fp8,
                          (r.q, r.q_scale, r.k, r.k_scale, r.v.transpose(2, 3), r.v_scale, 0.25, 4, -1, 0,
                           torch.bfloat16), test_utils=("test_faketensor",))


def test_compiles_fullgraph():
    """torch.compile(fullgraph=True) traces both forms (bf16 inputs through the pre-pass, e4m3 inputs with
    their scales) into one graph whose results equal the eager calls'."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def fn(q, k, v, q8, qs, k8, ks, v8, vs):
        return (tilefuse.attention(q, k, v, causal=True, fp8=True),
                tilefuse.attention(q8, k8, v8, fp8=True, q_scale=qs, k_scale=ks, v_scale=vs))

    q, k, v = _qkv(1, 2, 1, 40, 48, 32, seed=6)
    r = quantize_qkv(q, k, v)
    args = (q, k, v, r.q, r.q_scale, r.k, r.k_scale, r.v, r.v_scale)
    counter = CompileCounterWithBackend("aot_eager")
    got = torch.compile(fn, backend=counter, fullgraph=True)(*args)
    for g, e in zip(got, fn(*args)):
        assert torch.equal(g, e)
    assert counter.frame_count == 1


def test_v_t_reaches_the_kernels_keys_contiguous_and_tma_aligned():
    """quantize_qkv's V^T (rows padded to 16 keys) reaches the kernels as it is; a dense V^T at an odd key count
    (1000-byte rows: no TMA, so no warp-specialized kernel) is copied into the padded layout, values unchanged."""
    from tilefuse.ops.fp8_attention import _v_t_for_kernels
    q, k, v = _qkv(1, 2, 2, 64, 1000, 64, seed=3)
    r = quantize_qkv(q, k, v)
    padded = r.v.transpose(2, 3)
    assert _v_t_for_kernels(padded).data_ptr() == padded.data_ptr()
    dense = padded.contiguous()
    assert dense.stride(2) == 1000
    got = _v_t_for_kernels(dense)
    assert got.stride() == (2 * 64 * 1008, 64 * 1008, 1008, 1) and torch.equal(got.float(), dense.float())
