"""Which tilefuse.patch step makes training drift? GPT-2-small-shaped (2 layers) and Llama-shaped (2 layers)
models, bf16, AdamW (lr 1e-4, as `tilefuse bench train`), the same random batch every step, no padding: the
loss after each of N steps for the unpatched model, the whole patch, each step alone, the whole patch but
one step, and the whole patch with the host fast path's replays turned off. ``--batches 8 --eval-patch`` with
``--models bench:gpt2-small --batch 8`` (the bench's own model builder) is `tilefuse bench train`'s setting (8 batches in turn, patched in eval
mode), where the patched GPT-2-small's loss stalled on the H200 (10.36 against eager's 6.69 at step 200).

    python3 benchmarks/patch_train_drift.py --out patch_train_drift.json
"""
from __future__ import annotations

import argparse
import copy
import json

import torch

import tilefuse
from patch_step_grads import DEVICE, STEPS, build


def losses(model, batches, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    out = []
    for i in range(steps):
        ids = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        out.append(float(loss))
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--models", nargs="+", default=["gpt2-small-2l"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--batches", type=int, default=1, help="distinct batches, taken in turn")
    p.add_argument("--eval-patch", action="store_true", help="patch the model in eval mode, then train")
    p.add_argument("--variants", nargs="+", help="only these variant labels ('all', 'only loss', ...)")
    args = p.parse_args()
    from tilefuse.kernels import fastpath
    rows = []
    for name in args.models:
        torch.manual_seed(0)
        if name.startswith("bench:"):  # `tilefuse bench train`'s own model: its config, seed and dtype
            from tilefuse.harness import model_bench
            bench_name = name.split(":", 1)[1]
            base = model_bench.build_model(bench_name, DEVICE == "cuda", seed=0)
            n = model_bench.MODELS[bench_name][3][1] if DEVICE == "cuda" else model_bench.TINY_TRAIN[1]
        else:
            base, n = build(name)
        base = base.to(DEVICE).bfloat16()
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, base.config.vocab_size, (args.batch, n), generator=g).to(DEVICE)
                   for _ in range(args.batches)]
        variants = [("unpatched", None), ("all", {})] + [(f"only {s}", {t: t == s for t in STEPS}) for s in STEPS] \
            + [(f"all but {s}", {s: False}) for s in STEPS] + [("all, no replay", {})]
        variants = [v for v in variants if not args.variants or v[0] in args.variants]
        for label, flags in variants:
            m = copy.deepcopy(base)
            saved = fastpath.signature
            try:
                if flags is not None:
                    m.train(not args.eval_patch)
                    tilefuse.patch(m, **flags)
                if label.endswith("no replay"):
                    fastpath.signature = lambda *a, **k: None
                curve = losses(m, batches, args.steps)
                row = {"model": name, "variant": label, "first": curve[0], "last": curve[-1], "curve": curve}
            except Exception as exc:  # noqa: BLE001 - recorded
                row = {"model": name, "variant": label, "error": f"{type(exc).__name__}: {exc}"[:300]}
            finally:
                fastpath.signature = saved
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
            del m
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
