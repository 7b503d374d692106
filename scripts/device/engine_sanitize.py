"""The engine's serving path for compute-sanitizer: P-EAGLE K=7 and EAGLE-3 K=3 at concurrency 1 and 64, CUDA graphs,
async scheduling and prefix caching on, random weights at the target's shape with synthetic acceptance (so that
rounds accept 0..K drafts as trained heads do). Run it under `compute-sanitizer --tool memcheck`; it prints one JSON
line per point and checks that every request finished with its tokens.

    compute-sanitizer --tool memcheck python scripts/device/engine_sanitize.py TARGET_DIR HEADS_DIR
(HEADS_DIR/eagle3 and HEADS_DIR/peagle: `peagle drafter init --target TARGET_DIR` heads)
"""

from __future__ import annotations

import argparse
import json
import time

from peagle import LLM, SamplingParams

POINTS = {"peagle": (7, True, (0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)), "eagle3": (3, False, (0.8, 0.65, 0.5))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target")
    parser.add_argument("heads")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--concurrency", default="1,64")
    args = parser.parse_args()
    # Random weights: what a prompt says does not matter, its length does (short chat turns to long requests).
    prompts = [" ".join(f"word{j}" for j in range(8 + 37 * i % 400)) for i in range(64)]
    for method, (k, parallel, rates) in POINTS.items():
        llm = LLM(args.target, {"method": "eagle3", "model": f"{args.heads}/{method}", "num_speculative_tokens": k,
                                "parallel_drafting": parallel},
                  load_format="dummy", synthetic_acceptance=rates, enable_prefix_caching=True, async_scheduling=True,
                  max_num_seqs=64, max_model_len=2048, gpu_memory_utilization=0.3)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for c in map(int, args.concurrency.split(",")):
            start = time.monotonic()
            if c == 1:
                outs = [o for p in prompts[:3] for o in llm.generate([p], params, use_tqdm=False)]
            else:  # every prompt twice: the second copies start from the first's cached blocks
                batch = prompts[:c // 2] * 2
                outs = llm.generate(batch, params, use_tqdm=False)
            tokens = [len(o.outputs[0].token_ids) for o in outs]
            assert all(t == args.max_tokens for t in tokens), tokens
            print(json.dumps({"method": method, "k": k, "concurrency": c, "requests": len(outs),
                              "tokens": sum(tokens), "seconds": round(time.monotonic() - start, 1)}), flush=True)
        del llm


if __name__ == "__main__":
    main()
