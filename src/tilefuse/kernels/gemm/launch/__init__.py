"""The GEMM family's launch layer: the one place that decides which GEMM kernel runs, with which config, grid and
K split, for every GEMM-shaped op. One module per op over one module of shared rules:

- forward.py: tilefuse.linear (and the forward kernels the gated form and layer_norm_linear share)
- gated.py: the gated forward (SwiGLU / GeGLU)
- norm.py: layer_norm_linear
- backward.py: the linear backward, plain and gated
- loss.py: linear_cross_entropy (the LM-head loss), forward, backward and the training form
- qkv.py: the QKV projection into head layout, with RoPE and QK-norm
- fp8.py: FP8 (e4m3) Linear and the row quantizer
- rules.py: which kernels take which operands, row addressing, split-K and its buffers

The switches that turn a form off live in kernels/switches.py (``switches.gemm``), read on every full call and
seen by the fast path's plans. What runs where:

- Hopper (sm_90+), 16-bit operands, TMA-able layouts (unit inner strides, 16-byte-aligned rows and
  bases): the persistent TMA kernel (tma.py); layer_norm_linear there folds gamma into a copy of the
  weight, takes the rows' statistics from the norms family's pre-pass and lets the TMA GEMM normalize in its
  epilogue. The gated forward without slopes (inference) on
  sm_90 with at least one output tile per SM: the cooperative warp-specialized Gluon kernel (coop.py,
  ``coop_gated``).
- Small M (decode, M <= 64 with K >= 1024): with 16-bit operands, N wide enough for a wave of its 32-column
  programs and no slopes or gate, the decode kernel (decode.py: the weight read once, no K split); otherwise
  the portable kernel with K split over programs, reduced in the same launch (portable.py, SPLIT_K).
- Everything else, and the interpreter: the portable kernel; layer_norm_linear with a statistics
  pre-pass (the norms family's kernel) and normalization in the GEMM's prologue (norm_prologue.py).
- FP8 (e4m3) linear (``linear_fp8``): a 16/32-bit x is first quantized per row by the row quantizer
  (fp8.py, ``quantize_rows``, also what quantizes a weight per output channel); then on Hopper with TMA-able
  operands (K % 16 == 0, 16-byte output rows) the persistent FP8 TMA kernel, else the masked pointer kernel
  (Ada, odd shapes, the interpreter). Inference only: no slopes, no vendor candidate.
- Training: every forward entry takes ``save_slope`` and then also returns the activation's slope(s)
  ``act'(pre)`` its kernel stored (backward.py says why the slope, not the pre-activation); the backward
  entry runs the two backward GEMMs (backward.py), which make ``g = dy * slope`` in their operand loads: dW
  as a persistent TMA kernel on Hopper (16-bit, TMA-able operands), the tuned pointer kernels otherwise. With a
  slope, not gated, on sm_90, dx and dW (+ db) each take the cooperative warp-specialized Gluon kernel
  (coop.py) where it measured faster (``coop_backward``: enough output tiles for the SMs and a reduction of
  2048 or more; dW in the weight's row-major layout).

Each entry allocates its output, records what ran (kernels/launches.py) and goes through the family's fast path
(kernels/fastpath.py). Inputs arrive checked and non-empty (tilefuse.ops). The entries are re-exported here, the
surface tilefuse.ops calls.
"""
from tilefuse.kernels.gemm.launch.backward import linear_backward
from tilefuse.kernels.gemm.launch.forward import linear
from tilefuse.kernels.gemm.launch.fp8 import linear_fp8, quantize_rows
from tilefuse.kernels.gemm.launch.gated import gated_linear
from tilefuse.kernels.gemm.launch.loss import (linear_cross_entropy, linear_cross_entropy_backward,
                                               linear_cross_entropy_with_grads)
from tilefuse.kernels.gemm.launch.norm import layer_norm_linear
from tilefuse.kernels.gemm.launch.qkv import qkv_projection

__all__ = ["gated_linear", "layer_norm_linear", "linear", "linear_backward", "linear_cross_entropy",
           "linear_cross_entropy_backward", "linear_cross_entropy_with_grads", "linear_fp8", "qkv_projection",
           "quantize_rows"]
