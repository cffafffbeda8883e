"""Packaging and the CLI's preflight checks: the version flag, what ``import tilefuse`` exposes and
imports, and the one-line messages for an unusable numpy, a missing report extra and an untested triton.
Fast, CPU only: nothing here runs a kernel or builds a wheel."""
from __future__ import annotations

import builtins
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tilefuse
from tilefuse import cli, runtime

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "TILEFUSE_", "PYTEST_"))}
    env["PYTHONPATH"] = SRC
    return env


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_clean_env(), timeout=120)


def test_version_flag_prints_the_version():
    out = subprocess.run([sys.executable, "-m", "tilefuse", "--version"], capture_output=True, text=True,
                         env=_clean_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"tilefuse {tilefuse.__version__}\n"


def test_version_is_written_once(capsys):
    # pyproject.toml reads the version from tilefuse.__version__ (dynamic), so there is no second copy.
    text = (Path(SRC).parent / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text and 'attr = "tilefuse.__version__"' in text
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"tilefuse {tilefuse.__version__}\n"


def test_import_exposes_nn_and_does_not_import_triton():
    out = _python("import sys, tilefuse; tilefuse.nn.RMSNorm, tilefuse.nn.LayerNorm; "
                  "print('triton' in sys.modules, tilefuse.__file__)")
    assert out.returncode == 0, out.stderr
    imported, path = out.stdout.split()
    assert imported == "False"
    assert path.startswith(SRC)
    assert "tilefuse" not in out.stderr  # no warning from tilefuse either


def test_py_typed_is_shipped():
    assert (Path(tilefuse.__file__).parent / "py.typed").exists()
    assert '"py.typed"' in (Path(SRC).parent / "pyproject.toml").read_text()


@pytest.fixture
def cpu_report(monkeypatch, tmp_path):
    """cli.main(["report", ...]) as on a machine without a GPU, with run_report replaced so nothing runs
    if a check lets it through; returns (argv, calls of run_report)."""
    from tilefuse.harness import report

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # _prepare_interpreter only sets a default: keep this process's value (and restore it afterwards).
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    monkeypatch.setattr(report, "run_report", lambda **kw: calls.append(kw) or {"ops": {}})
    monkeypatch.setattr(runtime, "_TRITON_CHECKED", False)
    return ["report", "--quick", "--ops", "softmax", "--out", str(tmp_path / "rep")], calls


def _one_line(text: str) -> str:
    assert text.endswith("\n") and text.count("\n") == 1, text
    assert "Traceback" not in text
    return text.rstrip("\n")


def test_report_stops_in_one_line_on_numpy_the_interpreter_cannot_use(cpu_report, monkeypatch, capsys):
    argv, calls = cpu_report
    monkeypatch.setattr(runtime, "numpy_version", lambda: "2.4.1")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert _one_line(err) == (
        "tilefuse report: on a machine without a GPU the kernels run in Triton 3.6's interpreter, which "
        "needs numpy < 2.4 (you have numpy 2.4.1): pip install 'numpy<2.4'")
    assert not calls


@pytest.mark.parametrize("version", ["2.3.5", "1.26.4", "2.3.0rc1"])
def test_numpy_below_the_limit_passes(version, monkeypatch):
    monkeypatch.setattr(runtime, "numpy_version", lambda: version)
    assert runtime.interpreter_numpy_problem() is None


def test_numpy_is_not_checked_on_a_gpu(monkeypatch):
    """On a GPU machine the kernels are compiled, the interpreter is off, and a numpy it could not run on is no
    reason to stop. The check runs afresh here (whatever the tests before it left checked)."""
    from tilefuse.harness import report

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(runtime, "_TRITON_CHECKED", False)
    monkeypatch.setattr(runtime, "numpy_version", lambda: "2.5.0")
    monkeypatch.setattr(report, "run_report", lambda **kw: {"ops": {}})
    assert cli._preflight_report() is None


@pytest.mark.parametrize("missing", [["rich"], ["matplotlib"], ["rich", "matplotlib"]])
def test_report_stops_in_one_line_without_the_report_extra(missing, cpu_report, monkeypatch, capsys):
    argv, calls = cpu_report
    monkeypatch.setattr(runtime, "numpy_version", lambda: "2.3.5")
    real_import = builtins.__import__

    def failing_import(name, *args, **kwargs):
        if name.split(".")[0] in missing:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing_import)
    assert cli.main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("tilefuse report: the report needs rich and matplotlib")
    assert f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed" in line
    assert line.endswith('pip install "tilefuse[report]"')
    assert not calls


@pytest.mark.parametrize("version", ["3.5.1", "3.7.0", "4.0.0"])
def test_report_stops_in_one_line_on_an_untested_triton(version, cpu_report, monkeypatch, capsys):
    argv, calls = cpu_report
    monkeypatch.setattr(runtime, "numpy_version", lambda: "2.3.5")
    monkeypatch.setattr(runtime, "triton_version", lambda: version)
    monkeypatch.delenv(runtime.ALLOW_UNTESTED_TRITON_ENV, raising=False)
    assert cli.main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("tilefuse report: tilefuse's kernels are tested on triton 3.6.x only")
    assert f"triton {version} is installed" in line and "pip install 'triton>=3.6,<3.7'" in line
    assert not calls


def test_report_runs_when_every_check_passes(cpu_report, monkeypatch, capsys):
    from tilefuse.harness import report

    argv, calls = cpu_report
    monkeypatch.setattr(runtime, "numpy_version", lambda: "2.3.5")
    monkeypatch.setattr(report, "summary_text", lambda result: "summary: all bounds met\n", raising=False)
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    wrote = f"wrote {os.path.join(argv[-1], 'REPORT.md')}, report.json and plots"
    assert out[-2:] == ["summary: all bounds met", wrote]
    assert calls and calls[0]["ops"] == ["softmax"] and calls[0]["quick"]


def test_tune_stops_in_one_line_on_an_untested_triton(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TILEFUSE_AUTOTUNE", raising=False)
    monkeypatch.setattr(runtime, "_TRITON_CHECKED", False)
    monkeypatch.setattr(runtime, "triton_version", lambda: "3.5.0")
    monkeypatch.delenv(runtime.ALLOW_UNTESTED_TRITON_ENV, raising=False)
    assert cli.main(["tune", "--ops", "softmax"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("tilefuse tune: tilefuse's kernels are tested on triton 3.6.x only")


def test_check_triton(monkeypatch):
    monkeypatch.delenv(runtime.ALLOW_UNTESTED_TRITON_ENV, raising=False)
    monkeypatch.setattr(runtime, "_TRITON_CHECKED", False)
    monkeypatch.setattr(runtime, "triton_version", lambda: "3.5.1")
    with pytest.raises(ImportError, match=r"tested on triton 3\.6\.x only .* triton 3\.5\.1 is installed"):
        runtime.check_triton()
    with pytest.raises(runtime.UnsupportedTritonError):
        runtime.check_triton()  # a failed check is not remembered as passed

    monkeypatch.setattr(runtime, "triton_version", lambda: None)
    with pytest.raises(ImportError, match=r"triton is not installed: pip install 'triton>=3\.6,<3\.7'"):
        runtime.check_triton()

    monkeypatch.setenv(runtime.ALLOW_UNTESTED_TRITON_ENV, "1")  # the escape hatch for trying a new triton
    monkeypatch.setattr(runtime, "triton_version", lambda: "3.7.0")
    runtime.check_triton()
    monkeypatch.delenv(runtime.ALLOW_UNTESTED_TRITON_ENV)

    monkeypatch.setattr(runtime, "_TRITON_CHECKED", False)
    for ok in ("3.6.0", "3.6.1", "3.6.0+git9a8b7c6"):
        monkeypatch.setattr(runtime, "triton_version", lambda ok=ok: ok)
        assert runtime.triton_problem() is None
    runtime.check_triton()
    assert runtime._TRITON_CHECKED
    monkeypatch.setattr(runtime, "triton_version", lambda: "3.5.1")
    runtime.check_triton()  # after one success the check is one global read


def test_the_installed_triton_is_supported():
    # This suite runs on the versions tilefuse supports: the real check passes here, without importing triton.
    out = _python("import sys; from tilefuse import runtime; runtime.check_triton(); "
                  "print(runtime.triton_version(), 'triton' in sys.modules)")
    assert out.returncode == 0, out.stderr
    version, imported = out.stdout.split()
    assert version.startswith("3.6") and imported == "False"


def test_a_kernel_call_in_the_interpreter_names_the_numpy_it_cannot_use(monkeypatch):
    """A user's own script under TRITON_INTERPRET=1 (not the CLI) gets the one-line explanation at the first
    kernel launch, before the interpreter fails inside with an error that names neither numpy nor the fix."""
    import tilefuse

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(runtime, "_TRITON_CHECKED", False)
    monkeypatch.setattr(runtime, "numpy_version", lambda: "2.4.0")
    with pytest.raises(runtime.InterpreterNumpyError, match=r"needs numpy < 2.4 \(you have numpy 2.4.0\)"):
        tilefuse.softmax(torch.randn(4, 8), -1)
    if not torch.cuda.is_available():  # on a GPU machine triton was imported compiled: no interpreter to run
        monkeypatch.setattr(runtime, "numpy_version", lambda: "2.3.5")
        assert torch.allclose(tilefuse.softmax(torch.randn(4, 8), -1).sum(-1), torch.ones(4))


def test_make_sets_up_the_venv_again_only_when_its_inputs_change(tmp_path):
    """The README's commands run the bootstrap once, then again only after pyproject.toml or the bootstrap
    script changed (a re-run of pip costs seconds on every make otherwise)."""
    import shutil
    import time

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    root = Path(__file__).resolve().parents[1]
    shutil.copy(root / "Makefile", tmp_path / "Makefile")
    shutil.copy(root / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "scripts").mkdir()
    log = tmp_path / "bootstrap.log"
    (tmp_path / "scripts" / "bootstrap.sh").write_text(f'mkdir -p "$1/bin"; echo ran >> {log}\n')

    def setup_runs():
        subprocess.run(["make", "-s", "setup"], cwd=tmp_path, check=True, capture_output=True)
        return len(log.read_text().splitlines())
    assert setup_runs() == 1
    assert setup_runs() == 1  # nothing changed: no bootstrap
    stamp = tmp_path / ".venv" / ".tilefuse-setup"
    earlier = time.time() - 10
    os.utime(stamp, (earlier, earlier))  # pyproject.toml edited after the last setup
    (tmp_path / "pyproject.toml").touch()
    assert setup_runs() == 2
    assert setup_runs() == 2


def test_the_readme_quickstart_runs_as_written():
    """The README's Quickstart block, verbatim, in a fresh interpreter as a user runs it (no TRITON_INTERPRET):
    on a GPU the kernels, on a CPU the plain PyTorch reference."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Quickstart"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", 10)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    path = "compiled" if torch.cuda.is_available() else "reference"
    assert done.stdout.split()[0] == path, done.stdout
