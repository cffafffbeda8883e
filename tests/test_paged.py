"""tilefuse.PagedKVCache and tilefuse.paged_attention: appends land in the right pages of the right layer,
decode attention over ragged sequences matches float64 attention over the same keys kept densely (never read
back from the pages), splits merged by log-sum-exp, and bad input refused before anything changes."""
import math

import pytest
import torch

import tilefuse
from helpers import ON_GPU, assert_close
from tilefuse.opspec import REL_L2_BOUND
from tilefuse.reference import paged as ref_paged

DTYPES = [torch.bfloat16, torch.float16, torch.float32] if ON_GPU else [torch.float32]
HEAD_DIM = 128 if ON_GPU else 20        # 20: not a power of two, so the head-dim mask is crossed
PAGE_SIZES = [16, 7] if ON_GPU else [8, 5]
# Prompt lengths then decode steps: ragged, one sequence shorter than a page, one crossing many pages.
PROMPTS = [1000, 3, 4096 + 5] if ON_GPU else [13, 3, 37]


class DenseStash:
    """The same keys and values kept densely per (layer, seq_id): what the cache must reproduce."""

    def __init__(self):
        self.k, self.v = {}, {}

    def add(self, layer, ids, k, v):
        for i, s in enumerate(ids):
            key = (layer, s)
            self.k[key] = torch.cat([self.k.get(key, k[i, :0]), k[i]])
            self.v[key] = torch.cat([self.v.get(key, v[i, :0]), v[i]])


def _tokens(n_seqs, T, heads, dtype, device, gen, scale=1.0):
    return (torch.randn(n_seqs, T, heads, HEAD_DIM, generator=gen) * scale).to(device, dtype)


def _filled_cache(device, dtype, page_size, hkv=2, layers=2, seed=0):
    """A cache whose sequences got their prompts one at a time, then a decode step of 2 tokens for all of them
    at once, in layer 1; layer 0 gets a different set of lengths."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(math.ceil((p + 16) / page_size) for p in PROMPTS) + 2
    cache = tilefuse.PagedKVCache(layers, num_pages, page_size, hkv, HEAD_DIM, dtype, device, max_seqs=8)
    stash = DenseStash()
    ids = [cache.add_sequence() for _ in PROMPTS]
    for s, n in zip(ids, PROMPTS):
        k, v = _tokens(1, n, hkv, dtype, device, gen), _tokens(1, n, hkv, dtype, device, gen)
        cache.append(1, [s], k, v)
        stash.add(1, [s], k, v)
    k, v = _tokens(len(ids), 2, hkv, dtype, device, gen), _tokens(len(ids), 2, hkv, dtype, device, gen)
    order = ids[::-1]  # a batch in another order than the ids
    cache.append(1, order, k, v)
    stash.add(1, order, k, v)
    k, v = _tokens(2, 5, hkv, dtype, device, gen), _tokens(2, 5, hkv, dtype, device, gen)
    cache.append(0, ids[:2], k, v)
    stash.add(0, ids[:2], k, v)
    return cache, stash, ids, gen


def _dense_attention(q, stash, layer, ids, scale):
    """float64 attention of q [S, T, Hq, d] over the stashed keys, the new tokens the last T positions."""
    out = torch.empty(q.shape, dtype=torch.float64)
    T = q.shape[1]
    for i, s in enumerate(ids):
        k, v = (t.cpu().double() for t in (stash.k[(layer, s)], stash.v[(layer, s)]))
        group = q.shape[2] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("thd,nhd->htn", q[i].cpu().double(), k) * scale
        n = k.shape[0]
        visible = torch.arange(n)[None, :] <= torch.arange(n - T, n)[:, None]
        out[i] = torch.einsum("htn,nhd->thd", torch.softmax(scores.masked_fill(~visible, -math.inf), -1), v)
    return out


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_append_writes_each_token_into_its_page_of_its_layer(device, page_size):
    cache, stash, ids, _ = _filled_cache(device, DTYPES[0], page_size)
    for (layer, s), k in stash.k.items():
        n = k.shape[0]
        assert cache.length(layer, s) == n
        assert int(cache.seq_lens[layer, s]) == n
        table = cache.block_table[layer, s]
        assert torch.equal(ref_paged.gather(cache.k_pages[layer], table, n), k)
        assert torch.equal(ref_paged.gather(cache.v_pages[layer], table, n), stash.v[(layer, s)])
    # Each layer has its own pool: layer 0 took pages only for its two sequences.
    used0 = sum(math.ceil(stash.k[(0, s)].shape[0] / page_size) for s in ids[:2])
    assert cache.free_pages(0) == cache.num_pages - used0
    assert cache.length(0, ids[2]) == 0
    # No page is shared between two sequences of one layer.
    for layer in (0, 1):
        owned = [p for s in ids for p in cache.block_table[layer, s,
                 :math.ceil(cache.length(layer, s) / page_size)].tolist()]
        assert len(owned) == len(set(owned))


CASES = [  # (T, query heads per KV head, num_splits)
    (1, 1, 1), (1, 4, 0), (3, 2, 3), (8, 1, 2), (2, 4, 1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("T,group,num_splits", CASES)
def test_paged_attention_matches_float64(device, dtype, page_size, T, group, num_splits):
    cache, stash, ids, gen = _filled_cache(device, dtype, page_size)
    hkv = cache.num_kv_heads
    # The T query tokens' own keys are appended first, as a decode step does.
    k, v = _tokens(len(ids), T, hkv, dtype, device, gen), _tokens(len(ids), T, hkv, dtype, device, gen)
    cache.append(1, ids, k, v)
    stash.add(1, ids, k, v)
    q = _tokens(len(ids), T, hkv * group, dtype, device, gen)
    batch = [ids[2], ids[0], ids[1]]
    qb = q[[2, 0, 1]]
    out = tilefuse.paged_attention(qb, cache, 1, batch, num_splits=num_splits)
    assert out.shape == qb.shape and out.dtype == dtype
    ref = _dense_attention(qb, stash, 1, batch, HEAD_DIM ** -0.5)
    assert_close(out, ref, REL_L2_BOUND[dtype], f"T={T} G={group} splits={num_splits}")


def test_splits_agree_and_scale_is_applied(device):
    cache, stash, ids, gen = _filled_cache(device, DTYPES[0], PAGE_SIZES[0])
    q = _tokens(len(ids), 1, cache.num_kv_heads * 2, DTYPES[0], device, gen)
    ref = _dense_attention(q, stash, 1, ids, 0.3)
    for splits in (1, 2, 5):
        out = tilefuse.paged_attention(q, cache, 1, ids, softmax_scale=0.3, num_splits=splits)
        assert_close(out, ref, REL_L2_BOUND[DTYPES[0]], f"splits={splits}")


def test_large_logits_and_nan(device):
    """x1e4 queries do not overflow the online softmax; a NaN query gives NaN in its own row only."""
    dtype = DTYPES[-1]
    cache, stash, ids, gen = _filled_cache(device, dtype, PAGE_SIZES[0])
    q = _tokens(len(ids), 2, cache.num_kv_heads, dtype, device, gen, scale=1e4)
    out = tilefuse.paged_attention(q, cache, 1, ids, num_splits=3)
    assert torch.isfinite(out).all()
    assert_close(out, _dense_attention(q, stash, 1, ids, HEAD_DIM ** -0.5), REL_L2_BOUND[dtype], "x1e4")
    q = _tokens(len(ids), 2, cache.num_kv_heads, dtype, device, gen)
    q[1, 0, 1, 3] = float("nan")
    out = tilefuse.paged_attention(q, cache, 1, ids, num_splits=3)
    assert torch.isnan(out[1, 0, 1]).all()
    nan_rows = torch.isnan(out).any(-1)
    assert int(nan_rows.sum()) == 1


def test_free_returns_pages_and_the_id_is_reused(device):
    cache = tilefuse.PagedKVCache(1, 4, 4, 1, HEAD_DIM, DTYPES[0], device, max_seqs=2)
    a = cache.add_sequence()
    k = torch.randn(1, 9, 1, HEAD_DIM).to(device, DTYPES[0])
    cache.append(0, [a], k, k)
    assert cache.free_pages(0) == 1
    cache.free(a)
    assert cache.free_pages(0) == 4 and int(cache.seq_lens[0, a]) == 0
    b = cache.add_sequence()
    assert b == a and cache.length(0, b) == 0
    cache.append(0, [b], k[:, :3], k[:, :3])
    assert torch.equal(ref_paged.gather(cache.k_pages[0], cache.block_table[0, b], 3), k[0, :3])


def test_bad_input_is_refused_before_anything_changes(device):
    dtype = DTYPES[0]
    cache = tilefuse.PagedKVCache(2, 3, 4, 2, HEAD_DIM, dtype, device, max_seqs=2, max_seq_len=64)
    a = cache.add_sequence()
    kv = lambda n, T, h=2, d=HEAD_DIM, dt=dtype: torch.randn(n, T, h, d).to(device, dt)  # noqa: E731
    cache.append(0, [a], kv(1, 5), kv(1, 5))
    before = (cache.seq_lens.clone(), cache.block_table.clone(), cache.free_pages(0))
    with pytest.raises(ValueError, match="cache is full"):
        cache.append(0, [a], kv(1, 8), kv(1, 8))
    with pytest.raises(ValueError, match="not a live sequence"):
        cache.append(0, [7], kv(1, 1), kv(1, 1))
    with pytest.raises(ValueError, match="head_dim"):
        cache.append(0, [a], kv(1, 1, d=HEAD_DIM + 1), kv(1, 1, d=HEAD_DIM + 1))
    with pytest.raises(ValueError, match="num_kv_heads"):
        cache.append(0, [a], kv(1, 1, h=3), kv(1, 1, h=3))
    with pytest.raises(TypeError, match="dtype"):
        other = torch.float16 if dtype != torch.float16 else torch.float32
        cache.append(0, [a], kv(1, 1, dt=other), kv(1, 1, dt=other))
    with pytest.raises(ValueError, match="repeat"):
        cache.append(0, [a, a], kv(2, 1), kv(2, 1))
    with pytest.raises(ValueError, match="layer=2"):
        cache.append(2, [a], kv(1, 1), kv(1, 1))
    with pytest.raises(ValueError, match="max_seq_len"):
        _past_max_len(device, dtype)
    assert torch.equal(cache.seq_lens, before[0]) and torch.equal(cache.block_table, before[1])
    assert cache.free_pages(0) == before[2] and cache.length(0, a) == 5
    q = kv(1, 2, h=4)
    with pytest.raises(ValueError, match="fewer than"):
        tilefuse.paged_attention(q, cache, 1, [a])  # layer 1 holds nothing yet
    with pytest.raises(ValueError, match="1 to 8"):
        tilefuse.paged_attention(kv(1, 9, h=4), cache, 0, [a])
    with pytest.raises(ValueError, match="multiple"):
        tilefuse.paged_attention(kv(1, 1, h=3), cache, 0, [a])
    with pytest.raises(ValueError, match="num_splits"):
        tilefuse.paged_attention(kv(1, 1, h=4), cache, 0, [a], num_splits=-1)
    with pytest.raises(TypeError, match="PagedKVCache"):
        tilefuse.paged_attention(q, object(), 0, [a])
    cache.add_sequence()
    with pytest.raises(ValueError, match="max_seqs"):
        cache.add_sequence()
    with pytest.raises(ValueError, match="page_size"):
        tilefuse.PagedKVCache(1, 3, 0, 2, HEAD_DIM, dtype, device)


def _past_max_len(device, dtype):
    cache = tilefuse.PagedKVCache(1, 8, 4, 2, HEAD_DIM, dtype, device, max_seq_len=6)
    s = cache.add_sequence()
    k = torch.randn(1, 7, 2, HEAD_DIM).to(device, dtype)
    cache.append(0, [s], k, k)


def test_custom_op_path_matches_the_direct_path(device):
    """Inside torch.compile the calls go through the registered ops; their results are the direct path's."""
    dtype = DTYPES[0]
    cache, stash, ids, gen = _filled_cache(device, dtype, PAGE_SIZES[0])
    q = _tokens(len(ids), 2, cache.num_kv_heads * 2, dtype, device, gen)
    direct = tilefuse.paged_attention(q, cache, 1, ids, num_splits=2)
    slots = torch.tensor(ids, dtype=torch.int32, device=device)
    via_op, lse = torch.ops.tilefuse.kv_attention(
        q, cache.k_pages[1], cache.v_pages[1], cache.block_table[1], cache.seq_lens[1], slots, None, None, None,
        None, None, True, 0, 2, max(PROMPTS) + 2, HEAD_DIM ** -0.5, -1, 0, 0.0, False, False, 2, False)
    assert torch.equal(direct, via_op) and lse.numel() == 0
