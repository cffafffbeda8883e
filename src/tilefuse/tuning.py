"""Tile configurations: the fixed interpreter config and the small GPU autotune spaces.

Autotuning never runs under the Triton interpreter (it would time Python, not the GPU, and take
minutes); the interpreter uses ``INTERPRETER_GEMM`` -- large tiles, because the interpreter's cost is
per program, not per element.
"""
from __future__ import annotations

import os

import triton

def autotune_enabled() -> bool:
    """``TILEFUSE_AUTOTUNE=0`` pins each kernel to its first (pruned) config: the GPU test run uses it so
    hundreds of small test shapes do not each benchmark a config space. Read once, at import."""
    return os.environ.get("TILEFUSE_AUTOTUNE", "1") != "0"


def autotune(configs, key, prune_configs_by=None, **kwargs):
    """``triton.autotune`` for every tilefuse kernel, honouring ``TILEFUSE_AUTOTUNE=0``."""
    if not autotune_enabled():
        inner = (prune_configs_by or {}).get("early_config_prune")
        if inner is None:
            configs, prune_configs_by = configs[:1], None
        else:
            def first_only(cfgs, named_args, **kw):
                return list(inner(cfgs, named_args, **kw))[:1]
            prune_configs_by = {**prune_configs_by, "early_config_prune": first_only}
    return triton.autotune(configs=configs, key=key, prune_configs_by=prune_configs_by, **kwargs)


INTERPRETER_GEMM = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8)


def _gemm_config(bm, bn, bk, warps, stages, group=8):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group),
                         num_warps=warps, num_stages=stages)


# Portable GEMM space: a few shapes that cover large square-ish problems (128x256), mid-size (128x128)
# and skinny M (64xN). Configs that do not fit in shared memory for fp32 are dropped by the autotuner
# (OutOfResources) rather than listed per dtype.
PORTABLE_GEMM_CONFIGS = [
    _gemm_config(128, 256, 64, 8, 3),
    _gemm_config(256, 128, 64, 8, 3),
    _gemm_config(128, 128, 64, 8, 4),
    _gemm_config(128, 128, 32, 4, 4),
    _gemm_config(64, 128, 64, 4, 4),
    _gemm_config(64, 64, 64, 4, 4),
    _gemm_config(32, 64, 32, 4, 4),
]


def m_bucket(m: int) -> int:
    """Autotune key for the row count: the next power of two, so a new batch size rarely retunes."""
    return 1 << max(0, (m - 1).bit_length()) if m > 0 else 0


def describe(config) -> str:
    """One-line text of a triton.Config or a kwargs dict, for reports."""
    if config is None:
        return "n/a"
    if isinstance(config, dict):
        kw, extra = config, ""
    else:
        kw, extra = config.kwargs, f" w{config.num_warps} s{config.num_stages}"
    tile = "x".join(str(kw[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if k in kw)
    flags = "".join(f" {name}" for key, name in (("WARP_SPECIALIZE", "ws"), ("EPILOGUE_SUBTILE", "subtile"))
                    if kw.get(key))
    return f"{tile}{extra}{flags}"


# Hopper TMA persistent GEMM space (kernels/gemm_tma.py), as dicts so benchmarks can pin one.
# 128x256x64 with 3 stages is the classic Hopper bf16 shape (two consumer warpgroups of 64 rows);
# 128x128 serves mid-size N; 64-row tiles serve small M (wgmma's minimum M is 64).
TMA_GEMM_CONFIGS = [
    dict(bm=128, bn=256, bk=64, stages=3, warps=8),
    dict(bm=128, bn=128, bk=64, stages=4, warps=8),
    dict(bm=128, bn=128, bk=64, stages=4, warps=4),
    dict(bm=64, bn=128, bk=64, stages=4, warps=4),
    dict(bm=64, bn=256, bk=64, stages=4, warps=4),
]
