#!/usr/bin/env bash
# One script for the GPU machine: builds, checks and times peagle in stages that fit one call each.
#   bash scripts/device/run.sh STAGE      (STAGE: stage_a | gpu_tests | stage_b | bench | serve | scale)
# Large inputs travel in ignored folders named by the caller (.stage_a, .stage_b: halves of the testbed GGUF;
# .whl: wheels missing on the machine; .gpu: prompt files). Everything built lives under $W (kept while the
# machine stays warm); results are copied to $OUT.
set -euo pipefail
W=${PEAGLE_WORK:-${TMPDIR:-/tmp}/peagle-device}
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
    ;;
  gpu_tests)
    $py -m pytest tests/gpu -q 2>&1 | tee "$OUT/gpu_tests.log"
    ;;
  stage_b)
    # Convert, then train heads in the background while the correctness checks run in the foreground.
    need_model
    random_heads
    train_secs=${TRAIN_SECS:-270}
    (
      set +e
      zcat .gpu/sharegpt_train.jsonl.gz > "$W/sharegpt_train.jsonl"
      timeout -s TERM ${REGEN_SECS:-150} $py -m peagle regenerate --model "$W/smollm2" --prompts "$W/sharegpt_train.jsonl" \
        --out "$W/data" --max-tokens 384 --batch-size 256 --max-model-len 2048 --limit ${REGEN_LIMIT:-6000}
      for m in peagle eagle3; do
        $py -m peagle train --target "$W/smollm2" --data "$W/data" --method $m \
          --out "$W/train-$m" --steps ${TRAIN_STEPS:-3000} --k-train 8 --max-length 2048 --lr 3e-4 \
          --save-every 250 --eval-every 500 --time-limit $(python3 -c "print($train_secs / 60)") \
          > "$W/train-$m.log" 2>&1 &
      done
      wait
    ) > "$W/pipeline.log" 2>&1 &
    pipeline=$!
    $py scripts/device/verify_target.py "$W/smollm2" "$OUT/verify_target.json" 2>&1 | tail -20 | tee "$OUT/verify_target.log" || true
    $py scripts/device/engine_check.py "$W/smollm2" "$OUT/engine_check.json" --num-prompts 32 \
      --head eagle3="$W/heads/random-eagle3" --head peagle="$W/heads/random-peagle" 2>&1 | tail -30 | tee "$OUT/engine_check.log" || true
    wait $pipeline || true
    tail -5 "$W/pipeline.log"; for m in peagle eagle3; do tail -3 "$W/train-$m.log"; cp "$W/train-$m.log" "$OUT/"; \
      cp "$W/train-$m/train_log.jsonl" "$OUT/train-$m.jsonl" 2>/dev/null || true; done
    ;;
  bench)
    for m in peagle eagle3; do
      if [ -f "$W/train-$m/final/config.json" ]; then ln -sfn "$W/train-$m/final" "$W/heads/$m"
      else ln -sfn "$(ls -d "$W/train-$m/checkpoints/step-"* | tail -1)" "$W/heads/$m"; fi
    done
    $py scripts/device/engine_timing.py "$W/smollm2" "$OUT/engine_timing.json" \
      --head eagle3="$W/heads/eagle3" --head peagle="$W/heads/peagle" 2>&1 | tail -12 | tee "$OUT/engine_timing.log" || true
    $py -m peagle bench --model "$W/smollm2" --draft-eagle3 "$W/heads/eagle3" --draft-peagle "$W/heads/peagle" \
      --methods none,eagle3,peagle --k ${BENCH_K:-3,7} --concurrency ${BENCH_C:-1,4,16,64} \
      --datasets mtbench,humaneval --num-prompts ${BENCH_N:-32} --max-tokens 128 --max-model-len 4096 \
      --out "$OUT/bench" 2>&1 | tail -40
    ;;
  serve)
    $py scripts/device/server_soak.py "$W/smollm2" "$OUT/server_soak.json" --head "$W/heads/peagle" --k 7 \
      --clients 64 --seconds ${SOAK_SECS:-120} 2>&1 | grep -v -E " INFO " | tail -20
    ;;
  scale)
    $py scripts/device/scale_check.py "$OUT/scale.json" 2>&1 | tail -5
    ;;
  *)
    echo "unknown stage $stage"; exit 2 ;;
esac
cp -r "$OUT"/. "$W/results/" 2>/dev/null || true
