#!/usr/bin/env bash
# One-time set-up: a virtual environment in .venv with the project and its test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# check the interpreter before anything is downloaded (torch alone is hundreds of MB)
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "setup.sh: oneshot-fl needs Python >= 3.11; '$PYTHON' is $("$PYTHON" -V 2>/dev/null || echo 'not found')." >&2
    echo "          Run it with a newer interpreter, e.g. PYTHON=python3.11 ./scripts/setup.sh" >&2
    exit 1
fi
"$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch/torchvision first (pip's configured index or wheel cache), pinned to the pair that
# pyproject.toml pins, so the `pip install -e .` below finds them satisfied and changes nothing
.venv/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
.venv/bin/python -m pip install -q -e ".[dev]"
echo "set-up done: .venv ready ($(.venv/bin/python -c 'import flwr, torch; print("flwr", flwr.__version__, "torch", torch.__version__)'))"
