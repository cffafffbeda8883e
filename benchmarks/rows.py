"""Shared pieces of the benchmark scripts: their output (one JSON line per row as it is measured, so a run cut
short still printed what it had, then all rows in one JSON file when a path is given), and launch switches
flipped for a comparison."""
import contextlib
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


@contextlib.contextmanager
def launch_switches(module, **values):
    """Set a launch module's switches (e.g. ``COOP_GATED=False``) for the block, with no captured fast-path plan
    before or after (plans keep the kernels they captured), then restore them."""
    from tilefuse.kernels import fastpath

    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    fastpath.clear_all()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
        fastpath.clear_all()
