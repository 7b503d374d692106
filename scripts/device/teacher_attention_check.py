"""Device check: the training teacher's attention on the fused SDPA kernel (4-D inputs) against the math path it
took before (3-D inputs), side by side in one process.

Usage: python scripts/device/teacher_attention_check.py TARGET_DIR OUT.json --data DIR [DIR ...] [--lengths 2048,8192]
For each variant and packed length, a P-EAGLE training step as train_memory.py measures it (fresh 4-layer head,
K_train 8, S = 1, loss chunk 1024, the first two steps not counted). Every variant first runs once unmeasured
(FlexAttention compiles for new shapes inside the first runs, which otherwise favours whichever variant runs last),
then all are measured in order and again in reverse order.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import peagle.models.attention as attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_memory import measure  # noqa: E402

FUSED = attention._sdpa


def math_3d(q, k, v, mask=None, causal=False):
    """The previous `_sdpa`: 3-D inputs, which no fused SDPA kernel accepts."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         is_causal=causal and mask is None)
    return out.transpose(0, 1)


def default_backends(q, k, v, mask=None, causal=False):
    """4-D inputs with every SDPA backend allowed (cuDNN included): the first version of the fix."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, is_causal=causal and mask is None)
    return out[0].transpose(0, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--data", type=Path, nargs="+", required=True)
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--reverse", action="store_true", help="run the variants in the opposite order")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        variants = [("math path, 3-D inputs (before)", math_3d),
                    ("4-D inputs, every backend (cuDNN allowed)", default_backends),
                    ("4-D inputs, flash / memory-efficient (after)", FUSED)]
        if args.reverse:
            variants.reverse()
        lengths = list(map(int, args.lengths.split(",")))
        for name, fn in variants:  # warm-up, not recorded
            attention._sdpa = fn
            for length in lengths:
                measure(args.target, args.data, length, 1, 3, Path(scratch), 1024)
        for rep, order in enumerate((variants, variants[::-1])):
            for name, fn in order:
                attention._sdpa = fn
                for length in lengths:
                    row = {"variant": name, "pass": rep,
                           **measure(args.target, args.data, length, 1, args.steps, Path(scratch), 1024)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
                args.out.write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
