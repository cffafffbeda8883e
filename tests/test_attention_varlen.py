"""tilefuse.attention_varlen and flash_attn_varlen_func: packed sequences against float64 per-sequence
references (lengths 0 and 1 included), forward and backward, offsets validated or clamped."""
import pytest
import torch

import tilefuse
from helpers import ON_GPU, assert_close
from tilefuse.opspec import REL_L2_BOUND
from tilefuse.reference import attention as ref_attention

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
BOUND = REL_L2_BOUND[DTYPE]
LENS_Q = [300, 0, 257, 1, 700] if ON_GPU else [5, 0, 17, 1, 33]
LENS_K = [310, 3, 257, 1, 800] if ON_GPU else [7, 3, 17, 1, 40]


def _offsets(lengths, dtype, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=dtype, device=device)


def _packed(device, hq=4, hkv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(LENS_Q), hq, d, generator=g).to(device, DTYPE)
    k = torch.randn(sum(LENS_K), hkv, d, generator=g).to(device, DTYPE)
    v = torch.randn(sum(LENS_K), hkv, d, generator=g).to(device, DTYPE)
    return q, k, v


def _reference(q, k, v, dout, causal, window, softcap, slopes):
    """(out, lse [Hq, total_q], dq, dk, dv) in float64, one sequence at a time with tilefuse.attention's
    bottom-right alignment."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    cq, ck = _offsets(LENS_Q, torch.int64, "cpu").tolist(), _offsets(LENS_K, torch.int64, "cpu").tolist()
    for i in range(len(LENS_Q)):
        rq, rk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if LENS_Q[i] == 0 or LENS_K[i] == 0:
            continue
        qi, ki, vi = (t[r].detach().cpu().double().permute(1, 0, 2)[None].requires_grad_()
                      for t, r in ((q, rq), (k, rk), (v, rk)))
        o, l = ref_attention.attention(qi, ki, vi, causal=causal, window=window, softcap=softcap,
                                       alibi_slopes=None if slopes is None else slopes.cpu().double(), return_lse=True)
        o.backward(dout[rq].cpu().double().permute(1, 0, 2)[None])
        out[rq], lse[:, rq] = o[0].permute(1, 0, 2).detach(), l[0].detach()
        for gsum, t, r in zip(grads, (qi, ki, vi), (rq, rk, rk)):
            gsum[r] = t.grad[0].permute(1, 0, 2)
    return out, lse, grads


@pytest.mark.parametrize("causal,window,softcap,alibi,offset_dtype", [
    (False, None, None, False, torch.int32), (True, None, None, False, torch.int64),
    (True, (40, -1), 4.0, True, torch.int32), (False, (9, 3), None, True, torch.int64)])
def test_matches_per_sequence_attention(device, causal, window, softcap, alibi, offset_dtype):
    q, k, v = _packed(device)
    slopes = torch.rand(4, generator=torch.Generator().manual_seed(1)).to(device) if alibi else None
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(device, DTYPE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = tilefuse.attention_varlen(*leaves, _offsets(LENS_Q, offset_dtype, device),
                                         _offsets(LENS_K, offset_dtype, device), max(LENS_Q), max(LENS_K),
                                         causal=causal, window=window, softcap=softcap, alibi_slopes=slopes,
                                         return_lse=True)
    out.backward(dout)
    want_out, want_lse, want_grads = _reference(q, k, v, dout, causal, window, softcap, slopes)
    assert out.shape == q.shape and out.is_contiguous() and lse.shape == (4, q.shape[0])
    assert_close(out, want_out, BOUND, "out")
    assert_close(lse, want_lse, 1e-5 if DTYPE == torch.float32 else 1e-3, "lse")
    for got, want, name in zip(leaves, want_grads, "qkv"):
        assert_close(got.grad, want, BOUND, f"d{name}")


def test_flash_attn_varlen_func(device):
    q, k, v = _packed(device, hq=2, hkv=2)
    cq, ck = _offsets(LENS_Q, torch.int32, device), _offsets(LENS_K, torch.int32, device)
    out, lse, probs = tilefuse.flash_attn_varlen_func(q, k, v, cq, ck, max(LENS_Q), max(LENS_K), causal=True,
                                                      return_attn_probs=True)
    want = tilefuse.attention_varlen(q, k, v, cq, ck, max(LENS_Q), max(LENS_K), causal=True)
    assert probs is None and lse.shape == (2, q.shape[0])
    assert torch.equal(out, want)
    with pytest.raises(NotImplementedError, match="dropout"):
        tilefuse.flash_attn_varlen_func(q, k, v, cq, ck, max(LENS_Q), max(LENS_K), dropout_p=0.1)


@pytest.mark.parametrize("cu_q,exc,match", [
    ([1, 5, 10], ValueError, "must start at 0"),
    ([0, 5, 9], ValueError, "must end at the total length"),
    ([0, 7, 5, 10], ValueError, "non-decreasing"),
    ([0, 9, 10], ValueError, "above its max_seqlen"),
])
def test_bad_offsets_are_refused_when_validated(device, cu_q, exc, match):
    q = torch.randn(10, 2, 16, device=device, dtype=DTYPE)
    cu = torch.tensor(cu_q, dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + [10] * (len(cu_q) - 1), dtype=torch.int32, device=device)
    with pytest.raises(exc, match=match):
        tilefuse.attention_varlen(q, q, q, cu, cu_k, 8, 10)


def test_offset_dtype_is_checked(device):
    q = torch.randn(10, 2, 16, device=device, dtype=DTYPE)
    with pytest.raises(TypeError, match="int32 or int64"):
        tilefuse.attention_varlen(q, q, q, torch.tensor([0.0, 10.0], device=device),
                                  torch.tensor([0, 10], device=device), 10, 10)


def test_bad_offsets_without_validation_stay_inside_the_tensors(device):
    """validate=False with offsets past the totals, decreasing and negative: the kernels clamp them, so
    nothing outside q, k, v or the output is touched (the interpreter faults on an out-of-bounds address;
    on the GPU the compute-sanitizer run of these tests checks it). Decreasing offsets make two sequences
    claim the same rows, whose programs then race on those rows' outputs: the values are undefined there
    (out and lse may come from different sequences, so the gradients may overflow), as with FlashAttention;
    what is promised is memory safety, and that the inputs are left as they were. Rows of a clamped sequence
    longer than max_seqlen_q are never written either (the grid covers max_seqlen_q rows per sequence), so
    their values are undefined too."""
    q, k, v = _packed(device)
    total_q, total_k = q.shape[0], k.shape[0]
    cq = torch.tensor([0, total_q + 50, 3, -7, total_q, 10 * total_q], dtype=torch.int32, device=device)
    ck = torch.tensor([-5, 2, total_k + 9, 1, total_k, total_k], dtype=torch.int64, device=device)
    offsets = (cq.clone(), ck.clone())
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = tilefuse.attention_varlen(*leaves, cq, ck, max(LENS_Q), max(LENS_K), causal=True, validate=False)
    out.float().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert out.shape == q.shape
    assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves)
    assert all(torch.equal(a.detach(), b) for a, b in zip(leaves, (q, k, v)))
    assert torch.equal(cq, offsets[0]) and torch.equal(ck, offsets[1])


def test_alibi_lse_of_sequences_with_more_queries_than_keys(device):
    """ALiBi with return_lse over sequences with more queries than keys (rows before their keys, p < 0, whose
    true lse carries -slope * |p|), fewer, as many, none, and queries without keys: the op measures ALiBi from
    each row's nearest key and the lse handed out is converted per packed row from its own sequence's
    position (on the device). fp32 out, lse and gradients (through out and lse) against float64."""
    lens_q, lens_k = [70, 0, 9, 5, 33, 1], [6, 4, 9, 0, 40, 1]
    hq, hkv, d = 4, 2, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(device)
    k, v = (torch.randn(sum(lens_k), hkv, d, generator=g).to(device) for _ in range(2))
    dout, dlse = torch.randn(q.shape, generator=g).to(device), torch.randn(hq, q.shape[0], generator=g).to(device)
    slopes = torch.rand(len(lens_q), hq, generator=g).to(device) * 2  # per sequence: [B, Hq]
    cq, ck = _offsets(lens_q, torch.int32, device), _offsets(lens_k, torch.int64, device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = tilefuse.attention_varlen(*leaves, cq, ck, max(lens_q), max(lens_k), alibi_slopes=slopes,
                                         return_lse=True)
    torch.autograd.backward([out, lse], [dout, dlse])

    want_out = torch.zeros(q.shape, dtype=torch.float64)
    want_lse = torch.full((hq, q.shape[0]), float("-inf"), dtype=torch.float64)
    want_grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    oq, ok = cq.tolist(), ck.tolist()
    for i in range(len(lens_q)):
        rq, rk = slice(oq[i], oq[i + 1]), slice(ok[i], ok[i + 1])
        if lens_q[i] == 0 or lens_k[i] == 0:
            continue  # out 0, lse -inf, no gradient
        qi, ki, vi = (t[r].detach().cpu().double().permute(1, 0, 2)[None].requires_grad_()
                      for t, r in ((q, rq), (k, rk), (v, rk)))
        o, l = ref_attention.attention(qi, ki, vi, alibi_slopes=slopes[i].cpu().double(), return_lse=True)
        torch.autograd.backward([o, l], [dout[rq].cpu().double().permute(1, 0, 2)[None],
                                         dlse[:, rq].cpu().double()[None]])
        want_out[rq], want_lse[:, rq] = o[0].permute(1, 0, 2).detach(), l[0].detach()
        for gsum, t, r in zip(want_grads, (qi, ki, vi), (rq, rk, rk)):
            gsum[r] = t.grad[0].permute(1, 0, 2)
    bound = REL_L2_BOUND[torch.float32]
    assert want_lse.min() < -100  # the first sequence's rows before its keys
    assert_close(out, want_out, bound, "out")
    assert_close(lse, want_lse, bound, "lse")
    for got, want, name in zip(leaves, want_grads, "qkv"):
        assert_close(got.grad, want, bound, f"d{name}")
