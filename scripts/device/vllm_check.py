#!/usr/bin/env python3
"""vLLM on the GPU machine, proved: `import vllm`, the requirements its staged wheels leave unmet, and a plain greedy
generate (the vllm_stage stage of scripts/device/stages.py runs it with /tmp/vllm-site first on the path).

    python3 scripts/device/vllm_check.py MODEL OUT.json [--site /tmp/vllm-site] [--dummy | --tiny] [--max-tokens 32]

MODEL: a checkpoint directory (the testbed target); with --dummy a directory holding only config.json and the
tokenizer (random weights, load_format dummy); with --tiny a directory this writes a 2-layer Llama's config.json
into (random weights, no tokenizer: the prompts go in as token ids). Writes OUT.json: vLLM's, torch's and
transformers' versions, the GPU,
the staged distributions' unmet requirements (skipped ones named apart, with why: scripts/device/vllm_wheels.py),
the engine's start-up seconds, the generate's tokens/s and the first tokens of each output; prints the same last, as
one line.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import sys
import time
from pathlib import Path

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Speculative decoding is", "Once upon a time"]
TINY_PROMPTS = [{"prompt_token_ids": [(7 * i + j) % 4000 + 1 for j in range(5 + 3 * i)]} for i in range(4)]


def write_tiny_model(dest: Path) -> None:
    """A 2-layer Llama's config.json in DEST: random weights under load_format dummy, no tokenizer needed."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048).save_pretrained(dest)


def unmet_requirements(site: str) -> list[dict]:
    """Each requirement of a distribution installed in SITE (extras left out) that nothing on sys.path meets:
    {"of": the distribution, "needs": the requirement, "name": its name, "found": the version found or None}."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    out = []
    for dist in md.distributions(path=[site]):
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                have = None
            if have is None or not req.specifier.contains(have, prereleases=True):
                out.append({"of": canonicalize_name(dist.metadata["Name"]), "needs": str(req),
                            "name": canonicalize_name(req.name), "found": have})
    return sorted(out, key=lambda u: (u["of"], u["name"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("out", type=Path)
    ap.add_argument("--site", default="/tmp/vllm-site", help="where vLLM's staged wheels were installed")
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument("--dummy", action="store_true", help="random weights from MODEL's config.json")
    kind.add_argument("--tiny", action="store_true", help="write a tiny Llama's config.json into MODEL and run it")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).parent))
    from vllm_wheels import SKIP

    import torch
    import transformers
    import vllm
    from vllm import LLM, SamplingParams

    unmet = unmet_requirements(args.site)
    result = {"vllm": vllm.__version__, "vllm_file": vllm.__file__, "torch": torch.__version__,
              "cuda": torch.version.cuda, "transformers": transformers.__version__,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "unmet": [u for u in unmet if u["name"] not in SKIP],
              "unmet_skipped": sorted({u["name"] for u in unmet if u["name"] in SKIP})}
    args.out.write_text(json.dumps(result, indent=1))  # what is known so far, should the engine fail
    if args.tiny:
        write_tiny_model(Path(args.model))
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=1024, max_num_seqs=len(PROMPTS),
              gpu_memory_utilization=0.5, seed=0, load_format="dummy" if args.dummy or args.tiny else "auto",
              enable_prefix_caching=False, skip_tokenizer_init=args.tiny)
    result["startup_s"] = round(time.perf_counter() - start, 1)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = TINY_PROMPTS if args.tiny else PROMPTS
    llm.generate(prompts, params, use_tqdm=False)  # warm
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    result.update(tokens_per_s=round(sum(len(o.outputs[0].token_ids) for o in outs) / seconds, 1),
                  outputs=[list(o.outputs[0].token_ids[:8]) for o in outs],
                  texts=[(o.outputs[0].text or "")[:60] for o in outs])
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":  # vLLM may spawn its engine core, which imports this file again
    sys.exit(main())
