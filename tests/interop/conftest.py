"""Shared set-up of the interop checks: the tiny target, heads trained on it through peagle's CLI, and runners for
the scripts that execute in the interop virtual environment (vLLM's CPU build and speculators, kept apart from
peagle's own environment; scripts/ci/interop.sh builds it and names its python in PEAGLE_INTEROP_PYTHON).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import interop_fixtures as fixtures

HERE = Path(__file__).parent
NUM_PROMPTS, MAX_TOKENS = 8, 32
# The heads' drafting depth at serving time and the JSON that turns each method on, in vLLM and in peagle alike.
SPECULATIVE_CONFIGS = {
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 3},
    "peagle": {"method": "eagle3", "num_speculative_tokens": 4, "parallel_drafting": True},
}
# Brief CPU training (about a minute per head): enough for drafts to be accepted on this target's responses.
TRAIN_ARGS = {
    "eagle3": ["--k-train", "3", "--steps", "40"],
    "peagle": ["--num-layers", "2", "--k-train", "4", "--steps", "60"],
}
COMMON_TRAIN_ARGS = ["--max-length", "256", "--lr", "3e-3", "--batch-size", "4", "--eval-every", "1000",
                     "--save-every", "1000"]


@pytest.fixture(scope="session")
def interop_python() -> str:
    python = os.environ.get("PEAGLE_INTEROP_PYTHON")
    if not python:
        pytest.skip("PEAGLE_INTEROP_PYTHON is not set: scripts/ci/interop.sh installs vLLM's CPU build and "
                    "speculators in their own virtual environment and runs these checks with it")
    return python


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("interop")


@pytest.fixture(scope="session")
def target(workdir) -> Path:
    return fixtures.write_target(workdir / "target")


def peagle_cli(log: str, *args: str, cwd: Path) -> None:
    run_logged([sys.executable, "-m", "peagle", *args], cwd / log, cwd)


@pytest.fixture(scope="session")
def trained_heads(interop_python, workdir, target) -> dict[str, Path]:
    """Heads trained by `peagle regenerate` + `peagle train`, the target given as a relative path as users type it."""
    fixtures.write_prompts(workdir / "train_prompts.jsonl", fixtures.prompts(fixtures.TRAIN_MODULES, 48, seed=0))
    peagle_cli("regenerate.log", "regenerate", "--model", "target", "--prompts", "train_prompts.jsonl", "--out", "data",
               "--max-tokens", "48", "--batch-size", "48", "--dtype", "float32", "--device", "cpu",
               "--max-model-len", "512", cwd=workdir)
    heads = {}
    for method, args in TRAIN_ARGS.items():
        peagle_cli(f"train-{method}.log", "train", "--target", "target", "--data", "data", "--method", method, "--out", f"run-{method}",
                   *args, *COMMON_TRAIN_ARGS, cwd=workdir)
        heads[method] = workdir / f"run-{method}" / "final"
    return heads


@pytest.fixture(scope="session")
def eval_prompts(target) -> list[list[int]]:
    """Chat-formatted prompts from modules the heads never saw, as token ids (both engines get the same ids)."""
    from peagle.models.loader import load_tokenizer

    tokenizer = load_tokenizer(target)
    texts = fixtures.prompts(fixtures.EVAL_MODULES, NUM_PROMPTS, seed=1)
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


def run_logged(cmd: list[str], log: Path, cwd: Path | None = None, env: dict | None = None) -> None:
    with log.open("w") as f:
        done = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {done.returncode}; last lines of {log}:\n{tail}")


def interop_env(workdir: Path) -> dict[str, str]:
    """Offline, no usage reports, caches inside the run's directory, vLLM's engine in the calling process."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "XDG_CACHE_HOME": str(workdir / "cache"),
            "VLLM_CACHE_ROOT": str(workdir / "cache" / "vllm"), "HF_HOME": str(workdir / "cache" / "hf")}


def run_interop(python: str, workdir: Path, log: str, script: str, *args: str) -> None:
    run_logged([python, str(HERE / script), *args], workdir / log, workdir, interop_env(workdir))


@pytest.fixture(scope="session")
def vllm_generate(interop_python, workdir, target, eval_prompts):
    """vLLM's greedy outputs and spec-decode counters for a speculative config (None: no speculation)."""
    def generate(name: str, speculative_config: dict | None) -> dict:
        request, result = workdir / f"vllm-request-{name}.json", workdir / f"vllm-result-{name}.json"
        request.write_text(json.dumps({"target": str(target), "prompts": eval_prompts, "max_tokens": MAX_TOKENS,
                                       "speculative_config": speculative_config}))
        run_interop(interop_python, workdir, f"vllm-{name}.log", "vllm_generate.py", str(request), str(result))
        return json.loads(result.read_text())
    return generate


@pytest.fixture(scope="session")
def peagle_generate(target, eval_prompts):
    """The same through peagle's LLM on the CPU, counters summed over requests as vLLM counts them."""
    from peagle import LLM, SamplingParams

    def generate(speculative_config: dict | None) -> dict:
        llm = LLM(model=str(target), speculative_config=speculative_config, dtype="float32", device="cpu",
                  max_model_len=512, max_num_seqs=len(eval_prompts))
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(eval_prompts, params)
        metrics = [o.metrics for o in outs]
        counters = {
            "num_drafts": sum(m.num_drafting_rounds for m in metrics),
            "num_draft_tokens": sum(m.num_draft_tokens for m in metrics),
            "num_accepted_tokens": sum(m.num_accepted_tokens for m in metrics),
            "num_accepted_tokens_per_pos": ([sum(c) for c in zip(*(m.accepted_per_position for m in metrics))]
                                            if speculative_config else []),
        }
        return {"outputs": [list(o.token_ids) for o in outs], "spec_decode": counters}
    return generate


@pytest.fixture(scope="session")
def plain(vllm_generate, peagle_generate) -> dict[str, dict]:
    return {"vllm": vllm_generate("plain", None), "peagle": peagle_generate(None)}
