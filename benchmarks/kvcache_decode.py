"""The serving issue's decode and append rows: ``tilefuse.flash_attn_with_kvcache`` over paged caches (pages of 16
and 64 positions, shuffled over the pool) and a dense one, beside cuDNN's dense decode, and the append.

Per decode row (T = 1, d 128, bf16): GPU time as a CUDA-graph replay after an L2 flush (graph_ms: the host taken
out, the cache cold as a decode step finds it), for
- tilefuse paged / dense: ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=, block_table=, causal=True,
  validate=False)`` (splits chosen by the launch);
- sdpa_cudnn: ``F.scaled_dot_product_attention(enable_gqa=True)`` under ``sdpa_kernel(CUDNN_ATTENTION)`` over the
  same keys dense ``[B, Hkv, L, d]``; sdpa_default: SDPA's own pick (rows without a dense anchor when ragged).
Minimum HBM bytes: every cached key and value read once, q read and the output written; ``frac_read`` is those
bytes over the time against the run's read-only ceiling. FlashInfer (the issue's other anchor) is not here: its
0.7 wheel is 101 MB with binary dependencies (nvidia-cutlass-dsl, apache-tvm-ffi, cuda-tile), past what a call
to the GPU machine can carry (benchmarks/NOTES.md, issue 41).

Append rows (B 64, Hkv 32, d 128, 1 and 8 new tokens): the ``tilefuse::kv_append`` kernel alone (graph replay),
bytes written and read against the copy ceiling and against a same-size ``copy_`` (the fixed cost of any kernel
at this size); and ``PagedKVCache.append`` wall time with its host bookkeeping (do_bench).

    PYTHONPATH=src python benchmarks/kvcache_decode.py [--sweep]

``--sweep`` times instead split counts x the launch's tile constants (keys per tile, stages, warps) on paged-16 rows, with
what the launch's own rule picks and each compiled kernel's shared memory and registers.
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

D = 128
DECODE = [  # (batch, length, Hq, Hkv, ragged)
    (64, 4096, 32, 32, False), (8, 32768, 32, 8, False), (1, 131072, 32, 8, False), (16, 32768, 32, 8, True),
]
PAGES = (16, 64)


def _lengths(B, L, ragged, gen):
    if not ragged:
        return [L] * B
    return [int(x) for x in torch.randint(1024, L + 1, (B,), generator=gen)]


def _paged(k, v, page, gen):
    """Dense rows k, v [B, L, H, d] over pages in one shuffled order: (k pages, v pages, block table)."""
    B, L = k.shape[:2]
    per = -(-L // page)
    table = torch.randperm(B * per, generator=gen).view(B, per).to(torch.int32).to(k.device)

    def scatter(t):
        pages = torch.empty(B * per, page, *t.shape[2:], dtype=t.dtype, device=t.device)
        pages[table.long().flatten()] = F.pad(t, (0, 0, 0, 0, 0, per * page - L)).reshape(B * per, page, *t.shape[2:])
        return pages

    return scatter(k), scatter(v), table


def decode_row(B, L, hq, hkv, ragged, read_tbps):
    import tilefuse
    from tilefuse.harness.timing import graph_ms
    from tilefuse.kernels import launches

    gen = torch.Generator().manual_seed(B * 7 + L)
    lens = _lengths(B, L, ragged, gen)
    k = torch.randn(B, L, hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, L, hkv, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, 1, hq, D, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    row = {"B": B, "L": L, "Hq": hq, "Hkv": hkv, "ragged": ragged, "keys": sum(lens)}
    row["min_MB"] = round((2 * sum(lens) * hkv * D * 2 + 2 * q.numel() * 2) / 1e6, 2)

    def rate(ms):
        if not isinstance(ms, float):
            return None
        return round(row["min_MB"] / 1e6 / (ms * 1e-3) / read_tbps, 3)

    # float64 reference of a few heads of each sequence, for the rel-L2 of every variant
    def ref_out():
        outs = []
        for b, n in enumerate(lens):
            kk = k[b, :n].double().repeat_interleave(hq // hkv, 1)
            vv = v[b, :n].double().repeat_interleave(hq // hkv, 1)
            s = torch.einsum("hd,nhd->hn", q[b, 0].double(), kk) * D ** -0.5
            outs.append(torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vv))
        return torch.stack(outs)[:, None]

    ref = ref_out()

    def rel(out):
        return float((out.double() - ref).norm() / ref.norm())

    def run_dense():
        return tilefuse.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True, validate=False)

    for name in ["dense"] + [f"paged{page}" for page in PAGES]:
        fn = run_dense
        if name != "dense":
            k_pages, v_pages, table = _paged(k, v, int(name[5:]), gen)

            def fn(kp=k_pages, vp=v_pages, t=table):
                return tilefuse.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=t, causal=True,
                                                        validate=False)
        ms = graph_ms(fn)
        row[f"{name}_ms"] = ms
        row[f"{name}_frac_read"] = rate(ms)
        with launches.recording() as records:
            out = fn()
        row[f"{name}_rel_l2"] = rel(out)
        row[f"{name}_config"] = records[-1].describe() if records else None
        if name != "dense":
            del k_pages, v_pages, table
            torch.cuda.empty_cache()

    if not ragged:
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=hq != hkv)

        for name, fn in (("sdpa_cudnn", cudnn), ("sdpa_default", lambda: F.scaled_dot_product_attention(
                qt, kt, vt, enable_gqa=hq != hkv))):
            try:
                ms = graph_ms(fn)
                row[f"{name}_ms"] = ms
                row[f"{name}_frac_read"] = rate(ms)
                row[f"{name}_rel_l2"] = rel(fn().transpose(1, 2))
            except Exception as exc:  # noqa: BLE001 - a backend that refuses the shape is reported
                row[f"{name}_ms"] = f"{type(exc).__name__}: {exc}"[:200]
        for name in ("dense", "paged16", "paged64"):
            for anchor in ("sdpa_cudnn", "sdpa_default"):
                a, t = row.get(f"{anchor}_ms"), row.get(f"{name}_ms")
                if isinstance(a, float) and isinstance(t, float):
                    row[f"{name}_vs_{anchor}"] = round(a / t, 3)
        del kt, vt
    del k, v
    torch.cuda.empty_cache()
    return row


def append_row(T, copy_tbps):
    import tilefuse
    from tilefuse.harness.timing import bench_ms, graph_ms

    B, hkv, page, L0 = 64, 32, 16, 1000
    cache = tilefuse.PagedKVCache(1, B * (-(-(L0 + 64) // page)), page, hkv, D, torch.bfloat16, "cuda", max_seqs=B)
    ids = [cache.add_sequence() for _ in range(B)]
    cache.append(0, ids, torch.randn(B, L0, hkv, D, device="cuda", dtype=torch.bfloat16),
                 torch.randn(B, L0, hkv, D, device="cuda", dtype=torch.bfloat16))
    k = torch.randn(B, T, hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    old = torch.full((B,), L0, dtype=torch.int32, device="cuda")
    slots = torch.tensor(ids, dtype=torch.int32, device="cuda")
    kernel = lambda: torch.ops.tilefuse.kv_append(k, v, cache.k_pages[0], cache.v_pages[0],  # noqa: E731
                                                  cache.block_table[0], slots, old, None, None, False)
    moved = 2 * 2 * k.numel() * 2  # k and v, read and written
    row = {"append_B": B, "T": T, "Hkv": hkv, "bytes_moved_MB": round(moved / 1e6, 3)}
    ms = graph_ms(kernel)
    row["kernel_ms"] = ms
    src = torch.empty(moved // 4, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    same_size = graph_ms(lambda: dst.copy_(src))
    row["same_size_copy_ms"] = same_size
    if isinstance(ms, float):
        row["frac_copy_ceiling"] = round(moved / (ms * 1e-3) / 1e12 / copy_tbps, 3)
        if isinstance(same_size, float):
            row["vs_same_size_copy"] = round(same_size / ms, 3)
    # the cache's own append (its host bookkeeping, one copy of the new table entries, then the kernel)
    n = [0]

    def cache_append():
        if n[0] * T + T > 64:  # stay inside the pages: free and refill the batch now and then
            for s in ids:
                cache.free(s)
            ids[:] = [cache.add_sequence() for _ in range(B)]
            n[0] = 0
        cache.append(0, ids, k, v)
        n[0] += 1

    row["cache_append_wall_ms"] = bench_ms(cache_append)
    return row


SWEEP_TILES = [(64, 2, 4), (64, 2, 8), (128, 2, 8), (32, 2, 4)]  # (keys per tile, pipeline stages, warps)
SWEEP_SPLITS = (0, 4, 6, 8, 16, 32, 49, 64)  # 0: the launch's own rule


def compiled_resources() -> dict:
    """Shared memory and registers of each compiled cache attention kernel so far, by its constexprs: what the
    launch's residency model (resident_programs) assumes, checked."""
    from tilefuse.kernels.paged.kernels import kv_attention_kernel

    seen = {}
    try:
        for cache in kv_attention_kernel.device_caches.values():
            for compiled in cache[0].values():
                meta = compiled.metadata
                key = f"stages{meta.num_stages} warps{meta.num_warps} shared{int(meta.shared)}"
                seen[key] = {"shared": int(meta.shared), "regs": int(getattr(compiled, "n_regs", -1) or -1)}
    except Exception as exc:  # noqa: BLE001 -- triton's cache layout is not an API; report what failed
        seen["error"] = f"{type(exc).__name__}: {exc}"[:200]
    return seen


def sweep_row(B, L, hq, hkv, ragged, read_tbps):
    """Split counts and the launch's tile constants (keys per tile, stages, warps) swept on one paged-16 row: what
    choose_splits, resident_programs, DECODE_BLOCK_N, DECODE_STAGES and DECODE_WARPS are set from."""
    import tilefuse
    from tilefuse.harness.timing import graph_ms
    from tilefuse.kernels import launches
    from tilefuse.kernels.paged import launch

    gen = torch.Generator().manual_seed(B * 7 + L)
    lens = _lengths(B, L, ragged, gen)
    k = torch.randn(B, L, hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, L, hkv, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, 1, hq, D, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    k_pages, v_pages, table = _paged(k, v, 16, gen)
    del k, v
    min_mb = (2 * sum(lens) * hkv * D * 2 + 2 * q.numel() * 2) / 1e6
    row = {"sweep_B": B, "L": L, "Hq": hq, "Hkv": hkv, "ragged": ragged,
           "ms_frac_by_blockn_stages_warps_splits": {}}
    saved = launch.DECODE_BLOCK_N, launch.DECODE_STAGES, launch.DECODE_WARPS
    try:
        for bn, st, warps in SWEEP_TILES:
            launch.DECODE_BLOCK_N, launch.DECODE_STAGES, launch.DECODE_WARPS = bn, st, warps
            for splits in SWEEP_SPLITS:
                ms = graph_ms(lambda: tilefuse.flash_attn_with_kvcache(
                    q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table, causal=True, num_splits=splits,
                    validate=False))
                row["ms_frac_by_blockn_stages_warps_splits"][f"{bn}/{st}/{warps}/{splits or 'auto'}"] = (
                    [round(ms, 5), round(min_mb / 1e6 / (ms * 1e-3) / read_tbps, 3)] if isinstance(ms, float) else ms)
    finally:
        launch.DECODE_BLOCK_N, launch.DECODE_STAGES, launch.DECODE_WARPS = saved
    with launches.recording() as records:  # what the launch's own rule picks on this row
        tilefuse.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table, causal=True,
                                         validate=False)
    row["auto_launch"] = [r.describe() for r in records if r.op == "kv_attention"]
    row["compiled"] = compiled_resources()
    return row


def main() -> None:
    from tilefuse.harness.timing import measure_ceilings

    ceil = measure_ceilings()
    if "--sweep" in sys.argv:
        print(json.dumps({"read_TBps": round(ceil["read_TBps"], 3), "device": torch.cuda.get_device_name()}),
              flush=True)
        for B, L, hq, hkv, ragged in DECODE:
            try:
                print(json.dumps(sweep_row(B, L, hq, hkv, ragged, ceil["read_TBps"])), flush=True)
            except Exception as exc:  # noqa: BLE001
                print(json.dumps({"sweep_B": B, "L": L, "failed": f"{type(exc).__name__}: {exc}"[:300]}), flush=True)
            torch.cuda.empty_cache()
        return
    print(json.dumps({"read_TBps": round(ceil["read_TBps"], 3), "copy_TBps": round(ceil["copy_TBps"], 3),
                      "device": torch.cuda.get_device_name()}), flush=True)
    for B, L, hq, hkv, ragged in DECODE:
        try:
            print(json.dumps(decode_row(B, L, hq, hkv, ragged, ceil["read_TBps"])), flush=True)
        except Exception as exc:  # noqa: BLE001 - a failed row is printed, the others still run
            print(json.dumps({"B": B, "L": L, "failed": f"{type(exc).__name__}: {exc}"[:300]}), flush=True)
        torch.cuda.empty_cache()
    for T in (1, 8):
        try:
            print(json.dumps(append_row(T, ceil["copy_TBps"])), flush=True)
        except Exception as exc:  # noqa: BLE001
            print(json.dumps({"append_T": T, "failed": f"{type(exc).__name__}: {exc}"[:300]}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
