"""Decode attention over the paged KV cache (tilefuse.paged_attention) beside the vendor's way and the unfused one.

Per case (Hq 32, Hkv 8, d 128, bf16, pages of 16 positions, every sequence L long unless ragged): GPU time as a
CUDA-graph replay after an L2 flush (tilefuse.harness.timing.graph_ms: the host taken out, the cache cold as a
decode step finds it), for
- tilefuse: ``paged_attention`` over the cache (splits chosen by the launch), and at each split count of a sweep;
- sdpa: ``F.scaled_dot_product_attention(enable_gqa=True)`` over the same keys and values stored dense
  ``[B, Hkv, L, d]`` (what a server without paging runs; ragged cases have no dense anchor);
- gather+sdpa: the pages gathered into dense tensors, then SDPA (paging without a paged kernel).
Minimum HBM bytes: every cached key and value read once, q read and the output written; ``frac_read`` is those
bytes over the time against the run's read-only ceiling (measure_ceilings). One JSON line per case on stdout.

    PYTHONPATH=src python benchmarks/paged_decode.py
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

HQ, HKV, D, PAGE = 32, 8, 128, 16
CASES = [  # (batch, context length, new query tokens, ragged)
    (1, 4096, 1, False), (1, 32768, 1, False), (8, 8192, 1, False), (32, 4096, 1, False),
    (64, 8192, 1, False), (128, 2048, 1, False), (32, 4096, 4, False), (64, 4096, 1, True),
]


def case(B: int, L: int, T: int, ragged: bool, read_tbps: float) -> dict:
    import tilefuse
    from tilefuse.harness.timing import graph_ms

    gen = torch.Generator(device="cuda").manual_seed(B * 100003 + L + T)
    lens = ([int(x) for x in torch.randint(T, 2 * L, (B,), generator=gen, device="cuda")] if ragged else [L] * B)
    pages = sum(-(-n // PAGE) for n in lens)
    cache = tilefuse.PagedKVCache(1, pages, PAGE, HKV, D, torch.bfloat16, "cuda", max_seqs=B,
                                  max_seq_len=max(lens))
    ids = [cache.add_sequence() for _ in range(B)]
    # Sequences filled in interleaved chunks so that each one's pages are scattered over the pool, as a server's are.
    dense_k, dense_v = [], []
    for s, n in zip(ids, lens):
        dense_k.append(torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen))
        dense_v.append(torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen))
    done = [0] * B
    chunk = 256
    while any(d < n for d, n in zip(done, lens)):
        for i, (s, n) in enumerate(zip(ids, lens)):
            if done[i] < n:
                step = min(chunk, n - done[i])
                cache.append(0, [s], dense_k[i][None, done[i]:done[i] + step], dense_v[i][None, done[i]:done[i] + step])
                done[i] += step
    q = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    row = {"B": B, "L": L, "T": T, "ragged": ragged, "keys": sum(lens)}
    kv_bytes = 2 * sum(lens) * HKV * D * 2
    row["min_MB"] = round((kv_bytes + 2 * q.numel() * 2) / 1e6, 2)

    ms = graph_ms(lambda: tilefuse.paged_attention(q, cache, 0, ids))
    row["tilefuse_ms"] = ms
    if isinstance(ms, float):
        row["tilefuse_TBps"] = round(row["min_MB"] / 1e6 / (ms * 1e-3), 3)
        row["frac_read"] = round(row["tilefuse_TBps"] / read_tbps, 3)

    # the split count swept: what the launch's rule (choose_splits) is set from
    row["ms_by_splits"] = {n: graph_ms(lambda n=n: tilefuse.paged_attention(q, cache, 0, ids, num_splits=n))
                           for n in (1, 2, 4, 8, 16, 32, 64)}

    # float64 check of this case's output against the dense keys (every sequence's own length)
    from tilefuse.kernels import launches
    with launches.recording() as records:
        out = tilefuse.paged_attention(q, cache, 0, ids).double()
    row["config"] = records[-1].describe() if records else None
    err_num = err_den = 0.0
    for i, n in enumerate(lens):
        k = dense_k[i].double().transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        v = dense_v[i].double().transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        qi = q[i].double().transpose(0, 1)
        scores = qi @ k.transpose(1, 2) / D ** 0.5
        visible = torch.arange(n, device="cuda")[None, :] <= torch.arange(n - T, n, device="cuda")[:, None]
        ref = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v
        err_num += float((out[i].transpose(0, 1) - ref).pow(2).sum())
        err_den += float(ref.pow(2).sum())
    row["rel_l2"] = (err_num / err_den) ** 0.5

    mask = None
    if T > 1:  # the new tokens causal among themselves, bottom-right aligned
        mask = torch.arange(L, device="cuda")[None, :] <= torch.arange(L - T, L, device="cuda")[:, None]
    qt = q.transpose(1, 2)
    if not ragged:
        k_dense = torch.stack(dense_k).transpose(1, 2).contiguous()
        v_dense = torch.stack(dense_v).transpose(1, 2).contiguous()
        sdpa = graph_ms(lambda: F.scaled_dot_product_attention(qt, k_dense, v_dense, attn_mask=mask, enable_gqa=True))
        row["sdpa_ms"] = sdpa
        if isinstance(sdpa, float) and isinstance(ms, float):
            row["vs_sdpa"] = round(sdpa / ms, 3)
        del k_dense, v_dense

        table = cache.block_table[0, :B, : -(-L // PAGE)].long()

        def gather_sdpa():
            k = cache.k_pages[0][table].reshape(B, -1, HKV, D)[:, :L].transpose(1, 2)
            v = cache.v_pages[0][table].reshape(B, -1, HKV, D)[:, :L].transpose(1, 2)
            return F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, enable_gqa=True)

        gathered = graph_ms(gather_sdpa)
        row["gather_sdpa_ms"] = gathered
        if isinstance(gathered, float) and isinstance(ms, float):
            row["vs_gather_sdpa"] = round(gathered / ms, 3)
    del cache
    torch.cuda.empty_cache()
    return row


def main() -> None:
    from tilefuse.harness.timing import measure_ceilings

    read = measure_ceilings()["read_TBps"]
    print(json.dumps({"read_TBps": round(read, 3), "device": torch.cuda.get_device_name()}), flush=True)
    for B, L, T, ragged in CASES:
        try:
            print(json.dumps(case(B, L, T, ragged, read)), flush=True)
        except Exception as exc:  # noqa: BLE001 - a failed case is printed, the others still run
            print(json.dumps({"B": B, "L": L, "T": T, "failed": f"{type(exc).__name__}: {exc}"[:300]}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
