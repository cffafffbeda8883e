"""Tile helpers shared by the GEMM kernels (tile order, a tile's column halves), and the descriptor allocator
the TMA kernels need."""
import torch
import triton
import triton.language as tl
from triton.runtime import _allocation


@triton.jit
def grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of output tile ``tile_id`` in grouped order: GROUP_M row-tiles walk down one column
    band of tiles before moving right, so a weight tile fetched from HBM is reused from L2 by GROUP_M
    programs."""
    pids_per_group = GROUP_M * num_pid_n
    group_id = tile_id // pids_per_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % pids_per_group) % group_size_m)
    pid_n = (tile_id % pids_per_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def column_halves(acc, BLOCK_M: tl.constexpr, HALF: tl.constexpr):
    """The two column halves [BLOCK_M, HALF] of a [BLOCK_M, 2 * HALF] tile: columns [0, HALF) and [HALF, 2 HALF)."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_descriptor_allocator() -> None:
    """Device-side tensor descriptors (tl.make_tensor_descriptor) need global scratch for the
    descriptors themselves, taken from the allocator triton is given. Triton keeps that allocator in a
    ContextVar, so it is set per thread: the autograd engine runs backward passes on threads of its own,
    and a user's serving or loader thread is another. Set where none is; an allocator the user set stays."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_descriptor_scratch)
