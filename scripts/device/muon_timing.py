"""The Muon step of a P-EAGLE head of the testbed's shape on the GPU: blocks of one shape orthogonalised together
(`batch_shapes`, the default since run 15's session) against each block alone, and the fused AdamW step over the
same parameters for scale. CUDA events over repeated steps after a warm-up; the GPU otherwise idle.

Usage: python scripts/device/muon_timing.py OUT.json [--layers 4] [--steps 50]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from peagle.training.optimizers import Muon

# The testbed's drafter: hidden 576, 9 query and 3 KV heads of 64, MLP 1536, features of three target layers.
HIDDEN, Q, KV, INTER = 576, 576, 192, 1536


def head_params(layers: int, device) -> tuple[list[torch.nn.Parameter], list]:
    shapes = [((Q + 2 * KV, 2 * HIDDEN if i == 0 else HIDDEN), [Q, KV, KV]) for i in range(layers)]
    shapes += [((HIDDEN, Q), None), ((2 * INTER, HIDDEN), [INTER, INTER]), ((HIDDEN, INTER), None)] * layers
    shapes.append(((HIDDEN, 3 * HIDDEN), None))  # fc
    params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s, _ in shapes]
    return params, [rows for _, rows in shapes]


def time_steps(opt, params, steps: int) -> float:
    gen = torch.Generator(device=params[0].device).manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, device=p.device, generator=gen) * 1e-3
    for _ in range(5):
        opt.step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        opt.step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    rows = []
    for name, make in (("muon-batched", lambda p, b: Muon(p, b, lr=1e-3)),
                       ("muon-per-block", lambda p, b: Muon(p, b, lr=1e-3, batch_shapes=False)),
                       ("adamw-fused", lambda p, b: torch.optim.AdamW(p, lr=1e-3, fused=True))):
        params, blocks = head_params(args.layers, torch.device("cuda"))
        row = {"optimizer": name, "layers": args.layers, "matrices": len(params),
               "step_ms": time_steps(make(params, blocks), params, args.steps)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
