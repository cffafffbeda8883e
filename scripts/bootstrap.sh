#!/usr/bin/env bash
# Make (or refresh) the local venv the README's commands use.
# - The venv sees the system's site-packages, so a CUDA torch/triton a GPU user already has is used
#   as is and never replaced; only when `import torch` fails is the pinned CPU build installed.
# - Without a GPU the kernels run in the Triton interpreter, which breaks on numpy >= 2.4: pin it then.
set -euo pipefail
VENV=${1:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
V="$VENV/bin/python"
pip_install() { "$V" -m pip install -q --disable-pip-version-check "$@"; }
if ! "$V" -c "import torch" 2>/dev/null; then
  pip_install "torch==2.13.0"
fi
if ! "$V" -c "import triton" 2>/dev/null; then
  pip_install "triton==3.6.0"
fi
if ! "$V" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  pip_install "numpy<2.4"
fi
pip_install pytest pytest-xdist hypothesis matplotlib rich "transformers==5.17.0"
pip_install --no-deps -e .
