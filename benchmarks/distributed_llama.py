"""Issue targets on two or more GPUs (run with torchrun): a Llama-shaped model (8 layers, d 4096, MLP 11008,
32 heads, vocab 32000, bf16, random weights from one seed) two ways.

- fsdp: 100 AdamW steps under FSDP2 (every decoder layer and the root fully_shard-ed), unpatched and
  tilefuse-patched from the same weights and data (batch 2 x 2048 per rank); tokens/s over the steps after 10
  of warm-up, the loss curves and their largest relative difference.
- tp: prefill (B 1, N 2048) under tilefuse.distributed.tensor_parallel_plan on all ranks against the
  single-GPU unpatched logits on rank 0 (bf16 rel-L2), with the median ms of each.

    torchrun --nproc-per-node 2 benchmarks/distributed_llama.py --out distributed.json
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def _model(device):
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=8,
                                   num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                   max_position_embeddings=4096, attention_dropout=0.0)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)


def _fsdp(device, mesh, steps=100, warmup=10):
    from torch.distributed.fsdp import fully_shard

    import tilefuse
    out = {}
    g = torch.Generator(device=device).manual_seed(dist.get_rank())
    data = [torch.randint(0, 32000, (2, 2048), device=device, generator=g) for _ in range(4)]
    for name in ("unpatched", "tilefuse"):
        model = _model(device)
        if name == "tilefuse":
            tilefuse.patch(model)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses = []
        for i in range(steps):
            if i == warmup:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            ids = data[i % len(data)]
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        out[name] = dict(tokens_per_s=dist.get_world_size() * 2 * 2048 * (steps - warmup) / seconds,
                         losses=[x.item() for x in losses])
        del model, opt
        torch.cuda.empty_cache()
    a, b = out["tilefuse"]["losses"], out["unpatched"]["losses"]
    out["largest_loss_rel_diff"] = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    out["tokens_per_s_ratio"] = out["tilefuse"]["tokens_per_s"] / out["unpatched"]["tokens_per_s"]
    return out


def _tp(device, mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    import tilefuse
    ids = torch.randint(0, 32000, (1, 2048), device=device, generator=torch.Generator(device=device).manual_seed(7))

    def median_ms(fn):
        times = []
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - t0))
        return sorted(times)[5]
    with torch.no_grad():
        single = _model(device).eval()
        want = single(input_ids=ids).logits.float()
        single_ms = median_ms(lambda: single(input_ids=ids))
        del single
        model = _model(device).eval()
        tilefuse.patch(model)
        parallelize_module(model, mesh, tilefuse.distributed.tensor_parallel_plan(model, dist.get_world_size()))
        got = model(input_ids=ids).logits.float()
        tp_ms = median_ms(lambda: model(input_ids=ids))
    return dict(rel_l2_vs_single_gpu=float((got - want).norm() / want.norm()), single_gpu_unpatched_ms=single_ms,
                tensor_parallel_patched_ms=tp_ms)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--parts", nargs="+", default=["tp", "fsdp"])
    args = p.parse_args()
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    result = {part: {"tp": _tp, "fsdp": _fsdp}[part](device, mesh) for part in args.parts}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk not in ("unpatched", "tilefuse")}
                          for k, v in result.items()}, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
