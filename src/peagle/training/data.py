"""Training data on disk (shards written by `peagle regenerate`) and packing it into training sequences.

A data directory holds `manifest.json` and `shard-NNNNN.safetensors` files. Each shard stores its documents
(prompt followed by the target's own response) flat:
    token_ids   [total] int32
    loss_mask   [total] uint8, 1 on response tokens (what the drafter is trained to predict)
    doc_offsets [num_docs + 1] int64, document i is token_ids[doc_offsets[i]:doc_offsets[i+1]]
The manifest names the shards and fingerprints the tokenizer, so that data regenerated for one tokenizer is never
trained against a target with another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch
from safetensors.torch import load_file, save_file

from peagle.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "peagle-training-data"
VERSION = 1


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A hash of the token -> id map (added tokens included): equal iff the ids mean the same strings."""
    vocab = sorted(tokenizer.backend.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Document:
    token_ids: torch.Tensor  # [length] int64
    loss_mask: torch.Tensor  # [length] bool

    def __len__(self) -> int:
        return self.token_ids.numel()


@dataclass(frozen=True, slots=True)
class PackedSequence:
    """Several documents concatenated into one token-flat training sequence."""

    token_ids: torch.Tensor  # [n] int64
    loss_mask: torch.Tensor  # [n] bool
    doc_ids: torch.Tensor  # [n] int64, non-decreasing from 0
    sources: tuple[int, ...] = ()  # dataset index of each document (keys of the feature cache), if known

    def __len__(self) -> int:
        return self.token_ids.numel()

    def to(self, device: torch.device | str) -> "PackedSequence":
        return PackedSequence(self.token_ids.to(device), self.loss_mask.to(device), self.doc_ids.to(device),
                              self.sources)

    @property
    def doc_lengths(self) -> list[int]:
        return torch.bincount(self.doc_ids).tolist()

    @property
    def positions(self) -> torch.Tensor:
        """[n] each token's position within its document."""
        starts = torch.cumsum(torch.tensor([0, *self.doc_lengths[:-1]]), 0)
        return torch.arange(len(self)) - starts[self.doc_ids]

    @classmethod
    def of(cls, documents: Sequence[Document], sources: Sequence[int] = ()) -> "PackedSequence":
        return cls(
            token_ids=torch.cat([d.token_ids for d in documents]),
            loss_mask=torch.cat([d.loss_mask for d in documents]),
            doc_ids=torch.cat([torch.full((len(d),), i, dtype=torch.long) for i, d in enumerate(documents)]),
            sources=tuple(sources),
        )

    def document(self, i: int) -> Document:
        lo = sum(self.doc_lengths[:i])
        part = slice(lo, lo + self.doc_lengths[i])
        return Document(self.token_ids[part], self.loss_mask[part])

    @classmethod
    def concat(cls, sequences: Sequence["PackedSequence"]) -> "PackedSequence":
        """One micro-batch: the sequences' documents side by side, renumbered."""
        offsets, docs = 0, []
        for s in sequences:
            docs.append(s.doc_ids + offsets)
            offsets += int(s.doc_ids.max()) + 1 if len(s) else 0
        sources = sum((s.sources for s in sequences), ()) if all(s.sources for s in sequences) else ()
        return cls(torch.cat([s.token_ids for s in sequences]), torch.cat([s.loss_mask for s in sequences]),
                   torch.cat(docs), sources)


# ---- writing (regenerate) ----

@dataclass
class Manifest:
    tokenizer_fingerprint: str
    vocab_size: int
    model: str
    source: dict = field(default_factory=dict)  # what the documents were made from: prompts file, max tokens
    shards: list[dict] = field(default_factory=list)  # {file, first_prompt, num_prompts, num_documents, num_tokens}

    @property
    def prompts_done(self) -> int:
        return sum(s["num_prompts"] for s in self.shards)

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "tokenizer_fingerprint": self.tokenizer_fingerprint,
                "vocab_size": self.vocab_size, "model": self.model, "source": self.source, "shards": self.shards}

    @classmethod
    def read(cls, data_dir: Path) -> "Manifest":
        path = data_dir / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"{data_dir} has no {MANIFEST}; write training data with `peagle regenerate`")
        d = json.loads(path.read_text())
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise ValueError(f"{path} is not peagle training data of version {VERSION}")
        return cls(d["tokenizer_fingerprint"], d["vocab_size"], d["model"], d.get("source", {}), d["shards"])

    def write(self, data_dir: Path) -> None:
        tmp = data_dir / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(tmp, data_dir / MANIFEST)  # atomic: an interrupted run leaves the previous manifest intact


def write_shard(path: Path, documents: Sequence[Document]) -> None:
    offsets = torch.cumsum(torch.tensor([0, *(len(d) for d in documents)]), 0)
    tensors = {
        "token_ids": torch.cat([d.token_ids for d in documents]).to(torch.int32),
        "loss_mask": torch.cat([d.loss_mask for d in documents]).to(torch.uint8),
        "doc_offsets": offsets.to(torch.int64),
    }
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


# ---- reading (train) ----

def read_documents(data_dir: str | Path, tokenizer: Tokenizer, vocab_size: int) -> list[Document]:
    """All documents of a data directory, refusing data made with another tokenizer."""
    data_dir = Path(data_dir)
    manifest = Manifest.read(data_dir)
    fingerprint = tokenizer_fingerprint(tokenizer)
    if manifest.tokenizer_fingerprint != fingerprint:
        raise ValueError(
            f"the data in {data_dir} was tokenized for another tokenizer (model {manifest.model!r}, fingerprint "
            f"{manifest.tokenizer_fingerprint}) than the target's (fingerprint {fingerprint}); regenerate the data "
            "with this target"
        )
    documents = []
    for shard in manifest.shards:
        if shard["file"] is None:
            continue  # a batch whose prompts were all skipped
        tensors = load_file(str(data_dir / shard["file"]))
        ids, mask, offsets = tensors["token_ids"].long(), tensors["loss_mask"].bool(), tensors["doc_offsets"]
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(
                f"{shard['file']} holds token id {int(ids.max())} but the target has {vocab_size} ids; "
                "regenerate the data with this target"
            )
        for lo, hi in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            documents.append(Document(ids[lo:hi], mask[lo:hi]))
    if not documents:
        raise ValueError(f"{data_dir} holds no documents")
    return documents


def split_documents(documents: Sequence[Document], eval_fraction: float, max_eval: int, seed: int
                    ) -> tuple[list[Document], list[Document]]:
    """(train, held_out): a seeded random choice of documents held out for evaluation."""
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    num_eval = min(max_eval, int(len(documents) * eval_fraction)) if len(documents) > 1 else 0
    held = sorted(order[:num_eval])
    held_set = set(held)
    return [d for i, d in enumerate(documents) if i not in held_set], [documents[i] for i in held]


def truncate(document: Document, max_length: int) -> Document:
    return Document(document.token_ids[:max_length], document.loss_mask[:max_length])


def pack(documents: Sequence[Document], order: Iterable[int], max_length: int) -> list[PackedSequence]:
    """Greedy packing in the given order: documents join the current sequence while it stays within max_length.

    Documents longer than max_length are cut to it; documents left without a response token are skipped.
    """
    packs: list[PackedSequence] = []
    current: list[Document] = []
    sources: list[int] = []
    used = 0
    for i in order:
        doc = truncate(documents[i], max_length)
        if len(doc) < 3 or not doc.loss_mask[2:].any():
            continue  # nothing to predict: the first trainable prediction is token 2
        if used + len(doc) > max_length:
            packs.append(PackedSequence.of(current, sources))
            current, sources, used = [], [], 0
        current.append(doc)
        sources.append(i)
        used += len(doc)
    if current:
        packs.append(PackedSequence.of(current, sources))
    return packs


class TrainingData:
    """The packed training sequences of each epoch: documents shuffled by (seed, epoch), then packed."""

    def __init__(self, documents: Sequence[Document], max_length: int, seed: int):
        self.documents = list(documents)
        self.max_length = max_length
        self.seed = seed
        too_long = sum(len(d) > max_length for d in self.documents)
        if too_long:
            logger.warning("%d of %d documents are longer than --max-length %d and are cut to it",
                           too_long, len(self.documents), max_length)
        self._cache: dict[int, list[PackedSequence]] = {}

    def epoch(self, epoch: int) -> list[PackedSequence]:
        if epoch not in self._cache:
            order = list(range(len(self.documents)))
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
            self._cache = {epoch: pack(self.documents, order, self.max_length)}
        return self._cache[epoch]

    def steps_per_epoch(self, global_batch: int) -> int:
        # Packing depends on the order only through where sequences break; epoch 0 stands for all epochs.
        return len(self.epoch(0)) // global_batch
