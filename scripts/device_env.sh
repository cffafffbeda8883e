# Sourced by the device scripts (gpu_check.sh, models_gpu.sh): the repository root as the working directory, $OUT
# made, this tree's src/ first on PYTHONPATH, unbuffered Python, one Triton cache directory, and the pure-Python
# wheels carried in .whl/ (e.g. liger-kernel for its anchors) installed into /tmp/site.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/tilefuse_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p "$TRITON_CACHE_DIR"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
