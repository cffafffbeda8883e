"""A minimal sm_90a reproducer of the Triton pipelining hazard that broke layer_norm_linear (session 5),
for an upstream report and for telling when a Triton upgrade fixes it. Needs no GPU.

A TMA-loaded tile that feeds an async wgmma from shared memory AND is read into registers gets a ring
one buffer shorter than a tile with the wgmma as its only consumer. The load for step i + stages - 1
then refills the buffer that step i's wgmma may still be reading (its wait is `pendings = 1`).

Prints, per variant, each loaded operand's ring size from the TTGIR ("x" is the one also summed in
registers in the "dot + register read" variant).
Run: PYTHONPATH=src python benchmarks/triton_ring_hazard.py [STAGES]
"""
import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # a JITFunction, not an interpreter object, must compile

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


@triton.jit
def ring_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, READ_X: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr):
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    off_m = tl.program_id(0) * BM
    off_n = tl.program_id(1) * BN
    acc = tl.zeros((BM, BN), tl.float32)
    row_sq = tl.zeros((BM,), tl.float32)
    for k in range(0, K, BK):
        x = x_desc.load([off_m, k])
        w = w_desc.load([off_n, k])
        acc = tl.dot(x, w.T, acc)
        if READ_X:  # the second consumer: the tile in registers
            xf = x.to(tl.float32)
            row_sq += tl.sum(xf * xf, axis=1)
    offs_m = off_m + tl.arange(0, BM)
    offs_n = off_n + tl.arange(0, BN)
    tl.store(s_ptr + offs_m, row_sq, mask=offs_m < M)
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def rings(read_x: bool, stages: int) -> dict:
    consts = dict(READ_X=read_x, BM=128, BN=128, BK=64)
    sig = dict(x_ptr="*bf16", w_ptr="*bf16", s_ptr="*fp32", y_ptr="*bf16", M="i32", N="i32", K="i32",
               **{k: "constexpr" for k in consts})
    fn = ring_kernel
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]]
                           for k in ("x_ptr", "w_ptr", "s_ptr", "y_ptr", "M", "N", "K")})
    ttgir = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=8, num_stages=stages)).asm["ttgir"]
    # The operand rings: `%x = ttg.local_alloc : () -> !ttg.memdesc<RxBMxBK...` (named after the loaded value).
    found = dict(re.findall(r"%(x|w)\w* = ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x", ttgir))
    waits = sorted(set(int(p) for p in re.findall(r"warp_group_dot_wait [^\n]*pendings = (\d+)", ttgir)))
    return {"x_ring": int(found.get("x", 0)), "w_ring": int(found.get("w", 0)), "dot_wait_pendings": waits}


def main(stages: int = 3):
    for read_x in (False, True):
        row = {"variant": "dot + register read" if read_x else "dot only", "num_stages": stages,
               "triton": triton.__version__, **rings(read_x, stages)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
