"""benchmarks/RESULTS.md is generated from the committed GPU reports it names, and says per row whether
tilefuse beats or trails the best anchor."""
import re
from pathlib import Path

from tilefuse.harness.results import load, results_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_committed_results_table_is_what_its_reports_generate(monkeypatch):
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    sources = re.findall(r"^- `([^`]+report\.json)`", text, flags=re.M)
    assert sources, "RESULTS.md names no source report"
    monkeypatch.chdir(ROOT)
    assert results_markdown(load(sources)) == text, "RESULTS.md is stale: rerun benchmarks/results_table.py"


def test_best_anchor_and_verdicts():
    def row(case, ms, speedup):
        return {"case": case, "dtype": "bf16", "ms": ms, "roofline_pct": 50.0, "speedup": speedup}
    result = {"environment": {"device": "GPU", "torch": "t", "triton": "3.6.0", "time_utc": "now"},
              "ceilings": {"copy_TBps": 4.0},
              "ops": {"op": {"speed": [row("a", 1.0, {"eager unfused": 2.0, "fast": 0.8, "bad": "failed: x"}),
                                       row("b", 1.0, {"eager unfused": 1.5, "fast": 1.2})]}}}
    text = results_markdown([("r.json", result)])
    assert "| a | bf16 | 1.0000 | 50 | 2.000 | fast | 0.800 | **trails** |" in text
    assert "| b | bf16 | 1.0000 | 50 | 1.500 | fast | 1.200 | faster |" in text
    assert "faster than the best anchor on 1 of 2 rows; trails on 1 (worst: a bf16, 0.800× fast)" in text
    assert "Anchors timed: eager unfused, fast." in text
    cpu = dict(result, ceilings={})
    assert "## op" not in results_markdown([("cpu.json", cpu)])
