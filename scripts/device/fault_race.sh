#!/usr/bin/env bash
# Trainer faults (issue 48): P-EAGLE trainers side by side from cold compile caches, in pairs (seeds 0 and 1) that
# each take away one suspect, so that the pair that stays clean names the cause. Every trainer dumps every thread's
# Python stack on a fatal signal (peagle's CLI) and CUDA's GPU core on a device exception, read back with cuda-gdb
# (Firecracker machines). Run from the repository root with .fault and .cfg carried (benchmarks/runs/run-33.md).
# RACE_MINUTES (3) of training; RACE_PAIRS (base inline cthreads blocksparse nostatic), of:
#   base        the default trainer (a planning thread beside the loop, Inductor's compile workers, compiled FlexAttention)
#   inline      --prefetch-steps 0: no planning thread
#   cthreads    TORCHINDUCTOR_COMPILE_THREADS=1: Inductor compiles in the trainer's own thread, no worker pool (nor
#               its timer thread, which quiesces the pool 60 s after the last compile)
#   blocksparse PEAGLE_TRAIN_ATTENTION=blocksparse: the drafter's attention without compiled FlexAttention
#   nostatic    TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0: compiled kernels launched by Triton's launcher, not Inductor's
#   shared      the default trainer, both seeds on one Triton/Inductor cache (run 32's setting)
# Leaves $OUT/race.tar.gz (logs, train logs, fault records, cuda-gdb's reading of any GPU core).
set -u
W=/tmp/race; rm -rf $W /tmp/torchinductor_* ~/.triton ~/.cache/triton; mkdir -p $W
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
pids=() names=()
for pair in ${RACE_PAIRS:-base inline cthreads blocksparse nostatic}; do
  for seed in 0 1; do
    name=$pair-$seed; cache=$W/cache-$name; extra=() envs=()
    case $pair in
      base) ;;
      inline) extra=(--prefetch-steps 0) ;;
      cthreads) envs=(TORCHINDUCTOR_COMPILE_THREADS=1) ;;
      blocksparse) envs=(PEAGLE_TRAIN_ATTENTION=blocksparse) ;;
      nostatic) envs=(TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0) ;;
      shared) cache=$W/cache-shared ;;
      *) echo "unknown pair $pair" >&2; exit 2 ;;
    esac
    env "${envs[@]}" CUDA_COREDUMP_FILE=$W/core-$name TRITON_CACHE_DIR=$cache/triton \
      TORCHINDUCTOR_CACHE_DIR=$cache/inductor timeout $((minutes * 60 + 150)) python3 -m peagle train \
      --target $W/target --data .fault/chat .fault/code --steps 1000000 --max-length 8192 --save-every 100000 \
      --eval-every 100000 --method peagle --num-layers 4 --k-train 8 --batch-size 1 --seed $seed --out $W/run-$name \
      --time-limit $minutes "${extra[@]}" > $W/$name.log 2>&1 &
    pids+=($!) names+=($name)
  done
done
for i in "${!pids[@]}"; do wait ${pids[$i]}; echo "${names[$i]}: rc $?"; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for name in "${names[@]}"; do
  echo "-- $name: $(grep '"train"' $W/run-$name/train_log.jsonl 2>/dev/null | tail -1 | cut -c1-40)"
  grep -E "fault|Error|error:|Fatal Python|Thread 0x|File " $W/$name.log | grep -v Warning | head -40 | cut -c1-250
done
for core in $W/core-*; do
  [ -e "$core" ] || continue
  echo "== $core"
  for cmd in "info cuda kernels" "bt" "info cuda warps" "x/4i \$pc"; do
    timeout 60 cuda-gdb -batch -ex "target cudacore $core" -ex "$cmd" 2>&1 | tail -25
  done | tee -a $W/cores.txt
done
python3 -c 'import sys; sys.path.insert(0, "scripts/device"); import stages, pathlib
stages.gpu_errors(pathlib.Path(sys.argv[1]))' $W/gpu_errors.txt  # the driver's Xid lines, ECC: as testbed_wait's
cat $W/gpu_errors.txt
cd $W && tar -czf "$OUT/race.tar.gz" --exclude='*.safetensors' --exclude='*.pt' --exclude='core-*' \
  *.log cores.txt gpu_errors.txt run-*/train_log.jsonl run-*/faults 2>/dev/null
ls -la "$OUT"
