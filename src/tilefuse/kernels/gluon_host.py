"""Host-side TMA descriptors for the Gluon kernels (kernels/attention/ws.py): a tensor's view in tiles
of ``block_shape``, in the shared layout wgmma reads without bank conflicts."""
from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@functools.lru_cache(maxsize=None)
def tile_layout(block_shape: tuple, dtype: torch.dtype):
    """The NVMMA shared layout of one tile. Cached: building one is a constexpr_function call of ~10 us of
    Python, and a launch needs one per descriptor."""
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), _GL_DTYPES[dtype])


def host_descriptor(t: torch.Tensor, block_shape: tuple) -> TensorDescriptor:
    """``t`` (fp16/bf16, TMA-able: checked by the caller) in tiles of ``block_shape``."""
    return TensorDescriptor(t, t.shape, t.stride(), list(block_shape), tile_layout(block_shape, t.dtype))
