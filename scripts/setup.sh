#!/usr/bin/env bash
# One-time set-up: a virtual environment in .venv with the project and its test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch/torchvision pinned together (a mismatched pair fails at import: "torchvision::nms does not exist")
.venv/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
.venv/bin/python -m pip install -q -e ".[dev]"
echo "set-up done: .venv ready ($(.venv/bin/python -c 'import flwr, torch; print("flwr", flwr.__version__, "torch", torch.__version__)'))"
