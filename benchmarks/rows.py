"""Shared output of the benchmark scripts: one JSON line per row as it is measured (a run cut short
still printed what it had), then all rows in one JSON file when a path is given."""
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
