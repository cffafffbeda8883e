"""The rules every GEMM-shaped op of the launch layer shares: which kernels can take which operands (TMA, the
cooperative Gluon GEMM), how rows are addressed without copying, the split-K decision and its buffers, and the
elementwise pass grid of the vendor compositions. Which of those forms an op takes is its own module's choice;
the switches that turn forms off live in kernels/switches.py."""
from __future__ import annotations

import torch

from tilefuse import runtime, sizes
from tilefuse.kernels import fastpath, switches
from tilefuse.kernels.gemm import coop
from tilefuse.sizes import cdiv


def split_k_for(M: int, N: int, K: int, num_sms: int) -> int:
    """How many K slices for a small-M GEMM: enough programs for ~2 waves (with 64-wide column tiles),
    each slice still >= 512 deep. 1 (no split) above 64 rows, where the M x N tiles fill the GPU."""
    if M > 64 or K < 1024:
        return 1
    tiles = cdiv(M, 64) * cdiv(N, 64)
    return max(1, min(16, cdiv(2 * num_sms, tiles), K // 512))


def split_k_slices(M: int, N: int, K: int, path: str, device) -> int:
    """K slices on the compiled path (:func:`split_k_for`); 1 elsewhere. Tests force a split here."""
    if path != runtime.COMPILED:
        return 1
    return split_k_for(M, N, K, runtime.device_facts(device)[1])


def tma_device(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a GPU with TMA (sm_90+)."""
    return t.is_cuda and runtime.device_facts(t.device)[0] >= 9


def tma_supported(x2d: torch.Tensor, *others: torch.Tensor) -> bool:
    """TMA needs unit inner strides, 16-byte-aligned row strides and base addresses, on sm_90+."""
    if not tma_device(x2d):
        return False
    s = x2d.element_size()
    for t in (x2d, *others):
        if t.stride(-1) != 1 or (t.stride(0) * s) % 16 or t.data_ptr() % 16:
            return False
    return True


def hopper_tma(x2d: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the Hopper TMA kernels (tiles sized for sm_90's 227 KB of shared memory) take these operands:
    16-bit, TMA-able (``tma_supported``), on an sm_90 GPU."""
    return x2d.dtype != torch.float32 and tma_supported(x2d, *others) and runtime.device_facts(x2d.device)[0] == 9


# The backward's cooperative GEMM has one CTA per SM walking whole output tiles, each over the whole reduction
# (no split): with fewer tiles than SMs some SMs idle, and over a short reduction a tile's ring fill, drain and
# epilogue weigh more than its few K steps. Measured: dx slower with half the SMs' worth of tiles, dW slower over
# short reductions but faster with half an SM's worth of tiles over long ones (dW's own reduction runs 8-16k
# rows deep there); with these minimums it measured faster on every shape.
COOP_MIN_REDUCTION = 2048
COOP_MIN_TILES_PER_SM = {"dx": 1.0, "dW": 0.5}


def coop_operands(path: str, *tensors: torch.Tensor) -> bool:
    """Whether the cooperative kernel can take these 2-D operands and output: the compiled path, one 16-bit
    dtype, ``hopper_tma`` (sm_90, unit inner strides, 16-byte-aligned rows and bases) and dense rows (a row
    stride at least the row's length: no broadcast or overlapping rows under its TMA boxes)."""
    t0 = tensors[0]
    return (path == runtime.COMPILED and t0.dtype in (torch.float16, torch.bfloat16)
            and all(t.dtype == t0.dtype and t.stride(0) >= t.shape[1] for t in tensors) and hopper_tma(*tensors))


def coop_backward(c: torch.Tensor, a: torch.Tensor, s, b: torch.Tensor, path: str, gemm: str) -> bool:
    """Whether one backward GEMM runs the cooperative kernel: dx [M, K] = g @ W (``b`` = W [N, K]) or
    dW [N, K] = g^T @ x (``b`` = x [M, K]), g = a * s (``a`` = dy [M, N], ``s`` the slope or None), into ``c``.
    Taken with switches.gemm.COOP_BACKWARD, a slope (without one, today's kernels: not measured), ``coop_operands`` of all
    four as laid out -- so W row-major for dx, and dW only in the weight's row-major [N, K] layout (a Conv1D
    weight's dW^T stays on the TMA kernel) -- and where it measured faster: output tiles (``coop.output_tiles``
    at switches.gemm.COOP_BACKWARD_CONFIG) at least COOP_MIN_TILES_PER_SM[gemm] ("dx" or "dW") times the SM count and a
    reduction (``b``'s rows) of at least COOP_MIN_REDUCTION."""
    if not switches.gemm.COOP_BACKWARD or s is None or not coop_operands(path, c, a, s, b):
        return False
    tiles = coop.output_tiles(c.shape[0], c.shape[1], switches.gemm.COOP_BACKWARD_CONFIG)
    return (tiles >= COOP_MIN_TILES_PER_SM[gemm] * runtime.device_facts(c.device)[1]
            and b.shape[0] >= COOP_MIN_REDUCTION)


def coop_gated_dx(dx2d, dy2d, s_gate, s_up, w_gate, w_up, path: str) -> bool:
    """Whether the gated dx runs the cooperative kernel's GATED_DX form: switches.gemm.COOP_GATED_DX, the plain dx's rule
    (``coop_backward``) for the gate's product, and the up branch's slope and weight TMA-able alike."""
    return (switches.gemm.COOP_GATED_DX and coop_backward(dx2d, dy2d, s_gate, w_gate, path, "dx")
            and coop_operands(path, dx2d, s_up, w_up))


def coop_gated(x2d: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, y2d: torch.Tensor, save_slope: bool,
               path: str) -> bool:
    """Whether the gated forward y2d = glu(x2d @ w_gate^T + b_gate, x2d @ w_up^T + b_up) runs the cooperative
    kernel: switches.gemm.COOP_GATED, no slopes to store (the kernel has no slope outputs, so a training forward keeps the
    TMA kernel), ``coop_operands`` of x2d, both weights ([N, K] as nn.Linear keeps them) and y2d, and at least
    one output tile per SM at switches.gemm.COOP_GATED_CONFIG (it measured faster than the TMA gated kernel at prefill-sized
    M; with fewer tiles than SMs the TMA kernel keeps it)."""
    if not switches.gemm.COOP_GATED or save_slope or not coop_operands(path, y2d, x2d, w_gate, w_up):
        return False
    return coop.output_tiles(*y2d.shape, switches.gemm.COOP_GATED_CONFIG) >= runtime.device_facts(y2d.device)[1]


def row_addressing(x: torch.Tensor):
    """The rows of x[..., K] as (outer, inner) with two strides, without copying when possible.

    Returns (x_view, m_inner, stride_outer, stride_inner, stride_k). Leading dims are merged while they
    are mutually contiguous; if more than two groups remain, x is copied (rare: a >3-D tensor permuted
    in several leading dims).
    """
    K = x.shape[-1]
    groups: list[list[int]] = []  # [size, stride]; size-1 dims dropped, contiguous neighbours merged
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        if size == 1:
            continue
        if groups and groups[-1][1] == size * stride:
            groups[-1] = [groups[-1][0] * size, stride]
        else:
            groups.append([size, stride])
    if len(groups) > 2:
        x = x.contiguous()
        groups = [[x.numel() // max(K, 1), K]]
    if not groups:
        groups = [[1, K]]
    if len(groups) == 1:
        (m, s), = groups
        return x, max(m, 1), 0, s, x.stride(-1)
    (mo, so), (mi, si) = groups
    return x, mi, so, si, x.stride(-1)


MIN_TILE = 16  # no config tiles M or N finer (tl.dot needs 16): bounds the number of output tiles
_COUNTERS: dict = {}
_WORKSPACES: dict = {}


def split_k_workspace(device: torch.device, shape: tuple, stream: int) -> torch.Tensor:
    """The fp32 partial sums of a split-K launch, ``shape`` (slices, M, N): one buffer per (device, stream,
    shape), kept for the process (the fast path replays its address). Launches on one stream run in
    order and each writes every partial it reads, so they can share it; two streams must not."""
    key = (device.index, stream, shape)
    buf = _WORKSPACES.get(key)
    if buf is None:
        buf = _WORKSPACES[key] = fastpath.persistent(torch.empty(shape, dtype=torch.float32, device=device))
    return buf


def tile_counters(device: torch.device, tiles: int, stream: int) -> torch.Tensor:
    """Zeroed int32 split-K arrival counters, one per output tile, kept per (device, stream) for the
    process: every launch leaves them at zero again, so one zeroing serves all later launches; two
    streams running split-K at once must not share them."""
    key = (device.index, stream, max(1024, sizes.next_pow2(tiles)))
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = _COUNTERS[key] = fastpath.persistent(torch.zeros(key[2], dtype=torch.int32, device=device))
    return buf


def stream_handle(device: torch.device) -> int:
    """The current stream's handle on ``device`` (0 off the GPU): Triton's own getter, a fraction of
    ``torch.cuda.current_stream``'s host cost."""
    if device.type != "cuda":
        return 0
    from triton.runtime.driver import driver
    return driver.active.get_current_stream(device.index if device.index is not None else torch.cuda.current_device())


def training_field(save_slope: bool) -> dict:
    """The choice key's field for a training forward (the slopes stored too: its candidates' times differ from
    inference's); none for inference, whose keys the shipped tables hold as they are."""
    return {"TRAINING": True} if save_slope else {}


CUBLAS = "cublas"  # F.linear (bias in cuBLAS's epilogue), then torch's activation kernel in place on y


GATE_TILE = dict(BLOCK_M=8, BLOCK_N=256, num_warps=4)
GATE_INTERPRETER_TILE = dict(BLOCK_M=32, BLOCK_N=128)


def pass_grid(M: int, N: int, path) -> tuple[tuple, dict]:
    """(grid, tile) of an elementwise pass of gate.py over [M, N] rows."""
    tile = GATE_INTERPRETER_TILE if path == runtime.INTERPRETER else GATE_TILE
    return (cdiv(M, tile["BLOCK_M"]), cdiv(N, tile["BLOCK_N"])), tile


def fp8_tma_operands(x2d: torch.Tensor, w: torch.Tensor, y2d: torch.Tensor) -> bool:
    """Whether the FP8 TMA kernel takes x2d [M, K] and w [N, K] (e4m3) and y2d [M, N]: a TMA device of sm_90
    (the configs are sized for its shared memory) and each tensor with a unit inner stride, dense rows (a row
    stride at least the row's length: no overlapping rows under a TMA box), a row stride of a multiple of 16
    bytes (e4m3 rows: K % 16 == 0) and a 16-byte-aligned base."""
    if not tma_device(x2d) or runtime.device_facts(x2d.device)[0] != 9:
        return False
    return all(t.stride(-1) == 1 and t.stride(0) >= t.shape[1] and (t.stride(0) * t.element_size()) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in (x2d, w, y2d))


def persistent_grid(M: int, N: int, num_sms: int):
    """The grid of a persistent TMA kernel over [M, N] output tiles: one program per SM, fewer for fewer tiles."""
    def grid(meta):
        return (min(num_sms, cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])),)
    return grid


def launch_persistent_tma(kernel, tuned, cfg, grid, args, common: dict):
    """A persistent TMA GEMM: pinned at ``cfg`` (a triton.Config, its kwargs and warps/stages), or with None
    through its tuner ``tuned``. Returns the config used."""
    if cfg is not None:
        fastpath.launch(kernel, grid(cfg.kwargs), args,
                        dict(common, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        return cfg
    fastpath.launch(tuned, grid, args, common)
    return tuned.launched_config()
