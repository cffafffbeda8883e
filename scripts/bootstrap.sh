#!/usr/bin/env bash
# Make (or refresh) the local venv the README's commands use.
# - The venv sees the system's site-packages, so a CUDA torch/triton a GPU user already has is used
#   as is and never replaced; only when no torch is installed is the pinned CPU build installed.
# - Without a GPU the kernels run in the Triton interpreter, which breaks on numpy >= 2.4: pin it then.
# - What is missing goes in one pip call (pip byte-compiles at install: with PYTHONDONTWRITEBYTECODE set, as on
#   CI, nothing would write .pyc files later, and every process would compile torch's sources again).
set -euo pipefail
VENV=${1:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
V="$VENV/bin/python"
# One probe: which of torch and triton are installed (without importing them), and whether a GPU is there.
read -r HAS_TORCH HAS_TRITON HAS_GPU < <("$V" - <<'PROBE'
import importlib.util
torch = importlib.util.find_spec("torch") is not None
triton = importlib.util.find_spec("triton") is not None
gpu = False
if torch:
    try:
        import torch as t
        gpu = t.cuda.is_available()
    except Exception:  # an installed torch that does not import: install the pinned one
        torch = False
print(int(torch), int(triton), int(gpu))
PROBE
)
WANT=()
[ "$HAS_TORCH" = 1 ] || WANT+=("torch==2.13.0")
[ "$HAS_TRITON" = 1 ] || WANT+=("triton==3.6.0")
[ "$HAS_GPU" = 1 ] || WANT+=("numpy<2.4")
WANT+=(pytest pytest-xdist hypothesis matplotlib rich "transformers==5.17.0")
"$V" -m pip install -q --disable-pip-version-check "${WANT[@]}"
"$V" -m pip install -q --disable-pip-version-check --no-compile --no-deps -e .
