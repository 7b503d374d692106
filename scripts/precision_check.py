"""Where a P-EAGLE head's served acceptance moves with precision: the same head and prompts served greedy with the
target and drafter in bf16, in fp32, the drafter alone in fp32, and the target in fp32 with the features the drafter
reads rounded to bf16. An experiment, not a serving option: the last two modes patch the engine's drafter loading
and feature gather in this process only.

    python scripts/precision_check.py TARGET HEAD OUT.json [--modes bf16,fp32,fp32-drafter,fp32-target-bf16-features]
        [--num-prompts 24] [--max-tokens 256] [--k 7] [--dataset mtbench]

Per mode: acceptance length, acceptance by position, output tokens and the share of repeated 8-grams in the answers
(greedy answers of a small target loop, and a loop is easy to draft: text that changes with precision changes
acceptance without any change to the drafter).
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager, nullcontext

import torch

MODES = ("bf16", "fp32", "fp32-drafter", "fp32-target-bf16-features")


@contextmanager
def fp32_drafter():
    """The drafter's weights, buffers and KV cache in fp32 beside a bf16 target; the target's features cast up."""
    from peagle.engine import llm_engine, model_runner
    from peagle.engine.spec import proposer

    load, alloc, gather = (llm_engine.LLMEngine._load_drafter, model_runner.allocate_kv_cache,
                           proposer.kernels.gather_draft_features)
    allocated = []

    def load_fp32(self):
        drafter, cls = load(self)
        shared = {id(p) for p in self.target.parameters()} & {id(p) for p in drafter.parameters()}
        if shared:
            sys.exit("the drafter shares weights with the target: casting them would change the target")
        drafter.float()
        drafter.fc.register_forward_pre_hook(lambda m, args: tuple(a.float() for a in args))
        return drafter, cls

    def alloc_fp32(layers, blocks, block_size, kv_heads, head_dim, dtype, device):
        allocated.append(layers)  # the target's cache first, then the drafter's
        return alloc(layers, blocks, block_size, kv_heads, head_dim,
                     torch.float32 if len(allocated) == 2 else dtype, device)

    llm_engine.LLMEngine._load_drafter = load_fp32
    model_runner.allocate_kv_cache = alloc_fp32
    proposer.kernels.gather_draft_features = lambda aux, index, mask: gather(aux.to(mask.dtype), index, mask)
    try:
        yield
    finally:
        llm_engine.LLMEngine._load_drafter = load
        model_runner.allocate_kv_cache = alloc
        proposer.kernels.gather_draft_features = gather


@contextmanager
def bf16_features():
    """The target's features rounded to bf16 (and back) before the drafter reads them."""
    from peagle.engine.spec import proposer

    gather = proposer.kernels.gather_draft_features
    proposer.kernels.gather_draft_features = lambda aux, index, mask: gather(
        aux.to(torch.bfloat16).to(aux.dtype), index, mask)
    try:
        yield
    finally:
        proposer.kernels.gather_draft_features = gather


def repeated_8grams(answers: list[list[int]]) -> float:
    """The share of the answers' 8-grams that occurred earlier in the same answer."""
    from peagle.training.regenerate import repeated_ngrams

    flags = [repeated_ngrams(ids, 8)[7:] for ids in answers]  # the first 7 tokens end no 8-gram
    return sum(map(sum, flags)) / max(sum(map(len, flags)), 1)


def serve(target: str, head: str, mode: str, prompts: list[list[int]], k: int, max_tokens: int) -> dict:
    from peagle import LLM, SamplingParams

    patch = {"fp32-drafter": fp32_drafter, "fp32-target-bf16-features": bf16_features}.get(mode)
    dtype = "bfloat16" if mode in ("bf16", "fp32-drafter") else "float32"
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": k, "parallel_drafting": True}
    with patch() if patch else nullcontext():
        llm = LLM(model=target, speculative_config=spec, dtype=dtype, max_model_len=4096, max_num_seqs=1)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    metrics = [o.metrics for o in outs]
    rounds = sum(m.num_drafting_rounds for m in metrics)
    width = max(len(m.accepted_per_position) for m in metrics)
    answers = [list(o.outputs[0].token_ids) for o in outs]
    return {"mode": mode, "target_dtype": dtype, "output_tokens": sum(map(len, answers)),
            "acceptance_length": 1 + sum(m.num_accepted_tokens for m in metrics) / rounds,
            "per_position_acceptance": [sum(m.accepted_per_position[i] for m in metrics
                                            if i < len(m.accepted_per_position)) / rounds for i in range(width)],
            "repeated_8grams": repeated_8grams(answers)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("head", help="a P-EAGLE head")
    ap.add_argument("out")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--dataset", default="mtbench")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"unknown mode {bad[0]!r}: choose from {', '.join(MODES)}")
    from peagle.datasets import load_prompts
    from peagle.models.loader import load_tokenizer

    tok = load_tokenizer(args.target)
    prompts = [tok.encode_chat(p.messages) for p in load_prompts(args.dataset, limit=args.num_prompts)]
    results = []
    for mode in modes:
        results.append(serve(args.target, args.head, mode, prompts, args.k, args.max_tokens))
        r = results[-1]
        print(f"{mode}: AL {r['acceptance_length']:.3f}, {r['output_tokens']} tokens, repeated 8-grams "
              f"{r['repeated_8grams']:.3f}", flush=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with open(args.out, "w") as f:
        json.dump({"dataset": args.dataset, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
                   "k": args.k, "device": device, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
