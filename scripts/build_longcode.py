"""Build the vendored long-context code set (src/peagle/bench/data/longcode.jsonl.gz) once; the output is committed.

Each prompt is one real Python standard-library file followed by an instruction about one of its functions, e.g.
"Explain what the function `scanstring` above does and write a unit test for it". Files are picked so that prompt
lengths spread evenly over 2K-8K tokens (four length bins, the same number of prompts in each); the choice is
deterministic for a given Python version. The set stands in for SPEED-Bench's coding category.

Token counts come from the target's tokenizer when --tokenizer is given (a converted model directory, or a .gguf
file, loaded with transformers); otherwise they are estimated as characters / 3.5 (SmolLM2's tokenizer averages
about 3.5-3.8 characters per token on Python code). Each record says which of the two was used.

    python scripts/build_longcode.py --tokenizer MODEL_DIR_OR_GGUF --out src/peagle/bench/data/longcode.jsonl.gz

With --train, it writes instead every other qualifying file (--min-tokens up to 7.9K tokens) whose module is not in
the vendored benchmark set, as `{"prompt": ...}` lines for `peagle regenerate`: the long training documents of a
head trained at 8K, never overlapping the set it is measured on.

    python scripts/build_longcode.py --train --min-tokens 1024 --tokenizer MODEL_DIR --out longcode_train.jsonl.gz
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import platform
import sysconfig
from pathlib import Path

CHARS_PER_TOKEN_ESTIMATE = 3.5
MIN_TOKENS, MAX_TOKENS = 2048, 7936  # leaves room for a 256-token answer in an 8K context
NUM_BINS = 4
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings", "pydoc_data"}
# Command-line drivers and self-tests say little about the module; ask about its real code.
SKIP_FUNCTIONS = {"main", "test", "_test"}
TEMPLATE = (
    "Here is the Python module `{module}` from the standard library:\n\n```python\n{code}\n```\n\n"
    "Explain what the {kind} `{name}` above does and write a unit test for it."
)


def load_counter(tokenizer: str | None):
    """(count(text) -> int, description) for the tokenizer, or the character estimate."""
    if tokenizer is None:
        how = f"estimate: characters / {CHARS_PER_TOKEN_ESTIMATE}"
        return (lambda text: round(len(text) / CHARS_PER_TOKEN_ESTIMATE)), how
    from transformers import AutoTokenizer

    path = Path(tokenizer)
    if path.suffix == ".gguf":
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        tok = AutoTokenizer.from_pretrained(str(path))
    return (lambda text: len(tok(text, add_special_tokens=False)["input_ids"])), f"tokenizer: {path.name}"


def _public_function(node: ast.AST) -> bool:
    return (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")
            and node.name not in SKIP_FUNCTIONS)


def pick_function(source: str) -> tuple[str, str] | None:
    """The longest public top-level function, else the longest public method: (kind, name) or None."""
    tree = ast.parse(source)
    functions, methods = [], []
    for node in tree.body:
        if _public_function(node):
            functions.append((node.end_lineno - node.lineno, node.name))
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            methods += [(m.end_lineno - m.lineno, f"{node.name}.{m.name}") for m in node.body if _public_function(m)]
    for kind, found in (("function", functions), ("method", methods)):
        long_enough = [f for f in found if f[0] >= 8]
        if long_enough:
            return kind, max(long_enough)[1]
    return None


def candidates(stdlib: Path, count, min_tokens: int = MIN_TOKENS) -> list[dict]:
    records = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if SKIP_PARTS & set(rel.parts) or rel.name.startswith("test_"):
            continue
        try:
            code = path.read_text(encoding="utf-8")
            picked = pick_function(code)
        except (UnicodeDecodeError, SyntaxError):
            continue
        if picked is None or len(code) < min_tokens * 2.5 or len(code) > MAX_TOKENS * 6:
            continue  # cheap pre-filter before tokenizing
        kind, name = picked
        prompt = TEMPLATE.format(module=rel.as_posix(), code=code.rstrip("\n"), kind=kind, name=name)
        num_tokens = count(prompt)
        if min_tokens <= num_tokens <= MAX_TOKENS:
            records.append({"module": rel.as_posix(), "kind": kind, "function": name, "prompt": prompt,
                            "num_tokens": num_tokens})
    return records


def select(records: list[dict], num_prompts: int) -> list[dict]:
    """`num_prompts / NUM_BINS` per length bin, in an order fixed by a hash of the module path (spreads packages)."""
    if num_prompts % NUM_BINS:
        raise ValueError(f"--num-prompts must be a multiple of {NUM_BINS}")
    width = (MAX_TOKENS - MIN_TOKENS) / NUM_BINS
    chosen = []
    for b in range(NUM_BINS):
        lo, hi = MIN_TOKENS + b * width, MIN_TOKENS + (b + 1) * width
        in_bin = [r for r in records if lo <= r["num_tokens"] < hi or (b == NUM_BINS - 1 and r["num_tokens"] == hi)]
        in_bin.sort(key=lambda r: hashlib.sha256(r["module"].encode()).hexdigest())
        if len(in_bin) < num_prompts // NUM_BINS:
            raise ValueError(f"only {len(in_bin)} files fall in {lo:.0f}-{hi:.0f} tokens")
        chosen += sorted(in_bin[: num_prompts // NUM_BINS], key=lambda r: r["num_tokens"])
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", help="model directory or .gguf file whose tokenizer measures prompt lengths")
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("src/peagle/bench/data/longcode.jsonl.gz"))
    parser.add_argument("--train", action="store_true",
                        help="write training prompts: every qualifying module not in --exclude")
    parser.add_argument("--min-tokens", type=int, default=MIN_TOKENS, help="shortest prompt with --train")
    parser.add_argument("--exclude", type=Path, default=Path("src/peagle/bench/data/longcode.jsonl.gz"),
                        help="with --train: the benchmark set whose modules are left out")
    args = parser.parse_args()

    count, how = load_counter(args.tokenizer)
    if args.train:
        write_train(args, count)
        return
    chosen = select(candidates(args.stdlib, count), args.num_prompts)
    version = f"cpython-{platform.python_version()}"
    # No name and mtime 0 in the gzip header: rebuilding gives identical bytes wherever the file is written.
    with open(args.out, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as raw:
        for i, r in enumerate(chosen):
            record = {"id": f"longcode-{i:02d}", "source": f"{version}/Lib/{r['module']}", "kind": r["kind"],
                      "function": r["function"], "num_tokens": r["num_tokens"], "token_count": how,
                      "prompt": r["prompt"]}
            raw.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
    sizes = [r["num_tokens"] for r in chosen]
    print(f"wrote {len(chosen)} prompts ({min(sizes)}-{max(sizes)} tokens, {how}) to {args.out} "
          f"({args.out.stat().st_size / 1e3:.0f} kB)")


def write_train(args, count) -> None:
    with gzip.open(args.exclude, "rt", encoding="utf-8") as f:
        held_out = {json.loads(line)["source"].split("/Lib/", 1)[1] for line in f if line.strip()}
    records = [r for r in candidates(args.stdlib, count, args.min_tokens) if r["module"] not in held_out]
    with open(args.out, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as raw:
        for r in records:
            raw.write((json.dumps({"id": r["module"], "prompt": r["prompt"]}, ensure_ascii=False) + "\n").encode())
    sizes = [r["num_tokens"] for r in records]
    print(f"wrote {len(records)} training prompts ({min(sizes)}-{max(sizes)} tokens, {sum(sizes)} in all), "
          f"{len(held_out)} benchmark modules left out, to {args.out}")


if __name__ == "__main__":
    main()
