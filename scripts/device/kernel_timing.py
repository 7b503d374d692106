"""The engine's Triton kernels timed on the GPU at the testbed's shapes (bf16), each replayed from a CUDA graph (GPU
time, no host launch cost): paged attention for decode, verify, draft and prefill batches, the draft-batch
expansion, the draft-feature gather and the KV store; then the fused element-wise kernels (RMSNorm, add + RMSNorm,
rotary, SiLU-and-mul) at the testbed's and Llama-3.1-8B's sizes against the PyTorch ops they replace, graphed and
eager; then paged attention at batch 1 and 8 over 256-2048 tokens with 1, 2, 4 and 8 KV splits, merged by a second
kernel or inside the first (`splits`).

Usage: python scripts/device/kernel_timing.py OUT.json
Prints a table against a reference bound per kernel (about twice an idle H200's time) and writes the rows to
OUT.json; a row over its bound is flagged, not failed: a GPU shared with other work (trainers, a second engine)
slows every kernel, so this is a measurement to read on an idle GPU, never a test. The inputs are the GPU tests'
builders (tests/gpu/test_kernels_gpu.py, test_kernels_fused_gpu.py), so both time and check the same batches.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests" / "gpu"), str(ROOT / "tests" / "unit")]

CASES = [
    # (label, num_requests, query_len, context_len, shuffle, reference bound in microseconds)
    ("decode b1 ctx1k", 1, 1, 1024, False, 12),
    ("decode b1 ctx2k", 1, 1, 2048, False, 15),
    ("verify b1 q8 ctx2k", 1, 8, 2048, False, 18),
    ("draft b1 q16 ctx2k", 1, 16, 2048, True, 20),
    ("decode b64 ctx1k", 64, 1, 1024, False, 40),
    ("verify b64 q8 ctx1k", 64, 8, 1024, False, 50),
    ("draft b64 q16 ctx1k", 64, 16, 1024, True, 50),
    ("prefill 2k", 1, 2048, 2048, False, 85),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where the rows go (JSON)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    from triton.testing import do_bench_cudagraph

    import test_kernels_gpu as gpu_cases
    import test_kernels_triton as unit_cases
    from peagle.kernels import draft_batch, kv_cache

    cuda = torch.device("cuda")

    def bench_us(fn):
        # do_bench_cudagraph runs fn on a side stream that does not wait for the default stream: inputs made on the
        # GPU just before (torch.randint) must be complete, or the kernel reads uninitialised indices.
        torch.cuda.synchronize()
        return 1e3 * do_bench_cudagraph(fn)

    rows = []
    for label, num_requests, query_len, context_len, shuffle, bound_us in CASES:
        batch = gpu_cases.engine_attention_batch(num_requests, query_len, context_len, shuffle=shuffle)
        rows.append((f"paged_attention {label}", bench_us(lambda: gpu_cases.attention.paged_attention(**batch)),
                     bound_us))
    inputs = gpu_cases.to_cuda(unit_cases.make_draft_inputs(0, ["verify"] * 64, 7, 0, torch.int64))
    rows.append(("expand_draft_batch b64 K8", bench_us(lambda: draft_batch.expand_draft_batch(**inputs)), 6))
    aux = torch.randn(64 * 8, 3 * 576, device=cuda, dtype=torch.bfloat16)
    hidden_index = torch.randint(-1, 64 * 8, (64 * 15,), device=cuda)
    mask_hidden = torch.randn(3 * 576, device=cuda, dtype=torch.bfloat16)
    rows.append(("gather_draft_features b64 K8",
                 bench_us(lambda: draft_batch.gather_draft_features(aux, hidden_index, mask_hidden)), 6))
    k = torch.randn(64 * 8, 3, 64, device=cuda, dtype=torch.bfloat16)
    cache = torch.zeros(4096, 16, 3, 64, device=cuda, dtype=torch.bfloat16)
    slots = torch.randperm(4096 * 16, device=cuda)[: 64 * 8]
    rows.append(("store_kv 512 tokens", bench_us(lambda: kv_cache.store_kv(k, k, cache, cache, slots)), 6))

    print(f"{'kernel (testbed shape, bf16)':42s} {'us':>8s} {'bound':>6s}")
    for label, us, bound_us in rows:
        print(f"{label:42s} {us:8.2f} {bound_us:6d}{'  over' if us > bound_us else ''}")
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "rows": [{"kernel": label, "us": round(us, 3), "bound_us": bound_us, "over_bound": us > bound_us}
                       for label, us, bound_us in rows]}
    record["fused"] = fused_rows()
    record["splits"] = split_rows(gpu_cases, bench_us)
    args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps({"over_bound": [r["kernel"] for r in record["rows"] if r["over_bound"]],
                      "fused_slower_than_torch": [f"{r['model']} T={r['tokens']} {r['kernel']}" for r in record["fused"]
                                                  if r["graph_us"] > r["torch_graph_us"]]}))
    return 0


SPLIT_CASES = [(1, 1), (1, 8), (8, 1), (8, 8)]  # (requests, query rows each): decode and verify at small batches
SPLIT_CONTEXTS = (256, 512, 1024, 2048)


def split_rows(gpu_cases, bench_us) -> list[dict]:
    """Paged attention at small batches over short and long contexts with 1, 2, 4 and 8 KV splits and the
    heuristic's choice (`default_num_splits`, picked at 1-2K tokens): whether the split kernel and its merge pay
    at the benchmarks' contexts (a few hundred tokens), where one split needs no merge kernel; and 2, 4, 8 splits
    merged by their last arrival inside the attention kernel (`fused_merge`: one launch)."""
    from peagle.kernels.paged_attention import default_num_splits

    rows = []
    print(f"{'paged attention, splits':28s} {'ctx':>5s} " + " ".join(f"{f's={s}':>7s}" for s in (1, 2, 4, 8))
          + f" {'default':>8s}")
    for num_requests, query_len in SPLIT_CASES:
        for context in SPLIT_CONTEXTS:
            batch = gpu_cases.engine_attention_batch(num_requests, query_len, context)
            times = {s: bench_us(lambda: gpu_cases.attention.paged_attention(**batch, num_splits=s, fused_merge=False))
                     for s in (1, 2, 4, 8)}
            gpu_cases.attention.paged_attention(**batch, num_splits=8, fused_merge=True)  # counters made uncaptured
            fused = {s: bench_us(lambda: gpu_cases.attention.paged_attention(**batch, num_splits=s, fused_merge=True))
                     for s in (2, 4, 8)}
            kv_heads = batch["k_cache"].shape[2]
            chosen = default_num_splits(torch.device("cuda"), num_requests * kv_heads, query_len)
            rows.append({"requests": num_requests, "query_len": query_len, "context": context,
                         "us_by_splits": {str(s): round(t, 3) for s, t in times.items()},
                         "us_by_splits_fused_merge": {str(s): round(t, 3) for s, t in fused.items()},
                         "default_splits": chosen})
            print(f"{f'b{num_requests} q{query_len}':28s} {context:5d} "
                  + " ".join(f"{times[s]:7.2f}" for s in (1, 2, 4, 8)) + f" {chosen:8d} | fused "
                  + " ".join(f"{fused[s]:7.2f}" for s in (2, 4, 8)))
    return rows


def fused_rows() -> list[dict]:
    """Each fused kernel against the PyTorch ops it replaces (one launch against several), both graphed, and the
    fused kernel eager (its launch cost included)."""
    from triton.testing import do_bench, do_bench_cudagraph

    import test_kernels_fused_gpu as fused_cases

    rows = []
    for model in sorted(fused_cases.MODELS):
        for num_tokens in fused_cases.NUM_TOKENS:
            inputs = fused_cases.layer_inputs(model, num_tokens, torch.bfloat16)
            torch.cuda.synchronize()  # do_bench_cudagraph's side stream does not wait for the inputs' stream
            for name, fn, ref in fused_cases.single_ops(inputs):
                rows.append({"model": model, "tokens": num_tokens, "kernel": name,
                             "graph_us": round(1e3 * do_bench_cudagraph(fn), 3),
                             "torch_graph_us": round(1e3 * do_bench_cudagraph(ref), 3),
                             "eager_us": round(1e3 * do_bench(fn), 3)})
    print(f"\n{'model (bf16)':14s} {'T':>4s} {'kernel':14s} {'graph us':>9s} {'torch ops':>9s} {'eager us':>9s}")
    for r in rows:
        print(f"{r['model']:14s} {r['tokens']:4d} {r['kernel']:14s} {r['graph_us']:9.2f} {r['torch_graph_us']:9.2f} "
              f"{r['eager_us']:9.2f}")
    return rows


if __name__ == "__main__":
    sys.exit(main())
