"""Host cost of a matmul launch when its shape repeats against when it changes every call, on the GPU.

Usage: python scripts/device/mm_host_cost.py OUT.json [--calls 400]
Why: the trainer's profile (BENCHMARKS.md run 7) gave aten::mm about 100 us of host time per call, 27% of the
host's time in a step, far above a launch's usual cost; its shapes change every step (packs of different lengths,
COD-sampled element counts). If the library's kernel selection is what costs (cached per shape), steps whose
matrices keep a few row counts (padded to a bucket) would pay it once. For each projection of the testbed's
drafter and target (bf16) this times CALLS forward matmuls (and as many backward passes of a Linear) with the row
count fixed, drawn anew each call from 6,000-8,192 (few repeats in CALLS draws), and drawn so but padded up to a
multiple of 256 (9 row counts); per call: host microseconds (wall time of the launches, the queue kept short by a
synchronisation every 8 calls) and GPU microseconds (CUDA events). Prints a table and writes OUT.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
          "lm_head chunk": (49152, 576)}
BUCKET = 256


def rows(mode: str, rng: random.Random) -> int:
    m = rng.randint(6000, 8192) if mode != "fixed" else 8192
    return -(-m // BUCKET) * BUCKET if mode == "padded" else m


def measure(n: int, k: int, mode: str, calls: int, backward: bool) -> dict:
    dev = torch.device("cuda")
    rng = random.Random(0)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, requires_grad=backward)
    xs = [torch.randn(rows(mode, rng), k, device=dev, dtype=torch.bfloat16, requires_grad=backward)
          for _ in range(calls)]
    torch.cuda.synchronize()
    host = 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i, x in enumerate(xs):
        t0 = time.perf_counter()
        y = F.linear(x, w)
        if backward:
            y.backward(torch.ones_like(y))
        host += time.perf_counter() - t0
        if i % 8 == 7:
            torch.cuda.synchronize()  # keeps the launch queue short, so a launch never waits for the GPU
    end.record()
    torch.cuda.synchronize()
    return {"host_us": 1e6 * host / calls, "gpu_us": 1e3 * start.elapsed_time(end) / calls}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    results = []
    for name, (n, k) in SHAPES.items():
        for backward in (False, True):
            for mode in ("fixed", "varying", "padded"):
                measure(n, k, mode, 16, backward)  # warm-up
                r = measure(n, k, mode, args.calls, backward)
                results.append({"projection": name, "n": n, "k": k, "backward": backward, "rows": mode, **r})
    print(f"{'projection':14s} {'pass':8s} {'rows':8s} {'host us':>8s} {'GPU us':>8s}")
    for r in results:
        print(f"{r['projection']:14s} {'fwd+bwd' if r['backward'] else 'fwd':8s} {r['rows']:8s} "
              f"{r['host_us']:8.1f} {r['gpu_us']:8.1f}")
    args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "bucket": BUCKET, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
