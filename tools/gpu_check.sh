#!/usr/bin/env bash
# The GPU check on a lent GPU machine, as one prepared command (docs/testing.md, "What only a GPU can
# show"). That machine's image has Python 3.12, torch and transformers, no diffusers, and no network.
#
#   tools/gpu_check.sh --wheels     # here, with the package index: the diffusers and Pillow wheels
#                                   # constraints.txt pins, for Python 3.12 on x86-64 Linux, into .whl/
#   tools/gpu_check.sh [ARGS...]    # there, with .whl/ carried over (it is git-ignored: name it in the
#                                   # run's carry): installs those wheels without the index into
#                                   # .whl/site (on PYTHONPATH; the machine's Python is left alone),
#                                   # then runs benchmarks/gpu_check.py --out "$OUT" ARGS (its own
#                                   # deadline is 7 minutes; this stops it at 8)
#
# GPU_CHECK_WHEELS names another wheel folder. A wheel that does not install only skips the rows that
# need it (gpu_check says how to bring it).
set -euo pipefail
cd "$(dirname "$0")/.."
wheels="${GPU_CHECK_WHEELS:-.whl}"
if [ "${1:-}" = "--wheels" ]; then
    mapfile -t pins < <(grep -E '^(diffusers|pillow)==' constraints.txt || true)
    if [ "${#pins[@]}" -ne 2 ]; then
        echo "tools/gpu_check.sh: constraints.txt pins no diffusers or no pillow" >&2
        exit 1
    fi
    fresh=$(mktemp -d)
    pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$fresh" "${pins[@]}"
    rm -rf "$wheels"  # (only once the new ones are in)
    mv "$fresh" "$wheels"
    ls -l "$wheels"
    exit 0
fi
out="${OUT:-$(mktemp -d)}"
if compgen -G "$wheels/*.whl" > /dev/null; then
    site="$(realpath -m "$wheels")/site"
    python -m pip install -q --no-deps --no-index --upgrade --target "$site" "$wheels"/*.whl \
        || echo "tools/gpu_check.sh: the carried wheels did not install; the rows that need them skip"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU available', torch.cuda.is_available())"
echo "tools/gpu_check.sh: writing to $out"
exec timeout -k 15 480 python benchmarks/gpu_check.py --out "$out" "$@"
