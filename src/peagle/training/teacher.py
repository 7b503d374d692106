"""The frozen target's pass over a packed sequence: the drafter's input features and the teacher distribution.

`TeacherTable` holds that distribution once per supervising position: element (a, d) is supervised by position
a + d + 1, and so are (a + 1, d - 1), (a + 2, d - 2), ..., so one row serves up to K_train elements.

The target attends within each document only and numbers positions from 0 in each, so its outputs for a packed
sequence are the concatenation of its outputs for the documents alone. That is what lets `FeatureCache` keep them
per document, for later epochs to read instead of running the target again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file

from peagle.models.attention import VarlenAttention
from peagle.models.llama import LlamaModel
from peagle.training.data import PackedSequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TeacherPass:
    sequence: PackedSequence  # on the training device
    features: torch.Tensor  # [n, 3 * d_target], aux hidden states: the drafter's real-slot features
    hidden: torch.Tensor  # [n, d_target], final-normed; target.compute_logits(hidden[i]) is the distribution of i+1

    @property
    def token_ids(self) -> torch.Tensor:
        return self.sequence.token_ids


def to_device(device: torch.device | str):
    """A function copying a host tensor to `device`: through pinned memory and without waiting on CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return lambda t: t.to(device)
    return lambda t: (t if t.is_pinned() or t.is_cuda else t.pin_memory()).to(device, non_blocking=True)


@torch.no_grad()
def run_target(target: LlamaModel, sequence: PackedSequence, aux_layer_ids: Sequence[int],
               device: torch.device | str, pad_to: int | None = None) -> TeacherPass:
    """Runs the target over every document of the sequence (causal within a document, positions from 0).

    `sequence` is on the host; it is copied to `device` without waiting (from pinned memory on CUDA). `pad_to`:
    a shorter sequence runs with a padding document after its own up to that many tokens (attending only to
    itself, its outputs dropped), so every call has the same matrix shapes."""
    move = to_device(device)
    seq = PackedSequence(move(sequence.token_ids), move(sequence.loss_mask), move(sequence.doc_ids),
                         sequence.sources)
    n, pad = len(sequence.token_ids), max(0, (pad_to or 0) - len(sequence.token_ids))
    token_ids, positions, lengths = seq.token_ids, move(sequence.positions), list(sequence.doc_lengths)
    if pad:
        token_ids = move(torch.cat([sequence.token_ids, torch.zeros(pad, dtype=sequence.token_ids.dtype)]))
        positions = move(torch.cat([sequence.positions, torch.arange(pad, dtype=sequence.positions.dtype)]))
        lengths.append(pad)
    out = target(token_ids, positions, VarlenAttention(lengths, device), aux_layer_ids)
    return TeacherPass(seq, out.aux[:n], out.hidden[:n])


@dataclass(frozen=True, slots=True)
class TeacherTable:
    logp: torch.Tensor  # [num_rows, draft_vocab] fp32, log-softmax of the target's logits over the draft vocab
    argmax: torch.Tensor  # [num_rows] int64, the target's argmax over its whole vocabulary (the acceptance test)


@torch.no_grad()
def teacher_table(target: LlamaModel, hidden: torch.Tensor, draft_to_target: torch.Tensor | None,
                  chunk_size: int) -> TeacherTable:
    """The target's distribution at each row of `hidden` ([R, d_target], final-normed), restricted to the draft
    vocabulary (`draft_to_target` [draft_vocab] target ids, None for the whole vocabulary) and renormalised there."""
    width = target.config.vocab_size if draft_to_target is None else draft_to_target.numel()
    logp = torch.empty(hidden.shape[0], width, dtype=torch.float32, device=hidden.device)
    argmax = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        full = target.compute_logits(hidden[part])  # [c, target_vocab] fp32
        argmax[part] = full.argmax(-1)
        logp[part] = torch.log_softmax(full if draft_to_target is None else full[:, draft_to_target], dim=-1)
    return TeacherTable(logp, argmax)


class FeatureCache:
    """The target's outputs per training document on disk (`--feature-cache DIR`).

    The first epoch runs the target and writes each document's features and final hidden states; later epochs
    read them. Costs 4 x d_target values per token of disk (bf16 targets: 8 x d_target bytes). The directory is
    tied to one target, aux layer set, data directory and maximum length; another combination is refused.
    """

    def __init__(self, root: Path, target: LlamaModel, identity: dict):
        self.root = root
        self.target = target
        key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        meta = root / "cache.json"
        if meta.is_file():
            stored = json.loads(meta.read_text())
            if stored.get("key") != key:
                raise ValueError(
                    f"the feature cache {root} was written for another target, data or --max-length "
                    f"({stored.get('identity')}); point --feature-cache at a new directory"
                )
        else:
            root.mkdir(parents=True, exist_ok=True)
            meta.write_text(json.dumps({"key": key, "identity": identity}, indent=1))

    def _file(self, source: int) -> Path:
        return self.root / f"doc-{source:08d}.safetensors"

    @torch.no_grad()
    def run(self, sequence: PackedSequence, aux_layer_ids: Sequence[int], device: torch.device | str
            ) -> TeacherPass:
        if not sequence.sources:
            return run_target(self.target, sequence, aux_layer_ids, device)
        missing = [i for i, src in enumerate(sequence.sources) if not self._file(src).is_file()]
        if missing:
            fresh = run_target(self.target, PackedSequence.of([sequence.document(i) for i in missing]),
                               aux_layer_ids, device)
            starts = [0, *torch.cumsum(torch.tensor(fresh.sequence.doc_lengths), 0).tolist()]
            for j, i in enumerate(missing):
                part = slice(starts[j], starts[j + 1])
                tmp = self._file(sequence.sources[i]).with_suffix(".tmp")
                save_file({"features": fresh.features[part].cpu().contiguous(),
                           "hidden": fresh.hidden[part].cpu().contiguous()}, str(tmp))
                os.replace(tmp, self._file(sequence.sources[i]))
        stored = [load_file(str(self._file(src)), device=str(device)) for src in sequence.sources]
        if [t["hidden"].shape[0] for t in stored] != sequence.doc_lengths:
            raise ValueError(f"the feature cache {self.root} does not match the documents; delete it and retry")
        return TeacherPass(sequence.to(device), torch.cat([t["features"] for t in stored]),
                           torch.cat([t["hidden"] for t in stored]))
