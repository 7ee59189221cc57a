#!/usr/bin/env bash
# The test suite on a GPU machine: the GPU as each test process's default backend
# (tests/conftest.py, SPMD_TEST_PLATFORM=gpu), the eight CPU devices beside it.
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
SPMD_TEST_PLATFORM=gpu python3 -m pytest -q -p no:cacheprovider -rfE --junitxml="$out/junit.xml" "$@" 2>&1 | tee "$out/pytest.log" | grep -v "^tests/.* [.sxX]*\s*\[" 
