"""tilefuse.flash_attn_func and its packed forms against a reference written from FlashAttention 2's
documented semantics: [B, N, H, d] layout, softmax_scale default d**-0.5, causal aligned bottom-right
(query i at position i + Nk - Nq), window_size=(left, right) with -1 unbounded, softcap 0 for none,
alibi_slopes adding -slope * |i + Nk - Nq - j|, return_attn_probs giving (out, softmax_lse, None)."""
import math

import pytest
import torch

import tilefuse
from helpers import ON_GPU, assert_close
from tilefuse.opspec import REL_L2_BOUND

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
BOUND = REL_L2_BOUND[DTYPE]


def _r(*shape, seed, device):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, DTYPE)


def fa_reference(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """FlashAttention 2's documented math, one (batch, head) at a time, in float64; GQA by head index."""
    B, Nq, Hq, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    left, right = window_size
    if causal:
        right = 0
    out = torch.zeros(B, Nq, Hq, d, dtype=torch.float64)
    lse = torch.empty(B, Hq, Nq, dtype=torch.float64)
    pos = torch.arange(Nq)[:, None] + Nk - Nq
    j = torch.arange(Nk)[None, :]
    allowed = torch.ones(Nq, Nk, dtype=torch.bool)
    if left >= 0:
        allowed &= j >= pos - left
    if right >= 0:
        allowed &= j <= pos + right
    for b in range(B):
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            s = (q[b, :, h].double() @ k[b, :, hk].double().T) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            if alibi_slopes is not None:
                slope = alibi_slopes[h] if alibi_slopes.dim() == 1 else alibi_slopes[b, h]
                s = s - float(slope) * (pos - j).abs()
            s = s.masked_fill(~allowed, -math.inf)
            lse[b, h] = torch.logsumexp(s, -1)
            out[b, :, h] = torch.softmax(s, -1) @ v[b, :, hk].double()
    return out, lse


@pytest.mark.parametrize("causal,window_size,softcap,alibi", [
    (False, (-1, -1), 0.0, False), (True, (-1, -1), 0.0, False), (False, (8, 3), 0.0, False),
    (True, (16, -1), 4.0, False), (False, (-1, -1), 0.0, True), (True, (-1, -1), 6.0, True)])
def test_flash_attn_func_matches_flash_attention_semantics(device, causal, window_size, softcap, alibi):
    B, Nq, Nk, Hq, Hkv, d = 2, 33, 48, 4, 2, 32
    q, k, v = _r(B, Nq, Hq, d, seed=0, device=device), _r(B, Nk, Hkv, d, seed=1, device=device), \
        _r(B, Nk, Hkv, d, seed=2, device=device)
    slopes = torch.rand(Hq, generator=torch.Generator().manual_seed(3)).to(device) if alibi else None
    out, lse, probs = tilefuse.flash_attn_func(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                                               alibi_slopes=slopes, return_attn_probs=True)
    want, want_lse = fa_reference(q.cpu(), k.cpu(), v.cpu(), causal=causal, window_size=window_size,
                                  softcap=softcap, alibi_slopes=None if slopes is None else slopes.cpu())
    assert out.shape == (B, Nq, Hq, d) and lse.shape == (B, Hq, Nq) and probs is None
    assert out.is_contiguous(), f"out must be contiguous [B, Nq, Hq, d] as FlashAttention's, strides {out.stride()}"
    assert_close(out, want, BOUND, "out")
    assert_close(lse, want_lse, 1e-5 if DTYPE == torch.float32 else 1e-3, "softmax_lse")
    # The kernel writes FlashAttention's layout directly: the same values as tilefuse.attention's
    # [B, Hq, Nq, d] output, seen transposed (what flash_attn_func returned before).
    window = None if window_size == (-1, -1) else window_size
    prev, prev_lse = tilefuse.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                                        window=window, softcap=softcap or None, alibi_slopes=slopes, return_lse=True)
    assert torch.equal(out, prev.transpose(1, 2)) and torch.equal(lse, prev_lse)
    plain = tilefuse.flash_attn_func(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                                     alibi_slopes=slopes)
    assert plain.is_contiguous() and torch.equal(plain, out)


@pytest.mark.parametrize("slopes_shape", [(4,), (2, 4)])
def test_softmax_lse_with_alibi_and_more_queries_than_keys(device, slopes_shape):
    """Rows before the keys (Nq > Nk: p < 0) carry ALiBi's -slope * |p| in their softmax_lse, which tilefuse's
    op leaves out of its scores (measuring from the nearest key) and adds back for the caller."""
    B, Nq, Nk, Hq, d = 2, 90, 20, 4, 16
    q, k, v = _r(B, Nq, Hq, d, seed=0, device=device), _r(B, Nk, Hq, d, seed=1, device=device), \
        _r(B, Nk, Hq, d, seed=2, device=device)
    slopes = (torch.rand(*slopes_shape, generator=torch.Generator().manual_seed(3)) + 0.5).to(device)
    out, lse, _ = tilefuse.flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True)
    want, want_lse = fa_reference(q.cpu(), k.cpu(), v.cpu(), alibi_slopes=slopes.cpu())
    assert want_lse.min() < -30
    assert out.is_contiguous()
    assert_close(out, want, BOUND, "out")
    assert_close(lse, want_lse, 1e-5 if DTYPE == torch.float32 else 1e-3, "softmax_lse")


def test_gradients_and_packed_forms(device):
    B, N, H, d = 2, 40, 2, 16
    qkv = _r(B, N, 3, H, d, seed=0, device=device).requires_grad_()
    do = _r(B, N, H, d, seed=1, device=device)
    out = tilefuse.flash_attn_qkvpacked_func(qkv, causal=True)
    assert out.shape == (B, N, H, d) and out.is_contiguous()
    out.backward(do)
    ref = qkv.detach().double().cpu().requires_grad_()
    q, k, v = ref[:, :, 0], ref[:, :, 1], ref[:, :, 2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * d ** -0.5
    s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), -math.inf)
    torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v).backward(do.double().cpu())
    assert_close(qkv.grad, ref.grad, BOUND, "d qkv")

    q2 = qkv.detach()[:, :, 0].clone()
    kv = qkv.detach()[:, :, 1:].clone()
    packed = tilefuse.flash_attn_kvpacked_func(q2, kv, causal=True)
    plain = tilefuse.flash_attn_func(q2, kv[:, :, 0], kv[:, :, 1], causal=True)
    assert torch.equal(packed, plain)
    assert packed.is_contiguous() and plain.is_contiguous()
    assert torch.equal(out.detach(), tilefuse.attention(*(t.transpose(1, 2) for t in qkv.detach().unbind(2)),
                                                        causal=True).transpose(1, 2))

    # Gradients come back in the inputs' layout: contiguous [B, N, H, d] inputs get contiguous ones.
    leaves = [t.clone().requires_grad_() for t in qkv.detach().unbind(2)]
    tilefuse.flash_attn_func(*leaves, causal=True).backward(do)
    for t, name in zip(leaves, "qkv"):
        assert t.grad.is_contiguous(), f"d{name} strides {t.grad.stride()}"
        assert_close(t.grad, ref.grad[:, :, "qkv".index(name)], BOUND, f"d{name} (unpacked)")


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(dropout_p=0.1), NotImplementedError, "dropout"),
    (dict(window_size=(3,)), ValueError, "window_size"),
    (dict(window_size=torch.tensor([2.0, 1.0])), ValueError, "window_size"),
    (dict(window_size=torch.tensor([2, 1, 0])), ValueError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
])
def test_what_tilefuse_does_not_have_is_named(device, kwargs, exc, match):
    q = _r(1, 4, 2, 16, seed=0, device=device)
    with pytest.raises(exc, match=match):
        tilefuse.flash_attn_func(q, q, q, **kwargs)


@pytest.mark.parametrize("form", ["tuple", "list", "tensor"])
def test_window_size_as_a_tuple_list_or_tensor(device, form):
    """FlashAttention's own tests pass window_size as a tensor: each form gives the tuple's result."""
    q, k = _r(1, 20, 2, 16, seed=0, device=device), _r(1, 20, 2, 16, seed=1, device=device)
    window = {"tuple": (5, 2), "list": [5, 2], "tensor": torch.tensor([5, 2])}[form]
    got = tilefuse.flash_attn_func(q, k, k, window_size=window)
    want = fa_reference(q.cpu(), k.cpu(), k.cpu(), window_size=(5, 2))[0]
    assert_close(got, want, BOUND, f"window_size as a {form}")
    cu = torch.tensor([0, 20], dtype=torch.int32, device=device)
    packed = tilefuse.flash_attn_varlen_func(q[0], k[0], k[0], cu, cu, 20, 20, window_size=window)
    assert torch.equal(packed, got[0])


def test_varlen_takes_block_table_none(device):
    q = _r(12, 2, 16, seed=0, device=device)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    out = tilefuse.flash_attn_varlen_func(q, q, q, cu, cu, 7, 7, block_table=None)
    assert out.shape == q.shape
