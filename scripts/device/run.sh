#!/usr/bin/env bash
# One script for the GPU machine: builds, checks and times peagle in stages that fit one call each.
#   bash scripts/device/run.sh STAGE      (STAGE: stage_a | stage_b | regen | train | bench | serve | scale)
# Large inputs travel in ignored folders named by the caller (.stage_a, .stage_b: halves of the testbed GGUF;
# .whl: wheels missing on the machine; .gpu: prompt files). Everything built lives under $W (kept while the
# machine stays warm); results are copied to $OUT.
set -euo pipefail
W=${PEAGLE_WORK:-/tmp/pg}
OUT=${OUT:-$W/out}
mkdir -p "$W" "$OUT" "$W/results"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PEAGLE_CACHE="$W/cache"
py=python3

install_wheels() {
  if [ ! -f /tmp/site/.done ] && [ -d .whl ]; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    touch /tmp/site/.done
  fi
}

need_model() {
  if [ ! -f "$W/smollm2/config.json" ]; then
    [ -f "$W/gguf.part.aa" ] || { echo "stage_a has not run on this machine (no $W/gguf.part.aa)"; exit 3; }
    cat "$W/gguf.part.aa" .stage_b/gguf.part.ab > "$W/smollm2.gguf"
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $W/smollm2.gguf" | sha256sum -c -
    $py -m peagle convert gguf "$W/smollm2.gguf" "$W/smollm2" --dtype bf16
  fi
}

random_heads() {
  for m in eagle3 peagle; do
    layers=$([ $m = eagle3 ] && echo 1 || echo 4)
    [ -f "$W/heads/random-$m/config.json" ] || \
      $py -m peagle drafter init --target "$W/smollm2" --method $m --num-layers $layers --out "$W/heads/random-$m"
  done
}

stage=${1:?stage}
install_wheels
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
case "$stage" in
  stage_a)
    cp .stage_a/gguf.part.aa "$W/"
    $py -m pytest tests/gpu -q -x 2>&1 | tee "$OUT/gpu_tests.log"
    ;;
  stage_b)
    need_model
    $py scripts/device/verify_target.py "$W/smollm2" "$OUT/verify_target.json" | tee "$OUT/verify_target.log"
    random_heads
    $py scripts/device/engine_check.py "$W/smollm2" "$OUT/engine_check.json" \
      --head eagle3="$W/heads/random-eagle3" --head peagle="$W/heads/random-peagle" | tee "$OUT/engine_check.log"
    $py scripts/device/engine_timing.py "$W/smollm2" "$OUT/engine_timing.json" \
      --head eagle3="$W/heads/random-eagle3" --head peagle="$W/heads/random-peagle" | tee "$OUT/engine_timing.log"
    ;;
  *)
    echo "unknown stage $stage"; exit 2 ;;
esac
cp -r "$OUT"/. "$W/results/" 2>/dev/null || true
