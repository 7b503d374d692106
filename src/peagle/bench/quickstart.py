"""`peagle quickstart`: the whole system in one command.

On a CUDA GPU: build the reference testbed (SmolLM2-135M-Instruct, trained EAGLE-3 and P-EAGLE heads) and run the
benchmark sweep on MT-Bench and HumanEval with the Hugging Face baselines. Without a GPU: the same pipeline at smoke
scale (tiny random model, heads trained for a few steps, a handful of prompts), which finishes in minutes on a CPU
and shows every part working; its numbers are not a benchmark, and it says so.
"""

from __future__ import annotations

import logging
from pathlib import Path

from peagle.bench.sweep import SweepConfig, run_benchmark
from peagle.bench.testbed import build_testbed
from peagle.bench.testbed_scale import h200_scale, smoke_scale

logger = logging.getLogger(__name__)

SMOKE_NOTE = ("SMOKE SCALE: a tiny random model and drafter heads trained for a few steps, run on the CPU. "
              "These numbers only show that every part of the pipeline works; they are NOT a benchmark.")
SMOKE_BANNER = f"""\
{"=" * 100}
{SMOKE_NOTE}
Run `peagle quickstart` on a machine with a CUDA GPU for the real testbed and the real numbers.
{"=" * 100}"""


def gpu_config(paths: dict[str, Path]) -> SweepConfig:
    """The issue's full sweep: K 3/5/7, concurrency 1..64, MT-Bench and HumanEval, with HF baselines."""
    return SweepConfig(model=str(paths["model"]), draft_eagle3=str(paths["eagle3"]),
                       draft_peagle=str(paths["peagle"]), cache_dir=str(paths["cache"]), hf_baselines=True)


def smoke_config(paths: dict[str, Path]) -> SweepConfig:
    return SweepConfig(model=str(paths["model"]), draft_eagle3=str(paths["eagle3"]),
                       draft_peagle=str(paths["peagle"]), cache_dir=str(paths["cache"]), ks=(3,),
                       concurrency=(1, 3), datasets=("mtbench",), num_prompts=3, max_tokens=8, dtype="float32",
                       device="cpu", max_model_len=512, hf_baselines=True, hf_num_prompts=2, hf_batch_sizes=(1, 3),
                       note=SMOKE_NOTE)


def quickstart(cache_dir: Path | None, out_dir: Path, force_smoke: bool = False) -> int:
    import torch

    from peagle.bench.report import command_line, print_outcome

    smoke = force_smoke or not torch.cuda.is_available()
    if smoke:
        print(SMOKE_BANNER, flush=True)
    paths = build_testbed(cache_dir, smoke_scale() if smoke else h200_scale())
    config = smoke_config(paths) if smoke else gpu_config(paths)
    results, files = run_benchmark(config, out_dir, command_line())
    print_outcome(results, files, banner=SMOKE_BANNER if smoke else None)
    return 0
