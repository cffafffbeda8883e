"""One test suite for both machines.

Without a CUDA device the Triton kernels run in the interpreter; TRITON_INTERPRET must be set before
triton is first imported, so this happens here, before any tilefuse import. With a CUDA device the
same tests run the compiled kernels on the GPU grid (larger shapes, full product of options).
"""
import os
import re
import warnings

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Triton fixes its mode (interpreter or compiled) when first imported: import it now, so a test that
# switches TRITON_INTERPRET off to reach the plain-PyTorch path cannot be the first importer.
import triton  # noqa: E402,F401

import pytest  # noqa: E402

# The interpreter evaluates exp() in numpy: exp(+large) overflows to inf inside sigmoid, which gives the
# right limit (0 or 1) but warns. The warning is noise, not a result.
warnings.filterwarnings("ignore", message="overflow encountered in exp", category=RuntimeWarning)


@pytest.fixture
def tilefuse_backend():
    """The test checks a property of tilefuse's own kernels (a kernel variant, a launch record, an exact
    zero), so it pins the tilefuse backend whatever TILEFUSE_BACKEND says; the vendor compositions are checked
    by the registry grid and tests/test_backends.py."""
    import tilefuse

    with tilefuse.use_backend("tilefuse"):
        yield


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")


def _base_id(nodeid: str) -> str:
    """The test id without xdist's ``@group`` suffix (present in reports under --dist loadgroup)."""
    return re.sub(r"@[^\]]*$", "", nodeid)


def _already_passed() -> set[str]:
    """Ids recorded as passed in the result logs named by TILEFUSE_SKIP_PASSED (paths joined by ':')."""
    done = set()
    for path in filter(None, os.environ.get("TILEFUSE_SKIP_PASSED", "").split(":")):
        with open(path) as f:
            for line in f:
                outcome, _, nodeid = line.rstrip("\n").split(" ", 2)
                if outcome == "passed":
                    done.add(_base_id(nodeid))
    return done


def _registry_sample(items):
    """TILEFUSE_REGISTRY_STRIDE=k keeps every k-th registry-grid case of each op (in grid order, so the
    sample spans every axis) and drops the rest: a GPU call too short for the whole grid (2,800 compiled
    cases) still checks every op. Unset (CI, full runs): every case."""
    stride = int(os.environ.get("TILEFUSE_REGISTRY_STRIDE", "1") or 1)
    if stride <= 1:
        return items, []
    seen: dict = {}
    kept, dropped = [], []
    for item in items:
        if "test_matches_float64_reference" not in item.nodeid:
            kept.append(item)
            continue
        op = item.callspec.id.split("-", 1)[0]
        i = seen[op] = seen.get(op, -1) + 1
        (kept if i % stride == 0 else dropped).append(item)
    return kept, dropped


def pytest_collection_modifyitems(config, items):
    items[:], sampled_out = _registry_sample(items)
    if sampled_out:
        config.hook.pytest_deselected(items=sampled_out)
    # A GPU run cut off by its time limit resumes in the next call: tests that passed before are dropped.
    done = _already_passed()
    if done:
        kept = [item for item in items if _base_id(item.nodeid) not in done]
        config.hook.pytest_deselected(items=[item for item in items if _base_id(item.nodeid) in done])
        items[:] = kept
    if ON_GPU:
        return
    # CI's time limit: on a CPU the cases marked exhaustive (more of a grid whose representative cases run
    # anyway) are left to the GPU suite, unless TILEFUSE_EXHAUSTIVE=1 asks for them here.
    if os.environ.get("TILEFUSE_EXHAUSTIVE", "0") in ("", "0"):
        rest = [item for item in items if "exhaustive" in item.keywords]
        if rest:
            config.hook.pytest_deselected(items=rest)
            items[:] = [item for item in items if "exhaustive" not in item.keywords]
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu_only" in item.keywords:
            item.add_marker(skip)


_FAIL_LOG = os.environ.get("TILEFUSE_FAIL_LOG")
_RESULT_LOG = os.environ.get("TILEFUSE_RESULT_LOG")
_IS_XDIST_WORKER = False


def pytest_configure(config):
    global _IS_XDIST_WORKER
    _IS_XDIST_WORKER = hasattr(config, "workerinput")  # the controller writes the log, once per failure


def pytest_runtest_logreport(report):
    """With TILEFUSE_FAIL_LOG set, append each failure as it happens (test id + the error's last lines):
    a GPU run cut off by its time limit still says what failed and why."""
    if _IS_XDIST_WORKER:
        return
    if _RESULT_LOG and (report.when == "call" or report.outcome != "passed"):
        # One line per test as it ends ("outcome seconds id"): which tests ran, and where the time went.
        with open(_RESULT_LOG, "a") as f:
            f.write(f"{report.outcome} {report.duration:.2f} {report.nodeid}\n")
    if _FAIL_LOG and report.failed:
        text = report.longreprtext.strip().splitlines()
        with open(_FAIL_LOG, "a") as f:
            f.write(f"FAILED {report.nodeid} [{report.when}]\n  " + "\n  ".join(text[-6:]) + "\n")


@pytest.fixture
def tma_launch_device(monkeypatch):
    """The device for tests of the Hopper (TMA) kernels: the GPU, or on a CPU the interpreter (which runs
    tensor descriptors) with an sm_90 device of 3 SMs, so persistent programs loop over several tiles, host
    tensors taken as TMA-capable (launches that choose by device pick the TMA kernels), and descriptor
    scratch in host memory."""
    if ON_GPU:
        return torch.device("cuda")
    import triton
    from tilefuse import runtime
    from tilefuse.kernels.gemm import launch

    monkeypatch.setattr(runtime, "device_facts", lambda device: (9, 3))
    monkeypatch.setattr(launch.rules, "tma_device", lambda t: True)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    return torch.device("cpu")


@pytest.fixture
def pinned_tuners(monkeypatch):
    """Every autotuner picks its first pruned config, as the GPU tests do (TILEFUSE_AUTOTUNE=0), with
    fresh in-process caches so this test settles its own keys; no fast-path plan survives from before."""
    from tilefuse import tuning
    from tilefuse.kernels import fastpath
    from tilefuse.kernels.attention import launch as _a  # noqa: F401  (each family's tuners, registered)
    from tilefuse.kernels.gemm import launch as _g  # noqa: F401
    from tilefuse.kernels.norms import launch as _n  # noqa: F401
    from tilefuse.kernels.softmax import launch as _s  # noqa: F401

    tuners = list(tuning.autotuner._TUNERS.values())
    for t in tuners:
        monkeypatch.setattr(t, "pinned", True)
        monkeypatch.setattr(t, "cache", {})
    fastpath.clear_all()
    yield tuners
    fastpath.clear_all()
