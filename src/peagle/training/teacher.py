"""The frozen target's pass over a packed sequence: the drafter's input features and the teacher distribution."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from peagle.models.attention import DenseAttention
from peagle.models.llama import LlamaModel
from peagle.training.data import PackedSequence


@dataclass(frozen=True, slots=True)
class TeacherPass:
    sequence: PackedSequence  # on the training device
    features: torch.Tensor  # [n, 3 * d_target], aux hidden states: the drafter's real-slot features
    hidden: torch.Tensor  # [n, d_target], final-normed; target.compute_logits(hidden[i]) is the distribution of i+1

    @property
    def token_ids(self) -> torch.Tensor:
        return self.sequence.token_ids


@torch.no_grad()
def run_target(target: LlamaModel, sequence: PackedSequence, aux_layer_ids: Sequence[int],
               device: torch.device | str) -> TeacherPass:
    """Runs the target over every document of the sequence (causal within a document, positions from 0)."""
    seq = PackedSequence(*(t.to(device) for t in (sequence.token_ids, sequence.loss_mask, sequence.doc_ids)))
    positions = sequence.positions.to(device)
    out = target(seq.token_ids, positions, DenseAttention(seq_lens=sequence.doc_lengths), aux_layer_ids)
    return TeacherPass(seq, out.aux, out.hidden)
