"""Device timing of the P-EAGLE training attention alone (no model needed): tile classification and FlexAttention.

Usage: python scripts/device/flex_timing.py OUT.json [--tokens 8192] [--doc-tokens 600] [--k 8] [--variants ...]
A COD layout of one packed sequence (documents of --doc-tokens, 70% response tokens, r 0.8 / 0.2) and random bf16
q/k/v of the testbed drafter's shape (9 query heads, 3 KV heads, head_dim 64). Times, as medians of CUDA-event
timings after warm-up:
- the tiles classified on the GPU from the rule (`dense_tiles`) and on the host from the layout (`block_tiles`);
- compiled flex_attention forward, and forward + backward, per variant: `rule` (the trainer's mask_mod),
  `ranges` (the same visibility from per-query key ranges: two comparisons per pair), `rule-64` (rule with
  64 x 64 kernel tiles), and `rule-dynamic` / `rule-64-dynamic` (compiled for symbolic shapes, as in the trainer,
  whose layouts change size every step).
Writes OUT.json after every measurement (a run cut short keeps what it measured) and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from peagle.training.cod import cod_sample
from peagle.training.mask import BLOCK_SIZE, block_tiles, build_block_mask, dense_tiles


def cuda_ms(fn, iters: int = 10) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def ranges_mask_mod(layout, k_train: int):
    """The rule from per-query ranges: key j is visible to query i iff lo[i] <= j < hi[i] (its document's real
    slots up to its anchor) or code_lo[i] <= code[j] <= code_hi[i] (its own rollout; code = anchor * K + depth)."""
    host = layout.to("cpu")
    n0 = int((host.depth == 0).sum())
    hi = torch.searchsorted(host.anchor[:n0], host.anchor, right=True)
    lo = torch.searchsorted(host.doc[:n0], host.doc)
    code = host.anchor * k_train + host.depth
    pad = -(-len(host) // BLOCK_SIZE) * BLOCK_SIZE + BLOCK_SIZE - len(host)
    dev = layout.anchor.device
    lo, hi = (torch.nn.functional.pad(t, (0, pad), value=0).to(dev) for t in (lo, hi))
    code_lo = torch.nn.functional.pad(host.anchor * k_train, (0, pad), value=-1).to(dev)
    code_hi = torch.nn.functional.pad(code, (0, pad), value=-2).to(dev)
    code = torch.nn.functional.pad(code, (0, pad), value=-3).to(dev)

    def mask_mod(b, h, q, kv):
        return ((kv >= lo[q]) & (kv < hi[q])) | ((code[kv] >= code_lo[q]) & (code[kv] <= code_hi[q]))

    return mask_mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--doc-tokens", type=int, default=600)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--variants", default="rule,rule-64,rule-dynamic,rule-64-dynamic")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    num_docs = -(-args.tokens // args.doc_tokens)
    doc_ids = torch.arange(num_docs).repeat_interleave(args.doc_tokens)[: args.tokens]
    layout = cod_sample(doc_ids, torch.rand(args.tokens, generator=gen) < 0.7, args.k, 0.8, 0.2, gen)
    n = len(layout)
    dev = torch.device("cuda")
    lay = layout.to(dev)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
              "elements": n, "k": args.k}

    def save(**kv):
        result.update(kv)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    tiles = block_tiles(layout)
    save(full_tiles=int(tiles.full_num.sum()), partial_tiles=int(tiles.kv_num.sum()),
         dense_pairs_share=round(int(tiles.full_num.sum() + tiles.kv_num.sum()) * BLOCK_SIZE ** 2 / n ** 2, 4))
    save(tiles_rule_gpu_ms=cuda_ms(lambda: dense_tiles(lay)))
    host = []
    for _ in range(5):
        t0 = time.perf_counter()
        block_tiles(layout)
        host.append(1e3 * (time.perf_counter() - t0))
    on_gpu = dense_tiles(lay)
    same = all(torch.equal(getattr(on_gpu, f).cpu(), getattr(tiles, f)) for f in ("kv_num", "full_num"))
    save(tiles_host_ms=statistics.median(host), tiles_equal=same)
    print(json.dumps(result), flush=True)

    q = torch.randn(1, 9, n, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 3, n, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 3, n, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    device_tiles = tiles.map(lambda t: t.to(dev))
    static_flex, dynamic_flex = torch.compile(flex_attention), torch.compile(flex_attention, dynamic=True)
    for variant in args.variants.split(","):
        # "-dynamic": compiled for symbolic shapes, as the trainer's attention ends up after its second step (every
        # step's layout has another number of elements)
        flex = dynamic_flex if variant.endswith("-dynamic") else static_flex
        t0 = time.perf_counter()
        block = build_block_mask(lay, tiles=device_tiles)
        options = None
        if variant == "ranges":
            block = BlockMask.from_kv_blocks(device_tiles.kv_num, device_tiles.kv_idx, device_tiles.full_num,
                                             device_tiles.full_idx, BLOCK_SIZE=BLOCK_SIZE,
                                             mask_mod=ranges_mask_mod(lay, args.k), seq_lengths=(n, n))
        elif variant in ("rule-64", "rule-64-dynamic"):
            options = {"BLOCK_M": 64, "BLOCK_N": 64}
        elif variant not in ("rule", "rule-dynamic"):
            continue

        def fwd():
            with torch.no_grad():
                return flex(q, k, v, block_mask=block, enable_gqa=True, kernel_options=options)

        def fwd_bwd():
            out = flex(q, k, v, block_mask=block, enable_gqa=True, kernel_options=options)
            out.float().sum().backward()

        try:
            reference = fwd().float()
            row = {"fwd_ms": cuda_ms(fwd), "fwd_bwd_ms": cuda_ms(fwd_bwd),
                   "compile_and_time_s": round(time.perf_counter() - t0, 1)}
            if variant != "rule":
                base = static_flex(q, k, v, block_mask=build_block_mask(lay, tiles=device_tiles), enable_gqa=True)
                row["max_abs_diff_vs_rule"] = float((reference - base.detach().float()).abs().max())
        except Exception as e:  # noqa: BLE001 - a variant that fails to compile is reported, not fatal
            row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        save(**{variant: row})
        print(json.dumps({variant: row}), flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
