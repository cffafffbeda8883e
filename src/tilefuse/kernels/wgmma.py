"""Layouts of Hopper's warpgroup MMA for the Gluon kernels: each consumer partition is one warpgroup (4 warps)
issuing wgmma on 64-row tiles."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.constexpr_function
def accumulator_layout(cols):
    """The register layout of a [64, cols] fp32 wgmma result held by one warpgroup."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])


@gluon.constexpr_function
def register_operand_layout(acc_layout):
    """The layout of a 16-bit A operand in registers for a wgmma into ``acc_layout``."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
