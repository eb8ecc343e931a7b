#!/usr/bin/env bash
# Run the test suite on another torch release than the pinned one (the oldest supported: 2.11).
#
#   tools/test_torch.sh [VERSION] [VENV]      # defaults: 2.11.0, .venv-torch-VERSION
#
# Builds (once) a virtual environment with torch==VERSION from the package index (on Linux that is
# the CUDA build: about 5 GB with its CUDA libraries; it runs on the CPU) and every other package
# at the release constraints.txt pins (torchao, whose pinned release needs the newer torch, and so
# the quant extra, left out), installs this checkout into it, then runs the whole pytest suite.
# Arguments after the second go to pytest. docs/testing.md says when to run it.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-2.11.0}"
venv="${2:-.venv-torch-$version}"
shift $(( $# > 2 ? 2 : $# ))
if [ ! -x "$venv/bin/python" ]; then
    python -m venv "$venv"
    grep -v -E '^(torch|torchao)==' constraints.txt > "$venv/constraints.txt"
    "$venv/bin/pip" install -q "torch==$version"
    "$venv/bin/pip" install -q -c "$venv/constraints.txt" -e '.[dev,diffusers]'
fi
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
