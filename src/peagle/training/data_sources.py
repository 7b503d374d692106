"""Where training prompts come from, and what may never be one.

- `normalise(text)`: the form prompts are compared in (NFKC, case-folded, punctuation to spaces, whitespace
  collapsed), for deduplication and for the benchmark check.
- `BenchmarkGuard`: the built-in benchmark sets (MT-Bench, both turns; HumanEval, wrapped and bare; the longcode
  test set) and ShareGPT's held-out split. A training prompt overlaps a benchmark prompt when their normalised texts
  are equal or share a run of at least 2 * WINDOW - 1 words (a pasted benchmark problem inside a longer request);
  it overlaps the held-out ShareGPT split when it comes from a held-out conversation (by id) or its first turn
  equals one of that split's prompts. The data commands refuse prompt files that overlap a benchmark set.
- `sharegpt_conversations`: every human turn of each ShareGPT conversation of one split, for multi-turn
  regeneration (the target writes every answer again, so the recorded answers are dropped).

    python -m peagle.training.data_sources sharegpt ShareGPT_V3_unfiltered_cleaned_split.json sharegpt_turns.jsonl.gz
writes the train split's conversations (human turns only) as JSON Lines for `peagle regenerate --multi-turn`;
`--split test --first-turns --last 256` the prompts of an evaluation set (`peagle regenerate --eval-set`, then
`peagle train --eval-data`), less those equal to a train-split turn.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import logging
import re
import unicodedata
from pathlib import Path
from typing import Iterable, Sequence

from peagle import datasets

logger = logging.getLogger(__name__)

# Word windows hashed from every benchmark prompt; a training prompt is probed at this stride, so every shared run
# of 2 * WINDOW - 1 words or more is found.
WINDOW = 12
SHAREGPT_ID_PREFIX = "sharegpt-"
_PUNCTUATION = re.compile(r"[^\w\s]")


def normalise(text: str) -> str:
    """NFKC, case-folded, punctuation replaced by spaces, whitespace collapsed: 'Hello,  World!' -> 'hello world'."""
    return " ".join(_PUNCTUATION.sub(" ", unicodedata.normalize("NFKC", text).casefold()).split())


def open_text(path: Path):
    """A text file, gzip-compressed when its name ends in .gz."""
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return path.open("r", encoding="utf-8")


class BenchmarkGuard:
    """Tells which prompts overlap a benchmark set or a held-out evaluation set."""

    def __init__(self, benchmarks: Iterable[tuple[str, str]], held_out_texts: Iterable[str] = ()):
        self.exact: dict[str, str] = {}  # normalised text -> set name
        self.windows: dict[int, str] = {}  # hash of WINDOW words -> set name
        for name, text in benchmarks:
            words = normalise(text)
            self.exact.setdefault(words, name)
            words = words.split()
            for i in range(len(words) - WINDOW + 1):
                self.windows.setdefault(hash(tuple(words[i:i + WINDOW])), name)
        self.held_out = {normalise(t) for t in held_out_texts}

    @classmethod
    def builtin(cls, sharegpt_json: Path | None = None) -> "BenchmarkGuard":
        """The vendored benchmark sets, plus ShareGPT's held-out prompts when the ShareGPT JSON is at hand."""
        path = sharegpt_json or datasets.sharegpt_file(datasets.default_cache_dir())
        held_out = []
        if path.is_file():
            held_out = [m["content"] for p in datasets.sharegpt_prompts(datasets.read_sharegpt(path), "test")
                        for m in p.messages]
        return cls(builtin_benchmark_texts(), held_out)

    def benchmark_of(self, text: str) -> str | None:
        """The benchmark set `text` overlaps, or None."""
        words = normalise(text)
        if words in self.exact:
            return self.exact[words]
        words = words.split()
        for i in range(0, len(words) - WINDOW + 1, WINDOW):
            name = self.windows.get(hash(tuple(words[i:i + WINDOW])))
            if name is not None:
                return name
        return None

    @staticmethod
    def held_out_id(record_id: str | None) -> bool:
        """Whether a record id names a conversation of ShareGPT's held-out split."""
        if not record_id or not record_id.startswith(SHAREGPT_ID_PREFIX):
            return False
        return datasets.sharegpt_split_of(record_id[len(SHAREGPT_ID_PREFIX):]) == "test"

    def held_out_text(self, text: str) -> bool:
        """Whether `text` equals a held-out ShareGPT prompt (normalised)."""
        return bool(self.held_out) and normalise(text) in self.held_out

    def check(self, prompts: Sequence[tuple[str | None, Sequence[str]]], source: str, drop: bool = False,
              allow_held_out: bool = False) -> list[int]:
        """Indices of the prompts to keep: (id, user texts) pairs. Refuses benchmark overlap unless `drop`.

        Prompts equal to a held-out ShareGPT prompt are always dropped (a few short ones such as "Continue" occur
        in both splits); a file holding held-out conversations, or overlapping a benchmark set, is refused.
        `allow_held_out` (an evaluation set, never trained on) keeps ShareGPT's held-out prompts; benchmark
        overlap is refused all the same.
        """
        keep, benchmark_hits, held_ids, held_texts = [], [], 0, 0
        for i, (record_id, texts) in enumerate(prompts):
            hit = next((b for b in map(self.benchmark_of, texts) if b), None)
            if hit:
                benchmark_hits.append((i, hit, texts[0]))
            elif allow_held_out:
                keep.append(i)
            elif self.held_out_id(record_id):
                held_ids += 1
            elif self.held_out_text(texts[0]):  # the held-out set is first turns
                held_texts += 1
            else:
                keep.append(i)
        if held_ids and not drop:
            raise ValueError(f"{source} holds {held_ids} conversations of ShareGPT's held-out split (the benchmark's "
                             "'sharegpt' set): use the train split")
        if benchmark_hits and not drop:
            names = sorted({b for _, b, _ in benchmark_hits})
            i, name, text = benchmark_hits[0]
            raise ValueError(
                f"{source} holds {len(benchmark_hits)} prompts that overlap the benchmark sets {', '.join(names)} "
                f"(the first, prompt {i}, overlaps {name}: {text[:80]!r}); benchmark prompts never enter training "
                "data. Use other prompts, or --exclude-overlap to drop these and keep the rest"
            )
        dropped = len(prompts) - len(keep)
        if dropped:
            logger.warning("%s: dropped %d prompts (%d overlap benchmarks, %d from held-out ShareGPT conversations, "
                           "%d equal to held-out ShareGPT prompts)", source, dropped, len(benchmark_hits), held_ids,
                           held_texts)
        return keep


def builtin_benchmark_texts() -> list[tuple[str, str]]:
    """(set name, prompt text) of every vendored benchmark prompt, in each form a prompt file might hold it."""
    with datasets.data_file("mtbench_question.jsonl").open("r", encoding="utf-8") as f:
        texts = [("mtbench", turn) for line in f if line.strip() for turn in json.loads(line)["turns"]]
    with datasets.data_file("HumanEval.jsonl.gz").open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    texts += [("humaneval", r["prompt"]) for r in problems]
    texts += [("humaneval", datasets.HUMANEVAL_TEMPLATE.format(prompt=r["prompt"])) for r in problems]
    texts += [("longcode", r["prompt"]) for r in datasets.longcode_records()]
    return texts


def sharegpt_conversations(records: Iterable[dict], split: str = "train") -> list[dict]:
    """`{"id": "sharegpt-ID", "messages": [user turns]}` for every conversation of `split` with a human turn."""
    out = []
    for record in records:
        cid = str(record.get("id", ""))
        if not cid or datasets.sharegpt_split_of(cid) != split:
            continue
        turns = [t["value"] for t in record.get("conversations", [])
                 if isinstance(t, dict) and t.get("from") in ("human", "user") and isinstance(t.get("value"), str)
                 and t["value"].strip()]
        if turns:
            out.append({"id": SHAREGPT_ID_PREFIX + cid, "messages": [{"role": "user", "content": t} for t in turns]})
    return out


def without_train_turns(conversations: list[dict], train: Iterable[dict]) -> list[dict]:
    """`conversations` (held-out ones, an evaluation set's) less those with a turn equal (normalised) to a human
    turn of `train`: short prompts such as "hi" occur in both splits, and the training data holds every train turn."""
    seen = {normalise(m["content"]) for c in train for m in c["messages"]}
    kept = [c for c in conversations if not any(normalise(m["content"]) in seen for m in c["messages"])]
    if len(kept) < len(conversations):
        logger.warning("dropped %d held-out conversations with a turn equal to a train-split turn",
                       len(conversations) - len(kept))
    return kept


def write_jsonl(path: Path, records: Iterable[dict]) -> int:
    """JSON Lines (gzip-compressed for a .gz name, with a fixed header), written whole or not at all."""
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "wb") as f:
        raw = gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) if path.suffix == ".gz" else f
        for record in records:
            # ASCII JSON: characters such as U+2028 stay escaped, so every reader sees one record per line.
            raw.write((json.dumps(record) + "\n").encode())
            n += 1
        if raw is not f:
            raw.close()
    tmp.replace(path)
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sharegpt = sub.add_parser("sharegpt", help="ShareGPT conversations (human turns) of one split as JSON Lines")
    sharegpt.add_argument("sharegpt_json", type=Path)
    sharegpt.add_argument("out", type=Path, help="JSON Lines file (.gz: compressed)")
    sharegpt.add_argument("--split", choices=("train", "test"), default="train")
    sharegpt.add_argument("--first-turns", action="store_true",
                          help="each conversation's first human turn only, at most as long as the benchmark "
                               "'sharegpt' set's prompts (its form)")
    sharegpt.add_argument("--last", type=int, metavar="N",
                          help="the split's last N conversations only (an evaluation set beside the benchmark "
                               "'sharegpt' set, which reads the held-out split from its start: the two share no "
                               "prompt while the benchmark's --num-prompts stays below the split's size minus N)")
    args = parser.parse_args(argv)
    if args.last is not None and args.last < 1:
        parser.error(f"--last must be at least 1, got {args.last}")
    records = datasets.read_sharegpt(args.sharegpt_json)
    conversations = sharegpt_conversations(records, args.split)
    if args.first_turns:
        conversations = [{**c, "messages": c["messages"][:1]} for c in conversations
                         if len(c["messages"][0]["content"]) <= datasets.SHAREGPT_MAX_PROMPT_CHARS]
    # Prompts overlapping a benchmark set are dropped from either split (the held-out split is an evaluation set's
    # source: it is kept, never trained on).
    guard = BenchmarkGuard.builtin(args.sharegpt_json)
    keep = guard.check([(c["id"], [m["content"] for m in c["messages"]]) for c in conversations],
                       str(args.sharegpt_json), drop=True, allow_held_out=args.split == "test")
    conversations = [conversations[i] for i in keep]
    if args.split == "test":
        conversations = without_train_turns(conversations, sharegpt_conversations(records, "train"))
    if args.last is not None:
        conversations = conversations[-args.last:]
    n = write_jsonl(args.out, conversations)
    turns = sum(len(c["messages"]) for c in conversations)
    print(f"wrote {n} {args.split}-split conversations ({turns} human turns) to {args.out}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    raise SystemExit(main())
