#!/usr/bin/env bash
# Trainer faults (issue 48), the compile-cache hypothesis: four P-EAGLE trainers side by side from cold compile caches,
# seeds 0 and 1 sharing one Triton/Inductor cache (as the testbed's side-by-side trainers do), seeds 0 and 1 each with
# caches of their own. Run from a snapshot holding .fault and .cfg (benchmarks/runs/run-32.md), about 4 minutes.
set -u
W=/tmp/cache; rm -rf $W /tmp/torchinductor_* ~/.triton ~/.cache/triton; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src"
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
  TRITON_CACHE_DIR=$c/triton TORCHINDUCTOR_CACHE_DIR=$c/inductor timeout 200 python3 -m peagle train \
    --target $W/target --data .fault/chat .fault/code --steps 1000000 --max-length 8192 --save-every 100000 \
    --eval-every 100000 --method peagle --num-layers 4 --k-train 8 --batch-size 1 --seed $seed --out $W/run-$name \
    --time-limit 2 > $W/$name.log 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait $p; echo "pid $p rc $?"; done
for name in shared-0 shared-1 own-0 own-1; do
  echo "-- $name: $(tail -1 $W/run-$name/train_log.jsonl | cut -c1-50)"
  grep -E "fault|Error" $W/$name.log | grep -v Warning | head -3 | cut -c1-250
done
