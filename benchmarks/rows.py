"""Shared pieces of the benchmark scripts: their output (one JSON line per row as it is measured, so a run cut
short still printed what it had, then all rows in one JSON file when a path is given), and launch switches
flipped for a comparison."""
import json


def collect(rows, out=None) -> list:
    kept = []
    for row in rows:
        kept.append(row)
        print(json.dumps(row), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(kept, f, indent=1)
    return kept


def launch_switches(family, **values):
    """A family's switches (``tilefuse.kernels.switches.gemm`` / ``.attention``, e.g. ``COOP_GATED=False``) set for
    the block, then restored; the fast path drops its plans at each change."""
    from tilefuse.kernels import switches

    return switches.overridden(family, **values)
