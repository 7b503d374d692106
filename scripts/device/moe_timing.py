"""The fused MoE kernel on the GPU at the MoE targets' expert shapes: time per call, and the bandwidth or FLOP rate it
reaches; with --sweep, every block configuration of a grid against choose_config's.

Usage: python scripts/device/moe_timing.py OUT.json [--tokens 1,8,64,512,2048] [--sweep [--write-configs DIR]]
Each call is timed as 20 calls captured in one CUDA graph (best of 5 replays); bytes are the weights of the experts
the call touches (random routing, top-k of softmax over random logits), FLOPs 2 x pairs x 3 x H x I. A table, then one
JSON line. --write-configs DIR (with --sweep) writes each shape's best configuration per token count on this GPU
where choose_config reads it (src/peagle/kernels/moe_configs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from peagle.kernels import moe

# name -> (hidden, expert intermediate, experts, top-k, GPT-OSS's activation and biases)
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8, False), "gpt-oss-20b": (2880, 2880, 32, 4, True)}


def inputs(tokens, hidden, inter, experts, k, gpt_oss):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=0.02):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    probs = torch.softmax(torch.randn(tokens, experts, generator=gen, device="cuda"), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    case = dict(x=randn(tokens, hidden, scale=1.0), w13=randn(experts, 2 * inter, hidden),
                w2=randn(experts, hidden, inter), topk_weights=weights / weights.sum(-1, keepdim=True), topk_ids=ids)
    if gpt_oss:
        case.update(b13=randn(experts, 2 * inter), b2=randn(experts, hidden), activation="swiglu_limit")
    return case


def graph_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / reps * 1e3)
    return best


def grid(tokens: int, experts: int, k: int):
    per_expert = tokens * k / experts
    block_ms = ([16] if per_expert <= 8 else [16, 32] if per_expert <= 24 else [32, 64] if per_expert <= 96
                else [64, 128])
    for bm, bn, bk, warps, stages in itertools.product(block_ms, [32, 64, 128], [64, 128, 256], [4, 8], [3, 4]):
        if (bm * bn >= 64 * 128 and bk == 256) or (bm >= 64 and bn == 32) or (bm <= 32) == (warps == 8):
            continue
        yield moe.MoeConfig(bm, bn, bk, 8 if bm >= 32 else 1, warps, stages)


def write_configs(rows: list[dict], folder: str) -> list[Path]:
    """Each shape's best tiling per token count measured so far, as the kernel's tuned table on this GPU."""
    gpu, paths = torch.cuda.get_device_name(), []
    for name, (hidden, inter, experts, _, _) in SHAPES.items():
        table = {str(r["tokens"]): r["best_config"] for r in rows if r["shape"] == name}
        if table:
            paths.append(Path(folder) / moe.config_file(experts, inter, hidden, gpu).name)
            paths[-1].write_text(json.dumps(table, indent=1) + "\n")
    return paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--tokens", default="1,8,64,512,2048")
    ap.add_argument("--sweep", action="store_true", help="also time every configuration of the grid")
    ap.add_argument("--write-configs", metavar="DIR", help="with --sweep: each shape's best tiling per token count, "
                    "as the kernel's tuned table (src/peagle/kernels/moe_configs)")
    args = ap.parse_args()
    if args.write_configs and not args.sweep:
        ap.error("--write-configs needs --sweep")
    rows = []
    with torch.inference_mode():
        for name, (hidden, inter, experts, k, gpt_oss) in SHAPES.items():
            for tokens in map(int, args.tokens.split(",")):
                case = inputs(tokens, hidden, inter, experts, k, gpt_oss)
                touched = moe.experts_touched(case["topk_ids"])
                default = moe.choose_config(tokens, experts, k, hidden=hidden, inter=inter,
                                            device_name=torch.cuda.get_device_name())
                timed = []
                for config in [default, *(grid(tokens, experts, k) if args.sweep else [])]:
                    try:
                        timed.append((graph_us(lambda: moe._fused_moe_triton(**case, config=config)), config))
                    except Exception as e:  # noqa: BLE001 - a configuration that does not compile is skipped
                        print(f"skipped {tuple(config)}: {type(e).__name__}", file=sys.stderr)
                us = next(t for t, c in timed if c == default)
                best_us, best = min(timed, key=lambda r: r[0])
                rows.append({"shape": name, "tokens": tokens, "experts_touched": touched, "us": us,
                             "config": list(default), "GBps": touched * 3 * hidden * inter * 2 / us / 1e3,
                             "TFLOPs": 2 * tokens * k * 3 * hidden * inter / us / 1e6, "best_us": best_us,
                             "best_config": list(best)})
                Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
                if args.write_configs:  # after every row, so a sweep cut short keeps the tilings it found
                    write_configs(rows, args.write_configs)
    if args.write_configs:
        for path in write_configs(rows, args.write_configs):
            print(f"wrote {path}")
    print(f"{'shape':<15}{'T':>6}{'touched':>8}{'us':>9}{'GB/s':>8}{'TFLOP/s':>9}{'best us':>9}  best config")
    for r in rows:
        print(f"{r['shape']:<15}{r['tokens']:>6}{r['experts_touched']:>8}{r['us']:>9.1f}{r['GBps']:>8.0f}"
              f"{r['TFLOPs']:>9.1f}{r['best_us']:>9.1f}  {r['best_config']}")
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
