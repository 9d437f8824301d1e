#!/usr/bin/env bash
# One-step set-up for a fresh machine, then the main job or the tests.
#   bash bootstrap.sh demo     install, then `fedprism demo` (FedPrism, Fed-PRISM vs baselines; 1.5-3 min on 2 cores)
#   bash bootstrap.sh test     install, then the whole test suite (fast tests, then the slow ones)
#   bash bootstrap.sh fast     install, then only the fast tests (< 10 min on 2 cores)
#   bash bootstrap.sh install  install only
# Creates ./.venv; installs torch first (the CPU build where one is on local disk) so that the
# package's bare `torch` requirement never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
TORCH_VERSION="${FEDPRISM_TORCH:-2.13.0}"
PY="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" 2>/dev/null; then
  "$VPY" -m pip install -q "torch==${TORCH_VERSION}"
fi
"$VPY" -m pip install -q -e ".[dev,flower,tune,hf]"
# The dp extra (Opacus, for dp.local=dpsgd) without its dependencies: Opacus asks for torch>=2.6, and resolving
# that may swap the CPU torch above for another build; its other needs (numpy, scipy) are installed already.
"$VPY" -m pip install -q --no-deps "opacus==1.6.0" "opt-einsum>=3.3"

# The optional CPU kernels (fedprism.kernels; train.kernels / eval.kernels = auto use them where built):
# compiled once for this CPU, about a minute per library on 2 cores, cached; FEDPRISM_NO_KERNELS=1 skips it.
# A failed build is not fatal: runs then use PyTorch's kernels.
if [ -z "${FEDPRISM_NO_KERNELS:-}" ]; then
  .venv/bin/fedprism kernels build >/dev/null 2>&1 \
    || echo "bootstrap: the optional CPU kernels were not built ('.venv/bin/fedprism kernels status' says why);" \
            "runs use PyTorch's kernels" >&2
fi

# Real Fashion-MNIST from Debian when we can; otherwise the demo uses the bundled digits set.
if [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && [ -z "${FEDPRISM_NO_APT:-}" ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 \
      || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1)) \
      || echo "bootstrap: could not install dataset-fashion-mnist; demo falls back to digits" >&2
  else
    echo "bootstrap: Fashion-MNIST not found. Get it with 'sudo apt-get install dataset-fashion-mnist'" \
         "or '.venv/bin/fedprism data download fmnist'; the demo falls back to digits." >&2
  fi
fi

# The fast tests run in $FEDPRISM_TEST_WORKERS pytest-xdist processes (default 2: each test uses one torch
# thread, so two processes use both cores of the 2-core target); the slow ones (Flower clusters, whole
# paper runs) one at a time.
WORKERS="${FEDPRISM_TEST_WORKERS:-2}"

pytest_phase() {  # pytest exits 5 when a marker selects nothing: that is not a failure here
  local rc=0
  .venv/bin/python -m pytest "$@" || rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
}

case "${1:-demo}" in
  demo)    shift || true; exec .venv/bin/fedprism demo "$@" ;;
  test)    pytest_phase -q -m "not slow" -n "$WORKERS"; pytest_phase -q -m slow ;;
  fast)    pytest_phase -q -m "not slow" -n "$WORKERS" ;;
  install) echo "installed: $(.venv/bin/fedprism --help | head -1)" ;;
  *)       echo "usage: bash bootstrap.sh [demo|test|fast|install]" >&2; exit 2 ;;
esac
