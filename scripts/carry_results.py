"""The result log a GPU call resumes from: the tests that passed in committed result logs, narrowed by filters to
those whose code has not changed since (the caller names them: the script cannot tell).
    python3 scripts/carry_results.py LOG... [--keep REGEX...] [--drop REGEX...] [--out FILE]

Each LOG is a ``results.log`` of scripts/gpu_check.sh (``outcome seconds test-id`` per line). A test id is kept
when it passed in some LOG, matches one of ``--keep`` (default: every id) and none of ``--drop`` (``re.search``
over the whole id). The later LOG's line wins where an id repeats. Writes FILE (default ``.carry/results_carried.log``),
which scripts/gpu_check.sh reads with the other ``.carry/results*.log``, and prints the count per test file."""
from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path


def carried(logs, keep, drop) -> dict:
    """id -> its line, for every id that passed in ``logs`` (read in order) and passes the filters."""
    lines = {}
    for log in logs:
        for line in Path(log).read_text().splitlines():
            parts = line.split(" ", 2)
            if len(parts) == 3:
                lines[parts[2]] = (parts[0], line)
    keep_re = [re.compile(k) for k in keep or [""]]
    drop_re = [re.compile(d) for d in drop or []]
    return {nodeid: line for nodeid, (outcome, line) in lines.items()
            if outcome == "passed" and any(k.search(nodeid) for k in keep_re)
            and not any(d.search(nodeid) for d in drop_re)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--keep", nargs="+", metavar="REGEX")
    ap.add_argument("--drop", nargs="+", metavar="REGEX")
    ap.add_argument("--out", default=".carry/results_carried.log")
    args = ap.parse_args(argv)
    kept = carried(args.logs, args.keep, args.drop)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(line + "\n" for line in kept.values()))
    per_file = collections.Counter(nodeid.split("::")[0] for nodeid in kept)
    for name, count in sorted(per_file.items()):
        print(f"{count:6d} {name}")
    print(f"{len(kept):6d} passed ids carried into {out}")


if __name__ == "__main__":
    main()
