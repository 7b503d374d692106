"""Response regeneration: the target answers chat prompts itself, so the drafter learns the target's own outputs.

Prompts come from JSON Lines (`{"messages": [...]}` or `{"prompt": "..."}` per line) or a ShareGPT JSON file
(a list of `{"conversations": [{"from": "human" | "gpt", "value": ...}]}`; only the first human turn of each
conversation is used, and a truncated file is read up to its last complete record). Each prompt is rendered with
the target's chat template, answered greedily by the engine in batches, and written with its response as one
document (loss mask on the response). Every batch becomes one shard; the manifest lists finished shards, so an
interrupted run continues where it stopped.

Never regenerate from benchmark prompts (MT-Bench, HumanEval, ...): a drafter trained on them would inflate the
acceptance lengths measured there. Which file to use is the caller's choice.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm import tqdm

from peagle.models.config import ModelConfig
from peagle.models.loader import load_tokenizer
from peagle.models.tokenizer import Message, Tokenizer
from peagle.training.data import Document, Manifest, tokenizer_fingerprint, write_shard

logger = logging.getLogger(__name__)

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def read_prompts(path: str | Path) -> list[list[Message]]:
    """Conversations to answer, each ending with a user turn."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    records = _json_array_records(text, path) if text.lstrip().startswith("[") else _jsonl_records(text, path)
    prompts = [p for p in (_to_messages(r) for r in records) if p]
    if not prompts:
        raise ValueError(f"{path} holds no usable prompts (JSON Lines with messages/prompt, or ShareGPT JSON)")
    return prompts


def _jsonl_records(text: str, path: Path) -> Iterator[dict]:
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from None


def _json_array_records(text: str, path: Path) -> Iterator[dict]:
    """Records of a JSON array one at a time, stopping quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    pos, count = text.index("[") + 1, 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            logger.warning("%s is truncated after %d complete records; using those", path, count)
            return
        count += 1
        yield record


def _to_messages(record: Any) -> list[Message] | None:
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("prompt"), str):
        return [{"role": "user", "content": record["prompt"]}]
    if isinstance(record.get("messages"), list):
        messages = [m for m in record["messages"] if isinstance(m, dict) and m.get("role") in ROLES.values()]
        while messages and messages[-1]["role"] != "user":
            messages.pop()  # the target writes the answer itself
        return messages or None
    if isinstance(record.get("conversations"), list):
        first = next((t for t in record["conversations"]
                      if isinstance(t, dict) and t.get("from") == "human" and isinstance(t.get("value"), str)
                      and t["value"].strip()), None)
        return [{"role": "user", "content": first["value"]}] if first else None
    return None


def regenerate(
    model: str | Path,
    prompts: str | Path,
    out: str | Path,
    *,
    max_tokens: int = 1024,
    batch_size: int = 256,
    limit: int | None = None,
    speculative_config: dict | None = None,
    dtype: str = "bfloat16",
    device: str | None = None,
    max_model_len: int | None = None,
) -> Manifest:
    """Answers the prompts with the target and writes shards + manifest to `out`; resumes a previous run there."""
    if max_tokens < 1 or batch_size < 1:
        raise ValueError(f"--max-tokens and --batch-size must be positive, got {max_tokens} and {batch_size}")
    model, out = Path(model), Path(out)
    tokenizer = load_tokenizer(model)
    conversations = read_prompts(prompts)[:limit]
    source = {"prompts": Path(prompts).name, "max_tokens": max_tokens}
    manifest = _open_manifest(out, model, tokenizer, source)
    start = manifest.prompts_done
    if start >= len(conversations):
        logger.info("all %d prompts are already answered in %s", len(conversations), out)
        return manifest
    max_model_len = max_model_len or ModelConfig.from_dir(model).max_position_embeddings
    llm = _engine(model, speculative_config, dtype, device, max_model_len, batch_size)
    progress = tqdm(total=len(conversations), initial=start, desc="regenerating", unit=" prompts")
    for first in range(start, len(conversations), batch_size):
        batch = conversations[first:first + batch_size]
        documents = _answer(llm, tokenizer, batch, max_tokens, max_model_len)
        name = f"shard-{len(manifest.shards):05d}.safetensors"
        if documents:
            write_shard(out / name, documents)
        manifest.shards.append({"file": name if documents else None, "first_prompt": first,
                                "num_prompts": len(batch), "num_documents": len(documents),
                                "num_tokens": sum(len(d) for d in documents)})
        manifest.write(out)
        progress.update(len(batch))
    progress.close()
    return manifest


def _open_manifest(out: Path, model: Path, tokenizer: Tokenizer, source: dict) -> Manifest:
    fingerprint = tokenizer_fingerprint(tokenizer)
    if (out / "manifest.json").is_file():
        manifest = Manifest.read(out)
        if manifest.tokenizer_fingerprint != fingerprint or manifest.source != source:
            raise ValueError(
                f"{out} holds data regenerated by another model or from other prompts/settings "
                f"({manifest.model}, {manifest.source}); choose a new --out to start afresh"
            )
        logger.info("resuming: %d prompts already answered in %s", manifest.prompts_done, out)
        return manifest
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = ModelConfig.from_dir(model).vocab_size
    manifest = Manifest(fingerprint, vocab_size, str(model.name), source)
    manifest.write(out)
    return manifest


def _engine(model: Path, speculative_config: dict | None, dtype: str, device: str | None, max_model_len: int,
            batch_size: int):
    from peagle import LLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return LLM(model=str(model), speculative_config=speculative_config, dtype=dtype, device=device,
               max_model_len=max_model_len, max_num_seqs=min(batch_size, 256))


def _answer(llm, tokenizer: Tokenizer, batch: list[list[Message]], max_tokens: int, max_model_len: int
            ) -> list[Document]:
    from peagle import SamplingParams

    prompts = [tokenizer.encode_chat(messages) for messages in batch]
    fits = [p for p in prompts if len(p) + max_tokens <= max_model_len]
    if len(fits) < len(prompts):
        logger.warning("skipping %d prompts longer than %d tokens (max model length %d - max tokens %d)",
                       len(prompts) - len(fits), max_model_len - max_tokens, max_model_len, max_tokens)
    if not fits:
        return []
    outputs = llm.generate(fits, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    documents = []
    for prompt, output in zip(fits, outputs):
        response = list(output.token_ids)
        if not response:
            continue
        ids = torch.tensor(prompt + response, dtype=torch.long)
        mask = torch.cat([torch.zeros(len(prompt), dtype=torch.bool), torch.ones(len(response), dtype=torch.bool)])
        documents.append(Document(ids, mask))
    return documents
