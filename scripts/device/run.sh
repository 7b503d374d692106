#!/usr/bin/env bash
# The GPU machine's entry point, one stage a call, run from the repository root:
#   bash scripts/device/run.sh STAGE        (bash scripts/device/run.sh --help: the stages, one line each)
# Each stage is a function of scripts/device/stages.py whose docstring says what it does, what it carries and reads,
# and what it leaves under $OUT; docs/DEVICE.md shows how the stages chain. Large inputs travel in ignored folders
# that scripts/device/stage_local.sh builds and the call carries (.stage_* .whl .gpu .old .cfg .tb_a .tb_b
# .tb_c .hp_* .g3_* .vllm_*). Everything built lives under $W, kept while the machine stays warm; results go to $OUT.
set -euo pipefail
# The stages stages.py defines, in the order docs/DEVICE.md tells them (a unit test holds the two lists together).
stages=(
  stage_a tb_stage testbed testbed_data testbed_wait heads_out heads_in
  kernels admit prefix muon mmhost gpu_tests throughput buckets engine
  data train wait heads serve walk check ablate
  stage_b bench confidence bench2 sampled_ab httpserve longloop final teacher scale
  vllm_part vllm_stage vllm_bench
)
W=${PEAGLE_WORK:-${TMPDIR:-/tmp}/peagle-device}
OUT=${OUT:-$W/out}
export W OUT PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PEAGLE_CACHE="$W/cache"
py=${PYTHON:-python3}
stage=${1:?"usage: bash scripts/device/run.sh STAGE, one of: ${stages[*]}"}
exec $py scripts/device/stages.py "$stage"
