"""What a new drafter takes from its target: shape, embedding and output rows, tokenizer facts.

Read from a loaded LlamaModel or straight from a checkpoint directory; from a directory only the two tensors needed
are read, so initialising a drafter for a large target does not load the target.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from peagle.models.config import ModelConfig
from peagle.models.llama import LlamaModel
from peagle.models.tokenizer import Tokenizer
from peagle.models.weights import SafetensorsCheckpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetParts:
    config: ModelConfig
    embedding: torch.Tensor  # [vocab, hidden]
    output_weight: torch.Tensor  # [vocab, hidden], the lm_head (the embedding when tied)
    name_or_path: str | None
    tokenizer: Tokenizer | None

    @classmethod
    def of(cls, target: LlamaModel | str | Path, tokenizer: Tokenizer | None = None) -> "TargetParts":
        if isinstance(target, LlamaModel):
            return cls(target.config, target.embed_tokens.weight.detach(), target.output_weight.detach(),
                       target.config.extra.get("_name_or_path"), tokenizer)
        return cls.from_dir(target, tokenizer)

    @classmethod
    def from_dir(cls, path: str | Path, tokenizer: Tokenizer | None = None) -> "TargetParts":
        path = Path(path)
        config = ModelConfig.from_dir(path)
        ckpt = SafetensorsCheckpoint(path)
        embedding = ckpt.get("model.embed_tokens.weight")
        output = embedding if config.tie_word_embeddings else ckpt.get("lm_head.weight")
        if tokenizer is None and (path / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_dir(path)
        # The name the user knows the target by (a hub id when the checkpoint was saved from one), else the path.
        return cls(config, embedding, output, config.extra.get("_name_or_path") or str(path), tokenizer)

    @property
    def eos_token_ids(self) -> list[int]:
        ids = self.config.eos_token_ids + (self.tokenizer.eos_token_ids if self.tokenizer else [])
        return sorted(set(ids))


def choose_mask_token_id(tokenizer: Tokenizer | None, embedding_rows: int) -> int:
    """A token id no text ever produces, for P-EAGLE's MASK slots.

    The lowest reserved special token of the tokenizer; else the first embedding row beyond the tokenizer's
    vocabulary (checkpoints often pad the embedding matrix).
    """
    if tokenizer is None:
        raise ValueError(
            "choosing a mask token needs the target's tokenizer (tokenizer.json in the target directory) "
            "or an explicit mask_token_id"
        )
    reserved = tokenizer.reserved_token_ids()
    if reserved:
        return min(reserved)
    if tokenizer.vocab_size < embedding_rows:
        logger.info("no reserved token in the tokenizer; using padding row %d as the mask token",
                    tokenizer.vocab_size)
        return tokenizer.vocab_size
    raise ValueError(
        f"the target's tokenizer has no reserved special token and its {tokenizer.vocab_size} ids fill the "
        f"embedding matrix ({embedding_rows} rows), so no token id is free for P-EAGLE's mask token; "
        "pass one explicitly (mask_token_id) that text never produces"
    )
