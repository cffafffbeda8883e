"""Block-sparse attention (tilefuse.attention(block_mask=...)) beside torch's FlexAttention, compiled, with the same
masks; and the block masks' build times.

Rows (B1 H16 N32768 d128 bf16, forward and forward+backward, triton.testing.do_bench medians):
- window: causal & sliding_window(1024, 0) (query i sees keys i-1024..i) -- tilefuse block_mask (a band: the op
  runs it on the windowed kernels), the same block mask held on the block-sparse kernels, Flex, and
  tilefuse.attention(causal=True, window=(1024, 0)) (the windowed kernels called directly);
- window_global: that | global_tokens(64) -- tilefuse block_mask and Flex;
- document: 16 packed documents, causal inside each (document(ids) & causal()) -- tilefuse block_mask and Flex.
TFLOP/s count visible (query, key) pairs only: 4 * d per pair forward, 2.5 times that more for the backward
(FlashAttention's convention); ``frac_gemm`` is that over a bf16 GEMM ceiling measured in the same run.
``vs_flex``: Flex's time over this row's (> 1: faster than Flex).
Build rows: tilefuse's ``spec.build`` and Flex's ``create_block_mask`` at N = 131072 (128 x 128 tiles), ms.
Accuracy rows: rel-L2 and max-abs of each implementation's output against a float64 reference with the dense mask
at N = 2048 (H 2).

    PYTHONPATH=src python benchmarks/block_sparse.py [--n 32768] [--no-flex] [--no-backward] [--cases window,...]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

B, H, D = 1, 16, 128
WINDOW, GLOBAL, DOCS = 1024, 64, 16
BUILD_N = 131072
ACC_N, ACC_H = 2048, 2
BWD_FACTOR = 2.5  # backward FLOPs over forward FLOPs (five matmuls against two)


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def doc_ids(n: int, docs: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(docs)
    cuts = torch.sort(torch.randperm(n - 1, generator=g)[: docs - 1] + 1).values
    ids = torch.zeros(n, dtype=torch.int32)
    ids[cuts] = 1
    return ids.cumsum(0, dtype=torch.int32).to(device)


def mask_spec(name: str, n: int, device):
    from tilefuse import masks

    band = masks.causal() & masks.sliding_window(WINDOW, 0)
    if name == "window":
        return band
    if name == "window_global":
        return band | masks.global_tokens(GLOBAL)
    if name == "document":
        return masks.document(doc_ids(n, DOCS, device)) & masks.causal()
    raise ValueError(name)


def flex_block_mask(spec, n: int, device):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return spec.visible(b, h, q_idx, kv_idx)
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device=device)


def bench(fn) -> float:
    import triton

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def gemm_ceiling_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    return 2 * 8192 ** 3 / ms / 1e9


def generic_block_sparse(q, k, v, bm):
    """tilefuse.attention(block_mask=bm) on the block-sparse kernels even where the mask is a band (which the
    op otherwise runs on the windowed kernels: ops.attention.BAND_MASKS_AS_WINDOWS)."""
    import tilefuse
    from tilefuse.ops import attention as ops_attention

    saved, ops_attention.BAND_MASKS_AS_WINDOWS = ops_attention.BAND_MASKS_AS_WINDOWS, False
    try:
        return tilefuse.attention(q, k, v, block_mask=bm)
    finally:
        ops_attention.BAND_MASKS_AS_WINDOWS = saved


def speed_rows(name: str, n: int, flex: bool, backward: bool, ceiling: float) -> None:
    import tilefuse
    from torch.nn.attention.flex_attention import flex_attention

    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(n + len(name))
    q, k, v, do = (torch.randn(B, H, n, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    spec = mask_spec(name, n, dev)
    bm = spec.build(B, H, n, n, dev)
    visible = bm.visible_count(B, H)
    fwd_flops = 4.0 * D * visible
    impls = {"tilefuse.block_mask": lambda q, k, v: tilefuse.attention(q, k, v, block_mask=bm)}
    if name == "window":
        impls["tilefuse.window"] = lambda q, k, v: tilefuse.attention(q, k, v, causal=True, window=(WINDOW, 0))
        impls["tilefuse.block_sparse_kernels"] = lambda q, k, v: generic_block_sparse(q, k, v, bm)
    if flex:
        torch._dynamo.reset()
        fbm = flex_block_mask(spec, n, dev)
        compiled = torch.compile(flex_attention, dynamic=False)
        impls["flex_attention"] = lambda q, k, v: compiled(q, k, v, block_mask=fbm)
    passes = ["fwd"] + (["fwd+bwd"] if backward else [])
    for what in passes:
        times = {}
        for impl, fn in impls.items():
            if what == "fwd":
                def run(fn=fn):
                    with torch.no_grad():
                        fn(q, k, v)
            else:
                leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

                def run(fn=fn, leaves=leaves):
                    torch.autograd.backward(fn(*leaves), do)
            try:
                times[impl] = bench(run)
            except Exception as e:  # an implementation failing on a shape is reported, not dropped
                times[impl] = f"failed: {type(e).__name__}: {str(e)[:200]}"
        flops = fwd_flops * (1 + (BWD_FACTOR if what == "fwd+bwd" else 0))
        for impl, ms in times.items():
            row = {"case": name, "impl": impl, "pass": what}
            row.update(B=B, H=H, N=n, d=D, dtype="bf16",
                       visible_frac=round(visible / (B * H * n * n), 5))
            if isinstance(ms, float):
                tflops = flops / ms / 1e9
                row.update(ms=round(ms, 4), tflops=round(tflops, 1), frac_gemm=round(tflops / ceiling, 3))
                flex_ms = times.get("flex_attention")
                if isinstance(flex_ms, float):
                    row["vs_flex"] = round(flex_ms / ms, 3)
            else:
                row["error"] = ms
            emit(row)


def build_rows(flex: bool) -> None:
    dev = torch.device("cuda")
    for name in ("window", "window_global", "document"):
        spec = mask_spec(name, BUILD_N, dev)
        ms = bench(lambda: spec.build(B, H, BUILD_N, BUILD_N, dev))
        bm = spec.build(B, H, BUILD_N, BUILD_N, dev)
        row = dict(case=name, impl="tilefuse.build", N=BUILD_N, ms=round(ms, 3), partial_tiles=bm.num_partial,
                   full_tiles=int(bm.full_kv_num_blocks.sum()))
        if flex:
            try:
                row["flex_create_block_mask_ms"] = round(bench(lambda: flex_block_mask(spec, BUILD_N, dev)), 3)
            except Exception as e:
                row["flex_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        emit(row)


def accuracy_rows(flex: bool) -> None:
    import tilefuse
    from tilefuse.reference import attention as ref_attention
    from torch.nn.attention.flex_attention import flex_attention

    dev = torch.device("cuda")
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    for name in ("window", "window_global", "document"):
        spec = mask_spec(name, ACC_N, dev)
        gen = torch.Generator(device="cuda").manual_seed(7)
        q, k, v = (torch.randn(1, ACC_H, ACC_N, D, device=dev, generator=gen) for _ in range(3))
        dense = spec.dense(1, ACC_H, ACC_N, ACC_N, dev)
        ref, _ = ref_attention.attend(q.double(), k.double(), v.double(), dense, D ** -0.5, 0, -1, -1)
        outs = {}
        for dtype in (torch.float32, torch.bfloat16):
            qd, kd, vd = (t.to(dtype) for t in (q, k, v))
            bm = spec.build(1, ACC_H, ACC_N, ACC_N, dev)
            outs[f"tilefuse.block_mask {dtype}"] = tilefuse.attention(qd, kd, vd, block_mask=bm)
            if spec.band() is not None:
                outs[f"tilefuse.block_sparse_kernels {dtype}"] = generic_block_sparse(qd, kd, vd, bm)
            if flex:
                outs[f"flex_attention {dtype}"] = compiled(qd, kd, vd, block_mask=flex_block_mask(spec, ACC_N, dev))
        for impl, out in outs.items():
            err = out.double() - ref
            emit(dict(case=name, impl=impl, N=ACC_N, H=ACC_H, rel_l2=float(err.norm() / ref.norm()),
                      max_abs=float(err.abs().max()), tf32=torch.backends.cuda.matmul.allow_tf32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--cases", default="window,window_global,document")
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--no-build", action="store_true")
    parser.add_argument("--no-accuracy", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/block_sparse.py needs a CUDA device")
    flex = not args.no_flex
    start = time.time()
    ceiling = gemm_ceiling_tflops()
    emit(dict(impl="ceiling", what="bf16 GEMM 8192^3", tflops=round(ceiling, 1),
              device=torch.cuda.get_device_name()))
    if not args.no_accuracy:
        accuracy_rows(flex)
    if not args.no_build:
        build_rows(flex)
    for name in args.cases.split(","):
        speed_rows(name, args.n, flex, not args.no_backward, ceiling)
    emit(dict(impl="done", seconds=round(time.time() - start, 1)))


if __name__ == "__main__":
    main()
