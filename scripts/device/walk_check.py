"""Device check that the trainer's held-out walk predicts serving: the held-out documents' prompts served by the
engine with a trained head, per-round acceptance compared with the walk over the same documents.

Usage: python scripts/device/walk_check.py TARGET_DIR HEAD_DIR OUT.json --data DIR [DIR ...] [--k 7]
       [--dtypes float32,bfloat16] [--max-documents 64] [--eval-fraction 0.01] [--seed 0]
The held-out documents are the trainer's (same split, same defaults: pass the train run's --eval-fraction,
--max-eval-documents and --seed if they were changed); a directory that is an evaluation set (`peagle regenerate
--eval-set`, never trained on) is held out whole, its first --max-documents documents (run 10 split one by the
training fraction and kept 2 of its 256). For each, its first response is served greedily from its
prompt (max_tokens = the response's length) and walked with the same head. The served output equals the document
only where the engine's greedy choice equals the regeneration's (the same target, possibly another dtype or batch):
both acceptance lengths are reported over all documents and over those whose output matched. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from peagle.models.config import ModelConfig
from peagle.models.loader import load_tokenizer
from peagle.training.walk_check import al, first_turns, held_out_documents, served, walked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", type=Path)
    parser.add_argument("head", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--data", type=Path, nargs="+", required=True)
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--max-documents", type=int, default=64)
    parser.add_argument("--eval-fraction", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.target)
    held = held_out_documents(args.data, tokenizer, ModelConfig.from_dir(args.target).vocab_size, args.eval_fraction,
                              args.max_documents, args.seed)
    turns = first_turns(held)
    result = {"head": str(args.head), "k": args.k, "documents": len(turns), "by_dtype": {}}
    for dtype in args.dtypes.split(","):
        walk = walked(args.target, args.head, turns, args.k, dtype)
        serve = served(args.target, args.head, turns, args.k, dtype)
        same = [i for i, row in enumerate(serve) if row[2]]
        result["by_dtype"][dtype] = {
            "walk_al": al(walk), "served_al": al([(a, r) for a, r, _ in serve]),
            "matched_documents": len(same),
            "walk_al_matched": al([walk[i] for i in same]),
            "served_al_matched": al([serve[i][:2] for i in same]),
            "per_document": [{"walk": list(w), "served": list(s[:2]), "matched": s[2]} for w, s in zip(walk, serve)],
        }
        args.out.write_text(json.dumps(result, indent=1))
    summary = {d: {k: v for k, v in r.items() if k != "per_document"} for d, r in result["by_dtype"].items()}
    print(json.dumps({"head": result["head"], "k": args.k, "documents": len(turns), **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
