#!/usr/bin/env bash
# Trainer faults (issue 48), the compile-cache hypothesis: four P-EAGLE trainers side by side from cold compile caches,
# seeds 0 and 1 sharing one Triton/Inductor cache (as the testbed's side-by-side trainers do), seeds 0 and 1 each with
# caches of their own. Every trainer runs with CUDA's GPU core dump on exception, so a fault names its kernel and PC
# (read back with cuda-gdb). Run from the repository root with .fault and .cfg carried (benchmarks/runs/run-32.md),
# about 5 minutes; RACE_MINUTES (3) of training. Leaves $OUT/race.tar.gz (logs, fault records, cuda-gdb's reading).
set -u
W=/tmp/cache; rm -rf $W /tmp/torchinductor_* ~/.triton ~/.cache/triton; mkdir -p $W
OUT=${OUT:-$W/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src"
export CUDA_ENABLE_COREDUMP_ON_EXCEPTION=1 CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION=0 CUDA_ENABLE_LIGHTWEIGHT_COREDUMP=1
minutes=${RACE_MINUTES:-3}
python3 - "$W/target" <<'PY'
import glob, shutil, sys, torch, transformers
cfg = transformers.AutoConfig.from_pretrained(".cfg"); torch.manual_seed(0)
transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(sys.argv[1])
for f in glob.glob(".cfg/*.json"):
    if not f.endswith("config.json") or f.endswith("tokenizer_config.json"): shutil.copy(f, sys.argv[1])
PY
pids=()
for name in shared-0 shared-1 own-0 own-1; do
  seed=${name##*-}; c=$W/cache-shared; [ ${name%-*} = own ] && c=$W/cache-$name
  CUDA_COREDUMP_FILE=$W/core-$name TRITON_CACHE_DIR=$c/triton TORCHINDUCTOR_CACHE_DIR=$c/inductor \
    timeout $((minutes * 60 + 80)) python3 -m peagle train \
    --target $W/target --data .fault/chat .fault/code --steps 1000000 --max-length 8192 --save-every 100000 \
    --eval-every 100000 --method peagle --num-layers 4 --k-train 8 --batch-size 1 --seed $seed --out $W/run-$name \
    --time-limit $minutes > $W/$name.log 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait $p; echo "pid $p rc $?"; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for name in shared-0 shared-1 own-0 own-1; do
  echo "-- $name: $(tail -1 $W/run-$name/train_log.jsonl 2>/dev/null | cut -c1-60)"
  grep -E "fault|Error|error:" $W/$name.log | grep -v Warning | head -3 | cut -c1-300
done
for core in $W/core-*; do
  [ -e "$core" ] || continue
  echo "== $core"
  for cmd in "info cuda kernels" "bt" "info cuda warps" "x/4i \$pc"; do
    timeout 60 cuda-gdb -batch -ex "target cudacore $core" -ex "$cmd" 2>&1 | tail -25
  done | tee -a $W/cores.txt
done
cd $W && tar -czf "$OUT/race.tar.gz" --exclude='*.safetensors' --exclude='*.pt' --exclude='core-*' \
  *.log cores.txt run-*/train_log.jsonl run-*/faults 2>/dev/null
ls -la "$OUT"
