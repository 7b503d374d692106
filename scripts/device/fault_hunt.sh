#!/usr/bin/env bash
# Trainer faults on the GPU machine: the testbed's two recipes trained side by side, twice each (seeds 0 and 1), on
# data of the testbed's structure (.fault, from fault_data.py) against a random-weight target of the testbed's shape
# (.cfg), with a GPU core dump on any device exception (read back with cuda-gdb: the faulting kernel and its
# instruction); after them one short run of each recipe under compute-sanitizer memcheck with PyTorch's caching
# allocator off (every tensor its own allocation, so an access past a tensor is seen), then the engine's.
# Everything but weights lands in $OUT/fault_hunt.tar.gz; a summary is printed.
#   FH_MINUTES   every trainer's --time-limit, the sanitized ones' too (default 5)
#   FH_SAN_STEPS the sanitized runs' steps (default 100: the time limit may end them first); FH_SAN=0: no sanitized runs
#   FH_EXTRA     more `peagle train` arguments for every run (e.g. a candidate fix's switch)
#   FH_ENGINE=0  no engine pass (scripts/device/engine_sanitize.py under memcheck, after the trainers)
#   FH_RACE=0    no side-by-side trainers (the sanitized runs only)
#   FH_SAN_PARALLEL=1  the sanitized runs side by side, the engine's first (it sizes its KV cache from what is free),
#                the trainers once it has printed its first point or after 120 s; each cut after FH_MINUTES + 140 s
#   FH_SAN_METHODS  the sanitized trainers (default "eagle3 peagle")
#   FH_SAN_CACHING=1  PyTorch's caching allocator on under memcheck (it then checks whole segments only)
#   FH_KEEP=1    keep the work folder of an earlier call on this machine: the sanitized trainers resume from their
#                last checkpoint (saved every FH_SAN_SAVE steps, default 5), so that a memcheck run of more steps
#                than one call holds (about 7 s a step) goes on over calls, a memcheck log per call
set -u
W=${FH_WORK:-/tmp/fault-hunt}
OUT=${OUT:-$W/out}
[ "${FH_KEEP:-0}" = 1 ] || rm -rf "$W"
mkdir -p "$W" "$OUT"
call=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:/tmp/site"
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

$py - "$W/target" <<'PY'
import glob, shutil, sys
import torch, transformers
cfg = transformers.AutoConfig.from_pretrained(".cfg")
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.save_pretrained(sys.argv[1])
for f in glob.glob(".cfg/*.json"):
    if not f.endswith("config.json") or f.endswith("tokenizer_config.json"):
        shutil.copy(f, sys.argv[1])
print("random target written")
PY

common=(--target "$W/target" --data .fault/chat .fault/code --steps 1000000 --max-length 8192 --save-every 500
        --eval-every 500 ${FH_EXTRA:-})
eagle3=(--method eagle3 --num-layers 1 --k-train 3 --batch-size 1)
peagle=(--method peagle --num-layers 4 --k-train 8 --batch-size 1)
minutes=${FH_MINUTES:-5}
pids=()
seeds="0 1"
[ "${FH_RACE:-1}" = 0 ] && seeds=""
for seed in $seeds; do
  for m in eagle3 peagle; do
    name=$m-$seed
    args=("${common[@]}")
    [ $m = eagle3 ] && args+=("${eagle3[@]}") || args+=("${peagle[@]}")
    CUDA_ENABLE_COREDUMP_ON_EXCEPTION=1 CUDA_ENABLE_LIGHTWEIGHT_COREDUMP=1 CUDA_COREDUMP_FILE="$W/core.$name" \
      timeout $(( minutes * 60 + 150 )) $py -m peagle train "${args[@]}" --seed $seed --out "$W/run-$name" \
      --time-limit $minutes > "$W/$name.log" 2>&1 &
    pids+=($!)
  done
done
for p in "${pids[@]}"; do wait $p; echo "pid $p exit $?"; done
san_train() {  # one recipe under memcheck with PyTorch's caching allocator off
  local m=$1 args=("${common[@]}")
  [ $m = eagle3 ] && args+=("${eagle3[@]}") || args+=("${peagle[@]}")
  ls "$W/san-$m"/checkpoints/step-*/trainer_state.pt > /dev/null 2>&1 && args+=(--resume)  # a complete checkpoint
  local nc=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
  [ "${FH_SAN_CACHING:-0}" = 1 ] && nc=()  # PyTorch's caching allocator on: checks whole segments only
  env "${nc[@]}" timeout $(( minutes * 60 + 140 )) compute-sanitizer --tool memcheck \
    --print-limit 20 --log-file "$W/memcheck-$m-$call.log" $py -m peagle train "${args[@]}" --steps ${FH_SAN_STEPS:-100} \
    --eval-fraction 0 --log-every 5 --save-every ${FH_SAN_SAVE:-5} --time-limit $minutes --out "$W/san-$m" \
    >> "$W/san-$m.log" 2>&1
  echo "san-$m exit $?"
}
san_engine() {  # the engine's serving path under memcheck
  for m in eagle3 peagle; do
    l=$([ $m = eagle3 ] && echo 1 || echo 4)
    $py -m peagle drafter init --target "$W/target" --method $m --num-layers $l --out "$W/heads/$m" > /dev/null
  done
  timeout $(( minutes * 60 + 140 )) compute-sanitizer --tool memcheck --print-limit 20 \
    --log-file "$W/memcheck-engine.log" $py scripts/device/engine_sanitize.py "$W/target" "$W/heads" \
    > "$W/engine.log" 2>&1
  echo "engine exit $?"
}
if [ "${FH_SAN_PARALLEL:-0}" = 1 ]; then
  san=()
  [ "${FH_ENGINE:-1}" != 0 ] && { san_engine & san+=($!); }
  for _ in $(seq 120); do grep -q '^{' "$W/engine.log" 2> /dev/null && break; [ ${#san[@]} -eq 0 ] && break; sleep 1; done
  if [ "${FH_SAN:-1}" != 0 ]; then for m in ${FH_SAN_METHODS:-eagle3 peagle}; do san_train $m & san+=($!); done; fi
  for p in "${san[@]}"; do wait $p; done
else  # one at a time, after the trainers: run 32 found that beside them they ran out of memory
  if [ "${FH_SAN:-1}" != 0 ]; then for m in ${FH_SAN_METHODS:-eagle3 peagle}; do san_train $m; done; fi
  [ "${FH_ENGINE:-1}" != 0 ] && san_engine
fi

grep '^{' "$W/engine.log" 2>/dev/null

echo "== trainers"
for f in "$W"/*.log; do
  echo "-- $(basename $f): $(grep -c '"kind": "train"' "${f%.log}"/train_log.jsonl 2>/dev/null) rows"
  grep -E "Error|error|ERROR|Traceback|saved the trained|time limit" "$f" | grep -v Warning | tail -4 | cut -c1-300
done
for d in "$W"/run-* "$W"/san-*; do
  [ -f "$d/train_log.jsonl" ] && echo "$(basename $d): last step $(tail -1 "$d/train_log.jsonl" | cut -c1-80)"
done
echo "== memcheck"
for f in "$W"/memcheck-*.log; do echo "-- $f"; grep -E "ERROR SUMMARY|Invalid|at 0x|by thread|in block" "$f" | head -20; done
echo "== core dumps"
for core in "$W"/core.*; do
  [ -f "$core" ] || continue
  echo "-- $core"
  timeout 120 cuda-gdb -batch -ex "target cudacore $core" -ex "info cuda kernels" -ex "bt" -ex 'x/6i $pc' \
    > "$core.txt" 2>&1
  grep -v "^$" "$core.txt" | tail -40 | cut -c1-400
done
dmesg 2>/dev/null | grep -i xid | tail -5
(cd "$W" && tar czf "$OUT/fault_hunt.tar.gz" --exclude='*/checkpoints' --exclude='core.*[!t]' --exclude=target \
  --exclude='*/final' --exclude='*/tensorboard' --exclude=heads --exclude='*.pt' .) || true
ls -la "$OUT"
