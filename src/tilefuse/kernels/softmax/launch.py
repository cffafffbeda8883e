"""The softmax family's launch layer: the plan (one tile per row, a chunk loop, or a row split over
programs), the config spaces and tuners, and the launches, forward and backward. The row layout of a
strided tensor is found here too (rows as (outer, inner) pairs at two strides, so a softmax over a dim
that is not last needs no copy). Inputs arrive checked and non-empty (tilefuse.ops).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from tilefuse import runtime, sizes, tuning
from tilefuse.kernels import fastpath, launches
from tilefuse.kernels.softmax.kernels import (softmax_bwd_kernel, softmax_bwd_split_dot_kernel,
                                              softmax_bwd_split_write_kernel, softmax_fwd_kernel,
                                              softmax_split_stats_kernel, softmax_split_write_kernel)
from tilefuse.sizes import cdiv, next_pow2

# --------------------------------------------------------------------------------------------------
# Plans and launchers
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Caps:
    """Block-size limits. The interpreter's are tiny so rows of ~300 already take the chunk loop
    and the split-row path (its cost is per program and per op, not per element)."""
    max_block_n: int    # rows up to this many columns are one tile kept in registers
    tile: int           # target elements per program for short rows (several rows per program)
    max_tile: int       # never more elements than this in one tile (register budget)
    loop_rows: int      # rows per program in the chunk loop
    loop_block_n: int   # chunk width in the loop (GPU: autotuned around it)
    split_block_n: int  # chunk width in the split-row kernels
    min_seg: int        # shortest segment worth a program of its own
    num_sms: int


GPU_CAPS = Caps(max_block_n=16384, tile=8192, max_tile=16384, loop_rows=1, loop_block_n=4096,
                split_block_n=4096, min_seg=4096, num_sms=132)
INTERPRETER_CAPS = Caps(max_block_n=128, tile=2048, max_tile=2048, loop_rows=8, loop_block_n=64,
                        split_block_n=64, min_seg=64, num_sms=2)


@dataclass(frozen=True)
class Plan:
    mode: str           # "block" (row in registers), "loop" (chunk loop), "split" (row over programs)
    block_m: int
    block_n: int
    num_warps: int
    segments: int = 1
    seg_len: int = 0
    tuned: bool = False  # GPU: triton.autotune picks among this config and its neighbours (split: the
    #                      tiling is fixed and only algorithm="auto" is tuned)

    def describe(self) -> str:
        s = f"{self.mode} {self.block_m}x{self.block_n} w{self.num_warps}"
        return s + (f" {self.segments}x{self.seg_len}" if self.mode == "split" else "")


def _warps(tile: int) -> int:
    # ~16 fp32 values per thread: enough loads in flight per SM without spilling.
    return max(1, min(16, tile // 512))


def plan(rows: int, r_inner: int, n: int, rows_adjacent: bool, elem_size: int, caps: Caps) -> Plan:
    """Choose the tiling for R rows of N (rows_adjacent: the columns are strided but neighbouring
    rows are contiguous in memory, i.e. softmax over a dim that is not last)."""
    if rows_adjacent:
        # Tile tall in rows so each column slice is >= one 32-byte sector; as wide as fits.
        # One tile per row block when it fits max_tile, else a chunk loop at the smaller target tile
        # (the loop also holds the lane sums: twice the registers).
        bm = min(next_pow2(r_inner), 64, max(32 // elem_size, caps.tile // next_pow2(n)))
        if bm * next_pow2(n) <= caps.max_tile and n <= caps.max_block_n:
            return Plan("block", bm, next_pow2(n), _warps(bm * next_pow2(n)))
        bn = min(max(1, caps.tile // bm), caps.max_block_n // 2)
        return Plan("loop", bm, bn, _warps(bm * bn))
    if n > caps.max_block_n and rows < 2 * caps.num_sms:
        # Too few rows to fill the GPU with one program per row: split each row into segments.
        bn = caps.split_block_n
        segs = min(cdiv(4 * caps.num_sms, rows), cdiv(n, caps.min_seg))
        seg_len = cdiv(cdiv(n, segs), bn) * bn  # whole chunks: aligned 16-byte loads
        segs = cdiv(n, seg_len)
        if segs > 1:
            # Fixed tiling; on the GPU "auto" still tunes the algorithm of the stats kernel.
            return Plan("split", 1, bn, _warps(bn), segs, seg_len, tuned=caps is GPU_CAPS)
    tuned = caps is GPU_CAPS
    if n <= caps.max_block_n:
        bn = next_pow2(n)
        bm = block_rows(bn, r_inner, caps)
        return Plan("block", bm, bn, _warps(bm * bn), tuned=tuned)
    return Plan("loop", caps.loop_rows, caps.loop_block_n, _warps(caps.loop_rows * caps.loop_block_n),
                tuned=tuned)


def block_rows(block_n: int, r_inner: int, caps: Caps) -> int:
    return max(1, min(caps.tile // block_n, next_pow2(r_inner), 1024))


# Autotune (GPU only): the heuristic plan and two neighbours, keyed on power-of-two buckets.
def _block_config_space():
    return [triton.Config({"BLOCK_M": bm}, num_warps=w) for bm in (2 ** i for i in range(11))
            for w in (1, 2, 4, 8, 16)]


def _prune_block(configs, named_args, **kwargs):
    """Keep (rows, warps) of the heuristic, half its warps, and twice its rows (if the tile allows)."""
    args = {**named_args, **kwargs}
    bn, r_inner = args["BLOCK_N"], args["R_INNER"]
    bm = block_rows(bn, r_inner, GPU_CAPS)
    w = _warps(bm * bn)
    keep = {(bm, w), (bm, max(1, w // 2))}
    if 2 * bm <= next_pow2(r_inner) and 2 * bm * bn <= GPU_CAPS.max_tile:
        keep.add((2 * bm, _warps(2 * bm * bn)))
    return [c for c in configs if (c.kwargs["BLOCK_M"], c.num_warps) in keep]


# Chunk loops: the first three are the original space; LOOP_STAGES = 3 pipelines the loads, so an SM
# keeps more than one chunk in flight per row (one chunk per program at a time is ~55% of copy on the
# H200 for the norms' loop, which has the same shape).
_LOOP_CONFIGS = ([triton.Config({"BLOCK_M": 1, "BLOCK_N": bn, "LOOP_STAGES": st, "PROGRAMS_PER_SM": 0},
                                 num_warps=_warps(bn)) for st in (1, 3) for bn in (2048, 4096, 8192)]
                 # Persistent: 1-2 rows in flight per SM, so pass 2 re-reads the row from L2 (rows of
                 # 128K columns reach only ~68% of copy on the H200 with a row per program: 3 trips, not 2).
                 + [triton.Config({"BLOCK_M": 1, "BLOCK_N": bn, "LOOP_STAGES": 3, "PROGRAMS_PER_SM": p},
                                  num_warps=_warps(bn)) for bn, p in ((8192, 1), (4096, 1), (4096, 2))])
LOOP_SMEM_BUDGET = 220 * 1024


def loop_smem_bytes(cfg: triton.Config, elem_bytes: int, backward: bool) -> int:
    """Upper bound on the pipelining buffers: LOOP_STAGES - 1 copies of each chunk loaded in each loop
    (forward: up to three loops of x, for two_pass; backward: two loops of y and dy)."""
    loads = 4 if backward else 3
    return (cfg.kwargs["LOOP_STAGES"] - 1) * cfg.kwargs["BLOCK_M"] * cfg.kwargs["BLOCK_N"] * elem_bytes * loads


def _prune_loop(configs, named_args, **kwargs):
    backward = "dy_ptr" in named_args
    t = named_args["y_ptr"] if backward else named_args["x_ptr"]
    elem = t.element_size() if hasattr(t, "element_size") else 4
    return [c for c in configs if loop_smem_bytes(c, elem, backward) <= LOOP_SMEM_BUDGET] or configs[:1]

softmax_fwd_block_tuned = tuning.autotune(
    name="softmax_fwd_block",
    configs=_block_config_space(), key=["KEY_N", "KEY_R", "WIDE"],
    prune_configs_by={"early_config_prune": _prune_block})(softmax_fwd_kernel)
softmax_fwd_loop_tuned = tuning.autotune(
    name="softmax_fwd_loop",
    configs=_LOOP_CONFIGS, key=["KEY_N", "KEY_R", "ALGORITHM", "WIDE"],
    prune_configs_by={"early_config_prune": _prune_loop})(softmax_fwd_kernel)
softmax_bwd_block_tuned = tuning.autotune(
    name="softmax_bwd_block",
    configs=_block_config_space(), key=["KEY_N", "KEY_R", "WIDE"],
    prune_configs_by={"early_config_prune": _prune_block})(softmax_bwd_kernel)
softmax_bwd_loop_tuned = tuning.autotune(
    name="softmax_bwd_loop",
    configs=_LOOP_CONFIGS, key=["KEY_N", "KEY_R", "WIDE"],
    prune_configs_by={"early_config_prune": _prune_loop})(softmax_bwd_kernel)


# algorithm="auto": the algorithm is one more tuned parameter. Each chunked config is offered with
# "online" and with "two_pass" (online first: the pinned choice), so the tuner picks the faster pair
# for the key by measurement; a row held in one block reads x once either way and is offered once.
def with_both_algorithms(configs):
    return [triton.Config({**c.kwargs, "ALGORITHM": a}, num_warps=c.num_warps, num_stages=c.num_stages)
            for c in configs for a in (("online",) if c.kwargs.get("SINGLE_BLOCK") else ("online", "two_pass"))]


softmax_fwd_loop_auto = tuning.autotune(
    name="softmax_fwd_loop_auto",
    configs=with_both_algorithms(_LOOP_CONFIGS), key=["KEY_N", "KEY_R", "WIDE"],
    prune_configs_by={"early_config_prune": _prune_loop})(softmax_fwd_kernel)

# Rows of 8K-16K elements (forward): one row per program held in registers (~100 registers per thread
# at 16 warps, so one block per SM with no loads in flight while it reduces -- the norms' single pass
# ran at 56% of copy so) or the pipelined chunk loop, which re-reads the row from L2. The autotuner
# measures both. The single-block configs come first, in the block tuner's order (the pinned choice).
LONG_ROW_MIN_N = 8192


def _long_row_configs():
    single = [triton.Config({"BLOCK_M": c.kwargs["BLOCK_M"], "BLOCK_N": bn, "SINGLE_BLOCK": True,
                             "LOOP_STAGES": 1}, num_warps=c.num_warps)
              for bn in (8192, 16384) for c in _block_config_space() if c.kwargs["BLOCK_M"] <= 2]
    loop = [triton.Config({"BLOCK_M": 1, "BLOCK_N": bn, "SINGLE_BLOCK": False, "LOOP_STAGES": st},
                          num_warps=_warps(bn)) for bn in (2048, 4096) for st in (1, 3)]
    return single + loop


def _prune_long(configs, named_args, **kwargs):
    full = next_pow2(named_args["N"])
    single_kept = {(c.kwargs["BLOCK_M"], c.num_warps)
                   for c in _prune_block(_block_config_space(), {**named_args, "BLOCK_N": full})}
    elem = named_args["x_ptr"].element_size()
    keep = []
    for c in configs:
        if c.kwargs["SINGLE_BLOCK"]:
            if c.kwargs["BLOCK_N"] == full and (c.kwargs["BLOCK_M"], c.num_warps) in single_kept:
                keep.append(c)
        elif c.kwargs["BLOCK_N"] < full and loop_smem_bytes(c, elem, False) <= LOOP_SMEM_BUDGET:
            keep.append(c)
    return keep


softmax_fwd_long_tuned = tuning.autotune(
    name="softmax_fwd_long",
    configs=_long_row_configs(), key=["KEY_N", "KEY_R", "ALGORITHM", "WIDE"],
    prune_configs_by={"early_config_prune": _prune_long})(softmax_fwd_kernel)
softmax_fwd_long_auto = tuning.autotune(
    name="softmax_fwd_long_auto",
    configs=with_both_algorithms(_long_row_configs()), key=["KEY_N", "KEY_R", "WIDE"],
    prune_configs_by={"early_config_prune": _prune_long})(softmax_fwd_kernel)
# Few long rows split into segments: the stats kernel is where the algorithms differ (one read of each
# segment or two); the write kernel then follows the algorithm the stats kernel measured faster.
softmax_split_stats_auto = tuning.autotune(
    name="softmax_split_stats_auto",
    configs=[triton.Config({"ALGORITHM": a}, num_warps=_warps(GPU_CAPS.split_block_n)) for a in ("online", "two_pass")],
    key=["KEY_N", "KEY_R", "WIDE"])(softmax_split_stats_kernel)

@dataclass(frozen=True)
class RowLayout:
    """R rows of N columns, row r = (outer, inner) with R = R_OUTER * R_INNER; per tensor the strides
    (outer, inner, column). Every tensor of one launch enumerates the rows in the same order."""
    rows: int
    r_inner: int
    n: int
    strides: tuple  # one (stride_outer, stride_inner, stride_n) per tensor, in argument order

    @property
    def wide(self) -> bool:
        return any((self.n - 1) * abs(sn) >= 2 ** 31 for _, _, sn in self.strides)


def _caps(interpret: bool, device: torch.device) -> Caps:
    if interpret:
        return INTERPRETER_CAPS
    sms = runtime.device_facts(device)[1]
    return GPU_CAPS if sms == GPU_CAPS.num_sms else Caps(**{**GPU_CAPS.__dict__, "num_sms": sms})


def _plan_for(layout: RowLayout, t: torch.Tensor, interpret: bool) -> Plan:
    _, s_inner, s_n = layout.strides[0]
    rows_adjacent = s_n != 1 and s_inner == 1 and layout.r_inner > 1
    return plan(layout.rows, layout.r_inner, layout.n, rows_adjacent, t.element_size(),
                _caps(interpret, t.device))


def _flat_strides(layout: RowLayout):
    return [s for triple in layout.strides for s in triple]


def _launch_forward(x, y, layout: RowLayout, algorithm: str, interpret: bool) -> str:
    """y = softmax(x) over the layout's rows; returns a description of the config that ran.
    ``algorithm`` "auto": where the algorithms differ (rows longer than one block) and the GPU tunes,
    the faster one for the key is measured (the *_auto tuners); otherwise "online", which reads a long
    row twice instead of three times."""
    p = _plan_for(layout, x, interpret)
    R, r_inner, N = layout.rows, layout.r_inner, layout.n
    wide = layout.wide
    measured = algorithm == "auto" and p.tuned
    if algorithm == "auto" and not measured:
        algorithm = "online"
    if p.mode == "split":
        ws = torch.empty((2, R, p.segments), dtype=torch.float32, device=x.device)
        (sxo, sxi, sxn), (syo, syi, syn) = layout.strides
        grid = (p.segments, R)
        stats_args = (x, ws[0], ws[1], N, R, r_inner, p.seg_len, p.segments, sxo, sxi, sxn,
                      sizes.m_bucket(N), sizes.m_bucket(R))
        if measured:
            fastpath.launch(softmax_split_stats_auto, grid, stats_args, dict(WIDE=wide, BLOCK_N=p.block_n))
            algorithm = softmax_split_stats_auto.launched_config().kwargs["ALGORITHM"]
        else:
            fastpath.launch(softmax_split_stats_kernel, grid, stats_args,
                            dict(ALGORITHM=algorithm, WIDE=wide, BLOCK_N=p.block_n, num_warps=p.num_warps))
        fastpath.launch(softmax_split_write_kernel, grid,
                        (x, y, ws[0], ws[1], N, R, r_inner, p.seg_len, p.segments, sxo, sxi, sxn, syo, syi, syn),
                        dict(ALGORITHM=algorithm, WIDE=wide, BLOCK_N=p.block_n, BLOCK_S=next_pow2(p.segments),
                             num_warps=p.num_warps))
        return f"{'auto ' if measured else ''}{algorithm} {p.describe()}"
    n_outer = R // r_inner
    args = (x, y, N, r_inner, *_flat_strides(layout), sizes.m_bucket(N), sizes.m_bucket(r_inner), n_outer)
    if p.mode == "block" and p.tuned and p.block_n >= LONG_ROW_MIN_N:
        def grid(meta):
            return (n_outer * cdiv(r_inner, meta["BLOCK_M"]),)

        if measured:
            tuner = softmax_fwd_long_auto
            fastpath.launch(tuner, grid, args, dict(WIDE=wide))
        else:
            tuner = softmax_fwd_long_tuned
            fastpath.launch(tuner, grid, args, dict(ALGORITHM=algorithm, WIDE=wide))
        cfg = tuner.launched_config()
        k = cfg.kwargs
        how = "block" if k["SINGLE_BLOCK"] else f"loop stages {k['LOOP_STAGES']}"
        chosen = f"auto {k['ALGORITHM']}" if measured else algorithm
        return f"{chosen} {how} {k['BLOCK_M']}x{k['BLOCK_N']} w{cfg.num_warps} (tuned)"
    loop_tuned = softmax_fwd_loop_tuned
    if p.mode == "block":
        # One tile per row: both algorithms are the same single read, so compile one variant.
        algorithm = "online" if algorithm == "auto" else algorithm
        common = dict(ALGORITHM="online", SINGLE_BLOCK=True, WIDE=wide)
    elif measured:
        loop_tuned = softmax_fwd_loop_auto  # its configs carry ALGORITHM
        common = dict(SINGLE_BLOCK=False, WIDE=wide)
    else:
        common = dict(ALGORITHM=algorithm, SINGLE_BLOCK=False, WIDE=wide)
    return _launch_rows(softmax_fwd_kernel, softmax_fwd_block_tuned, loop_tuned,
                        p, args, common, n_outer, r_inner, algorithm)


def _launch_backward(y, dy, dx, layout: RowLayout, interpret: bool) -> str:
    """dx = y * (dy - sum(dy * y)) over the layout's rows."""
    p = _plan_for(layout, y, interpret)
    R, r_inner, N = layout.rows, layout.r_inner, layout.n
    wide = layout.wide
    if p.mode == "split":
        part = torch.empty((R, p.segments), dtype=torch.float32, device=y.device)
        (syo, syi, syn), (sdo, sdi, sdn), (sxo, sxi, sxn) = layout.strides
        grid = (p.segments, R)
        fastpath.launch(softmax_bwd_split_dot_kernel, grid,
                        (y, dy, part, N, R, r_inner, p.seg_len, p.segments, syo, syi, syn, sdo, sdi, sdn),
                        dict(WIDE=wide, BLOCK_N=p.block_n, num_warps=p.num_warps))
        fastpath.launch(softmax_bwd_split_write_kernel, grid,
                        (y, dy, dx, part, N, R, r_inner, p.seg_len, p.segments, syo, syi, syn, sdo, sdi, sdn,
                         sxo, sxi, sxn),
                        dict(WIDE=wide, BLOCK_N=p.block_n, BLOCK_S=next_pow2(p.segments), num_warps=p.num_warps))
        return f"backward {p.describe()}"
    n_outer = R // r_inner
    args = (y, dy, dx, N, r_inner, *_flat_strides(layout), sizes.m_bucket(N), sizes.m_bucket(r_inner),
            n_outer)
    common = dict(SINGLE_BLOCK=p.mode == "block", WIDE=wide)
    return _launch_rows(softmax_bwd_kernel, softmax_bwd_block_tuned, softmax_bwd_loop_tuned,
                        p, args, common, n_outer, r_inner, "backward")


def _launch_rows(kernel, block_tuned, loop_tuned, p: Plan, args, common, n_outer, r_inner, name):
    def grid(meta):
        tiles = n_outer * cdiv(r_inner, meta["BLOCK_M"])
        per_sm = meta.get("PROGRAMS_PER_SM", 0)
        return (min(tiles, per_sm * runtime.device_facts(args[0].device)[1]) if per_sm else tiles,)

    if p.tuned:
        if p.mode == "block":
            fastpath.launch(block_tuned, grid, args, dict(common, BLOCK_N=p.block_n))
            cfg = block_tuned.launched_config()
            return f"{name} block {cfg.kwargs['BLOCK_M']}x{p.block_n} w{cfg.num_warps} (tuned)"
        fastpath.launch(loop_tuned, grid, args, common)
        cfg = loop_tuned.launched_config()
        per_sm = cfg.kwargs.get("PROGRAMS_PER_SM", 0)
        if "ALGORITHM" in cfg.kwargs:  # a tuned algorithm ("auto") is named with the tiles
            name = f"{name} {cfg.kwargs['ALGORITHM']}"
        return (f"{name} loop 1x{cfg.kwargs['BLOCK_N']} w{cfg.num_warps} stages {cfg.kwargs['LOOP_STAGES']}"
                + (f" persistent {per_sm}/SM" if per_sm else "") + " (tuned)")
    fastpath.launch(kernel, grid, args, dict(common, BLOCK_M=p.block_m, BLOCK_N=p.block_n, num_warps=p.num_warps))
    return f"{name} {p.describe()}"


# ---- row layouts -----------------------------------------------------------------------------------
def _row_split(views: list[torch.Tensor]):
    """Rows of tensors shaped [..., N] (softmax dim moved last, a view) as (outer, inner) pairs.

    Finds the first split of the leading dims into an outer and an inner group such that, in every
    tensor, each group collapses to one stride. Returns (r_inner, ((s_outer, s_inner, s_n), ...)), or
    None when no split works for all of them (the caller then copies; rare: >3-d permuted layouts).
    """
    shape = views[0].shape
    lead = [j for j in range(len(shape) - 1) if shape[j] != 1]

    def collapses(t, dims):
        return all(t.stride(a) == shape[b] * t.stride(b) for a, b in zip(dims, dims[1:]))

    for k in range(len(lead) + 1):
        outer, inner = lead[:k], lead[k:]
        if all(collapses(t, outer) and collapses(t, inner) for t in views):
            strides = tuple((t.stride(outer[-1]) if outer else 0, t.stride(inner[-1]) if inner else 0,
                             t.stride(-1)) for t in views)
            return math.prod(shape[j] for j in inner), strides
    return None


def row_layout(tensors, dim: int) -> RowLayout | None:
    """The common row layout of ``tensors`` (one shape) for a softmax over ``dim``, or None."""
    views = [t.movedim(dim, -1) for t in tensors]
    found = _row_split(views)
    if found is None:
        return None
    r_inner, strides = found
    n = views[0].shape[-1]
    return RowLayout(rows=views[0].numel() // n, r_inner=r_inner, n=n, strides=strides)


# ---- entries ---------------------------------------------------------------------------------------
_FORWARD = fastpath.Plans("softmax")
_BACKWARD = fastpath.Plans("softmax_backward")


def forward(x, dim: int, algorithm: str, path) -> torch.Tensor:
    """softmax over ``dim`` (non-negative) of a non-empty x with at least one dim; the result is laid
    out as ``torch.empty_like(x)`` (x's strides when x is dense)."""
    mode = runtime.backend()
    return _FORWARD.run((x,), (dim, algorithm, mode), lambda: _forward_chosen(x, dim, algorithm, path, mode))


def _forward_chosen(x, dim, algorithm, path, mode):
    def run(candidate):
        if candidate == TORCH:
            return fastpath.vendor(_forward_torch, x, dim, path)
        return _forward(x, dim, algorithm, path)

    return fastpath.run_chosen(FORWARD_CHOICE, mode, CANDIDATES, lambda: _choice_key(x, dim), x.device, run)


def _forward(x, dim, algorithm, path):
    y = torch.empty_like(x)
    interpret = path == runtime.INTERPRETER
    layout = row_layout([x, y], dim)
    if layout is not None:
        how = _launch_forward(x, y, layout, algorithm, interpret)
    else:
        # No two row strides address x (e.g. a 4-d tensor permuted twice): compute on a contiguous copy.
        xc = x.contiguous()
        yc = torch.empty_like(xc)
        how = _launch_forward(xc, yc, row_layout([xc, yc], dim), algorithm, interpret)
        y.copy_(yc)
    launches.record("softmax", path, "", how)
    return y


def backward(y, dy, dim: int, path) -> torch.Tensor:
    """dx = y * (dy - sum(dy * y)) over ``dim``; dx laid out as ``torch.empty_like(y)``."""
    mode = runtime.backend()
    return _BACKWARD.run((y, dy), (dim, mode), lambda: _backward_chosen(y, dy, dim, path, mode))


def _backward_chosen(y, dy, dim, path, mode):
    def run(candidate):
        return fastpath.vendor(_backward_torch, y, dy, dim, path) if candidate == TORCH else _backward(y, dy, dim, path)

    return fastpath.run_chosen(BACKWARD_CHOICE, mode, CANDIDATES, lambda: _choice_key(y, dim), y.device, run)


def _backward(y, dy, dim, path):
    dx = torch.empty_like(y)
    interpret = path == runtime.INTERPRETER
    layout = row_layout([y, dy, dx], dim)
    if layout is not None:
        how = _launch_backward(y, dy, dx, layout, interpret)
    else:
        yc, dyc = y.contiguous(), dy.contiguous()
        dxc = torch.empty_like(yc)
        how = _launch_backward(yc, dyc, dxc, row_layout([yc, dyc, dxc], dim), interpret)
        dx.copy_(dxc)
    launches.record("softmax_backward", path, "", how)
    return dx


# ---- torch's kernels, the vendor candidate -----------------------------------------------------------
TORCH = "torch"
CANDIDATES = (tuning.TILEFUSE, TORCH)
FORWARD_CHOICE = tuning.BackendChoice("softmax_forward_backend", CANDIDATES)
BACKWARD_CHOICE = tuning.BackendChoice("softmax_backward_backend", CANDIDATES)


def _choice_key(x, dim: int):
    n = x.shape[dim]
    return tuning.ChoiceKey(N=n, ROWS_BUCKET=sizes.m_bucket(x.numel() // n), LAST_DIM=dim == x.dim() - 1,
                            dtype=x.dtype)


def _dense(t) -> bool:
    """Whether t's elements fill one block of memory without overlap, in some order of its dims: then
    ``torch.empty_like(t)`` keeps t's strides (otherwise it is contiguous)."""
    expected = 1
    for d in sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=t.stride):
        if t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def _like(t, out):
    """``out`` laid out as ``torch.empty_like(t)`` (the launch contract), copied only when torch's differs."""
    if out.stride() == t.stride() or not _dense(t):
        return out
    return torch.empty_like(t).copy_(out)


def _forward_torch(x, dim, path):
    launches.record("softmax", path, TORCH, "aten._softmax")
    return _like(x, torch.ops.aten._softmax(x, dim, False))


def _backward_torch(y, dy, dim, path):
    launches.record("softmax_backward", path, TORCH, "aten._softmax_backward_data")
    return _like(y, torch.ops.aten._softmax_backward_data(dy, y, dim, y.dtype))
