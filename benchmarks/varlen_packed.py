"""Issue target: a packed batch through tilefuse.attention_varlen against SDPA one sequence at a time and
against cuDNN SDPA on the batch padded with a mask, forward + backward, side by side in one run.

Batch: 16 sequences of lengths 256 * i (i = 1..16, 34,816 tokens), H 16, d 128, causal, bf16.
- tilefuse: one attention_varlen call (validate=False: the offsets are known good) and its backward.
- SDPA-FA2, sequence by sequence: the sum over the 16 sequences of each one's fwd+bwd median
  (each [1, H, L, d], the flash backend).
- cuDNN SDPA, padded: [16, H, 4096, d] with a boolean mask (causal within each sequence, padded keys
  masked, padded query rows see key 0 so nothing is NaN); the padded rows' output gradient is 0.
Times are triton.testing.do_bench medians of one forward + backward; FLOPs counted over the real
(causal) pairs. Writes JSON; prints a table.

    python3 benchmarks/varlen_packed.py --out varlen_packed.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--d", type=int, default=128)
    args = p.parse_args()
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import tilefuse

    dev, dt, H, d = torch.device("cuda"), torch.bfloat16, args.heads, args.d
    lens = [256 * i for i in range(1, 17)]
    total, n_max = sum(lens), max(lens)
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=dt)

    q, k, v, dout = (randn(total, H, d) for _ in range(4))
    cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def tilefuse_step():
        out = tilefuse.attention_varlen(*leaves, cu, cu, n_max, n_max, causal=True, validate=False)
        torch.autograd.grad(out, leaves, dout)

    rows = {}
    pairs = sum(L * (L + 1) // 2 for L in lens)
    flops = 4.0 * pairs * d * H * 3.5  # forward: QK^T and PV (4 flops per pair and dim); backward 2.5x that

    def record(name, ms, **extra):
        rows[name] = dict(ms=ms, tflops=flops / ms * 1e-9, **extra)
        print(f"{name:40s} {ms:8.3f} ms  {flops / ms * 1e-9:6.0f} TFLOP/s", flush=True)

    tilefuse_step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    tilefuse_step()
    peak = torch.cuda.max_memory_allocated()
    record("tilefuse.attention_varlen", triton.testing.do_bench(tilefuse_step), peak_bytes=peak)

    # SDPA (flash backend), one sequence at a time: the sum of each sequence's own median.
    per_seq = []
    starts = [0] + list(torch.tensor(lens).cumsum(0).tolist())
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for i, L in enumerate(lens):
            sl = slice(starts[i], starts[i] + L)
            qi, ki, vi = (t[sl].transpose(0, 1)[None].detach().clone().requires_grad_() for t in (q, k, v))
            doi = dout[sl].transpose(0, 1)[None].contiguous()

            def step(qi=qi, ki=ki, vi=vi, doi=doi):
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True)
                torch.autograd.grad(o, (qi, ki, vi), doi)
            step()
            per_seq.append(triton.testing.do_bench(step))
    record("sdpa.flash, sequence by sequence (sum)", sum(per_seq), per_sequence_ms=per_seq)

    # cuDNN on the padded batch with a mask.
    B = len(lens)
    qp, kp, vp, dop = (torch.zeros(B, H, n_max, d, device=dev, dtype=dt) for _ in range(4))
    valid = torch.zeros(B, n_max, dtype=torch.bool, device=dev)
    for i, L in enumerate(lens):
        sl = slice(starts[i], starts[i] + L)
        for dst, src in ((qp, q), (kp, k), (vp, v), (dop, dout)):
            dst[i, :, :L] = src[sl].transpose(0, 1)
        valid[i, :L] = True
    causal = torch.ones(n_max, n_max, dtype=torch.bool, device=dev).tril()
    mask = causal[None] & valid[:, None, :]
    mask[:, :, 0] |= ~valid  # padded query rows see key 0 (a finite row; its gradient in is 0)
    mask = mask[:, None]
    padded = [t.requires_grad_() for t in (qp, kp, vp)]
    for label, kwargs in (("sdpa.cudnn, padded to 4096 with a mask", dict(attn_mask=mask)),
                          ("sdpa.cudnn, padded to 4096, causal only (no padding mask)", dict(is_causal=True))):
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                def step(kwargs=kwargs):
                    o = F.scaled_dot_product_attention(*padded, **kwargs)
                    torch.autograd.grad(o, padded, dop)
                step()
                record(label, triton.testing.do_bench(step))
        except RuntimeError as e:
            rows[label] = dict(error=str(e).splitlines()[0][:300])
            print(label, "refused:", rows[label]["error"], flush=True)

    t = rows["tilefuse.attention_varlen"]["ms"]
    ratios = {name: r["ms"] / t for name, r in rows.items() if "ms" in r and name != "tilefuse.attention_varlen"}
    for name, r in ratios.items():
        print(f"tilefuse speedup over {name}: {r:.3f}x")
    with open(args.out, "w") as f:
        json.dump(dict(lengths=lens, heads=H, d=d, dtype="bf16", causal=True, flops=flops, rows=rows,
                       speedup_over=ratios, device=torch.cuda.get_device_name()), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
