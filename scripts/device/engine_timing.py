"""Per-round time breakdown of the engine on the GPU: target verify, drafting, everything else.

Usage: python scripts/device/engine_timing.py TARGET_DIR OUT.json --head eagle3=DIR --head peagle=DIR
       [--methods none,peagle] [--variants sync,async,gemv,async+gemv]
For each method, engine variant and batch size (1 and 64) it runs real requests to a steady decode state, then times
- the whole round (engine.step wall time, median over N rounds),
- the whole round's GPU work (the greedy round's CUDA graph replayed alone, timed with CUDA events), and inside it
  the target's verify forward and the drafting pass (their own graphs); verification = the remainder,
- the host-side input building (perf_counter),
and reports "other" = round wall time - the round's GPU time: what the host adds.
With --profile DIR, 10 more rounds per method and batch run under torch.profiler and their operator table (CPU and
CUDA time) is written to DIR/profile-METHOD-kK-bB.txt: where "other" goes.

Variants (one engine each, timed side by side per method): `sync` is the engine without async scheduling (the
default); `async` schedules the next
step while the GPU runs the current one (async_scheduling: "other" then is the host time the GPU waits for, and
`ahead_share` the rounds launched before the previous answer arrived); `gemv` runs the target's linear layers at
<= 8 rows through the split-K GEMV kernel (decode_gemv: it changes the GPU columns); `async+gemv` both;
`chunked` prefills in chunks of what the decodes leave of 512 tokens per step (enable_chunked_prefill);
`async+chunked` both.
With --stall N, each variant also times the stall a new N-token prompt causes: 8 requests decode, the prompt
arrives, and `stall_max_ms` is the longest step until its first token, against `stall_decode_ms`, a decode step's
median before it arrived (without chunking, one step prefills the whole prompt).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

from peagle import LLM, SamplingParams
from peagle.bench.datasets import load_prompts
from peagle.models.loader import load_tokenizer

CONFIGS = {"none": ("none", None, 0, False), "peagle": ("peagle", "peagle", 7, True),
           "eagle3-k3": ("eagle3", "eagle3", 3, False), "eagle3-k7": ("eagle3", "eagle3", 7, False)}
VARIANTS = {"sync": {"async_scheduling": False}, "async": {"async_scheduling": True},
            "gemv": {"async_scheduling": False, "decode_gemv": True},
            "async+gemv": {"async_scheduling": True, "decode_gemv": True},
            "chunked": {"async_scheduling": False, "enable_chunked_prefill": True, "max_num_batched_tokens": 512},
            "async+chunked": {"async_scheduling": True, "enable_chunked_prefill": True, "max_num_batched_tokens": 512}}


def gpu_ms(fn, iters=50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def profile_rounds(eng, path, rounds: int = 10) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            eng.step()
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=50, max_name_column_width=70)
    with open(path, "w") as f:
        f.write(f"torch.profiler over {rounds} engine rounds, sorted by CPU time total\n\n{table}\n")


def measure(llm, prompts, batch: int, k: int, rounds: int = 40, profile_path=None) -> dict:
    eng = llm.engine
    for i in range(batch):
        eng.add_request(f"t{batch}-{i}", prompts[i % len(prompts)],
                        SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True))
    while eng.scheduler.num_waiting or any(s.num_computed_tokens == 0 for s in eng.scheduler.running):
        eng.step()
    for _ in range(5):
        eng.step()
    times, tokens, build, launches = [], 0, [], []
    runner = eng.runner

    def timed(name):  # host-side input building: from the sequences, or (async) beside the step in flight
        real = getattr(runner, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = real(*a, **kw)
            build.append(time.perf_counter() - t)
            launches.append(name)
            return out

        setattr(runner, name, wrapper)

    timed("build_inputs")
    timed("build_next_inputs")
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = eng.step()
        times.append(time.perf_counter() - t0)
        tokens += sum(len(o.new_token_ids) for o in outs)
    graphs = runner.graphs
    bucket = graphs.bucket_for(batch)
    g = {kind: graphs.graphs[(kind, bucket, k)][0] for kind in ("greedy", "target", "draft")
         if (kind, bucket, k) in graphs.graphs}
    row = {"batch": batch, "k": k, "round_ms": 1e3 * statistics.median(times),
           "tokens_per_round": tokens / rounds, "output_tokens_per_s": tokens / sum(times),
           "gpu_round_ms": gpu_ms(g["greedy"].replay), "target_ms": gpu_ms(g["target"].replay),
           "draft_ms": gpu_ms(g["draft"].replay) if "draft" in g else 0.0}
    row["verify_ms"] = max(0.0, row["gpu_round_ms"] - row["target_ms"] - row["draft_ms"])
    del runner.build_inputs, runner.build_next_inputs  # the methods again
    row["host_build_ms"] = 1e3 * statistics.median(build)
    row["ahead_share"] = launches.count("build_next_inputs") / len(launches)
    if profile_path is not None:
        profile_rounds(eng, profile_path)
    seqs = list(eng.scheduler.running)
    row["other_ms"] = row["round_ms"] - row["gpu_round_ms"]
    row["other_share"] = row["other_ms"] / row["round_ms"]
    for s in seqs:
        eng.abort_request(s.seq_id)
    return row


def measure_stall(llm, prompts, prompt_len: int, batch: int = 8, rounds: int = 20) -> dict:
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"s-{i}", prompts[i % len(prompts)], params)
    while eng.scheduler.num_waiting or any(s.num_computed_tokens == 0 for s in eng.scheduler.running):
        eng.step()
    before = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        eng.step()
        before.append(time.perf_counter() - t0)
    long_prompt = [t for p in prompts for t in p][:prompt_len]
    seq = eng.add_request("s-long", long_prompt, params)
    during = []
    while seq.num_output_tokens == 0:
        t0 = time.perf_counter()
        eng.step()
        during.append(time.perf_counter() - t0)
    for s in list(eng.scheduler.running):
        eng.abort_request(s.seq_id)
    return {"batch": batch, "stall_prompt_tokens": len(long_prompt), "stall_decode_ms": 1e3 * statistics.median(before),
            "stall_max_ms": 1e3 * max(during), "stall_steps": len(during), "stall_ttft_ms": 1e3 * sum(during)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("--head", action="append", default=[], help="METHOD=DIR (eagle3 or peagle)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--methods", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)} (those with a --head)")
    ap.add_argument("--variants", default="sync", help=f"engine variants timed side by side: {', '.join(VARIANTS)}")
    ap.add_argument("--stall", type=int, metavar="N", help="also time the stall a new N-token prompt causes")
    ap.add_argument("--profile", metavar="DIR", help="also write a torch.profiler table per method and batch here")
    args = ap.parse_args(argv)
    heads = dict(h.split("=", 1) for h in args.head)
    tok = load_tokenizer(args.target)
    prompts = [tok.encode_chat(p.messages) for p in load_prompts("mtbench")]
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    unknown += [m for m in args.methods.split(",") if m not in CONFIGS]
    if unknown:
        ap.error(f"unknown method(s) or variant(s) {unknown}")
    rows = []

    def keep(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:  # after every row: a run cut short keeps what it measured
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)

    for name, head, k, parallel in (CONFIGS[m] for m in args.methods.split(",")):
        if head is not None and head not in heads:
            continue
        spec = None if head is None else {"method": "eagle3", "model": heads[head], "num_speculative_tokens": k,
                                          "parallel_drafting": parallel}
        for variant in args.variants.split(","):
            llm = LLM(model=args.target, speculative_config=spec, dtype="bfloat16", max_model_len=4096,
                      max_num_seqs=64, **VARIANTS[variant])
            for b in map(int, args.batches.split(",")):
                tag = "" if variant == "sync" else f"-{variant}"
                path = f"{args.profile}/profile-{name}-k{k}-b{b}{tag}.txt" if args.profile else None
                row = {"method": name, "variant": variant, **measure(llm, prompts, b, k, profile_path=path)}
                keep(row)
            if args.stall:
                keep({"method": name, "variant": variant, "k": k, **measure_stall(llm, prompts, args.stall)})
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    print_table(rows)
    return 0


def print_table(rows) -> None:
    cols = ("method", "variant", "batch", "k", "round_ms", "gpu_round_ms", "target_ms", "host_build_ms", "other_ms",
            "other_share", "ahead_share", "output_tokens_per_s")
    print(" | ".join(cols))
    for row in (r for r in rows if "round_ms" in r):
        print(" | ".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in cols))
    stalls = [r for r in rows if "stall_max_ms" in r]
    if stalls:
        cols = ("method", "variant", "stall_prompt_tokens", "stall_decode_ms", "stall_max_ms", "stall_steps",
                "stall_ttft_ms")
        print(" | ".join(cols))
        for row in stalls:
            print(" | ".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in cols))


if __name__ == "__main__":
    sys.exit(main())
