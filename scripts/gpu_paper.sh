#!/usr/bin/env bash
# The CIFAR-10 paper preset on a lent GPU in one call (benchmarks/gpu_paper.py; docs/gpu.md says how to send it).
#   OUT       where summary.json, cost_model.json and runs.tar.gz go (the device tool's output folder)
#   DEADLINE  seconds for the whole call, start-up and data included (default 540: one 10-minute call)
#   DATA      the folder holding cifar10/ (default: shared/data in this checkout)
#   COMMIT    the commit this copy of the tree is (default: git's answer here, where there is a .git)
#   PYTHON    the interpreter (default python3, the GPU image's torch one)
# Wheels in .whl/ (flwr and what the GPU image lacks) are installed first into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
  "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export ONESHOT_FL_GIT_COMMIT="${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
export ONESHOT_FL_GIT_DIRTY="${DIRTY:-0}" PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
exec "${PYTHON:-python3}" -m benchmarks.gpu_paper run --out "${OUT:-/tmp/gpu_paper_out}" --deadline "${DEADLINE:-540}" \
  --data-dir "${DATA:-shared/data}" "$@"
