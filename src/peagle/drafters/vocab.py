"""The draft vocabulary: the target ids a drafter can propose, and the maps between the two id spaces.

Draft ids are the chosen target ids in ascending order. Two tensors describe the choice (the speculators layout):
    d2t [draft_vocab] int64: offsets, target_id = draft_id + d2t[draft_id]
    t2d [target_vocab] bool: whether a target id is in the draft vocabulary
Example: target ids {1, 4, 5} of a 6-token vocabulary -> d2t = [1, 3, 3], t2d = [F, T, F, F, T, T].
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch
from tqdm import tqdm

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftVocab:
    d2t: torch.Tensor  # [draft_vocab] int64
    t2d: torch.Tensor  # [target_vocab] bool

    def __post_init__(self):
        if self.d2t.dim() != 1 or self.t2d.dim() != 1:
            raise ValueError(f"d2t and t2d must be 1-D, got shapes {list(self.d2t.shape)}, {list(self.t2d.shape)}")
        if int(self.t2d.sum()) != self.size:
            raise ValueError(f"t2d marks {int(self.t2d.sum())} target ids but d2t has {self.size} draft ids")

    @property
    def size(self) -> int:
        return self.d2t.numel()

    @property
    def target_vocab_size(self) -> int:
        return self.t2d.numel()

    @property
    def target_ids(self) -> torch.Tensor:
        """[draft_vocab] the target id of every draft id."""
        return torch.arange(self.size) + self.d2t

    @classmethod
    def from_target_ids(cls, target_ids: Iterable[int], target_vocab_size: int) -> "DraftVocab":
        ids = torch.tensor(sorted(set(int(i) for i in target_ids)), dtype=torch.long)
        if ids.numel() == 0:
            raise ValueError("a draft vocabulary needs at least one token id")
        if ids[0] < 0 or ids[-1] >= target_vocab_size:
            raise ValueError(f"draft token ids must lie in 0..{target_vocab_size - 1}, got {ids[0]}..{ids[-1]}")
        t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
        t2d[ids] = True
        return cls(d2t=ids - torch.arange(ids.numel()), t2d=t2d)

    @classmethod
    def identity(cls, target_vocab_size: int) -> "DraftVocab":
        return cls(d2t=torch.zeros(target_vocab_size, dtype=torch.long),
                   t2d=torch.ones(target_vocab_size, dtype=torch.bool))

    @classmethod
    def from_counts(cls, counts: torch.Tensor, size: int, required_ids: Iterable[int] = ()) -> "DraftVocab":
        """The `size` most frequent ids of `counts` ([target_vocab]); `required_ids` are always in.

        Ties go to the lower id, so the choice is deterministic.
        """
        target_vocab = counts.numel()
        required = sorted(set(int(i) for i in required_ids))
        if not len(required) <= size <= target_vocab:
            raise ValueError(
                f"draft vocabulary size {size} must lie in {len(required)}..{target_vocab} "
                f"(the required ids .. the target vocabulary)"
            )
        scores = counts.double().clone()
        scores[required] = float("inf")
        # A stable sort of the negated counts keeps lower ids first among equal counts.
        order = torch.sort(-scores, stable=True).indices
        return cls.from_target_ids(order[:size].tolist(), target_vocab)

    @classmethod
    def from_corpus(cls, sequences: Iterable[Sequence[int]], target_vocab_size: int, size: int,
                    required_ids: Iterable[int] = ()) -> "DraftVocab":
        """Top-`size` token ids by frequency over sequences of target token ids."""
        counts = count_tokens(sequences, target_vocab_size)
        if counts.sum() == 0:
            raise ValueError("the vocabulary corpus holds no tokens")
        vocab = cls.from_counts(counts, size, required_ids)
        covered = counts[vocab.t2d].sum() / counts.sum()
        logger.info("draft vocabulary of %d ids covers %.2f%% of the corpus tokens", size, 100 * covered)
        return vocab


def count_tokens(sequences: Iterable[Sequence[int]], target_vocab_size: int) -> torch.Tensor:
    """[target_vocab] int64 occurrence counts."""
    counts = torch.zeros(target_vocab_size, dtype=torch.long)
    for seq in sequences:
        ids = torch.as_tensor(seq, dtype=torch.long)
        if ids.numel() == 0:
            continue
        if ids.min() < 0 or ids.max() >= target_vocab_size:
            raise ValueError(
                f"corpus token id {int(ids.max() if ids.max() >= target_vocab_size else ids.min())} is outside "
                f"the target vocabulary 0..{target_vocab_size - 1}; was the corpus tokenized for another model?"
            )
        counts += torch.bincount(ids, minlength=target_vocab_size)
    return counts


def read_token_corpus(path: str | Path) -> Iterator[list[int]]:
    """Token-id sequences from a file: JSON Lines (each line a list of ids, or an object with "input_ids" or
    "token_ids") or plain text (whitespace-separated ids, one sequence per line)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"vocabulary corpus {path} does not exist")
    with path.open() as f:
        for lineno, line in enumerate(tqdm(f, desc=f"counting tokens in {path.name}", unit=" lines", disable=None), 1):
            line = line.strip()
            if line:
                yield _parse_line(line, path, lineno)


def _parse_line(line: str, path: Path, lineno: int) -> list[int]:
    if line[0] in "[{":
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from None
        if isinstance(record, dict):
            record = record.get("input_ids", record.get("token_ids"))
        if not isinstance(record, list) or not all(isinstance(i, int) for i in record):
            raise ValueError(f"{path}:{lineno}: expected a list of token ids or an object with \"input_ids\"")
        return record
    try:
        return [int(tok) for tok in line.split()]
    except ValueError:
        raise ValueError(
            f"{path}:{lineno}: expected whitespace-separated token ids or JSON Lines of token ids, got text"
        ) from None
