"""vLLM's own offline path, timed: `LLM.generate` with no speculation, as a user of vLLM would run it (statistics off,
LLM's default), beside `peagle bench --vllm-baselines`' rows, which drive vLLM's engine step by step with its
statistics on (the spec-decode counters need them).

    python3 scripts/device/vllm_sanity.py MODEL OUT.json [--site /tmp/vllm-site] [--prompt-tokens 120]
        [--max-tokens 256] [--batches 1:4,64:192]

Random prompts of --prompt-tokens ids (seeded), greedy, --max-tokens with ignore_eos; for each CONCURRENCY:PROMPTS of
--batches one untimed batch, then PROMPTS prompts in batches of CONCURRENCY (LLM.generate runs each batch to its end,
so this is batch throughput, not continuous arrivals). Writes {"tokens_per_s": {concurrency: rate}, ...}.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--site", default="/tmp/vllm-site", help="a directory put first on sys.path (staged vLLM)")
    parser.add_argument("--prompt-tokens", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batches", default="1:4,64:192", help="CONCURRENCY:PROMPTS,... (default 1:4,64:192)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    args = parser.parse_args(argv)
    batches = [tuple(int(x) for x in item.split(":")) for item in args.batches.split(",")]

    sys.path.insert(0, args.site)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype="bfloat16", max_num_seqs=max(c for c, _ in batches),
              gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=4096, enable_prefix_caching=False,
              seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)])
               for _ in range(max(n for _, n in batches))]
    rates = {}
    for concurrency, count in batches:
        llm.generate(prompts[:concurrency], params, use_tqdm=False)  # warm-up: this batch size's graphs and kernels
        start, tokens = time.perf_counter(), 0
        for i in range(0, count, concurrency):
            done = llm.generate(prompts[i:i + concurrency], params, use_tqdm=False)
            tokens += sum(len(r.outputs[0].token_ids) for r in done)
        rates[str(concurrency)] = round(tokens / (time.perf_counter() - start), 1)
        print(f"concurrency {concurrency}: {rates[str(concurrency)]} tok/s", flush=True)
    result = {"vllm": vllm.__version__, "model": args.model, "prompt_tokens": args.prompt_tokens,
              "max_tokens": args.max_tokens, "batches": args.batches, "tokens_per_s": rates}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
