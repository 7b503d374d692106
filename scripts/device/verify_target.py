"""Device check for the foundation: peagle's target model vs transformers on the same converted checkpoint.

Usage: python scripts/device/verify_target.py CKPT_DIR OUT.json [--num-prompts 8] [--max-new-tokens 128]
Compares, on MT-Bench first turns with the chat template applied: the max abs logit difference over every prompt
position (bf16 and fp32), and greedy continuations (peagle full-recompute greedy vs transformers generate).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from transformers import AutoModelForCausalLM

from peagle.datasets import load_prompts
from peagle.models.attention import DenseAttention
from peagle.models.loader import load_model, load_tokenizer
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only for dry runs of this script


@torch.inference_mode()
def greedy_peagle(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        t = torch.tensor(out, device=DEVICE)
        h = model(t, torch.arange(len(out), device=DEVICE), DenseAttention([len(out)])).hidden
        out.append(int(model.compute_logits(h[-1:]).argmax(-1)))
    return out[len(ids):]


@torch.inference_mode()
def compare(ckpt: str, dtype: torch.dtype, prompts: list[list[int]], new_tokens: int) -> dict:
    ours = load_model(ckpt, dtype=dtype, device=DEVICE)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(DEVICE).eval()
    rows = []
    for ids in prompts:
        t = torch.tensor(ids, device=DEVICE)
        a = ours.compute_logits(ours(t, torch.arange(len(ids), device=DEVICE), DenseAttention([len(ids)])).hidden)
        b = ref(t[None]).logits[0].float()
        g_ours = greedy_peagle(ours, ids, new_tokens)
        g_ref = ref.generate(t[None], max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
                             eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        first_diff = next((i for i, (x, y) in enumerate(zip(g_ours, g_ref)) if x != y), None)
        rows.append({"prompt_tokens": len(ids), "max_abs_logit_diff": float((a - b).abs().max()),
                     "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
                     "greedy_identical": g_ours == g_ref, "first_divergence": first_diff})
    del ours, ref
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return {"dtype": str(dtype), "rows": rows,
            "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
            "greedy_identical": sum(r["greedy_identical"] for r in rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("out")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    tok = load_tokenizer(args.ckpt)
    prompts = [tok.encode_chat(p.messages) for p in load_prompts("mtbench", limit=args.num_prompts)]
    result = {"num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
              "results": [compare(args.ckpt, d, prompts, args.max_new_tokens) for d in (torch.bfloat16, torch.float32)]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in result["results"]:
        print(f"{r['dtype']}: max |logit diff| {r['max_abs_logit_diff']:.4g}; greedy identical "
              f"{r['greedy_identical']}/{len(prompts)}")
    print(json.dumps({k: v for k, v in result.items() if k != "results"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
