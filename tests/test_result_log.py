"""The GPU runs resume across calls: every test writes a result line, and a later run skips what passed."""
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def _pytest(env_extra, tmp_path):
    # A GPU run sets these for itself: the child must not write into (or skip from) the run's own logs.
    env = {k: v for k, v in os.environ.items()
           if k not in ("TILEFUSE_RESULT_LOG", "TILEFUSE_SKIP_PASSED", "TILEFUSE_FAIL_LOG", "PYTEST_XDIST_WORKER")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(TESTS / "test_tuning.py"), "-k", "m_bucket or bad_entry"],
                          env=env, capture_output=True, text=True, cwd=tmp_path)


def test_result_log_records_each_test_and_a_rerun_skips_the_passed(tmp_path):
    log = tmp_path / "results.log"
    first = _pytest({"TILEFUSE_RESULT_LOG": str(log)}, tmp_path)
    assert first.returncode == 0, first.stdout[-2000:]
    lines = log.read_text().splitlines()
    assert lines and all(line.split(" ", 2)[0] == "passed" for line in lines), lines
    assert all("test_tuning.py::" in line for line in lines)
    second = _pytest({"TILEFUSE_SKIP_PASSED": str(log)}, tmp_path)
    # The same selection now runs nothing (exit 5): the tests that matched -k passed before.
    assert second.returncode == 5 and "passed" not in second.stdout, second.stdout[-2000:]
