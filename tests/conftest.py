"""One test suite for both machines.

Without a CUDA device the Triton kernels run in the interpreter; TRITON_INTERPRET must be set before
triton is first imported, so this happens here, before any tilefuse import. With a CUDA device the
same tests run the compiled kernels on the GPU grid (larger shapes, full product of options).
"""
import os
import warnings

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# The interpreter evaluates exp() in numpy: exp(+large) overflows to inf inside sigmoid, which gives the
# right limit (0 or 1) but warns. The warning is noise, not a result.
warnings.filterwarnings("ignore", message="overflow encountered in exp", category=RuntimeWarning)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu_only" in item.keywords:
            item.add_marker(skip)


_FAIL_LOG = os.environ.get("TILEFUSE_FAIL_LOG")
_IS_XDIST_WORKER = False


def pytest_configure(config):
    global _IS_XDIST_WORKER
    _IS_XDIST_WORKER = hasattr(config, "workerinput")  # the controller writes the log, once per failure


def pytest_runtest_logreport(report):
    """With TILEFUSE_FAIL_LOG set, append each failure as it happens (test id + the error's last lines):
    a GPU run cut off by its time limit still says what failed and why."""
    if _FAIL_LOG and report.failed and not _IS_XDIST_WORKER:
        text = report.longreprtext.strip().splitlines()
        with open(_FAIL_LOG, "a") as f:
            f.write(f"FAILED {report.nodeid} [{report.when}]\n  " + "\n  ".join(text[-6:]) + "\n")
