"""Block-sparse attention masks: describe which keys each query sees, build the tile lists the kernels walk.

A mask spec says, for batch b, head h, query position q and key position k, whether q sees k. Positions are
**top-left aligned**: query row i is position i and key row j is position j, whatever Nq and Nk are (unlike
``tilefuse.attention(causal=True)``, which aligns bottom-right). The built-in specs::

    causal()                   k <= q
    sliding_window(left, right)  q - left <= k <= q + right   (None: that side unbounded)
    global_tokens(n)           k < n or q < n   (the first n keys are seen by every query, the first n
                               queries see every key)
    document(doc_ids)          doc_ids[q] == doc_ids[k]   (doc_ids int [Nk] or [B, Nk]; Nq == Nk; sorted or not)
    from_function(fn)          fn(b, h, q_idx, kv_idx) -> bool tensor, on broadcast int64 index tensors

combine with ``&`` and ``|``: ``(causal() & sliding_window(1024, 0)) | global_tokens(64)``.

``spec.build(B, H, Nq, Nk, device, block_q=128, block_k=128)`` returns a :class:`BlockMask`: for each (batch,
head, query tile) the key tiles that are FULL (every element visible) and those that are PARTIAL (some visible,
some not), as counts and index lists, the same lists transposed (per key tile, its query tiles) for the
backward, and for each partial tile its element mask as a bitmap. A key tile cut by Nk counts its keys past Nk
as not visible (so it is never full: the kernels then skip every bound check on full tiles); query rows past
Nq are ignored.

How it is built, on ``device`` and without any Nq x Nk tensor:

1. Every spec classifies the tile grid analytically: the built-in ones from each tile's position intervals
   (causal, windows, global tokens) or the per-tile min/max of the document ids, as two boolean grids:
   ``some`` (the tile may hold a visible element) and ``every`` (every element is visible). ``&`` and ``|``
   combine them (AND: empty if either is empty, full if both are full; OR: full if either is full, empty if
   both are empty). ``every`` is exact or an under-estimate and ``some`` exact or an over-estimate, never
   the other way.
2. Only the tiles left undecided (``some`` and not ``every``) are evaluated element by element, in chunks of
   tiles, through the spec's vectorised element function; their counts settle each one as empty, full or
   partial (so a combination whose intervals over-estimate, or unsorted document ids, still come out exact),
   and the partial ones keep their bits.
3. The lists are made by cumulative sums and scatters over the tile grid (no sort, no Python loop over tiles).

Why a bitmap: the kernels then apply any mask, built-in or ``from_function``, the same way, reading
``block_q * block_k / 8`` bytes per partial tile (2 KB at 128 x 128, beside the 64 KB of K and V a tile
costs in bf16 at d = 128), and the mask costs nothing at all on full tiles. ``from_function`` has no
interval form: every tile goes through step 2, the slow, general path (block_q * block_k evaluations per
tile, chunk by chunk: never all N x N at once).

Masks that depend on neither the batch nor the head are stored once (B = 1, H = 1) and broadcast by the
kernels (zero strides); ``document`` with [B, Nk] ids depends on the batch; ``from_function`` on both unless
told otherwise (``uses_batch`` / ``uses_head``).
"""
from __future__ import annotations

from typing import Callable

import torch

from tilefuse.sizes import cdiv

# Element evaluations per chunk of undecided tiles (step 2): bounds the temporaries at a few hundred MB.
CHUNK_ELEMENTS = 1 << 24
BLOCK_SIZES = (16, 32, 64, 128, 256, 512, 1024)
EMPTY, PARTIAL, FULL = 0, 1, 2
# Bit i of a word is worth 2**i; bit 31 is the sign bit of an int32.
_BIT_WEIGHTS = [1 << i for i in range(31)] + [-(1 << 31)]


class _TileGrid:
    """The tile grid a build classifies: bounds of every query tile ([1, 1, Tq, 1]) and key tile ([1, 1, 1, Tk]),
    clipped to Nq / Nk, as int64 on the build's device."""

    def __init__(self, B, H, Nq, Nk, block_q, block_k, device):
        self.B, self.H, self.Nq, self.Nk = B, H, Nq, Nk
        self.block_q, self.block_k, self.device = block_q, block_k, device
        self.Tq, self.Tk = cdiv(Nq, block_q), cdiv(Nk, block_k)
        iq = torch.arange(self.Tq, device=device, dtype=torch.int64)
        ik = torch.arange(self.Tk, device=device, dtype=torch.int64)
        self.q_lo = (iq * block_q).view(1, 1, -1, 1)
        self.q_hi = ((iq + 1) * block_q).clamp(max=Nq).view(1, 1, -1, 1) - 1
        self.k_lo = (ik * block_k).view(1, 1, 1, -1)
        self.k_hi = ((ik + 1) * block_k).clamp(max=Nk).view(1, 1, 1, -1) - 1


class MaskSpec:
    """A mask: :meth:`visible` element by element, :meth:`_tiles` tile by tile. Combine with ``&`` and ``|``;
    :meth:`build` the block lists for the kernels."""

    uses_batch = False
    uses_head = False

    def visible(self, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Bool tensor of the broadcast of the int64 index tensors b, h, q, k (all in range)."""
        raise NotImplementedError

    def _tiles(self, grid: _TileGrid) -> tuple:
        """(some, every): bool tensors broadcastable to [B, H, Tq, Tk], or python bools (the same everywhere)."""
        return True, False

    def _check(self, B: int, Nq: int, Nk: int) -> None:
        """A ValueError when this spec cannot describe these shapes."""

    def band(self) -> tuple | None:
        """(left, right) when this mask is exactly the band q - left <= k <= q + right (None for an unbounded
        side): causal() and sliding_window() combined with ``&``. None for every other mask. A band needs no tile
        lists: ``tilefuse.attention`` runs it on the windowed kernels, which compute it from positions."""
        return None

    def __and__(self, other: "MaskSpec") -> "MaskSpec":
        return _Combined("&", _as_spec(self), _as_spec(other))

    def __or__(self, other: "MaskSpec") -> "MaskSpec":
        return _Combined("|", _as_spec(self), _as_spec(other))

    def dense(self, B: int, H: int, Nq: int, Nk: int, device=None) -> torch.Tensor:
        """The whole [B', H', Nq, Nk] bool mask (B' = B if the mask uses the batch, else 1; H' likewise): for
        tests and small shapes only."""
        self._check(B, Nq, Nk)
        Bm, Hm = (B if self.uses_batch else 1), (H if self.uses_head else 1)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        b = torch.arange(Bm, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(Hm, device=dev).view(1, -1, 1, 1)
        q = torch.arange(Nq, device=dev).view(1, 1, -1, 1)
        k = torch.arange(Nk, device=dev).view(1, 1, 1, -1)
        return self.visible(b, h, q, k).expand(Bm, Hm, Nq, Nk).clone()

    def build(self, B: int, H: int, Nq: int, Nk: int, device=None, *, block_q: int = 128,
              block_k: int = 128) -> "BlockMask":
        """The :class:`BlockMask` of this spec for ``B`` batches, ``H`` query heads, ``Nq`` queries and ``Nk``
        keys, in tiles of ``block_q`` x ``block_k`` (powers of two from 16 to 1024), on ``device``."""
        for name, n in (("B", B), ("H", H), ("Nq", Nq), ("Nk", Nk)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"build: {name} must be an int >= 1, got {n!r}")
        for name, n in (("block_q", block_q), ("block_k", block_k)):
            if n not in BLOCK_SIZES:
                raise ValueError(f"build: {name} must be a power of two in [16, 1024], got {n!r}")
        self._check(B, Nq, Nk)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        return _build(self, B, H, Nq, Nk, block_q, block_k, dev)


def _as_spec(x) -> MaskSpec:
    if not isinstance(x, MaskSpec):
        raise TypeError(f"masks combine with other mask specs, got {type(x).__name__}")
    return x


def _and(a, b):
    if a is True:
        return b
    if b is True:
        return a
    if a is False or b is False:
        return False
    return a & b


def _or(a, b):
    if a is False:
        return b
    if b is False:
        return a
    if a is True or b is True:
        return True
    return a | b


class _Combined(MaskSpec):
    def __init__(self, op, a: MaskSpec, b: MaskSpec):
        self.op, self.a, self.b = op, a, b
        self.uses_batch = a.uses_batch or b.uses_batch
        self.uses_head = a.uses_head or b.uses_head

    def visible(self, b, h, q, k):
        x, y = self.a.visible(b, h, q, k), self.b.visible(b, h, q, k)
        return x & y if self.op == "&" else x | y

    def _tiles(self, grid):
        (sa, ea), (sb, eb) = self.a._tiles(grid), self.b._tiles(grid)
        if self.op == "&":
            return _and(sa, sb), _and(ea, eb)
        return _or(sa, sb), _or(ea, eb)

    def _check(self, B, Nq, Nk):
        self.a._check(B, Nq, Nk)
        self.b._check(B, Nq, Nk)

    def band(self):
        x, y = self.a.band(), self.b.band()
        if self.op != "&" or x is None or y is None:
            return None
        tighter = lambda u, w: w if u is None else u if w is None else min(u, w)  # noqa: E731
        return tighter(x[0], y[0]), tighter(x[1], y[1])

    def __repr__(self):
        return f"({self.a!r} {self.op} {self.b!r})"


class _Causal(MaskSpec):
    def visible(self, b, h, q, k):
        return k <= q

    def _tiles(self, g):
        return g.k_lo <= g.q_hi, g.k_hi <= g.q_lo

    def band(self):
        return None, 0

    def __repr__(self):
        return "causal()"


class _Window(MaskSpec):
    def __init__(self, left, right):
        self.left, self.right = left, right

    def visible(self, b, h, q, k):
        ok = None
        if self.left is not None:
            ok = k >= q - self.left
        if self.right is not None:
            r = k <= q + self.right
            ok = r if ok is None else ok & r
        return ok if ok is not None else torch.ones_like(q - k, dtype=torch.bool)

    def _tiles(self, g):
        some, every = True, True
        if self.left is not None:
            some, every = _and(some, g.k_hi >= g.q_lo - self.left), _and(every, g.k_lo >= g.q_hi - self.left)
        if self.right is not None:
            some, every = _and(some, g.k_lo <= g.q_hi + self.right), _and(every, g.k_hi <= g.q_lo + self.right)
        return some, every

    def band(self):
        return self.left, self.right

    def __repr__(self):
        return f"sliding_window({self.left}, {self.right})"


class _Global(MaskSpec):
    def __init__(self, n):
        self.n = n

    def visible(self, b, h, q, k):
        return (k < self.n) | (q < self.n)

    def _tiles(self, g):
        return (g.k_lo < self.n) | (g.q_lo < self.n), (g.k_hi < self.n) | (g.q_hi < self.n)

    def __repr__(self):
        return f"global_tokens({self.n})"


class _Document(MaskSpec):
    def __init__(self, doc_ids: torch.Tensor):
        self.ids = doc_ids if doc_ids.dim() == 2 else doc_ids[None]  # [B or 1, Nk]
        self.uses_batch = self.ids.shape[0] > 1
        self._on_device = {}  # int64 copies of the ids per device, made once

    def _check(self, B, Nq, Nk):
        if Nq != Nk:
            raise ValueError(f"document masks need Nq == Nk, got Nq={Nq}, Nk={Nk}")
        if self.ids.shape[1] != Nk:
            raise ValueError(f"doc_ids has {self.ids.shape[1]} positions but Nk is {Nk}")
        if self.ids.shape[0] not in (1, B):
            raise ValueError(f"doc_ids has batch {self.ids.shape[0]}; expected 1 or B={B}")

    def _ids(self, device):
        ids = self._on_device.get(device)
        if ids is None:
            ids = self._on_device[device] = self.ids.to(device=device, dtype=torch.int64)
        return ids

    def visible(self, b, h, q, k):
        ids = self._ids(q.device)
        bi = b if self.uses_batch else torch.zeros_like(b)
        return ids[bi, q] == ids[bi, k]

    def _ranges(self, ids, block):
        """Per-tile (min, max) of ids [Bi, N] in tiles of ``block`` ([Bi, T] each); the last tile padded with
        its last id, which leaves its range as it is."""
        n = ids.shape[1]
        t = cdiv(n, block)
        pad = t * block - n
        if pad:
            ids = torch.cat([ids, ids[:, -1:].expand(-1, pad)], dim=1)
        tiles = ids.view(ids.shape[0], t, block)
        return tiles.amin(-1), tiles.amax(-1)

    def _tiles(self, g):
        ids = self._ids(g.device)
        qmin, qmax = (x[:, None, :, None] for x in self._ranges(ids, g.block_q))
        kmin, kmax = (x[:, None, None, :] for x in self._ranges(ids, g.block_k))
        # Sorted ids: ranges that overlap share an id (each tile holds every id of its range that occurs);
        # unsorted ones may not, and step 2 settles those tiles.
        return (qmin <= kmax) & (kmin <= qmax), (qmin == qmax) & (kmin == kmax) & (qmin == kmin)

    def __repr__(self):
        return f"document(<{tuple(self.ids.shape)} ids>)"


class _Function(MaskSpec):
    def __init__(self, fn, uses_batch, uses_head):
        self.fn, self.uses_batch, self.uses_head = fn, uses_batch, uses_head

    def visible(self, b, h, q, k):
        out = self.fn(b, h, q, k)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            raise TypeError(f"from_function: fn must return a bool tensor, got "
                            f"{out.dtype if isinstance(out, torch.Tensor) else type(out).__name__}")
        return out

    def __repr__(self):
        return f"from_function({getattr(self.fn, '__name__', self.fn)!r})"


def _check_int(name, n, minimum=0):
    if isinstance(n, bool) or not isinstance(n, int) or n < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {n!r}")


def causal() -> MaskSpec:
    """Query position q sees keys k <= q (top-left aligned)."""
    return _Causal()


def sliding_window(left: int | None, right: int | None) -> MaskSpec:
    """Query position q sees keys q - left <= k <= q + right; None leaves that side unbounded.
    ``causal() & sliding_window(w, 0)`` is causal with a window of w + 1 keys."""
    for name, w in (("left", left), ("right", right)):
        if w is not None:
            _check_int(f"sliding_window's {name}", w)
    return _Window(left, right)


def global_tokens(n: int) -> MaskSpec:
    """The first ``n`` key positions are seen by every query, and the first ``n`` queries see every key."""
    _check_int("global_tokens' n", n)
    return _Global(n)


def document(doc_ids: torch.Tensor) -> MaskSpec:
    """Query and key see each other when they share a document id: ``doc_ids`` an int tensor [Nk] (every
    batch) or [B, Nk], sorted (packed documents) or not. Needs Nq == Nk."""
    if not isinstance(doc_ids, torch.Tensor):
        raise TypeError(f"doc_ids must be a torch.Tensor, got {type(doc_ids).__name__}")
    if doc_ids.is_floating_point() or doc_ids.is_complex() or doc_ids.dtype == torch.bool:
        raise TypeError(f"doc_ids has dtype {doc_ids.dtype}; expected an integer dtype")
    if doc_ids.dim() not in (1, 2) or doc_ids.shape[-1] < 1:
        raise ValueError(f"doc_ids must be [Nk] or [B, Nk], got shape {tuple(doc_ids.shape)}")
    return _Document(doc_ids)


def from_function(fn: Callable, *, uses_batch: bool = True, uses_head: bool = True) -> MaskSpec:
    """Any mask: ``fn(b, h, q_idx, kv_idx)`` returns a bool tensor (True: visible) of the broadcast of its four
    int64 index tensors. The slow, general path: it has no tile-level form, so a build evaluates it on every
    tile not already decided by the specs it is combined with (chunk by chunk). ``uses_batch`` / ``uses_head``
    False: fn ignores b / h, and the mask is stored once for every batch / head."""
    if not callable(fn):
        raise TypeError(f"from_function: fn must be callable, got {type(fn).__name__}")
    return _Function(fn, bool(uses_batch), bool(uses_head))


# ---- the block lists -------------------------------------------------------------------------------
class BlockMask:
    """The tile lists a spec's build made, for one (B, H, Nq, Nk, block_q, block_k).

    ``batch`` / ``heads``: 1 where the mask broadcasts over it, else B / H. Tq = cdiv(Nq, block_q) and
    Tk = cdiv(Nk, block_k) tiles. int32 tensors, on the build's device:

    - ``kv_num_blocks`` [batch, heads, Tq], ``kv_indices`` [batch, heads, Tq, Tk]: the partial key tiles of
      each query tile (the first ``kv_num_blocks`` entries, ascending), ``kv_slots`` (same shape) each one's
      bitmap; ``full_kv_num_blocks`` / ``full_kv_indices``: the full key tiles.
    - ``q_num_blocks``, ``q_indices``, ``q_slots`` [batch, heads, Tk, (Tq)], ``full_q_num_blocks`` /
      ``full_q_indices``: the same per key tile (the backward's dK/dV pass walks these).
    - ``partial_bits`` [max(P, 1), block_q, cdiv(block_k, 32)]: the element masks of the P partial tiles, bit
      c % 32 of word c // 32 of row r set when row r of the tile sees its key c.
    """

    TENSORS = ("kv_num_blocks", "kv_indices", "kv_slots", "full_kv_num_blocks", "full_kv_indices",
               "q_num_blocks", "q_indices", "q_slots", "full_q_num_blocks", "full_q_indices", "partial_bits")

    def __init__(self, tensors: dict, seq_q: int, seq_k: int, block_q: int, block_k: int, num_partial: int,
                 spec=None):
        for name in self.TENSORS:
            setattr(self, name, tensors[name])
        self.seq_q, self.seq_k, self.block_q, self.block_k = seq_q, seq_k, block_q, block_k
        self.batch, self.heads = self.kv_num_blocks.shape[0], self.kv_num_blocks.shape[1]
        self.num_partial = num_partial
        self.spec = spec

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    def tensors(self) -> list:
        """The tensors in the order the attention op takes them (``TENSORS``)."""
        return [getattr(self, name) for name in self.TENSORS]

    def tile_classes(self) -> torch.Tensor:
        """int8 [batch, heads, Tq, Tk]: 0 empty, 1 partial, 2 full (from the lists)."""
        Tq, Tk = cdiv(self.seq_q, self.block_q), cdiv(self.seq_k, self.block_k)
        cls = torch.zeros((self.batch, self.heads, Tq, Tk + 1), dtype=torch.int8, device=self.device)
        cols = torch.arange(Tk, device=self.device)
        for num, idx, value in ((self.kv_num_blocks, self.kv_indices, PARTIAL),
                                (self.full_kv_num_blocks, self.full_kv_indices, FULL)):
            used = cols < num[..., None]
            cls.scatter_(-1, torch.where(used, idx.long(), Tk), torch.full_like(cls[..., :Tk], value))
        return cls[..., :Tk]

    def to_dense(self) -> torch.Tensor:
        """[batch, heads, Nq, Nk] bool: the mask these lists describe (small shapes: tests, the reference)."""
        from tilefuse.reference.masks import dense_from_blocks

        return dense_from_blocks(self.tile_classes(), self.kv_slots_dense(), self.partial_bits, self.seq_q,
                                 self.seq_k, self.block_q, self.block_k)

    def kv_slots_dense(self) -> torch.Tensor:
        """int64 [batch, heads, Tq, Tk]: each partial tile's bitmap slot (0 elsewhere)."""
        Tk = cdiv(self.seq_k, self.block_k)
        out = torch.zeros((*self.kv_indices.shape[:-1], Tk + 1), dtype=torch.int64, device=self.device)
        used = torch.arange(Tk, device=self.device) < self.kv_num_blocks[..., None]
        out.scatter_(-1, torch.where(used, self.kv_indices.long(), Tk), self.kv_slots.long())
        return out[..., :Tk]

    def visible_count(self, B: int | None = None, H: int | None = None) -> int:
        """Visible (query, key) pairs over ``B`` batches and ``H`` heads (default: the stored ones): the full
        tiles' in-range elements plus the partial tiles' set bits (one host synchronisation)."""
        B = self.batch if B is None else B
        H = self.heads if H is None else H
        Tq, Tk = cdiv(self.seq_q, self.block_q), cdiv(self.seq_k, self.block_k)
        dev = self.device
        rows = ((torch.arange(Tq, device=dev) + 1) * self.block_q).clamp(max=self.seq_q) - \
            torch.arange(Tq, device=dev) * self.block_q
        cols = torch.arange(Tk, device=dev)
        used = cols < self.full_kv_num_blocks[..., None]
        full = (used * rows.view(1, 1, -1, 1)).sum() * self.block_k  # full tiles are never cut by Nk
        partial = _popcount(self.partial_bits[: self.num_partial]).sum() if self.num_partial else 0
        per = int(full + partial)
        return per * (B // self.batch) * (H // self.heads)

    def __repr__(self):
        return (f"BlockMask(batch={self.batch}, heads={self.heads}, Nq={self.seq_q}, Nk={self.seq_k}, "
                f"block={self.block_q}x{self.block_k}, partial tiles={self.num_partial}, spec={self.spec!r})")


def _popcount(words: torch.Tensor) -> torch.Tensor:
    """Set bits of each int32 word (as int64), by the SWAR sums of bit pairs, nibbles and bytes."""
    x = words.long() & 0xFFFFFFFF
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) & 0xFFFFFFFF) >> 24


def _lists(sel: torch.Tensor):
    """(counts int32 [..., T], indices int32 [..., T, L]) of the True entries of ``sel`` [..., T, L] along its
    last dim, ascending, by a cumulative sum and a scatter (the unused tail of each list is 0)."""
    L = sel.shape[-1]
    counts = sel.sum(-1, dtype=torch.int32)
    dest = torch.where(sel, sel.cumsum(-1) - 1, L)  # unselected entries go to a spare column
    idx = torch.zeros((*sel.shape[:-1], L + 1), dtype=torch.int32, device=sel.device)
    src = torch.arange(L, dtype=torch.int32, device=sel.device).expand(sel.shape)
    idx.scatter_(-1, dest, src)
    return counts, idx[..., :L].contiguous()


def _pack_bits(vis: torch.Tensor) -> torch.Tensor:
    """[C, rows, cols] bool -> [C, rows, cdiv(cols, 32)] int32 words (bit c % 32 of word c // 32)."""
    C, R, K = vis.shape
    words = cdiv(K, 32)
    if words * 32 != K:
        vis = torch.nn.functional.pad(vis, (0, words * 32 - K))
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.int32, device=vis.device)
    # distinct powers of two: their int32 sum is their bitwise or, and never leaves int32's range
    return (vis.view(C, R, words, 32).to(torch.int32) * weights).sum(-1, dtype=torch.int32)


def _evaluate(spec, coords, grid):
    """(classes int8 [P], bits int32 [P, block_q, words]) of the tiles at ``coords`` [P, 4] (b, h, i, j)."""
    bq, bk = grid.block_q, grid.block_k
    dev = grid.device
    rows = torch.arange(bq, device=dev).view(1, -1, 1)
    cols = torch.arange(bk, device=dev).view(1, 1, -1)
    chunk = max(1, CHUNK_ELEMENTS // (bq * bk))
    classes, bits = [], []
    for start in range(0, coords.shape[0], chunk):
        c = coords[start:start + chunk]
        b, h = c[:, 0].view(-1, 1, 1), c[:, 1].view(-1, 1, 1)
        q = c[:, 2].view(-1, 1, 1) * bq + rows
        k = c[:, 3].view(-1, 1, 1) * bk + cols
        in_q, in_k = q < grid.Nq, k < grid.Nk
        # the spec sees in-range indices only (a from_function may index tensors with them)
        vis = spec.visible(b, h, q.clamp(max=grid.Nq - 1), k.clamp(max=grid.Nk - 1))
        vis = (vis & in_q & in_k).expand(c.shape[0], bq, bk)
        count = vis.sum((1, 2))
        rows_in = (grid.Nq - c[:, 2] * bq).clamp(max=bq)
        cls = torch.where(count == 0, EMPTY, torch.where(count == rows_in * bk, FULL, PARTIAL)).to(torch.int8)
        classes.append(cls)
        bits.append(_pack_bits(vis))
    return torch.cat(classes), torch.cat(bits)


def _build(spec, B, H, Nq, Nk, block_q, block_k, dev) -> BlockMask:
    Bm, Hm = (B if spec.uses_batch else 1), (H if spec.uses_head else 1)
    grid = _TileGrid(Bm, Hm, Nq, Nk, block_q, block_k, dev)
    Tq, Tk = grid.Tq, grid.Tk
    shape = (Bm, Hm, Tq, Tk)
    some, every = spec._tiles(grid)
    some = torch.as_tensor(some, device=dev).expand(shape)
    every = torch.as_tensor(every, device=dev).expand(shape)
    if Nk % block_k:  # the last key tile holds keys past Nk, which no query sees: never full
        every = every & (torch.arange(Tk, device=dev) < Tk - 1)
    cls = torch.where(every, FULL, EMPTY).to(torch.int8)
    undecided = (some & ~every).nonzero()  # [P, 4] (b, h, i, j), row-major: one host synchronisation
    bits = torch.zeros((0, block_q, cdiv(block_k, 32)), dtype=torch.int32, device=dev)
    if undecided.shape[0]:
        tile_cls, tile_bits = _evaluate(spec, undecided, grid)
        cls[tuple(undecided.t())] = tile_cls
        bits = tile_bits[tile_cls == PARTIAL]  # in row-major tile order, as the slots below number them
    num_partial = bits.shape[0]
    if num_partial == 0:
        bits = torch.zeros((1, block_q, cdiv(block_k, 32)), dtype=torch.int32, device=dev)
    partial, full = cls == PARTIAL, cls == FULL
    slot = (partial.flatten().cumsum(0, dtype=torch.int32) - 1).clamp(min=0).view(shape)
    kv_num, kv_idx = _lists(partial)
    full_kv_num, full_kv_idx = _lists(full)
    q_num, q_idx = _lists(partial.transpose(-1, -2))
    full_q_num, full_q_idx = _lists(full.transpose(-1, -2))
    tensors = dict(
        kv_num_blocks=kv_num, kv_indices=kv_idx, kv_slots=slot.gather(-1, kv_idx.long()).contiguous(),
        full_kv_num_blocks=full_kv_num, full_kv_indices=full_kv_idx,
        q_num_blocks=q_num, q_indices=q_idx,
        q_slots=slot.transpose(-1, -2).gather(-1, q_idx.long()).contiguous(),
        full_q_num_blocks=full_q_num, full_q_indices=full_q_idx, partial_bits=bits.contiguous())
    return BlockMask(tensors, Nq, Nk, block_q, block_k, num_partial, spec)


__all__ = ["MaskSpec", "BlockMask", "causal", "sliding_window", "global_tokens", "document", "from_function"]
