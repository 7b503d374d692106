"""A micro-batch's step plan: every index the training step needs, computed on the host before the device needs it.

The step must never wait for the device to tell the host something (a `nonzero`, a `.item()`, boolean indexing of a
device tensor each drain the GPU's queue). Everything about a micro-batch's elements is known from its layout, which
COD sampling makes on the host, so the host works it out ahead, possibly in a background thread:
- per forward (one per sequence segment, one without the partition): the elements it runs (a depth-major sub-layout
  and its per-depth counts) and those it charges, with their depth, weight and teacher row;
- the teacher table's rows: the distinct positions that supervise a charged element, ascending;
- the block-mask tiles of each attention pass (`mask.block_tiles`), which the GPU would otherwise classify from the
  rule pair by pair (28 ms for an 8K-token P-EAGLE layout on an H200, against 9 ms of host time off the GPU's path).
`StepPlan.to(device)` then moves it in a few non-blocking copies from pinned memory.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from peagle.training.cod import Layout
from peagle.training.data import PackedSequence
from peagle.training.mask import Tiles
from peagle.training.partition import plan_partition
from peagle.training.teacher import to_device


@dataclass(frozen=True, slots=True)
class ForwardPlan:
    layout: Layout  # the elements this forward runs, depth-major
    depth_counts: tuple[int, ...]  # elements per depth in `layout` (host ints)
    charged: torch.Tensor  # [C] int64, indices into `layout` of the elements this forward charges
    depth: torch.Tensor  # [C] int64
    weight: torch.Tensor  # [C] float32, the loss weight of each charged element
    teacher_row: torch.Tensor  # [C] int64, the row of the step's teacher table that supervises it
    tiles: tuple[Tiles, ...] = ()  # per attention pass of the forward, its block mask's tiles (empty: not planned)


@dataclass(frozen=True, slots=True)
class StepPlan:
    sequence: PackedSequence
    layout: Layout  # every element of the micro-batch (statistics, evaluation)
    teacher_positions: torch.Tensor  # [R] int64 ascending: positions whose target distribution supervises
    forwards: tuple[ForwardPlan, ...]
    charged_per_depth: torch.Tensor  # [K] int64
    weight_sum: float  # the micro-batch's share of the loss denominator
    num_elements: int
    noise_seeds: tuple[tuple[int, int], ...] = ()  # (seed, length) of each packed sequence: its feature noise

    def to(self, device: torch.device | str) -> "StepPlan":
        """The plan with its index tensors on `device` (the sequence stays on the host: the teacher moves it)."""
        return self._map(to_device(device))

    def pinned(self) -> "StepPlan":
        """The plan with its host tensors in pinned memory (done ahead, so that `to` only starts copies)."""
        pin = torch.Tensor.pin_memory
        seq = self.sequence
        return replace(self._map(pin), sequence=PackedSequence(pin(seq.token_ids), pin(seq.loss_mask),
                                                                       pin(seq.doc_ids), seq.sources))

    def _map(self, move) -> "StepPlan":  # the index tensors through `move`, the sequence as it is
        return replace(
            self, layout=_move_layout(self.layout, move), teacher_positions=move(self.teacher_positions),
            forwards=tuple(replace(f, layout=_move_layout(f.layout, move), charged=move(f.charged),
                                   depth=move(f.depth), weight=move(f.weight), teacher_row=move(f.teacher_row),
                                   tiles=tuple(t.map(move) for t in f.tiles))
                           for f in self.forwards),
            charged_per_depth=move(self.charged_per_depth),
        )


def _move_layout(layout: Layout, move) -> Layout:
    return Layout(*(move(getattr(layout, f.name)) for f in fields(Layout)))


def depth_weights(depth: torch.Tensor, decay: float) -> torch.Tensor:
    """decay ** depth ([C] float32): SpecForge-style per-depth loss weights (1.0 everywhere for decay 1)."""
    return torch.ones(depth.shape, dtype=torch.float32) if decay == 1.0 else decay ** depth.float()


def plan_step(sequence: PackedSequence, layout: Layout, k: int, num_segments: int = 1,
              depth_decay: float = 1.0) -> StepPlan:
    """The plan of one micro-batch (sequence and layout on the host)."""
    layout = layout.to("cpu")
    num_real = int((layout.depth == 0).sum())
    if not bool((layout.depth[:num_real] == 0).all()):
        raise ValueError("the layout must be depth-major (all depth-0 elements first)")
    # A short sequence (the tail of a packing) may have fewer real slots than segments asked for.
    segments = plan_partition(layout, min(num_segments, max(1, num_real)))
    parts = []
    for segment in segments:
        sub = layout.select(segment.elements)
        charged = torch.nonzero(segment.owned & (sub.weight > 0)).flatten()
        if charged.numel():  # nothing charged: its forward would only produce zero gradients
            parts.append((sub, charged))
    targets = torch.cat([sub.target[c] for sub, c in parts]) if parts else torch.zeros(0, dtype=torch.long)
    positions = torch.unique(targets)  # sorted
    forwards, weight_sum = [], 0.0
    for sub, charged in parts:
        depth = sub.depth[charged]
        weight = sub.weight[charged] * depth_weights(depth, depth_decay)
        weight_sum += float(weight.sum())
        forwards.append(ForwardPlan(sub, tuple(torch.bincount(sub.depth, minlength=1).tolist()), charged, depth,
                                    weight, torch.searchsorted(positions, sub.target[charged])))
    charged_depth = torch.cat([f.depth for f in forwards]) if forwards else torch.zeros(0, dtype=torch.long)
    return StepPlan(sequence, layout, positions, tuple(forwards), torch.bincount(charged_depth, minlength=k)[:k],
                    weight_sum, len(layout))
