"""Rows split between several programs: the exchange of per-chunk partials through global memory.

Used by the split-row kernels (norm_split_row.py, softmax_split_row.py). SPLITS programs each hold one
chunk of a row in registers, store a two-number partial of it, and wait until the row's other programs
have stored theirs; every program then merges all the partials itself and finishes its own chunk, so
the row is read once and written once.
The wait needs all SPLITS programs resident at once: launchers size a cooperative grid
(``launch_cooperative_grid``: a grid that cannot be co-resident fails to launch instead of hanging), and
the wait is bounded, so a failed wait comes back as ``arrived == False`` (kernels poison the row with
NaN) rather than as a hung GPU. The interpreter runs programs one at a time: there SPLITS must be 1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilefuse import runtime
from tilefuse.kernels.gemm_epilogue import tile_counters

MAX_POLLS = 1 << 20  # ~1 s of polling at worst: long past any real wait, short of a hung GPU call


@triton.jit
def program_chunk(N, CHUNK, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's place: (split, row groups in the grid, its first row, column offsets of its chunk,
    their mask). Program p holds chunk p % SPLITS of rows p // SPLITS, p // SPLITS + groups, ..."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_N)
    offs = (pid % SPLITS) * CHUNK + lanes
    return pid % SPLITS, tl.num_programs(0) // SPLITS, pid // SPLITS, offs, (lanes < CHUNK) & (offs < N)


@triton.jit
def load_row_chunk(ptr, row, rows, stride, offs, mask, OTHER: tl.constexpr):
    """The chunk of ``row`` (``OTHER`` past the row's end, and everywhere when row >= rows: a prefetch past
    the last row loads nothing)."""
    row64 = (row + tl.arange(0, 1)).to(tl.int64)  # [1]: rows * stride can pass 2**31
    return tl.load(ptr + row64 * stride + offs, mask=mask & (row < rows), other=OTHER)


@triton.jit
def exchange_partials(part_ptr, count_ptr, row, row64, split, part_a, part_b, SPLITS: tl.constexpr,
                      MAX_POLLS: tl.constexpr):
    """Stores this program's (part_a, part_b) for ``row`` (row64: the same as an int64 [1] tensor), waits
    for the row's SPLITS partials, and returns (every part_a [SPLITS], every part_b [SPLITS], arrived)."""
    part = part_ptr + (row64 * SPLITS + split) * 2
    tl.store(part, part_a)
    tl.store(part + 1, part_b)
    # Arrive: the barrier and the release make this program's partial visible before its count is.
    tl.debug_barrier()
    seen = tl.atomic_add(count_ptr + row, 1, sem="acq_rel") + 1
    polls = 0
    while (seen < SPLITS) & (polls < MAX_POLLS):
        # A compare-and-swap that never matches (counts are >= 0) reads the count as a read-modify-write:
        # sm_90a PTX for an atomic add of 0 came out without the loop at all.
        seen = tl.atomic_cas(count_ptr + row, -1, -1, sem="acquire")
        polls += 1
    parts = part_ptr + (row64 * SPLITS + tl.arange(0, SPLITS)) * 2
    every_a = tl.load(parts, cache_modifier=".cg")
    every_b = tl.load(parts + 1, cache_modifier=".cg")
    return every_a, every_b, seen >= SPLITS


@triton.jit
def leave_row(count_ptr, row, SPLITS: tl.constexpr):
    """Counts this program out of ``row``: the last of the row's 2 * SPLITS counts puts the counter back
    to zero, so the counter buffer is zero before and after every launch."""
    if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == 2 * SPLITS - 1:
        tl.atomic_xchg(count_ptr + row, 0)


def split_row_launch(t: torch.Tensor, rows: int, splits: int, programs_per_sm: int):
    """(grid, partials buffer fp32 [rows, splits, 2], zeroed counters, launch options) for a split-row
    launch over ``rows`` rows of tensor ``t``'s device."""
    interpret = runtime.execution_path(t) == runtime.INTERPRETER
    if interpret and splits != 1:
        raise ValueError("the interpreter runs one program at a time: split rows need splits=1 there")
    slots = 1 if interpret else runtime.device_facts(t.device)[1] * programs_per_sm
    if splits > slots:
        raise ValueError(f"{splits} programs per row do not fit a cooperative grid of {slots}")
    groups = max(1, min(rows, slots // splits))
    parts = torch.empty((rows, splits, 2), dtype=torch.float32, device=t.device)
    options = {} if interpret else {"launch_cooperative_grid": True}
    return (groups * splits,), parts, tile_counters(t.device, rows), options
