"""What a training step does for each method: which elements it trains, how it runs the drafter, how it is scored.

Both methods train on the same elements (anchor, depth) with the same loss and the same attention rule; they
differ in the inputs of depth >= 1 (MASK slots in one pass vs the drafter's own states in K chained passes) and in
how elements are chosen (COD sampling vs every element).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from peagle.drafters.drafter import Drafter
from peagle.models.llama import LlamaModel
from peagle.training.cod import Layout, cod_sample, full_layout
from peagle.training.data import PackedSequence
from peagle.training.forward import StepStats, charged_loss, peagle_forward, ttt_forward
from peagle.training.partition import partitioned_backward
from peagle.training.teacher import TeacherPass


@dataclass
class EvalStats:
    """Held-out scores. `leading[j]` counts anchors (with all K drafts on response tokens) whose first j drafts
    match the target's argmax and whose draft j+1 does not (j = K: all matched)."""

    stats: StepStats
    leading: torch.Tensor  # [K + 1] int64

    def __add__(self, other: "EvalStats") -> "EvalStats":
        return EvalStats(self.stats + other.stats, self.leading + other.leading)

    def acceptance_length(self, k: int) -> float:
        """Simulated acceptance length with k drafts: 1 + E[min(matched prefix, k)] (the bonus token counts)."""
        n = int(self.leading.sum())
        if n == 0:
            return float("nan")
        matched = torch.arange(self.leading.numel()).clamp(max=k)
        return 1.0 + float((matched * self.leading).sum()) / n

    def conditional_accuracy(self) -> list[float]:
        """P(draft j correct | drafts 1..j-1 correct), j = 1..K: the chain that the acceptance length multiplies."""
        reach = torch.flip(torch.cumsum(torch.flip(self.leading, [0]), 0), [0])  # reach[j] = #(leading >= j)
        return [float(reach[j + 1] / reach[j]) if reach[j] else float("nan") for j in range(self.leading.numel() - 1)]


class Objective(ABC):
    method: str

    def __init__(self, k_train: int, loss_chunk: int):
        if k_train < 1:
            raise ValueError(f"--k-train must be at least 1, got {k_train}")
        self.k = k_train
        self.loss_chunk = loss_chunk

    @abstractmethod
    def sample_layout(self, sequence: PackedSequence, generator: torch.Generator) -> Layout:
        """The elements one sequence trains on this step."""

    @abstractmethod
    def forward(self, drafter: Drafter, teacher: TeacherPass, layout: Layout) -> torch.Tensor:
        """[num_elements, d] drafter outputs for a depth-major layout."""

    def backward(self, drafter: Drafter, target: LlamaModel, teacher: TeacherPass, layout: Layout,
                 denominator: float) -> StepStats:
        hidden = self.forward(drafter, teacher, layout)
        everything = torch.ones(len(layout), dtype=torch.bool, device=hidden.device)
        loss, stats, _ = charged_loss(drafter, target, teacher, layout, hidden, everything, denominator, self.k,
                                      self.loss_chunk)
        if loss.requires_grad:
            loss.backward()
        return stats

    @torch.no_grad()
    def evaluate(self, drafter: Drafter, target: LlamaModel, teacher: TeacherPass) -> EvalStats:
        """Every element to depth K on a held-out sequence; the loss is summed (denominator 1) for pooling."""
        seq = teacher.sequence
        layout = full_layout(seq.doc_ids.cpu(), seq.loss_mask.cpu(), self.k).to(seq.token_ids.device)
        hidden = self.forward(drafter, teacher, layout)
        everything = torch.ones(len(layout), dtype=torch.bool, device=hidden.device)
        _, stats, correct = charged_loss(drafter, target, teacher, layout, hidden, everything, 1.0, self.k,
                                         self.loss_chunk)
        return EvalStats(stats, _leading_matches(layout, correct, len(seq), self.k))


class PEagleObjective(Objective):
    method = "peagle"

    def __init__(self, k_train: int, r: float, r_min: float, num_segments: int, loss_chunk: int):
        super().__init__(k_train, loss_chunk)
        self.r, self.r_min, self.num_segments = r, r_min, num_segments

    def sample_layout(self, sequence, generator):
        return cod_sample(sequence.doc_ids, sequence.loss_mask, self.k, self.r, self.r_min, generator)

    def forward(self, drafter, teacher, layout):
        return peagle_forward(drafter, teacher, layout)

    def backward(self, drafter, target, teacher, layout, denominator):
        def run_segment(sub: Layout, owned: torch.Tensor):
            hidden = peagle_forward(drafter, teacher, sub)
            loss, stats, _ = charged_loss(drafter, target, teacher, sub, hidden, owned, denominator, self.k,
                                          self.loss_chunk)
            return loss, stats

        return partitioned_backward(layout, self.num_segments, run_segment, self.k)


class Eagle3Objective(Objective):
    """Training-time test: K chained passes over every element (no sampling: each pass needs its parents)."""

    method = "eagle3"

    def sample_layout(self, sequence, generator):
        return full_layout(sequence.doc_ids, sequence.loss_mask, self.k)

    def forward(self, drafter, teacher, layout):
        return ttt_forward(drafter, teacher, layout)


def _leading_matches(layout: Layout, correct: torch.Tensor, n: int, k: int) -> torch.Tensor:
    # correct: per charged element (weight > 0) in layout order -> histogram [K + 1] over complete rollouts.
    sel = torch.nonzero(layout.weight > 0).flatten().cpu()
    anchor, depth = layout.anchor.cpu()[sel], layout.depth.cpu()[sel]
    present = torch.zeros(n, k, dtype=torch.bool)
    ok = torch.zeros(n, k, dtype=torch.bool)
    present[anchor, depth] = True
    ok[anchor, depth] = correct.cpu()
    complete = present.all(dim=1)
    leading = torch.cumprod(ok[complete].long(), dim=1).sum(dim=1)
    return torch.bincount(leading, minlength=k + 1)
