"""Which tilefuse.patch step changes a training step's gradients? For each HF family and each step alone
(norm, mlp, qkv, attention, linear, loss), one forward + backward with labels on the same batch, bf16, beside
the unpatched bf16 model; both measured against the unpatched model in fp32, so bf16's own noise is the
yardstick: a step whose error is many times the unpatched bf16 error is wrong, not rounded.

    python3 benchmarks/patch_step_grads.py --out patch_step_grads.json

Models: tiny configs (head dim 16, the portable attention kernels) with a left-padded batch, and 2-layer
GPT-2-small / Llama shapes (head dim 64 / 128, the Hopper kernels) with and without padding.
"""
from __future__ import annotations

import argparse
import copy
import json

import torch
import transformers

import tilefuse

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STEPS = ("norm", "mlp", "qkv", "attention", "linear", "loss")


def build(name):
    t = transformers
    if name == "llama-tiny":
        cfg = t.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
        return t.LlamaForCausalLM(cfg), 10
    if name == "gpt2-tiny":
        cfg = t.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64, attn_pdrop=0.0,
                           resid_pdrop=0.0, embd_pdrop=0.0)
        return t.GPT2LMHeadModel(cfg), 10
    if name == "gpt2-small":  # the shape of `tilefuse bench train --model gpt2-small` (12 layers, seq 1024)
        cfg = t.GPT2Config(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024, attn_pdrop=0.0,
                           resid_pdrop=0.0, embd_pdrop=0.0)
        return t.GPT2LMHeadModel(cfg), 1024
    if name == "gpt2-small-2l":
        cfg = t.GPT2Config(vocab_size=50257, n_embd=768, n_layer=2, n_head=12, n_positions=1024, attn_pdrop=0.0,
                           resid_pdrop=0.0, embd_pdrop=0.0)
        return t.GPT2LMHeadModel(cfg), 256
    assert name == "llama-2l"
    cfg = t.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=2,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048)
    return t.LlamaForCausalLM(cfg), 256


def step(model, ids, mask, labels):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.loss.detach().double(), {n: p.grad.detach().double() for n, p in model.named_parameters()
                                         if p.grad is not None}


def compare(got, want):
    loss_g, grads_g = got
    loss_w, grads_w = want
    errs = {n: float((grads_g[n] - g).norm() / g.norm().clamp_min(1e-30)) if n in grads_g else float("inf")
            for n, g in grads_w.items()}
    worst = max(errs, key=errs.get)
    return {"loss_rel": float(abs(loss_g - loss_w) / abs(loss_w)), "worst_grad": worst,
            "worst_grad_rel": errs[worst], "median_grad_rel": sorted(errs.values())[len(errs) // 2]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--models", nargs="+", default=["gpt2-tiny", "llama-tiny", "gpt2-small-2l", "llama-2l"])
    args = p.parse_args()
    rows = []
    for name in args.models:
        torch.manual_seed(0)
        base, n = build(name)
        base = base.to(DEVICE)
        vocab = base.config.vocab_size
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab, (2, n), generator=g).to(DEVICE)
        for padded in (False, True):
            mask = torch.ones_like(ids)
            if padded:
                mask[0, : n // 3] = 0
            labels = ids.masked_fill(mask == 0, -100)
            want = step(copy.deepcopy(base).float(), ids, mask, labels)
            ref16 = copy.deepcopy(base).bfloat16()
            rows.append({"model": name, "padded": padded, "step": "unpatched bf16",
                         **compare(step(ref16, ids, mask, labels), want)})
            print(json.dumps(rows[-1]), flush=True)
            for only in STEPS:
                m = copy.deepcopy(base).bfloat16()
                try:
                    report = tilefuse.patch(m, **{s: s == only for s in STEPS})
                    kept = [r[0] for r in report.replaced]
                    row = {"model": name, "padded": padded, "step": only, "kept": len(kept),
                           "skipped": [s for s in report.skipped][:3], **compare(step(m, ids, mask, labels), want)}
                except Exception as exc:  # noqa: BLE001 - recorded
                    row = {"model": name, "padded": padded, "step": only, "error": f"{type(exc).__name__}: {exc}"[:300]}
                rows.append(row)
                print(json.dumps(row, default=str), flush=True)
                del m
        del base
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
