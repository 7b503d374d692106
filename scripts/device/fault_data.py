"""Training data with the testbed's structure, made without running the target: for reproducing trainer faults.

A trainer's kernels see the data through its shapes: document lengths, where the loss mask is on, how documents
pack into 8K sequences. This writes two data directories with the testbed's mixture of those, from text alone:
    chat/  ShareGPT train-split conversations through the chat template, up to 4 user turns each, the recorded
           answers cut to --answer-tokens and trained on (the testbed answers every turn with the target instead)
    code/  Python source files of the standard library: a prompt of up to 4K tokens, an answer of --answer-tokens
           (the testbed's short and long code prompts, answered by the target)
The tokens are real, the answers are not the target's: heads trained on this are worthless, its faults are real.

    python scripts/device/fault_data.py --tokenizer .cfg --sharegpt ShareGPT.json --out .fault --max-tokens 2500000
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
from pathlib import Path

import torch

from peagle.datasets import sharegpt_split_of
from peagle.models.tokenizer import Tokenizer
from peagle.training.data import Document, Manifest, tokenizer_fingerprint, write_shard


def chat_documents(tokenizer: Tokenizer, records: list[dict], answer_tokens: int, budget: int):
    """Documents of train-split conversations: each user turn's template tokens masked off, each answer on."""
    used = 0
    for record in records:
        if used >= budget:
            return
        if sharegpt_split_of(str(record.get("id", ""))) != "train":
            continue
        messages, ids, mask = [], [], []
        turns = [t for t in record.get("conversations", []) if isinstance(t, dict) and isinstance(t.get("value"), str)]
        for user, answer in zip(turns[0::2], turns[1::2]):
            if user.get("from") not in ("human", "user") or len(messages) >= 8:
                break
            messages.append({"role": "user", "content": user["value"]})
            prompt = tokenizer.encode_chat(messages, add_generation_prompt=True)
            reply = tokenizer.encode(answer["value"])[:answer_tokens] + [tokenizer.token_to_id("<|im_end|>")]
            new = prompt[len(ids):]
            ids, mask = ids + new + reply, mask + [0] * len(new) + [1] * len(reply)
            messages.append({"role": "assistant", "content": tokenizer.decode(reply)})
            if len(ids) > 4096:
                break
        if mask and any(mask):
            used += len(ids)
            yield Document(torch.tensor(ids), torch.tensor(mask, dtype=torch.bool))


def code_documents(tokenizer: Tokenizer, answer_tokens: int, budget: int, seed: int):
    """Documents of standard-library files: a prompt of 16-4096 tokens, the next `answer_tokens` trained on."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    random.Random(seed).shuffle(files)
    used = 0
    rng = random.Random(seed)
    for path in files:
        if used >= budget:
            return
        try:
            ids = tokenizer.encode(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if len(ids) < 64:
            continue
        cut = min(len(ids) - 16, rng.choice([rng.randint(16, 512), rng.randint(512, 4096)]))
        doc = ids[:cut + answer_tokens]
        used += len(doc)
        yield Document(torch.tensor(doc), torch.arange(len(doc)) >= cut)


def write(out: Path, documents, tokenizer: Tokenizer, name: str, shard_docs: int = 2048) -> int:
    out.mkdir(parents=True, exist_ok=True)
    docs = list(documents)
    manifest = Manifest(tokenizer_fingerprint(tokenizer), tokenizer.vocab_size, name, {"fault_data": name})
    for i in range(0, len(docs), shard_docs):
        part = docs[i:i + shard_docs]
        file = f"shard-{i // shard_docs:05d}.safetensors"
        write_shard(out / file, part)
        manifest.shards.append({"file": file, "first_prompt": i, "num_prompts": len(part),
                                "num_documents": len(part), "num_tokens": sum(len(d) for d in part)})
    manifest.write(out)
    return sum(len(d) for d in docs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, required=True, help="the target's directory (its tokenizer)")
    parser.add_argument("--sharegpt", type=Path, required=True, help="ShareGPT_V3_unfiltered_cleaned_split.json")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=2_500_000, help="tokens in all (half chat, half code)")
    parser.add_argument("--answer-tokens", type=int, default=256)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_dir(args.tokenizer)
    text = args.sharegpt.read_text(encoding="utf-8")
    decoder, records, at = json.JSONDecoder(), [], text.index("[") + 1
    while len(records) < 40_000:  # the file is cut mid-record: decode record by record
        at = text.find("{", at)
        if at < 0:
            break
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break
        records.append(record)
    half = args.max_tokens // 2
    chat = write(args.out / "chat", chat_documents(tokenizer, records, args.answer_tokens, half), tokenizer, "chat")
    code = write(args.out / "code", code_documents(tokenizer, args.answer_tokens, half, 0), tokenizer, "code")
    print(json.dumps({"chat_tokens": chat, "code_tokens": code}))


if __name__ == "__main__":
    main()
