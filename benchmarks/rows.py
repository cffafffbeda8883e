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
