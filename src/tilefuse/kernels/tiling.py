"""Tile-order helpers shared by the GEMM kernels, and host-side helpers every launcher uses."""
import torch
import triton
import triton.language as tl


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


# Host-side integer helpers for launch paths. triton.cdiv and triton.next_power_of_2 are constexpr
# functions whose every host call costs microseconds of Python; launchers call these on every launch.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


_descriptor_allocator_set = False


def ensure_descriptor_allocator() -> None:
    """Device-side tensor descriptors (tl.make_tensor_descriptor) need global scratch for the
    descriptors themselves, taken from the allocator triton is given; set it once per process."""
    global _descriptor_allocator_set
    if not _descriptor_allocator_set:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _descriptor_allocator_set = True
