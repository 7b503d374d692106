"""The small-batch GEMV (peagle.kernels.gemv) against cuBLAS (F.linear) per decoder projection, on the GPU.

Usage: python scripts/device/gemv_timing.py OUT.json [--rows 1,8,64] [--models smollm2-135m,llama-3.1-8b]
Each (model, projection, M) is timed as back-to-back calls captured in one CUDA graph and replayed (as the
engine runs them: no host launch cost), median of 5 replays, for cuBLAS, the GEMV with the tiling and split-K the
engine chooses (gemv.choose_tiling), and the GEMV without split-K; twice: "warm", 20 calls on one weight matrix
(after the first call it sits in the L2 cache), and "cold", each call on another copy of it, enough copies to pass
128 MB (the L2 holds 50 MB), as a model's layers follow one another: run 8's warm GEMV beat cuBLAS per call while
the engine with it lost 0.19 ms a step (run 10), so the cold columns are the ones the engine sees. Prints a table,
then one JSON line; writes the rows to OUT.json. --sweep adds cold rows of the GEMV at other tilings (BLOCK_N x
BLOCK_K x split-K) per projection, to choose the engine's tiling by what it sees (rows with "sweep": true).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from peagle.kernels import gemv

SHAPES = {  # projection: (N, K)
    "smollm2-135m": {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576),
                     "down_proj": (576, 1536)},
    "llama-3.1-8b": {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
                     "down_proj": (4096, 14336)},
}
CALLS = 20
COLD_BYTES = 128 << 20  # the cold columns' weight copies together pass this (2.5x the L2 cache)


def graph_us(fn, calls: int = CALLS) -> float:
    """Microseconds per call of `fn(i)`, i = 0..calls-1, replayed from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times[1:])


def sweep(spec: list[list[int]], model: str, proj: str, x: torch.Tensor, ws: list,
          cold_cublas_us: float) -> list[dict]:
    """Cold rows of the GEMV at each tiling of `spec` ([BLOCK_NS, BLOCK_KS, SPLITS]) that splits K into whole tiles."""
    block_ns, block_ks, splits = spec
    (n, k), m = ws[0].shape, x.shape[0]
    out = []
    for bn in block_ns:
        for bk in block_ks:
            for split in splits:
                if split > 1 and k < split * bk:
                    continue
                row = {"sweep": True, "model": model, "proj": proj, "n": n, "k": k, "m": m, "block_n": bn,
                       "block_k": bk, "split_k": split,
                       "num_warps": 4 if bn * bk <= getattr(gemv, "WARPS4_TILE_MAX", bn * bk) else 8}
                try:  # a tiling too large for the chip (registers, shared memory) is recorded, not fatal
                    us = graph_us(lambda i: gemv.gemv(x, ws[i], split_k=split, block_n=bn, block_k=bk), len(ws))
                except Exception as e:  # noqa: BLE001 - Triton's and the driver's errors have no common base
                    out.append({**row, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    continue
                out.append({**row, "cold_gemv_us": us, "cold_over_cublas": us / cold_cublas_us})
    timed = [r for r in out if "cold_gemv_us" in r]
    if not timed:
        print(f"  sweep {proj}: no tiling ran", flush=True)
        return out
    best = min(timed, key=lambda r: r["cold_gemv_us"])
    print(f"  sweep {proj}: best BLOCK_N {best['block_n']} BLOCK_K {best['block_k']} split {best['split_k']}: "
          f"{best['cold_gemv_us']:.2f} us cold (cuBLAS {cold_cublas_us:.2f})", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--sweep", metavar="BLOCK_NS:BLOCK_KS:SPLITS",
                    help="also time the GEMV cold at each tiling, e.g. 16,32:64,128,256:1,2,3,5 (at the first of "
                         "--rows only)")
    args = ap.parse_args(argv)
    if args.sweep is not None:
        try:
            parts = [[int(v) for v in part.split(",")] for part in args.sweep.split(":")]
        except ValueError:
            parts = []
        if len(parts) != 3 or not all(parts):
            ap.error(f"--sweep wants BLOCK_NS:BLOCK_KS:SPLITS, comma-separated integers each, got {args.sweep!r}")
    dev = torch.device("cuda")
    rows = []
    print(f"{'model':14} {'proj':13} {'M':>3} {'cuBLAS us':>10} {'gemv us':>8} {'split':>5} {'gemv s=1 us':>11} "
          f"{'best/cuBLAS':>11} {'GB/s gemv':>9} | cold: {'cuBLAS':>7} {'gemv':>7} {'s=1':>7} {'GB/s':>6}")
    for model in args.models.split(","):
        for proj, (n, k) in SHAPES[model].items():
            w = (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)
            copies = max(CALLS, -(-COLD_BYTES // (2 * n * k)))
            ws = [w.clone() for _ in range(copies)]
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k, device=dev).to(torch.bfloat16)
                block_n, block_k, split = gemv.choose_tiling(n, k, dev)
                row = {"model": model, "proj": proj, "n": n, "k": k, "m": m, "split_k": split, "block_n": block_n,
                       "block_k": block_k,
                       "cublas_us": graph_us(lambda i: F.linear(x, w)),
                       "gemv_us": graph_us(lambda i: gemv.gemv(x, w)),
                       "gemv_split1_us": graph_us(lambda i: gemv.gemv(x, w, split_k=1)),
                       "cold_copies": copies,
                       "cold_cublas_us": graph_us(lambda i: F.linear(x, ws[i]), copies),
                       "cold_gemv_us": graph_us(lambda i: gemv.gemv(x, ws[i]), copies),
                       "cold_gemv_split1_us": graph_us(lambda i: gemv.gemv(x, ws[i], split_k=1), copies)}
                best = min(row["gemv_us"], row["gemv_split1_us"])
                row["best_over_cublas"] = best / row["cublas_us"]
                row["cold_best_over_cublas"] = (min(row["cold_gemv_us"], row["cold_gemv_split1_us"])
                                                / row["cold_cublas_us"])
                row["gemv_gbps"] = 2 * n * k / (row["gemv_us"] * 1e3)
                row["cold_gemv_gbps"] = 2 * n * k / (row["cold_gemv_us"] * 1e3)
                rows.append(row)
                if args.sweep and m == int(args.rows.split(",")[0]):
                    rows += sweep(parts, model, proj, x, ws, row["cold_cublas_us"])
                write(args.out, rows)  # after every row: a run cut by its time limit keeps what it measured
                print(f"{model:14} {proj:13} {m:3d} {row['cublas_us']:10.2f} {row['gemv_us']:8.2f} {split:5d} "
                      f"{row['gemv_split1_us']:11.2f} {row['best_over_cublas']:11.2f} {row['gemv_gbps']:9.0f} | "
                      f"cold: {row['cold_cublas_us']:7.2f} {row['cold_gemv_us']:7.2f} "
                      f"{row['cold_gemv_split1_us']:7.2f} {row['cold_gemv_gbps']:6.0f}", flush=True)
    print(json.dumps(write(args.out, rows)))
    return 0


def write(path: str, rows: list[dict]) -> dict:
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(main())
