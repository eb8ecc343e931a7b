#!/usr/bin/env bash
# The GPU check on a lent GPU machine, as one prepared command (docs/testing.md, "What only a GPU can
# show"). That machine's image has Python 3.12, torch and transformers, no diffusers, and no network.
#
#   tools/gpu_check.sh --wheels     # here, with the package index: the diffusers and Pillow wheels
#                                   # constraints.txt pins, for Python 3.12 on x86-64 Linux, into .whl/
#   tools/gpu_check.sh [ARGS...]    # there, with .whl/ carried over: installs those wheels without the
#                                   # index, then runs benchmarks/gpu_check.py --out "$OUT" ARGS
#                                   # (its own deadline is 7 minutes; this stops it at 8)
#
# A wheel that does not install only skips the rows that need it (gpu_check says how to bring it).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--wheels" ]; then
    rm -rf .whl
    mkdir -p .whl
    mapfile -t pins < <(grep -E '^(diffusers|pillow)==' constraints.txt)
    pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
    ls -l .whl
    exit 0
fi
out="${OUT:-$PWD/gpu_check_out}"
if compgen -G ".whl/*.whl" > /dev/null; then
    python -m pip install -q --no-deps --no-index .whl/*.whl \
        || echo "tools/gpu_check.sh: the carried wheels did not install; the rows that need them skip"
fi
python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU available', torch.cuda.is_available())"
exec timeout 480 python benchmarks/gpu_check.py --out "$out" "$@"
