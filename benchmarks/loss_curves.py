"""Does ``tilefuse.patch`` change where training goes, beyond what the seed alone changes? Loss curves of
patched training against eager over several seeds.

For each model (default: GPT-2-small and Llama-1B, at ``tilefuse bench train``'s batch and sequence), each seed
(default 0, 1, 2) and each variant (``eager``, ``tilefuse``), trains ``--steps`` (default 200) steps with
``tilefuse bench train``'s own training run (tilefuse.harness.model_bench: AdamW lr 1e-4 on the bf16 model, labels
= the inputs, its seeded batches; the seed sets the weights and the data, identical for both variants of a
seed). Each run is summarised by its tail mean: the mean loss over steps ``--tail-from``..``--steps``
(1-based, both included; default the last quarter, steps 150-200 of 200).

Per model the verdict: the patched tail mean averaged over the seeds must lie inside a band around eager,
the wider of (a) the eager seeds' spread, min..max of their tail means, and (b) eager's mean over the seeds
+-1%. (a) is how far the seed alone moves the loss; (b) keeps the check meaningful where three seeds happen
to land close together. A non-finite loss fails; a run that failed leaves the model unchecked.

Writes JSON to ``--out`` (after every model, so a run cut short keeps what finished) and prints a summary;
exit status 1 if a model fails its check or a run fails. Without a GPU, model_bench's tiny configurations of
each family run with the kernels in the Triton interpreter (a smoke check: use few ``--steps``).

    PYTHONPATH=$PWD/src python3 benchmarks/loss_curves.py [--models gpt2-small llama-1b] [--seeds 0 1 2]
        [--steps 200] [--tail-from 150] [--out loss_curves.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is first imported: without a GPU the kernels are interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tilefuse.harness import model_bench  # noqa: E402
from tilefuse.harness.mlp_train import _failure  # noqa: E402

VARIANTS = ("eager", "tilefuse")
DEFAULT_MODELS = ("gpt2-small", "llama-1b")
DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_STEPS = 200
REL_BAND = 0.01  # (b): eager's mean +-1%


def default_tail_from(steps: int) -> int:
    """The first step of the tail window when none is given: the last quarter (150 of 200)."""
    return max(1, steps - steps // 4)


def tail_mean(curve, tail_from: int, steps: int) -> float:
    """Mean loss over steps tail_from..steps (1-based, inclusive)."""
    window = curve[tail_from - 1:steps]
    return sum(window) / len(window)


def verdict(eager_tails: list[float], patched_tails: list[float], rel: float = REL_BAND) -> dict:
    """The check of one model from the per-seed tail means (see the module docstring): the band used, which
    of the two it was, the means, and whether the patched mean lies inside (False for any non-finite loss)."""
    values = eager_tails + patched_tails
    eager_mean = sum(eager_tails) / len(eager_tails)
    patched_mean = sum(patched_tails) / len(patched_tails)
    out = {"eager_mean": eager_mean, "patched_mean": patched_mean,
           "eager_spread": [min(eager_tails), max(eager_tails)],
           "rel_band": [eager_mean - rel * abs(eager_mean), eager_mean + rel * abs(eager_mean)],
           "rel_diff_of_means": abs(patched_mean - eager_mean) / abs(eager_mean) if eager_mean else math.inf}
    if not all(map(math.isfinite, values)):
        return {**out, "band": None, "band_kind": None, "within": False, "verdict": "FAIL (a loss is not finite)"}
    spread, band_rel = out["eager_spread"], out["rel_band"]
    if spread[1] - spread[0] >= band_rel[1] - band_rel[0]:
        band, kind = spread, "eager seeds' spread"
    else:
        band, kind = band_rel, f"eager mean +-{rel:.0%}"
    within = band[0] <= patched_mean <= band[1]
    return {**out, "band": band, "band_kind": kind, "within": within, "verdict": "PASS" if within else "FAIL"}


def train_model(name: str, seeds, steps: int, tail_from: int, on_gpu: bool, log=print) -> dict:
    """Every (variant, seed) run of one model: tail mean, final loss, curve, seconds (or the failure); then
    the model's verdict (None with the reason where a run failed)."""
    batch, seq = (model_bench.MODELS[name][3] if on_gpu else model_bench.TINY_TRAIN)[:2]
    warmup = min(10, steps // 2)  # model_bench.run's warm-up: the timing is not what this script reads
    runs = {v: {} for v in VARIANTS}
    for seed in seeds:
        for variant in VARIANTS:
            t0 = time.perf_counter()
            try:
                entry = model_bench._train(variant, name, batch, seq, steps, warmup, seed, on_gpu, None,
                                           lambda: None)
                curve = entry["loss_curve"]
                run = {"tail_mean": tail_mean(curve, tail_from, steps), "final_loss": entry["final_loss"],
                       "loss_curve": curve, "error": None}
            except Exception as exc:  # noqa: BLE001 - recorded, and the model is then left unchecked
                failure = _failure(exc)
                run = {"tail_mean": None, "final_loss": None, "loss_curve": [], "error": failure["error"],
                       "traceback": failure["traceback"]}
            run["seconds"] = time.perf_counter() - t0
            runs[variant][str(seed)] = run
            log(f"{name} seed {seed} {variant}: "
                + (f"tail mean {run['tail_mean']:.5g}" if run["error"] is None else f"failed: {run['error']}")
                + f" ({run['seconds']:.1f} s)")
            model_bench._release(torch.device("cuda" if on_gpu else "cpu"))
    failed = [f"{v} seed {s}: {r['error']}" for v, by_seed in runs.items() for s, r in by_seed.items()
              if r["error"] is not None]
    result = {"batch": batch, "seq": seq, "runs": runs}
    if failed:
        result["check"] = {"verdict": None, "within": None, "why_unchecked": failed}
    else:
        result["check"] = verdict([runs["eager"][str(s)]["tail_mean"] for s in seeds],
                                  [runs["tilefuse"][str(s)]["tail_mean"] for s in seeds])
    return result


def summary_text(result: dict) -> str:
    """Per model: each seed's tail mean per variant, the eager spread, the band, the verdict."""
    lines = [f"loss curves on {result['device']} ({result['path']}), {result['dtype']}: {result['steps']} steps, "
             f"tail mean over steps {result['tail_steps'][0]}-{result['tail_steps'][1]}, seeds "
             f"{', '.join(map(str, result['seeds']))}"]
    for name, m in result["models"].items():
        lines.append(f"{name} (batch {m['batch']} x seq {m['seq']}):")
        for variant, by_seed in m["runs"].items():
            cells = [f"seed {s} " + (f"{r['tail_mean']:.5g}" if r["error"] is None else "failed")
                     for s, r in by_seed.items()]
            lines.append(f"  {variant}: " + ", ".join(cells))
        c = m["check"]
        if c["verdict"] is None:
            lines.append("  not checked: " + "; ".join(c["why_unchecked"]))
            continue
        lines.append(f"  eager spread {c['eager_spread'][0]:.5g}..{c['eager_spread'][1]:.5g}, eager mean "
                     f"{c['eager_mean']:.5g}, tilefuse mean {c['patched_mean']:.5g} "
                     f"({100 * c['rel_diff_of_means']:.3g}% from eager's)")
        band = "none" if c["band"] is None else f"{c['band'][0]:.5g}..{c['band'][1]:.5g} ({c['band_kind']})"
        lines.append(f"  band {band}: {c['verdict']}")
    if result["path"] != "compiled":
        lines.append("(no GPU: tiny configurations, the kernels in the Triton interpreter)")
    return "\n".join(lines)


def run(models=DEFAULT_MODELS, seeds=DEFAULT_SEEDS, steps: int = DEFAULT_STEPS, tail_from: int | None = None,
        out: str = "loss_curves.json", log=print) -> dict:
    """Train every model, seed and variant; write the JSON to ``out`` after each model; return it."""
    from tilefuse.harness.report import _quiet_interpreter_math, environment

    unknown = [m for m in models if m not in model_bench.MODELS]
    if unknown:
        raise ValueError(f"unknown model {unknown[0]!r}; known: {', '.join(model_bench.MODELS)}")
    if steps < 2:
        raise ValueError(f"--steps must be >= 2 (a warm-up step, then timed ones), got {steps}")
    tail_from = default_tail_from(steps) if tail_from is None else tail_from
    if not 1 <= tail_from <= steps:
        raise ValueError(f"--tail-from must be in 1..{steps}, got {tail_from}")
    if not seeds:
        raise ValueError("name at least one seed")
    on_gpu = torch.cuda.is_available()
    env = environment()
    result = {"benchmark": "loss-curves", "device": env["device"], "path": env["path"], "environment": env,
              "dtype": "bf16" if on_gpu else "fp32", "steps": steps, "tail_steps": [tail_from, steps],
              "seeds": list(seeds), "lr": model_bench.LR, "variants": list(VARIANTS), "rel_band": REL_BAND,
              "models": {}}
    path = Path(out)
    with _quiet_interpreter_math():
        for name in models:
            result["models"][name] = train_model(name, seeds, steps, tail_from, on_gpu, log)
            path.write_text(json.dumps(result, indent=1, default=str))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=sorted(model_bench.MODELS))
    p.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS))
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--tail-from", type=int, default=None,
                   help="first step (1-based) of the tail window (default: the last quarter, 150 of 200)")
    p.add_argument("--out", default="loss_curves.json")
    args = p.parse_args(argv)
    try:
        result = run(args.models, args.seeds, args.steps, args.tail_from, args.out,
                     log=lambda s: print(s, file=sys.stderr, flush=True))
    except ValueError as exc:
        p.error(str(exc))
    print(summary_text(result))
    print(f"wrote {args.out}")
    return 0 if all(m["check"]["verdict"] == "PASS" for m in result["models"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
