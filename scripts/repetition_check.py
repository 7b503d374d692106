"""How much of the target's greedy answers repeats itself, by answer position: benchmark prompts beside training ones.

Usage: python scripts/repetition_check.py MODEL_DIR OUT.json [--num-prompts 16] [--max-tokens 512] [--device cpu]
A token counts as repeated when the 8-gram ending at it already occurred earlier in the same answer: inside a
degenerate loop every token is. Reported per prompt set: the repeated share of answer tokens 1-256 and 257-512, the
mean answer length and how many answers stopped (EOS) before --max-tokens. Sets: MT-Bench and HumanEval (the
benchmarks, first prompts), the first human turns of ShareGPT's train split and the short standard-library code
prompts (the training sources; .gpu/ holds their files, see scripts/device/run.sh). Greedy, fp32.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from peagle import LLM, SamplingParams
from peagle.datasets import load_prompts
from peagle.training.regenerate import repeated_ngrams

SPLIT = 256  # the benchmarks' --max-tokens in `run.sh heads`


def prompt_sets(n: int, files: Path) -> dict[str, list[list[dict]]]:
    read = lambda name: [json.loads(line) for line in gzip.open(files / name, "rt")][:n]  # noqa: E731
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    return {"mtbench": [list(p.messages) for p in load_prompts("mtbench")[:n]],
            "humaneval": [list(p.messages) for p in load_prompts("humaneval")[:n]],
            "sharegpt-train": [user(r["conversations"][0]["value"]) for r in read("sharegpt_train_turns.jsonl.gz")],
            "code-train": [user(r["prompt"]) for r in read("code_short.jsonl.gz")]}


def share(flags: list[list[bool]]) -> float | None:
    total = sum(map(len, flags))
    return sum(map(sum, flags)) / total if total else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out", type=Path)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--files", type=Path, default=Path(".gpu"), help="folder of the training sources' prompt files")
    args = ap.parse_args()
    llm = LLM(model=args.model, device=args.device, dtype="float32", max_model_len=4096, max_num_seqs=64)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    report = {"model": args.model, "max_tokens": args.max_tokens, "ngram": 8, "sets": {}}
    for name, chats in prompt_sets(args.num_prompts, args.files).items():
        answers = [list(r.outputs[0].token_ids) for r in llm.chat(chats, params, use_tqdm=False)]
        flags = [repeated_ngrams(a) for a in answers]
        report["sets"][name] = {
            "num_prompts": len(answers), "mean_length": sum(map(len, answers)) / len(answers),
            "stopped_before_max": sum(len(a) < args.max_tokens for a in answers),
            f"repeated_1_{SPLIT}": share([f[:SPLIT] for f in flags]),
            f"repeated_{SPLIT + 1}_{args.max_tokens}": share([f[SPLIT:] for f in flags]),
        }
        print(name, report["sets"][name], flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
