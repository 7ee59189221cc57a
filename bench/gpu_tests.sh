#!/usr/bin/env bash
# The test suite on a GPU machine, in two runs: every test that runs on one device
# with the GPU as the default backend (tests/conftest.py, SPMD_TEST_PLATFORM=gpu),
# then the `cpu_mesh` tests on the eight simulated CPU devices, as CI runs them.
# Usage: bash bench/gpu_tests.sh [OUTDIR] [pytest args...]; wheels of packages the
# machine lacks may sit in .whl/ (installed to /tmp/site, no network needed).
set -u
out=${1:-/tmp/gpu_tests}; shift || true
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 ||
  echo "editable install failed; spmd from PYTHONPATH" >&2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys,jax,jaxlib,flax,optax,numpy,orbax.checkpoint as o; print(sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'numpy', numpy.__version__); print(jax.devices(), jax.devices()[0].device_kind)"
echo "== on the GPU"
SPMD_TEST_PLATFORM=gpu python3 -m pytest -q -p no:cacheprovider -rfE --junitxml="$out/gpu.xml" "$@" \
  2>&1 | tee "$out/gpu.log" | grep -v "^tests/.* [.sxX]*\s*\["
echo "== cpu_mesh tests on the CPU devices"
python3 -m pytest -q -p no:cacheprovider -rfE -m cpu_mesh --junitxml="$out/cpu_mesh.xml" "$@" \
  2>&1 | tee "$out/cpu_mesh.log" | grep -v "^tests/.* [.sxX]*\s*\["
