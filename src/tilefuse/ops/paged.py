"""A paged KV cache for serving, and decode attention over it.

``PagedKVCache`` holds each layer's keys and values in fixed-size pages (FlashAttention's paged layout,
``[num_pages, page_size, Hkv, d]`` per layer), a block table per layer mapping each sequence's position
``n`` to page ``block_table[layer, seq, n // page_size]``, and each sequence's length per layer. Page
bookkeeping (which pages are free, how long each sequence is) is kept on the host as well, so appending and
attending never wait on the GPU to learn a length. ``paged_attention`` runs 1-8 new query tokens per sequence
against their sequence's cached keys (flash-decoding: the key positions split over programs and merged by
log-sum-exp), the new tokens causal among themselves.

Registered as the custom ops ``tilefuse::kv_append`` (mutating the cache) and ``tilefuse::kv_attention``, which\n``flash_attn_with_kvcache`` (FlashAttention 2's API, dense or paged caches) and the paged\n``flash_attn_varlen_func`` run on as well.
"""
from __future__ import annotations

import math
import operator
from typing import Optional

import torch

from tilefuse import runtime
from tilefuse.ops import _dispatch
from tilefuse.ops._checks import (check_no_grad_needed, check_offsets, check_same_device, check_same_dtype,
                                  check_tensor, flash_attn_window, score_modifiers)
from tilefuse.reference import paged as reference
from tilefuse.sizes import cdiv

MAX_QUERY_TOKENS = 8


def _launch():
    runtime.check_triton()
    from tilefuse.kernels.paged import launch  # imports triton: only once a kernel is to run
    return launch


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got a bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


# --------------------------------------------------------------------------------------------------
# Custom ops: the launch layer's contract (tilefuse.kernels.paged.launch), flattened into op arguments
# --------------------------------------------------------------------------------------------------
def _rotary(cos, sin, interleaved, sequential=None):
    if cos is None:
        return None
    return (cos, sin, interleaved) if sequential is None else (cos, sin, interleaved, sequential)


def _append_impl(k, v, k_cache, v_cache, block_table, slots, old_lens, rot_cos, rot_sin, rot_interleaved):
    path = runtime.execution_path(k)
    rotary = _rotary(rot_cos, rot_sin, rot_interleaved)
    if path == runtime.REFERENCE:
        _dispatch.record_reference("kv_append", path)
        reference.append(k, v, k_cache, v_cache, block_table, slots, old_lens, rotary)
        return
    with _dispatch.on_device(k):
        _launch().append(k, v, k_cache, v_cache, block_table, slots, old_lens, rotary, path)


@torch.library.custom_op("tilefuse::kv_append", mutates_args=("k_cache", "v_cache"))
def _append_op(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_table: Optional[torch.Tensor], slots: Optional[torch.Tensor], old_lens: torch.Tensor,
               rot_cos: Optional[torch.Tensor], rot_sin: Optional[torch.Tensor], rot_interleaved: bool) -> None:
    _append_impl(k, v, k_cache, v_cache, block_table, slots, old_lens, rot_cos, rot_sin, rot_interleaved)


def _append(*args) -> None:
    if _dispatch.direct(*(a for a in args if isinstance(a, torch.Tensor))):
        _append_impl(*args)
    else:
        _append_op(*args)


def _attention_impl(q, k_cache, v_cache, block_table, lens, slots, leftpad, cu_q, alibi, rot_cos, rot_sin,
                    lens_by_slot, extra_keys, max_q, max_keys, scale, window_left, window_right, softcap,
                    rot_interleaved, rot_sequential, num_splits, return_lse):
    path = runtime.execution_path(q)
    kwargs = dict(block_table=block_table, lens=lens, lens_by_slot=lens_by_slot, extra_keys=extra_keys, slots=slots,
                  leftpad=leftpad, cu_q=cu_q, max_q=max_q, scale=scale, window=(window_left, window_right),
                  softcap=softcap or None, alibi=alibi,
                  rotary=_rotary(rot_cos, rot_sin, rot_interleaved, rot_sequential))
    if path == runtime.REFERENCE:
        _dispatch.record_reference("kv_attention", path)
        out, lse = reference.attention(q, k_cache, v_cache, **kwargs)
        return out, (lse if return_lse else lse.new_empty(0))
    with _dispatch.on_device(q):
        return _launch().attention(q, k_cache, v_cache, max_keys=max_keys, num_splits=num_splits,
                                   return_lse=return_lse, path=path, **kwargs)


@torch.library.custom_op("tilefuse::kv_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: Optional[torch.Tensor],
                  lens: Optional[torch.Tensor], slots: Optional[torch.Tensor], leftpad: Optional[torch.Tensor],
                  cu_q: Optional[torch.Tensor], alibi: Optional[torch.Tensor], rot_cos: Optional[torch.Tensor],
                  rot_sin: Optional[torch.Tensor], lens_by_slot: bool, extra_keys: int, max_q: int, max_keys: int,
                  scale: float, window_left: int, window_right: int, softcap: float, rot_interleaved: bool,
                  rot_sequential: bool, num_splits: int, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _attention_impl(q, k_cache, v_cache, block_table, lens, slots, leftpad, cu_q, alibi, rot_cos, rot_sin,
                           lens_by_slot, extra_keys, max_q, max_keys, scale, window_left, window_right, softcap,
                           rot_interleaved, rot_sequential, num_splits, return_lse)


@_attention_op.register_fake
def _(q, k_cache, v_cache, block_table, lens, slots, leftpad, cu_q, alibi, rot_cos, rot_sin, lens_by_slot,
      extra_keys, max_q, max_keys, scale, window_left, window_right, softcap, rot_interleaved, rot_sequential,
      num_splits, return_lse):
    if not return_lse:
        lse_shape = (0,)
    elif cu_q is not None:
        lse_shape = (q.shape[-2], q.shape[0])
    else:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


def _attention(*args):
    if _dispatch.direct(*(a for a in args if isinstance(a, torch.Tensor))):
        return _attention_impl(*args)
    return _attention_op(*args)


# --------------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------------
class PagedKVCache:
    """Keys and values of ``num_layers`` layers in pages of ``page_size`` positions.

    Tensors (on ``device``): ``k_pages``, ``v_pages`` ``[num_layers, num_pages, page_size, num_kv_heads,
    head_dim]`` (``k_pages[layer]`` is FlashAttention's paged ``k_cache``), ``block_table`` ``[num_layers,
    max_seqs, pages_per_seq]`` int32 (``pages_per_seq = ceil(max_seq_len / page_size)``) and ``seq_lens``
    ``[num_layers, max_seqs]`` int32, indexed by seq_id. Each layer has its own pool of ``num_pages`` pages and
    its own lengths. ``max_seq_len`` defaults to what one layer's pages hold (``num_pages * page_size``);
    ``max_seqs`` bounds the live sequences (the block table's rows).
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device=None, *, max_seqs: int = 256,
                 max_seq_len: int | None = None):
        self.num_layers = _positive_int("num_layers", num_layers)
        self.num_pages = _positive_int("num_pages", num_pages)
        self.page_size = _positive_int("page_size", page_size)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = _positive_int("head_dim", head_dim)
        self.max_seqs = _positive_int("max_seqs", max_seqs)
        if self.head_dim > 256:
            raise ValueError(f"head_dim must be <= 256, got {head_dim}")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        self.max_seq_len = (self.num_pages * self.page_size if max_seq_len is None
                            else _positive_int("max_seq_len", max_seq_len))
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        self.pages_per_seq = cdiv(self.max_seq_len, self.page_size)
        shape = (self.num_layers, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        self.k_pages = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_pages = torch.zeros(shape, dtype=dtype, device=self.device)
        self.device = self.k_pages.device  # with its index: "cuda" becomes the current device
        self.block_table = torch.zeros(self.num_layers, self.max_seqs, self.pages_per_seq, dtype=torch.int32,
                                       device=self.device)
        self.seq_lens = torch.zeros(self.num_layers, self.max_seqs, dtype=torch.int32, device=self.device)
        # Host bookkeeping: free pages per layer (popped lowest first), each live sequence's pages and length.
        self._free_pages = [list(range(self.num_pages - 1, -1, -1)) for _ in range(self.num_layers)]
        self._pages: list[dict[int, list[int]]] = [{} for _ in range(self.num_layers)]
        self._lens: list[dict[int, int]] = [{} for _ in range(self.num_layers)]
        self._free_ids = list(range(self.max_seqs - 1, -1, -1))
        self._slots_cache: tuple = ((), None)

    # ---- sequences -------------------------------------------------------------------------------
    def add_sequence(self) -> int:
        """A new empty sequence in every layer; returns its seq_id (its row in ``block_table``)."""
        if not self._free_ids:
            raise ValueError(f"the cache already holds max_seqs={self.max_seqs} sequences; free one first")
        seq_id = self._free_ids.pop()
        for layer in range(self.num_layers):
            self._pages[layer][seq_id] = []
            self._lens[layer][seq_id] = 0
        return seq_id

    def free(self, seq_id: int) -> None:
        """Releases the sequence's pages in every layer; its seq_id may be handed out again."""
        seq_id = self._check_seq_id(seq_id, "seq_id")
        for layer in range(self.num_layers):
            self._free_pages[layer].extend(reversed(self._pages[layer].pop(seq_id)))
            del self._lens[layer][seq_id]
        self.seq_lens[:, seq_id] = 0
        self._free_ids.append(seq_id)
        self._slots_cache = ((), None)

    def length(self, layer: int, seq_id: int) -> int:
        """How many positions of ``seq_id`` layer ``layer`` holds (from the host's bookkeeping: no GPU sync)."""
        return self._lens[self._check_layer(layer)][self._check_seq_id(seq_id, "seq_id")]

    def free_pages(self, layer: int) -> int:
        return len(self._free_pages[self._check_layer(layer)])

    # ---- checks ----------------------------------------------------------------------------------
    def _check_layer(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} is out of range: the cache has {self.num_layers} layers")
        return layer

    def _check_seq_id(self, seq_id, name: str) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            raise TypeError(f"{name} must be an int, got {type(seq_id).__name__}")
        if seq_id not in self._lens[0]:
            raise ValueError(f"{name}={seq_id} is not a live sequence of this cache (add_sequence() makes one)")
        return seq_id

    def _check_seq_ids(self, seq_ids) -> list[int]:
        if isinstance(seq_ids, torch.Tensor):
            if seq_ids.dim() != 1 or seq_ids.dtype.is_floating_point or seq_ids.dtype == torch.bool:
                raise TypeError("seq_ids must be a list of ints or a 1-d integer tensor")
            seq_ids = seq_ids.tolist()
        if not isinstance(seq_ids, (list, tuple)) or not seq_ids:
            raise ValueError("seq_ids must be a non-empty list of seq_ids")
        ids = [self._check_seq_id(s, f"seq_ids[{i}]") for i, s in enumerate(seq_ids)]
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids must not repeat a sequence, got {ids}")
        return ids

    def _check_tokens(self, name: str, t, n_seqs: int, heads: int | None) -> None:
        check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be [len(seq_ids), T, heads, head_dim], got shape {tuple(t.shape)}")
        if t.shape[0] != n_seqs:
            raise ValueError(f"{name} has {t.shape[0]} sequences in dim 0 but seq_ids names {n_seqs}")
        if heads is not None and t.shape[2] != heads:
            raise ValueError(f"{name} has {t.shape[2]} heads but the cache has num_kv_heads={heads}")
        if t.shape[3] != self.head_dim:
            raise ValueError(f"{name} has head_dim {t.shape[3]} but the cache has head_dim={self.head_dim}")
        if t.dtype != self.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but the cache holds {self.dtype}; they must match")
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device} but the cache is on {self.device}")

    def _slots(self, ids: list[int]) -> torch.Tensor:
        key, tensor = self._slots_cache
        if key != tuple(ids):  # one host-to-device copy per batch of sequences, reused by every layer
            tensor = torch.tensor(ids, dtype=torch.int32, device=self.device)
            self._slots_cache = (tuple(ids), tensor)
        return tensor

    # ---- append ----------------------------------------------------------------------------------
    def append(self, layer: int, seq_ids, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes the new tokens' keys and values, ``k``, ``v`` ``[len(seq_ids), T, Hkv, head_dim]``, at the end
        of each sequence in ``layer`` (one kernel for all of them), taking free pages as a sequence needs them.
        A cache without the pages for all of them refuses before anything changes."""
        layer = self._check_layer(layer)
        ids = self._check_seq_ids(seq_ids)
        self._check_tokens("k", k, len(ids), self.num_kv_heads)
        self._check_tokens("v", v, len(ids), self.num_kv_heads)
        if k.shape != v.shape:
            raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        check_no_grad_needed("PagedKVCache.append", k, v)
        T = k.shape[1]
        if T == 0:
            return
        lens, pages = self._lens[layer], self._pages[layer]
        needed = []
        for s in ids:
            new_len = lens[s] + T
            if new_len > self.max_seq_len:
                raise ValueError(f"seq_id {s} would hold {new_len} positions in layer {layer}, past "
                                 f"max_seq_len={self.max_seq_len}")
            needed.append(cdiv(new_len, self.page_size) - len(pages[s]))
        free = self._free_pages[layer]
        if sum(needed) > len(free):
            raise ValueError(f"the cache is full: layer {layer} needs {sum(needed)} more pages of "
                             f"{self.page_size} positions and has {len(free)} free")
        rows, cols, new_pages, old = [], [], [], []
        for s, n in zip(ids, needed):
            for _ in range(n):
                page = free.pop()
                rows.append(s)
                cols.append(len(pages[s]))
                new_pages.append(page)
                pages[s].append(page)
            old.append(lens[s])
            lens[s] += T
        n_new, n_ids = len(new_pages), len(ids)
        # One host-to-device copy carries the new table entries, the slots, the old and the new lengths.
        meta = torch.tensor(rows + cols + new_pages + ids + old + [o + T for o in old], dtype=torch.int32,
                            device=self.device)
        table, seq_lens = self.block_table[layer], self.seq_lens[layer]
        if n_new:
            table[meta[:n_new].long(), meta[n_new:2 * n_new].long()] = meta[2 * n_new:3 * n_new]
        slots = meta[3 * n_new:3 * n_new + n_ids]
        old_lens = meta[3 * n_new + n_ids:3 * n_new + 2 * n_ids]
        seq_lens[slots.long()] = meta[3 * n_new + 2 * n_ids:]
        _append(k, v, self.k_pages[layer], self.v_pages[layer], table, slots, old_lens, None, None, False)


def paged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, seq_ids, *,
                    softmax_scale: float | None = None, num_splits: int = 0) -> torch.Tensor:
    """Attention of the new query tokens ``q`` ``[len(seq_ids), T, Hq, head_dim]`` (1 <= T <= 8) over their
    sequences' keys and values in ``cache`` at ``layer``, their own keys included: append them first
    (``cache.append``). Query token t of a sequence of length L sits at position L - T + t and sees keys
    0..L - T + t (causal among the new tokens). Sequences of different lengths share one batch; Hq must be a
    multiple of the cache's num_kv_heads (GQA). ``softmax_scale`` defaults to 1/sqrt(head_dim);
    ``num_splits`` (0: chosen from the batch and heads against the SM count) splits each sequence's key
    positions over that many programs, merged by log-sum-exp. Returns q's shape and dtype. Forward only."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a tilefuse.PagedKVCache, got {type(cache).__name__}")
    layer = cache._check_layer(layer)
    ids = cache._check_seq_ids(seq_ids)
    cache._check_tokens("q", q, len(ids), None)
    T, hq = q.shape[1], q.shape[2]
    if not 1 <= T <= MAX_QUERY_TOKENS:
        raise ValueError(f"q must hold 1 to {MAX_QUERY_TOKENS} new tokens per sequence (dim 1), got {T}")
    if hq % cache.num_kv_heads:
        raise ValueError(f"q has {hq} heads, not a multiple of the cache's num_kv_heads={cache.num_kv_heads}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: chosen), got {num_splits!r}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(cache.head_dim)
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not math.isfinite(
            softmax_scale):
        raise ValueError(f"softmax_scale must be a finite number or None, got {softmax_scale!r}")
    check_no_grad_needed("paged_attention", q)
    lens = cache._lens[layer]
    short = [s for s in ids if lens[s] < T]
    if short:
        raise ValueError(f"seq_ids {short} hold fewer than the {T} query tokens' positions in layer {layer}: "
                         "append the new tokens' keys and values (cache.append) before attending")
    max_len = max(lens[s] for s in ids)
    out, _ = _attention(q, cache.k_pages[layer], cache.v_pages[layer], cache.block_table[layer],
                        cache.seq_lens[layer], cache._slots(ids), None, None, None, None, None, True, 0, T, max_len,
                        float(softmax_scale), -1, 0, 0.0, False, False, num_splits, False)
    return out


# --------------------------------------------------------------------------------------------------
# FlashAttention 2's kvcache API
# --------------------------------------------------------------------------------------------------
_INT_DTYPES = (torch.int32, torch.int64)


def _index_tensor(name: str, t, length: int | None, device) -> None:
    """A 1-D (or, with length None, any) int32/int64 tensor on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; expected int32 (or int64)")
    if length is not None and tuple(t.shape) != (length,):
        raise ValueError(f"{name} must have shape [{length}] (one entry per sequence), got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; they must be on one device")


def _check_cache(q, k_cache, v_cache, block_table, n_seqs):
    """The cache tensors against q: returns (rows of the table or cache, key capacity per row)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ([batch_cache, seqlen_cache, Hkv, d], or [num_blocks, page_size, "
                             f"Hkv, d] with block_table), got shape {tuple(t.shape)}")
        check_same_dtype(name, t, "q", q)
        check_same_device(name, t, "q", q)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    if d != q.shape[-1]:
        raise ValueError(f"k_cache has head dim {d} but q has {q.shape[-1]}; they must agree")
    if d > 256:
        raise ValueError(f"head dim must be <= 256, got {d}")
    if hkv == 0 or q.shape[-2] % hkv:
        raise ValueError(f"q has {q.shape[-2]} heads, not a multiple of k_cache's {hkv} KV heads")
    if block_table is None:
        return k_cache.shape[0], k_cache.shape[1]
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor or None, got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table has dtype {block_table.dtype}; expected int32")
    if block_table.dim() != 2 or block_table.shape[1] == 0:
        raise ValueError(f"block_table must be [batch, max_blocks_per_seq] with max_blocks_per_seq >= 1, got shape "
                         f"{tuple(block_table.shape)}")
    check_same_device("block_table", block_table, "q", q)
    if n_seqs is not None and block_table.shape[0] != n_seqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows but q holds {n_seqs} sequences")
    if k_cache.shape[0] == 0 or k_cache.shape[1] == 0:
        raise ValueError(f"k_cache holds no pages (shape {tuple(k_cache.shape)})")
    return block_table.shape[0], k_cache.shape[1] * block_table.shape[1]


def _validating(validate: bool, *tensors) -> bool:
    """Whether to check the index tensors' values now (one host synchronisation): not while a CUDA graph is
    captured or torch.compile traces, where the kernels' clamps keep every access in bounds instead."""
    if not validate or torch.compiler.is_compiling():
        return False
    return not any(t is not None and t.is_cuda and torch.cuda.is_current_stream_capturing() for t in tensors)


def _check_pages_used(block_table, rows, lens, num_pages, page_size):
    """The page ids each sequence reaches (its first ceil(len / page_size) columns) lie in [0, num_pages)."""
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    used = cols[None, :] * page_size < lens[:, None].to(cols.dtype)
    ids = block_table[rows.long()]
    bad = used & ((ids < 0) | (ids >= num_pages))
    if bool(bad.any()):
        b, c = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_table[{int(rows[b])}, {c}] = {int(ids[b, c])} is not a page of the cache "
                         f"(num_blocks = {num_pages})")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            *, validate: bool = True):
    """``flash_attn.flash_attn_with_kvcache`` (FlashAttention 2's signature and semantics) on tilefuse's kernels.

    q ``[B, Tq, Hq, d]``; ``k_cache``, ``v_cache`` dense ``[B_cache, seqlen_cache, Hkv, d]`` (sequence b in row
    ``cache_batch_idx[b]``, default b) or paged ``[num_blocks, page_size, Hkv, d]`` with ``block_table`` int32
    ``[B, max_blocks]`` (any page size; with ``cache_batch_idx``, sequence b reads table row
    ``cache_batch_idx[b]``). Sequence b holds ``cache_seqlens[b]`` keys (an int, or int32 ``[B]``; None: the whole
    capacity). New ``k``, ``v`` ``[B, T_new, Hkv, d]`` are written in place at positions cache_seqlens[b] + t
    (one kernel), rotated first by ``rotary_cos`` / ``rotary_sin`` ``[seqlen_ro, rotary_dim / 2]`` (GPT-J pairs
    when ``rotary_interleaved``, else GPT-NeoX halves), and attended to with the cache. q is rotated at positions
    cache_seqlens[b] + t when causal or windowed, else at cache_seqlens[b]. Keys before ``cache_leftpad[b]``
    are hidden. Causal and ``window_size`` are aligned bottom-right (query t at key position
    n_b - Tq + t); ``softcap`` > 0 caps the scores, ``alibi_slopes`` fp32 ``[Hq]`` or ``[B, Hq]`` add
    -slope * |position - key|. ``num_splits`` splits each sequence's keys over programs merged by log-sum-exp
    (0: chosen from B x heads against the SM count). Returns out ``[B, Tq, Hq, d]``, with
    ``return_softmax_lse`` also the natural-log lse fp32 ``[B, Hq, Tq]`` (-inf where a row sees no key; its
    output is 0). Forward only.

    ``validate=True`` checks the index tensors' values against the cache (lengths, page ids, batch indices,
    left padding, the rotary table's length) with one host synchronisation; ``validate=False``, a CUDA graph
    capture or torch.compile skips that, and the kernels clamp every index into its tensor instead (so a bad
    value gives wrong numbers, never an access outside the tensors)."""
    window = flash_attn_window(0.0, window_size, softcap)
    check_tensor("q", q)
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D [B, Tq, Hq, d] (FlashAttention's layout), got shape {tuple(q.shape)}")
    B, Tq, hq, d = q.shape
    rows, capacity = _check_cache(q, k_cache, v_cache, block_table,
                                  B if (block_table is not None and cache_batch_idx is None) else None)
    hkv = k_cache.shape[2]
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values) or both be None")
    t_new = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t)
            if t.dim() != 4 or t.shape[0] != B or t.shape[2] != hkv or t.shape[3] != d:
                raise ValueError(f"{name} must be [B={B}, T_new, Hkv={hkv}, d={d}], got shape {tuple(t.shape)}")
            check_same_dtype(name, t, "k_cache", k_cache)
            check_same_device(name, t, "q", q)
        if k.shape != v.shape:
            raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
        t_new = k.shape[1]
        if cache_seqlens is None:
            raise ValueError("cache_seqlens must be given with new k and v: it says where they are written")
    int_len = None
    if cache_seqlens is not None:
        if isinstance(cache_seqlens, bool):
            raise TypeError("cache_seqlens must be an int or an int32 tensor [B], got a bool")
        if isinstance(cache_seqlens, int):
            if not 0 <= cache_seqlens <= capacity - t_new:
                raise ValueError(f"cache_seqlens={cache_seqlens} with {t_new} new tokens does not fit the cache's "
                                 f"{capacity} positions per sequence")
            int_len = cache_seqlens
            cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device)
        else:
            _index_tensor("cache_seqlens", cache_seqlens, B, q.device)
    if cache_batch_idx is not None:
        _index_tensor("cache_batch_idx", cache_batch_idx, B, q.device)
    if cache_leftpad is not None:
        _index_tensor("cache_leftpad", cache_leftpad, B, q.device)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos / rotary_sin need new k and v (they rotate the appended keys and q)")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            check_tensor(name, t)
            check_same_device(name, t, "q", q)
            if t.dim() != 2 or t.shape[0] == 0 or t.shape[1] == 0 or 2 * t.shape[1] > d or t.stride(1) != 1:
                raise ValueError(f"{name} must be [seqlen_ro, rotary_dim / 2] with 0 < rotary_dim <= d={d} and "
                                 f"a unit last stride, got shape {tuple(t.shape)}")
        if rotary_cos.shape != rotary_sin.shape:
            raise ValueError(f"rotary_sin must have rotary_cos's shape {tuple(rotary_cos.shape)}, got "
                             f"{tuple(rotary_sin.shape)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: chosen), got {num_splits!r}")
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not math.isfinite(
            softmax_scale):
        raise ValueError(f"softmax_scale must be a finite number or None, got {softmax_scale!r}")
    softcap, alibi = score_modifiers(q.new_empty((B, hq, 0, 0)), softcap or None, alibi_slopes)
    if alibi is not None and alibi.stride(-1) != 1 and alibi.shape[-1] > 1:
        alibi = alibi.contiguous()
    check_no_grad_needed("flash_attn_with_kvcache", q, k, v)
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    sequential = causal or window is not None

    if _validating(validate, q) and (cache_seqlens is not None or cache_batch_idx is not None
                                     or cache_leftpad is not None or block_table is not None):
        slot_ids = cache_batch_idx if cache_batch_idx is not None else torch.arange(B, device=q.device)
        if cache_batch_idx is not None and B and (int(slot_ids.min()) < 0 or int(slot_ids.max()) >= rows):
            raise ValueError(f"cache_batch_idx holds {int(slot_ids.min())}..{int(slot_ids.max())}, outside the "
                             f"cache's {rows} rows")
        lens = cache_seqlens.long() if cache_seqlens is not None else torch.full((B,), capacity, device=q.device)
        if B and (int(lens.min()) < 0 or int(lens.max()) + t_new > capacity):
            raise ValueError(f"cache_seqlens holds {int(lens.min())}..{int(lens.max())}: with {t_new} new tokens "
                             f"each sequence must fit the cache's {capacity} positions")
        if cache_leftpad is not None and B and (bool((cache_leftpad < 0).any())
                                                or bool((cache_leftpad > lens + t_new).any())):
            raise ValueError("cache_leftpad must lie in [0, cache_seqlens + new tokens] for every sequence")
        if rotary_cos is not None and B:
            reach = int(lens.max()) + (max(Tq, t_new) if sequential else t_new)
            if reach > rotary_cos.shape[0]:
                raise ValueError(f"rotary_cos has {rotary_cos.shape[0]} positions but the sequences reach {reach}")
        if block_table is not None and B:
            _check_pages_used(block_table, slot_ids, lens + t_new, k_cache.shape[0], k_cache.shape[1])

    slots = cache_batch_idx
    if k is not None and B and t_new:
        _append(k, v, k_cache, v_cache, block_table, slots, cache_seqlens, rotary_cos, rotary_sin,
                bool(rotary_interleaved))
    max_keys = capacity if int_len is None else min(capacity, int_len + t_new)
    out, lse = _attention(q, k_cache, v_cache, block_table, cache_seqlens, slots, cache_leftpad, None, alibi,
                          rotary_cos, rotary_sin, False, t_new, Tq, max_keys, float(softmax_scale), left, right,
                          float(softcap or 0.0), bool(rotary_interleaved), sequential, num_splits,
                          bool(return_softmax_lse))
    return (out, lse) if return_softmax_lse else out


def flash_attn_varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            block_table, softmax_scale=None, causal=False, window=None, softcap=None,
                            alibi_slopes=None, return_lse=False, validate=True):
    """Packed queries over a paged cache: ``flash_attn_varlen_func(..., block_table=)``. q ``[total_q, Hq, d]``
    (sequence b's rows at cu_seqlens_q[b]:cu_seqlens_q[b + 1]), ``k_cache`` / ``v_cache`` ``[num_blocks,
    page_size, Hkv, d]``, sequence b's cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys in the pages of
    ``block_table[b]``; causal and the window aligned bottom-right per sequence. Returns out ``[total_q, Hq,
    d]`` (and the lse fp32 ``[Hq, total_q]``). Forward only."""
    check_tensor("q", q)
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [total_q, Hq, d], got shape {tuple(q.shape)}")
    if block_table is None:
        raise ValueError("block_table is required here")
    check_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, _validating(validate, q))
    seqs = cu_seqlens_q.shape[0] - 1
    _, capacity = _check_cache(q, k_cache, v_cache, block_table, seqs)
    _index_tensor("cu_seqlens_k", cu_seqlens_k, seqs + 1, q.device)
    check_same_device("cu_seqlens_q", cu_seqlens_q, "q", q)
    if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int) or max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_k must be an int >= 0, got {max_seqlen_k!r}")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    softcap, alibi = score_modifiers(q.new_empty((seqs, q.shape[1], 0, 0)), softcap, alibi_slopes)
    check_no_grad_needed("flash_attn_varlen_func with block_table", q)
    lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    if _validating(validate, q) and seqs:
        if int(lens.min()) < 0 or int(lens.max()) > min(capacity, max_seqlen_k):
            raise ValueError(f"cu_seqlens_k gives sequences of {int(lens.min())}..{int(lens.max())} keys; each must "
                             f"be >= 0 and fit max_seqlen_k={max_seqlen_k} and the table's {capacity} positions")
        _check_pages_used(block_table, torch.arange(seqs, device=q.device), lens, k_cache.shape[0], k_cache.shape[1])
    left, right = tuple(window) if window is not None else (-1, -1)
    if causal:
        right = 0
    out, lse = _attention(q, k_cache, v_cache, block_table, lens, None, None, cu_seqlens_q, alibi, None, None,
                          False, 0, int(max_seqlen_q), min(capacity, int(max_seqlen_k)), float(softmax_scale), left,
                          right, float(softcap or 0.0), False, False, 0, bool(return_lse))
    return (out, lse) if return_lse else out
