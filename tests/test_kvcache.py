"""tilefuse.flash_attn_with_kvcache (FlashAttention 2's kvcache API, dense and paged caches) and
flash_attn_varlen_func(block_table=): the new keys land rotated in the right rows and pages, the output and lse
match float64 attention over the same keys kept densely, every option (cache_batch_idx, left padding, rotary
interleaved or not, causal, window, soft-cap, ALiBi, GQA, splits) against its own dense definition, and bad input
refused before any launch."""
import math

import pytest
import torch

import tilefuse
from helpers import ON_GPU, assert_close
from tilefuse.opspec import REL_L2_BOUND
from tilefuse.reference import paged as ref_paged
from tilefuse.reference.linear import rotate_half, rotate_pairs

DTYPES = [torch.bfloat16, torch.float32] if ON_GPU else [torch.float32]
D = 128 if ON_GPU else 24        # 24: not a power of two, so the head-dim mask is crossed
CAP = 300 if ON_GPU else 40      # keys a dense cache row holds
LSE_BOUND = 1e-5


def _r(*shape, gen, device, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)


def _rotate(x, cos, sin, pos, interleaved):
    """x [T, H, d] float64 rotated at positions pos [T] (the test's own definition, from FlashAttention's
    docstring: pairs (2i, 2i + 1) when interleaved, else (i, i + r/2))."""
    r = 2 * cos.shape[1]
    c, s = cos[pos].double()[:, None], sin[pos].double()[:, None]
    c, s = (c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)) if interleaved else \
        (torch.cat([c, c], -1), torch.cat([s, s], -1))
    head = x[..., :r]
    turn = rotate_pairs(head) if interleaved else rotate_half(head)
    return torch.cat([head * c + turn * s, x[..., r:]], -1)


def _dense_reference(q, keys, values, n_keys, scale, causal, window, softcap, slopes, leftpad):
    """float64 out [B, Tq, Hq, d] and lse [B, Hq, Tq] of q over keys[b][:n_keys[b]] with FlashAttention's masks:
    bottom-right aligned, keys j with lo <= j, p - left <= j <= p + right (causal: right = 0)."""
    B, Tq, hq, d = q.shape
    out = torch.zeros(B, Tq, hq, d, dtype=torch.float64)
    lse = torch.full((B, hq, Tq), -math.inf, dtype=torch.float64)
    left, right = window
    if causal:
        right = 0
    for b in range(B):
        n = n_keys[b]
        k = keys[b][:n].double().repeat_interleave(hq // keys[b].shape[1], 1)
        v = values[b][:n].double().repeat_interleave(hq // keys[b].shape[1], 1)
        s = torch.einsum("thd,nhd->htn", q[b].double(), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        p = torch.arange(Tq)[:, None] + n - Tq
        j = torch.arange(n)[None, :]
        if slopes is not None:
            s = s - slopes[b].double()[:, None, None] * (p - j).abs()
        vis = j >= (int(leftpad[b]) if leftpad is not None else 0)
        if left >= 0:
            vis = vis & (j >= p - left)
        if right >= 0:
            vis = vis & (j <= p + right)
        vis = vis.expand(Tq, n)
        s = s.masked_fill(~vis, -math.inf)
        lse[b] = torch.logsumexp(s, -1)
        o = torch.einsum("htn,nhd->thd", torch.softmax(s, -1), v)
        out[b] = o.masked_fill(~vis.any(-1)[:, None, None], 0.0)
    return out, lse


def _paged_copy(dense, page_size, gen, values=None, spare=3):
    """The dense rows [B, CAP, H, d] scattered over pages in a shuffled order (and ``values`` over the same pages):
    (pages, block_table) or (pages, value pages, block_table)."""
    B, cap = dense.shape[:2]
    per_seq = -(-cap // page_size)
    n_pages = B * per_seq + spare
    table = torch.randperm(n_pages, generator=gen)[:B * per_seq].view(B, per_seq).to(torch.int32)

    def scatter(t):
        pages = torch.zeros(n_pages, page_size, *t.shape[2:], dtype=t.dtype)
        padded = torch.zeros(B, per_seq * page_size, *t.shape[2:], dtype=t.dtype)
        padded[:, :cap] = t.cpu()
        pages[table.long().flatten()] = padded.reshape(B * per_seq, page_size, *t.shape[2:])
        return pages.to(t.device)

    if values is None:
        return scatter(dense), table.to(dense.device)
    return scatter(dense), scatter(values), table.to(dense.device)


# (page size or None, batch idx, left pad, rotary, causal, window, softcap, alibi, Tq, T_new, Hq, Hkv, splits)
CASES = [
    (None, False, False, None, True, (-1, -1), 0.0, False, 1, 1, 4, 2, 0),
    (7, False, False, "neox", True, (-1, -1), 0.0, False, 3, 3, 4, 1, 2),
    (None, True, True, "interleaved", False, (-1, -1), 0.0, False, 2, 1, 2, 2, 1),
    (5, True, False, None, False, (6, 2), 0.0, True, 4, 2, 6, 3, 3),
    (None, False, True, "neox", True, (9, -1), 30.0, True, 5, 5, 3, 1, 0),
    (16, False, False, None, False, (-1, -1), 5.0, False, 6, 0, 4, 4, 2),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page,batch_idx,leftpad,rotary,causal,window,softcap,alibi,Tq,t_new,hq,hkv,splits", CASES)
def test_kvcache_matches_float64(device, dtype, page, batch_idx, leftpad, rotary, causal, window, softcap, alibi,
                                 Tq, t_new, hq, hkv, splits):
    gen = torch.Generator().manual_seed(Tq * 7 + t_new)
    B = 3
    rows = B + 2 if batch_idx else B
    k_dense = _r(rows, CAP, hkv, D, gen=gen, device=device, dtype=dtype)
    v_dense = _r(rows, CAP, hkv, D, gen=gen, device=device, dtype=dtype)
    q = _r(B, Tq, hq, D, gen=gen, device=device, dtype=dtype)
    lens = torch.tensor([CAP - t_new - 2, 1, CAP // 2][:B], dtype=torch.int32)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32) if batch_idx else None
    pad = torch.tensor([3, 0, 5], dtype=torch.int32) if leftpad else None
    k_new = _r(B, t_new, hkv, D, gen=gen, device=device, dtype=dtype) if t_new else None
    v_new = _r(B, t_new, hkv, D, gen=gen, device=device, dtype=dtype) if t_new else None
    cos = sin = None
    if rotary:
        angle = torch.rand(CAP + Tq, (D // 2) // 8 * 4 or 2, generator=gen) * 2 * math.pi
        cos, sin = angle.cos().to(device, dtype), angle.sin().to(device, dtype)
    slopes = (torch.rand(B, hq, generator=gen) * 0.3).to(device) if alibi else None

    # what the cache must hold after the call, and the keys each sequence attends over
    rows_of = idx.tolist() if batch_idx else list(range(B))
    sequential = causal or window != (-1, -1)
    keys, values = [], []
    for b, row in enumerate(rows_of):
        k_row, v_row = k_dense[row].cpu().double(), v_dense[row].cpu().double()
        n0 = int(lens[b])
        if t_new:
            kn = k_new[b].cpu().double()
            if rotary:
                kn = _rotate(kn, cos.cpu(), sin.cpu(), torch.arange(n0, n0 + t_new), rotary == "interleaved")
            k_row, v_row = k_row.clone(), v_row.clone()
            k_row[n0:n0 + t_new], v_row[n0:n0 + t_new] = kn, v_new[b].cpu().double()
        keys.append(k_row)
        values.append(v_row)
    q_ref = q.cpu().double()
    if rotary:
        q_ref = torch.stack([_rotate(q_ref[b], cos.cpu(), sin.cpu(),
                                     int(lens[b]) + (torch.arange(Tq) if sequential else torch.zeros(Tq, dtype=torch.long)),
                                     rotary == "interleaved") for b in range(B)])
    ref, ref_lse = _dense_reference(q_ref, keys, values, [int(n) + t_new for n in lens], D ** -0.5, causal, window,
                                    softcap, slopes.cpu() if alibi else None, pad)

    if page is None:
        k_cache, v_cache, table = k_dense.clone(), v_dense.clone(), None
    else:
        k_cache, v_cache, table = _paged_copy(k_dense, page, gen, values=v_dense)
    out, lse = tilefuse.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens.to(device),
        cache_batch_idx=idx.to(device) if batch_idx else None, cache_leftpad=pad.to(device) if leftpad else None,
        block_table=table, causal=causal, window_size=window, softcap=softcap,
        rotary_interleaved=rotary == "interleaved", alibi_slopes=slopes, num_splits=splits, return_softmax_lse=True)
    what = f"page={page} idx={batch_idx} pad={leftpad} rot={rotary} causal={causal} window={window}"
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (B, hq, Tq) and lse.dtype == torch.float32
    assert_close(out, ref, REL_L2_BOUND[dtype], what)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite), what
    assert_close(lse.cpu()[finite], ref_lse[finite], max(LSE_BOUND, REL_L2_BOUND[dtype] / 10), what + " lse")
    # the new keys and values sit in the cache (rotated keys: to the dtype's rounding)
    for b, row in enumerate(rows_of):
        n = int(lens[b]) + t_new
        got_k = k_cache[row, :n] if table is None else ref_paged.gather(k_cache, table[row], n)
        got_v = v_cache[row, :n] if table is None else ref_paged.gather(v_cache, table[row], n)
        assert_close(got_k, keys[b][:n], REL_L2_BOUND[dtype], what + " k_cache")
        assert torch.equal(got_v.cpu().double(), values[b][:n]), what


def test_kvcache_splits_agree_and_fully_hidden_rows_give_zero(device):
    gen = torch.Generator().manual_seed(1)
    q = _r(2, 3, 4, D, gen=gen, device=device, dtype=torch.float32)
    kc = _r(2, CAP, 2, D, gen=gen, device=device, dtype=torch.float32)
    vc = _r(2, CAP, 2, D, gen=gen, device=device, dtype=torch.float32)
    lens = torch.tensor([CAP, 9], dtype=torch.int32, device=device)
    outs = [tilefuse.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, num_splits=n,
                                             return_softmax_lse=True) for n in (1, 2, 5)]
    for out, lse in outs[1:]:
        assert_close(out, outs[0][0], 1e-5, "splits")
        assert_close(lse, outs[0][1], 1e-5, "splits lse")
    # a window of (0, -1) with left padding past the query positions: no visible key
    pad = torch.tensor([CAP, 9], dtype=torch.int32, device=device)
    out, lse = tilefuse.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=pad, num_splits=2,
                                                return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


@pytest.mark.filterwarnings("ignore:All-NaN slice")
def test_kvcache_whole_cache_when_no_lengths_and_nan_propagates(device):
    gen = torch.Generator().manual_seed(2)
    q = _r(1, 1, 2, D, gen=gen, device=device, dtype=torch.float32)
    kc = _r(1, 17, 2, D, gen=gen, device=device, dtype=torch.float32)
    vc = _r(1, 17, 2, D, gen=gen, device=device, dtype=torch.float32)
    out = tilefuse.flash_attn_with_kvcache(q, kc, vc)
    ref, _ = _dense_reference(q.cpu(), [kc[0].cpu()], [vc[0].cpu()], [17], D ** -0.5, False, (-1, -1), 0.0, None,
                              None)
    assert_close(out, ref, 1e-5, "no cache_seqlens")
    q[0, 0, 1, 0] = float("nan")
    out = tilefuse.flash_attn_with_kvcache(q, kc, vc)
    assert bool(torch.isnan(out[0, 0, 1]).all()) and bool(torch.isfinite(out[0, 0, 0]).all())


def test_reference_path_matches_the_kernels(device):
    """The op's plain-PyTorch path (CPU without the interpreter) takes the launch layer's arguments: the same
    numbers as the kernels on one call with every option."""
    gen = torch.Generator().manual_seed(3)
    B, Tq, hq, hkv, page = 2, 3, 4, 2, 6
    q = _r(B, Tq, hq, D, gen=gen, device=device, dtype=torch.float32)
    dense = _r(B, CAP, hkv, D, gen=gen, device=device, dtype=torch.float32)
    pages, table = _paged_copy(dense, page, gen)
    lens = torch.tensor([CAP - 4, 11], dtype=torch.int32, device=device)
    angle = torch.rand(CAP + 8, 4, generator=gen)
    cos, sin = angle.cos().to(device), angle.sin().to(device)
    slopes = torch.rand(B, hq, generator=gen).to(device)
    kw = dict(block_table=table, lens=lens, lens_by_slot=False, extra_keys=2, slots=None,
              leftpad=torch.tensor([1, 2], dtype=torch.int32, device=device), cu_q=None, max_q=Tq, scale=0.3,
              window=(5, 0), softcap=4.0, alibi=slopes, rotary=(cos, sin, True, True))
    from tilefuse.kernels.paged import launch
    out, lse = launch.attention(q, pages, pages, max_keys=CAP, num_splits=2, return_lse=True,
                                path=tilefuse.runtime.default_path() if not ON_GPU else "compiled", **kw)
    ref_out, ref_lse = ref_paged.attention(q.cpu(), pages.cpu(), pages.cpu(),
                                           **{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()
                                              if k not in ("alibi", "rotary")},
                                           alibi=slopes.cpu(), rotary=(cos.cpu(), sin.cpu(), True, True),
                                           dtype=torch.float64)
    assert_close(out, ref_out, 1e-5, "reference path")
    assert_close(lse, ref_lse, 1e-5, "reference path lse")


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (3, 1))])
def test_varlen_block_table_matches_float64(device, causal, window):
    gen = torch.Generator().manual_seed(4)
    page, hq, hkv = 5, 4, 2
    q_lens, k_lens = [3, 1, 6], [CAP - 3, 2, 17]
    dense = _r(3, CAP, hkv, D, gen=gen, device=device, dtype=torch.float32)
    values = _r(3, CAP, hkv, D, gen=gen, device=device, dtype=torch.float32)
    k_pages, v_pages, table = _paged_copy(dense, page, gen, values=values)
    q = _r(sum(q_lens), hq, D, gen=gen, device=device, dtype=torch.float32)
    cu_q = torch.tensor([0, 3, 4, 10], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, k_lens[0], k_lens[0] + 2, sum(k_lens)], dtype=torch.int32, device=device)
    out, lse, _ = tilefuse.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 6, max(k_lens), causal=causal,
                                                  window_size=window, block_table=table, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (hq, q.shape[0])
    for b in range(3):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        ref, ref_lse = _dense_reference(q[rows].cpu()[None], [dense[b].cpu()], [values[b].cpu()], [k_lens[b]],
                                        D ** -0.5, causal, window, 0.0, None, None)
        assert_close(out[rows], ref[0], 1e-5, f"sequence {b}")
        finite = torch.isfinite(ref_lse[0])
        assert_close(lse[:, rows].cpu()[finite], ref_lse[0][finite], 1e-5, f"sequence {b} lse")


def _args(device, **over):
    gen = torch.Generator().manual_seed(5)
    a = dict(q=_r(2, 1, 4, D, gen=gen, device=device, dtype=torch.float32),
             k_cache=_r(2, 16, 2, D, gen=gen, device=device, dtype=torch.float32),
             v_cache=_r(2, 16, 2, D, gen=gen, device=device, dtype=torch.float32),
             k=_r(2, 1, 2, D, gen=gen, device=device, dtype=torch.float32),
             v=_r(2, 1, 2, D, gen=gen, device=device, dtype=torch.float32),
             cache_seqlens=torch.tensor([3, 15], dtype=torch.int32, device=device))
    a.update(over)
    return a


def test_bad_input_is_refused_before_anything_changes(device):
    base = _args(device)
    snapshot = base["k_cache"].clone()
    pages = torch.zeros(4, 8, 2, D, device=device)
    bad = [
        (dict(q=base["q"][0]), ValueError, "q must be 4-D"),
        (dict(q=base["q"].half()), TypeError, "dtype"),
        (dict(q=torch.zeros(2, 1, 3, D, device=device)), ValueError, "multiple"),
        (dict(v_cache=base["v_cache"][:, :8]), ValueError, "v_cache must have k_cache's shape"),
        (dict(k_cache=base["k_cache"][..., :8], v_cache=base["v_cache"][..., :8]), ValueError, "head dim"),
        (dict(v=None), ValueError, "together"),
        (dict(cache_seqlens=None), ValueError, "cache_seqlens must be given"),
        (dict(cache_seqlens=16), ValueError, "does not fit"),
        (dict(cache_seqlens=torch.tensor([3, 16], dtype=torch.int32, device=device)), ValueError, "fit"),
        (dict(cache_seqlens=torch.tensor([3.0, 1.0], device=device)), TypeError, "cache_seqlens"),
        (dict(cache_seqlens=torch.tensor([3], dtype=torch.int32, device=device)), ValueError, "shape"),
        (dict(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32, device=device)), ValueError, "cache_batch_idx"),
        (dict(cache_leftpad=torch.tensor([0, 17], dtype=torch.int32, device=device)), ValueError, "cache_leftpad"),
        (dict(rotary_cos=torch.ones(16, 4, device=device)), ValueError, "together"),
        (dict(rotary_cos=torch.ones(10, 4, device=device), rotary_sin=torch.ones(10, 4, device=device)), ValueError,
         "positions"),
        (dict(rotary_cos=torch.ones(16, D, device=device), rotary_sin=torch.ones(16, D, device=device)), ValueError,
         "rotary_dim"),
        (dict(block_table=torch.tensor([[0, 1], [2, 7]], dtype=torch.int32, device=device), k_cache=pages,
              v_cache=pages.clone()), ValueError, "not a page"),
        (dict(block_table=torch.tensor([[0, 1]], dtype=torch.int32, device=device), k_cache=pages,
              v_cache=pages.clone()), ValueError, "rows"),
        (dict(block_table=torch.tensor([[0, 1], [2, 3]], device=device), k_cache=pages, v_cache=pages.clone()),
         TypeError, "int32"),
        (dict(window_size=(1,)), ValueError, "window_size"),
        (dict(num_splits=-1), ValueError, "num_splits"),
        (dict(alibi_slopes=torch.ones(3, device=device)), ValueError, "alibi_slopes"),
    ]
    for over, exc, match in bad:
        with pytest.raises(exc, match=match):
            tilefuse.flash_attn_with_kvcache(**_args(device, **{"k_cache": base["k_cache"], **over}))
    assert torch.equal(base["k_cache"], snapshot)  # nothing was written by a refused call
    with pytest.raises(NotImplementedError, match="backward"):
        tilefuse.flash_attn_with_kvcache(**_args(device, q=base["q"].clone().requires_grad_()))


def test_varlen_block_table_bad_input(device):
    q = torch.zeros(5, 2, D, device=device)
    pages = torch.zeros(3, 4, 2, D, device=device)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="fit"):
        tilefuse.flash_attn_varlen_func(q, pages, pages, cu, torch.tensor([0, 9, 12], dtype=torch.int32,
                                        device=device), 3, 9, block_table=table)
    with pytest.raises(ValueError, match="not a page"):
        tilefuse.flash_attn_varlen_func(q, pages, pages, cu, cu, 3, 3,
                                        block_table=torch.tensor([[0, 1], [5, 0]], dtype=torch.int32, device=device))
    with pytest.raises(NotImplementedError, match="dropout"):
        tilefuse.flash_attn_varlen_func(q, pages, pages, cu, cu, 3, 3, dropout_p=0.1, block_table=table)


def _decode_step(q, k_cache, v_cache, k, v, lens, table):
    """One decode step as a server runs it: append the new token's keys and values, attend, advance lengths."""
    out = tilefuse.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table,
                                           causal=True, num_splits=2)
    return out


def _step_inputs(device, seed):
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[0]
    dense = _r(2, CAP, 2, D, gen=gen, device=device, dtype=dtype)
    values = _r(2, CAP, 2, D, gen=gen, device=device, dtype=dtype)
    k_pages, v_pages, table = _paged_copy(dense, 8, gen, values=values)
    q = _r(2, 1, 4, D, gen=gen, device=device, dtype=dtype)
    k, v = (_r(2, 1, 2, D, gen=gen, device=device, dtype=dtype) for _ in range(2))
    return q, k_pages, v_pages, k, v, torch.tensor([CAP - 5, 9], dtype=torch.int32, device=device), table


def test_kvcache_under_torch_compile_fullgraph(device):
    backend = "inductor" if ON_GPU else "aot_eager"
    eager_in = _step_inputs(device, 6)
    compiled_in = [t.clone() for t in eager_in]
    want = _decode_step(*eager_in)
    got = torch.compile(_decode_step, fullgraph=True, backend=backend)(*compiled_in)
    assert_close(got, want.double(), REL_L2_BOUND[DTYPES[0]], "compiled")
    assert torch.equal(compiled_in[1], eager_in[1]) and torch.equal(compiled_in[2], eager_in[2])  # the append


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_kvcache_decode_step_in_a_cuda_graph_replays_on_new_inputs(device):
    static = _step_inputs(device, 7)
    for _ in range(2):
        _decode_step(*[t.clone() for t in static])  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode_step(*static)
    fresh = _step_inputs(device, 8)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    want = _decode_step(*[t.clone() for t in fresh])
    assert_close(out, want.double(), REL_L2_BOUND[DTYPES[0]], "graph replay")


def test_append_split_over_head_blocks_writes_every_head(device, monkeypatch):
    """The append kernel spreads a token's KV heads over programs (APPEND_TILE elements each): with one head
    per program and three heads, every head still lands in its page row, and nothing else changes."""
    from tilefuse.kernels.paged import launch
    monkeypatch.setattr(launch, "APPEND_TILE", 1)
    gen = torch.Generator().manual_seed(9)
    dense = _r(2, CAP, 3, D, gen=gen, device=device, dtype=torch.float32)
    pages, values, table = _paged_copy(dense, 6, gen, values=dense.clone())
    before = pages.clone()
    k = _r(2, 2, 3, D, gen=gen, device=device, dtype=torch.float32)
    lens = torch.tensor([4, CAP - 2], dtype=torch.int32, device=device)
    q = _r(2, 2, 3, D, gen=gen, device=device, dtype=torch.float32)
    tilefuse.flash_attn_with_kvcache(q, pages, values, k, k.clone(), cache_seqlens=lens, block_table=table)
    for b in range(2):
        n0 = int(lens[b])
        got = ref_paged.gather(pages, table[b], n0 + 2)
        assert torch.equal(got[n0:], k[b]) and torch.equal(got[:n0], ref_paged.gather(before, table[b], n0))


def test_split_rule_fills_one_round_of_resident_programs():
    """The launch's split count: programs x splits within one round of what the SMs hold at once, none shorter
    than MIN_KEYS_PER_SPLIT keys; residency from the pipelined key and value tiles' shared memory."""
    from tilefuse.kernels.paged import launch

    hopper = 228 * 1024
    tile = launch.DECODE_STAGES * 2 * 64 * 128 * 2  # stages x (k + v) x 64 keys x d 128 x bf16
    assert launch.resident_programs(64, 128, 2, hopper) == min(launch.MAX_RESIDENT,
                                                               hopper // (tile + launch.SMEM_PER_PROGRAM_SLACK))
    assert launch.resident_programs(256, 256, 4, hopper) == 1  # never below one
    assert launch.resident_programs(16, 16, 2, hopper) == launch.MAX_RESIDENT
    round_size = 132 * 3
    for programs, keys in [(8, 131072), (64, 32768), (128, 32768), (2048, 4096), (8, 4096), (1, 100)]:
        splits = launch.choose_splits(programs, keys, round_size)
        assert 1 <= splits <= launch.MAX_SPLITS
        assert programs * splits <= max(round_size, programs)  # one round, or one split when a round is full
        assert splits == 1 or math.ceil(keys / splits) >= launch.MIN_KEYS_PER_SPLIT
    assert launch.choose_splits(8, 131072, round_size) == 49
    assert launch.choose_splits(64, 32768, round_size) == 6
    assert launch.choose_splits(2048, 4096, round_size) == 1
    assert launch.choose_splits(8, 4096, round_size) == 4096 // launch.MIN_KEYS_PER_SPLIT
