"""``tilefuse tune``'s work: run the registry ops' bench cases so each kernel behind them picks (and
stores) a config for every key they hit."""
from __future__ import annotations

import time

import torch


def tune_ops(op_names: list[str], dtypes: list[str] | None = None, seed: int = 0, device="cuda",
             log=print) -> list[str]:
    """Run the fused function of each named registry op on each of its bench cases (optionally only
    the given dtype names, e.g. ``["bf16"]``), so every kernel behind them picks a config for each key
    they hit. A case that fails is logged and the others still run; returns the failures as text."""
    from tilefuse import registry
    from tilefuse.opspec import dtype_name

    device = torch.device(device)
    failures = []
    for op in op_names:
        spec = registry.get(op)
        cases = [p for p in spec.bench_cases if dtypes is None or dtype_name(p["dtype"]) in dtypes]
        for params in cases:
            label = f"{op} {spec.label(params)} {dtype_name(params['dtype'])}"
            start = time.perf_counter()
            try:
                inputs = spec.make_inputs(params, device, seed)
                with torch.no_grad():
                    spec.fused(**inputs)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            except Exception as e:  # report it and go on with the other cases; the caller exits non-zero
                failures.append(f"{label}: {type(e).__name__}: {e}")
                log(f"  FAILED {label}: {type(e).__name__}: {e}")
                continue
            finally:
                inputs = None
            log(f"  {label}: {time.perf_counter() - start:.1f} s")
    return failures
