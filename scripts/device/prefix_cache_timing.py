"""Prefix caching's effect on time to first token: prompts that share a long first part (a system prompt, a
conversation's earlier turns), each asked for one token at concurrency 1, with the cache off and on, in one process.

Usage: python scripts/device/prefix_cache_timing.py MODEL_DIR OUT.json [--shared 1024] [--own 64] [--prompts 32]
       [--speculative-config JSON] [--dummy]
MODEL_DIR is a checkpoint, or with --dummy a directory with config.json only (random weights, as the device script's
.cfg). Every prompt is the same `--shared` tokens followed by `--own` tokens of its own, so with the cache on each
prompt after the first computes only its own part (and the block the two parts meet in). Each setting first runs
the prompts once untimed (compilation, graph captures, and with the cache, the cache filled as a warm server's
would be), then times each prompt alone: TTFT p50 / p90 and the tokens taken from the cache. The greedy first tokens
of both settings are compared and must be equal. On a CPU (no GPU) the numbers only show that the script runs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from peagle import LLM, SamplingParams


def prompts(vocab: int, shared: int, own: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    first = [rng.randrange(3, vocab) for _ in range(shared)]
    return [first + [rng.randrange(3, vocab) for _ in range(own)] for _ in range(count)]


def time_setting(args, caching: bool, batch: list[list[int]]) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(model=args.model, load_format="dummy" if args.dummy else "auto", device=device,
              dtype="bfloat16" if device == "cuda" else "float32", max_model_len=args.shared + args.own + 16,
              max_num_seqs=4, speculative_config=args.speculative_config, enable_prefix_caching=caching)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(batch, params, use_tqdm=False)  # warm-up: compilation, captures, the cache filled
    ttft, cached, first = [], [], []
    for prompt in batch:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        ttft.append(1e3 * (time.perf_counter() - start))
        cached.append(out.num_cached_tokens)
        first.append(out.token_ids[0])
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    quantiles = statistics.quantiles(ttft, n=10) if len(ttft) > 1 else ttft * 9
    return {"prefix_caching": caching, "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p90": quantiles[8],
            "cached_tokens_median": statistics.median(cached), "first_tokens": first}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="checkpoint directory (with --dummy: config.json only)")
    parser.add_argument("out", type=Path, help="the JSON written")
    parser.add_argument("--shared", type=int, default=1024, help="tokens every prompt starts with (default 1024)")
    parser.add_argument("--own", type=int, default=64, help="tokens of each prompt's own (default 64)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts timed per setting (default 32)")
    parser.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                        help="speculate as the server would (e.g. a head's config); default: none")
    parser.add_argument("--dummy", action="store_true", help="random weights from config.json")
    args = parser.parse_args(argv)
    if args.shared < 1 or args.own < 1 or args.prompts < 1:
        parser.error("--shared, --own and --prompts must be at least 1")
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    batch = prompts(vocab, args.shared, args.own, args.prompts)
    rows = [time_setting(args, caching, batch) for caching in (False, True)]
    off, on = rows
    result = {"shared": args.shared, "own": args.own, "prompts": args.prompts,
              "speculative_config": args.speculative_config, "device": torch.cuda.get_device_name()
              if torch.cuda.is_available() else "cpu", "rows": rows,
              "ttft_p50_off_over_on": off["ttft_ms_p50"] / on["ttft_ms_p50"],
              "first_tokens_equal": off["first_tokens"] == on["first_tokens"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for row in rows:
        print(f"prefix caching {'on ' if row['prefix_caching'] else 'off'}: TTFT p50 {row['ttft_ms_p50']:.2f} ms, "
              f"p90 {row['ttft_ms_p90']:.2f} ms, {row['cached_tokens_median']:g} tokens from the cache (median)")
    print(f"off / on at p50: {result['ttft_p50_off_over_on']:.2f}x; first tokens equal: "
          f"{result['first_tokens_equal']}")
    return 0 if result["first_tokens_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
