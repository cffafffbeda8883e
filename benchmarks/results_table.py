"""Regenerate benchmarks/RESULTS.md, the one current table of where tilefuse is faster and where it trails,
from GPU report.json files (later files win for the same row). scripts/gpu_check.sh runs it on each
call's report; after committing results, rerun it over the latest committed reports:

    python benchmarks/results_table.py REPORT.json [REPORT.json ...] --out benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tilefuse.harness.results import load, results_markdown  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="report.json files of GPU runs, oldest first")
    ap.add_argument("--out", default="benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    Path(args.out).write_text(results_markdown(load(args.reports)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
