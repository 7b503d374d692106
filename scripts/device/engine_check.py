"""Device check for the engine: speculative greedy output vs plain greedy output, with CUDA graphs.

Usage: python scripts/device/engine_check.py TARGET_DIR OUT.json --head eagle3=DIR --head peagle=DIR
       [--num-prompts 32] [--max-tokens 128] [--dtypes float32,bfloat16] [--sampling] [--async-scheduling]
       [--prefill-cuda-graphs] [--k 7,11] [--draft-confidence-cutoff C] [--dataset longcode] [--max-model-len N]
       [--completions]
fp32: outputs must be identical. bf16: verifying several tokens in one pass may flip a near-tie, so the report gives
the identical count and, for every divergence, the target's top-2 logit gap at the first differing position
(recomputed from scratch in fp32 over the plain-greedy prefix).
With --sampling: seeded sampled requests (temperature 0.8, top-p 0.95) under CUDA graphs must give the same tokens
as under enforce_eager, with each method (the sampling path, graphed).
With --async-scheduling the checked engines (plain and speculative) schedule asynchronously and are compared with
plain greedy output of an engine that does not: the check that async scheduling is lossless under CUDA graphs and
real asynchronous copies.
With --prefill-cuda-graphs the checked engines (plain and speculative) replay CUDA graphs for steps that prefill too
(captured on first use) and are compared with plain greedy output of an engine that runs those steps eagerly; it
combines with --async-scheduling. With --sampling it turns them on in the graphed engine.
With --dataset longcode the prompts are 2K-8K tokens (past every sliding window of the supported families); give
--max-model-len room for them and the answers. --completions encodes each prompt's text as it is, for a base model
without a chat template (Gemma 3 270M).
With --draft-confidence-cutoff C the speculative engines verify only their confident drafts (issue 52); the reference
is plain greedy, as always.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch

from peagle import LLM, SamplingParams
from peagle.bench.sweep import prompt_encoder
from peagle.datasets import BUILTIN_DATASETS, load_prompts
from peagle.models.attention import DenseAttention
from peagle.models.loader import load_model, load_tokenizer

METHODS = {"eagle3": (3, False), "peagle": (7, True)}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only for dry runs of this script


def run(target, prompts, max_tokens, dtype, head=None, k=0, parallel=False, eager=False, sampled=False,
        async_scheduling=False, max_model_len=2048, prefill_cuda_graphs=False, cutoff=None):
    spec = None if head is None else {"method": "eagle3", "model": head, "num_speculative_tokens": k,
                                      "parallel_drafting": parallel}
    llm = LLM(model=target, speculative_config=spec, dtype=dtype, max_model_len=max_model_len, max_num_seqs=32,
              enforce_eager=eager, async_scheduling=async_scheduling, prefill_cuda_graphs=prefill_cuda_graphs,
              draft_confidence_cutoff=cutoff if head is not None else None)
    if sampled:
        params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens, ignore_eos=True)
                  for i in range(len(prompts))]
    else:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    del llm
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return [o.token_ids for o in outs], outs


@torch.inference_mode()
def near_tie(model, prompt, base, spec):
    i = next(j for j, (a, b) in enumerate(zip(base, spec)) if a != b)
    ids = torch.tensor(prompt + base[:i], device=DEVICE)
    h = model(ids, torch.arange(len(ids), device=DEVICE), DenseAttention([len(ids)])).hidden
    top = model.compute_logits(h[-1:])[0].topk(2)
    return {"position": i, "base_token": base[i], "spec_token": spec[i],
            "top2_gap_fp32": float(top.values[0] - top.values[1]),
            "spec_token_is_top2": int(top.indices[1]) == spec[i] or int(top.indices[0]) == spec[i]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("--head", action="append", default=[], help="METHOD=DIR (eagle3 or peagle)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--sampling", action="store_true", help="seeded sampling: CUDA graphs vs eager only")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="greedy check: comma list of float32, bfloat16")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="the checked engines schedule asynchronously (the reference does not)")
    ap.add_argument("--prefill-cuda-graphs", action="store_true",
                    help="the checked engines replay CUDA graphs for prefill steps too (the reference does not)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dataset", default="mtbench", choices=BUILTIN_DATASETS,
                    help="the prompts (mtbench; longcode: 2K-8K tokens, past the sliding windows)")
    ap.add_argument("--completions", action="store_true",
                    help="the prompts' text as it is, no chat template (a base model)")
    ap.add_argument("--draft-confidence-cutoff", type=float, default=None, metavar="C",
                    help="the speculative engines verify only drafts whose confidence reaches C (issue 52)")
    ap.add_argument("--k", default=None,
                    help="comma list of K to check each head at (default: EAGLE-3 3, P-EAGLE 7), e.g. 7,11")
    args = ap.parse_args(argv)
    try:
        ks = None if args.k is None else [int(k) for k in args.k.split(",")]
    except ValueError:
        ap.error(f"--k takes a comma list of integers, got {args.k!r}")
    if ks is not None and (not ks or min(ks) < 1):
        ap.error(f"--k takes integers >= 1, got {args.k!r}")
    dtypes = args.dtypes.split(",")
    if not dtypes or set(dtypes) - {"float32", "bfloat16"}:
        ap.error(f"--dtypes takes float32 and/or bfloat16, got {args.dtypes!r}")
    heads = dict(h.split("=", 1) for h in args.head)
    tok = load_tokenizer(args.target)
    if not args.completions and not tok.chat_template:
        ap.error(f"{args.target} has no chat template (a base model): give --completions")
    encode = prompt_encoder(tok, args.completions)
    prompts = [encode(p) for p in load_prompts(args.dataset, limit=args.num_prompts, completions=args.completions)]
    longest = max(len(p) for p in prompts)
    if longest + args.max_tokens > args.max_model_len:
        ap.error(f"a {args.dataset} prompt has {longest} tokens: --max-model-len {args.max_model_len} leaves no room "
                 f"for {args.max_tokens} more")
    report = {"dataset": args.dataset, "completions": args.completions, "num_prompts": len(prompts),
              "max_tokens": args.max_tokens, "prompt_tokens": {"min": min(len(p) for p in prompts), "max": longest},
              "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "checks": []}
    if args.sampling:
        return sampling_check(args, heads, prompts, report)
    fp32_model = load_model(args.target, dtype="float32", device=DEVICE)
    for dtype in dtypes:
        base, _ = run(args.target, prompts, args.max_tokens, dtype, max_model_len=args.max_model_len)
        engine_variant = args.async_scheduling or args.prefill_cuda_graphs
        checked = [("none", None), *heads.items()] if engine_variant else list(heads.items())
        runs = [(method, head, k) for method, head in checked
                for k in ([METHODS.get(method, (0, False))[0]] if ks is None or head is None else ks)]
        for method, head, k in runs:
            parallel = METHODS.get(method, (0, False))[1]
            for eager in (False, True) if dtype == "bfloat16" and method == "peagle" else (False,):
                spec, outs = run(args.target, prompts, args.max_tokens, dtype, head, k, parallel, eager,
                                 async_scheduling=args.async_scheduling, max_model_len=args.max_model_len,
                                 prefill_cuda_graphs=args.prefill_cuda_graphs, cutoff=args.draft_confidence_cutoff)
                same = [a == b for a, b in zip(base, spec)]
                entry = {"dtype": dtype, "method": method, "k": k, "enforce_eager": eager,
                         "async_scheduling": args.async_scheduling, "prefill_cuda_graphs": args.prefill_cuda_graphs,
                         "draft_confidence_cutoff": args.draft_confidence_cutoff,
                         "verified_per_accepted": _verified_per_accepted(outs),
                         "identical": sum(same), "of": len(same),
                         "mean_acceptance_length": sum(o.metrics.acceptance_length or 1 for o in outs) / len(outs),
                         "divergences": [near_tie(fp32_model, p, b, s)
                                         for p, b, s, ok in zip(prompts, base, spec, same) if not ok]}
                report["checks"].append(entry)
                print(f"{dtype} {method} K={k} eager={eager} async={args.async_scheduling} "
                      f"prefill_graphs={args.prefill_cuda_graphs}: identical {sum(same)}/{len(same)}; "
                      f"divergence gaps {[round(d['top2_gap_fp32'], 4) for d in entry['divergences']]}", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({"checks": [{k: v for k, v in c.items() if k != "divergences"} for c in report["checks"]]}))
    return 0


def _verified_per_accepted(outs) -> float | None:
    """Draft tokens verified per accepted draft over the outputs (None without speculation)."""
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    return sum(o.metrics.num_verified_tokens for o in outs) / accepted if accepted else None


def sampling_check(args, heads, prompts, report) -> int:
    for method, head in [("none", None), *heads.items()]:
        k, parallel = METHODS.get(method, (0, False))
        graphed, outs = run(args.target, prompts, args.max_tokens, "bfloat16", head, k, parallel, False, True,
                            max_model_len=args.max_model_len, prefill_cuda_graphs=args.prefill_cuda_graphs,
                            cutoff=args.draft_confidence_cutoff)
        eager, _ = run(args.target, prompts, args.max_tokens, "bfloat16", head, k, parallel, True, True,
                       max_model_len=args.max_model_len, cutoff=args.draft_confidence_cutoff)
        same = sum(a == b for a, b in zip(graphed, eager))
        entry = {"sampling": "temperature 0.8, top_p 0.95, seeded", "method": method, "k": k,
                 "prefill_cuda_graphs": args.prefill_cuda_graphs,
                 "graphs_equal_eager": same, "of": len(prompts),
                 "mean_acceptance_length": sum(o.metrics.acceptance_length or 1 for o in outs) / len(outs)}
        report["checks"].append(entry)
        print(json.dumps(entry), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
