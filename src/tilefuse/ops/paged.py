"""A paged KV cache for serving, and decode attention over it.

``PagedKVCache`` holds each layer's keys and values in fixed-size pages (FlashAttention's paged layout,
``[num_pages, page_size, Hkv, d]`` per layer), a block table per layer mapping each sequence's position
``n`` to page ``block_table[layer, seq, n // page_size]``, and each sequence's length per layer. Page
bookkeeping (which pages are free, how long each sequence is) is kept on the host as well, so appending and
attending never wait on the GPU to learn a length. ``paged_attention`` runs 1-8 new query tokens per sequence
against their sequence's cached keys (flash-decoding: the key positions split over programs and merged by
log-sum-exp), the new tokens causal among themselves.

Registered as the custom ops ``tilefuse::paged_append`` (mutating the pages) and ``tilefuse::paged_attention``.
"""
from __future__ import annotations

import math
import operator

import torch

from tilefuse import runtime
from tilefuse.ops import _dispatch
from tilefuse.ops._checks import check_no_grad_needed, check_tensor
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
# Custom ops
# --------------------------------------------------------------------------------------------------
def _append_impl(k, v, k_pages, v_pages, block_table, slots, old_lens):
    path = runtime.execution_path(k)
    if path == runtime.REFERENCE:
        _dispatch.record_reference("paged_append", path)
        reference.append(k, v, k_pages, v_pages, block_table, slots, old_lens)
        return
    with _dispatch.on_device(k):
        _launch().append(k, v, k_pages, v_pages, block_table, slots, old_lens, path)


@torch.library.custom_op("tilefuse::paged_append", mutates_args=("k_pages", "v_pages"))
def _append_op(k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
               block_table: torch.Tensor, slots: torch.Tensor, old_lens: torch.Tensor) -> None:
    _append_impl(k, v, k_pages, v_pages, block_table, slots, old_lens)


def _attention_impl(q, k_pages, v_pages, block_table, seq_lens, slots, max_len, scale, num_splits):
    path = runtime.execution_path(q)
    if path == runtime.REFERENCE:
        _dispatch.record_reference("paged_attention", path)
        return reference.paged_attention(q, k_pages, v_pages, block_table, seq_lens, slots, scale)
    with _dispatch.on_device(q):
        return _launch().decode(q, k_pages, v_pages, block_table, seq_lens, slots, max_len, scale, num_splits,
                                path)


@torch.library.custom_op("tilefuse::paged_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, slots: torch.Tensor, max_len: int, scale: float,
                  num_splits: int) -> torch.Tensor:
    return _attention_impl(q, k_pages, v_pages, block_table, seq_lens, slots, max_len, scale, num_splits)


@_attention_op.register_fake
def _(q, k_pages, v_pages, block_table, seq_lens, slots, max_len, scale, num_splits):
    return torch.empty_like(q)


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
        args = (k, v, self.k_pages[layer], self.v_pages[layer], table, slots, old_lens)
        if _dispatch.direct(k, v):
            _append_impl(*args)
        else:
            _append_op(*args)


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
    args = (q, cache.k_pages[layer], cache.v_pages[layer], cache.block_table[layer], cache.seq_lens[layer],
            cache._slots(ids), max_len, float(softmax_scale), num_splits)
    if _dispatch.direct(q):
        return _attention_impl(*args)
    return _attention_op(*args)
