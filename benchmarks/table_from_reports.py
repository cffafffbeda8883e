"""Merge the configs a GPU report run autotuned and the backend choices it measured (report.json's "tuning"
records) into a shipped table, the same format `tilefuse tune --out` writes. Records whose kernel changed since
the run can be left out, so their keys are tuned afresh; ``--only`` keeps only the tables whose name matches:

  PYTHONPATH=src python benchmarks/table_from_reports.py OUT.json REPORT.json [...] \
      [--drop KERNEL] [--drop-key KERNEL:REGEX] [--only REGEX]

Only records measured on the report's own GPU ("autotuned" kernel configs, "measured" backend choices, or "user
cache" from the same machine) are taken; each keeps its timings, so the report can still show what the stored
choice beat.
"""
from __future__ import annotations

import argparse
import json
import re

from tilefuse import tuning


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--drop", action="append", default=[], help="kernel name to leave out")
    ap.add_argument("--drop-key", action="append", default=[], help="KERNEL:REGEX of keys to leave out")
    ap.add_argument("--only", default=None, help="REGEX: take only the tables whose name matches")
    args = ap.parse_args(argv)
    only = re.compile(args.only) if args.only else None
    drop_keys = [(k, re.compile(rx)) for k, rx in (d.split(":", 1) for d in args.drop_key)]
    gpus, records = set(), []
    for path in args.reports:
        report = json.load(open(path))
        gpus.add(report["environment"]["device"])
        for op in report["ops"].values():
            for r in op.get("tuning", []):
                if r["source"] not in ("autotuned", "measured", "user cache") or r["kernel"] in args.drop:
                    continue
                if only is not None and not only.search(r["kernel"]):
                    continue
                if any(r["kernel"] == k and rx.search(r["key"]) for k, rx in drop_keys):
                    continue
                records.append(r)
    if len(gpus) != 1:
        raise SystemExit(f"reports from {len(gpus)} GPUs ({sorted(gpus)}): one table per GPU")
    n = tuning.write_table(args.out, records, gpus.pop())
    print(f"merged {n} records into {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
