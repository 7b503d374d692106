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
from peagle.training.mask import BLOCK_SIZE, Tiles, round_up
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
    # Shape padding (`pad_shapes`): the charged elements before padding (their tensors' tails are weight-0 copies of
    # element 0), the rows the drafter runs (its layout followed by padding rows) and the rows of the real slots'
    # feature projection. None: not padded.
    num_charged: int | None = None
    rows: int | None = None
    real_rows: int | None = None


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
    num_teacher_rows: int | None = None  # teacher_positions before shape padding (None: not padded)

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


def _pad_to(t: torch.Tensor, length: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(length - t.numel())]) if length > t.numel() else t


def pad_shapes(plan: StepPlan, multiple: int, drafter_rows: bool = False) -> StepPlan:
    """The plan with the row counts of its matrices padded up to multiples of `multiple`, so that a step's GEMMs
    keep a few shapes from step to step instead of new ones each time (a shape the GEMM library has not seen costs
    ~100 us of host time to select a kernel, a repeated one ~15 us: docs/DECISIONS.md).

    Padded: the teacher table's rows (copies of position 0), each forward's charged elements (weight-0 copies of
    element 0: no loss, no gradient, not counted), and with `drafter_rows` (P-EAGLE's single pass) the drafter's
    rows, `rows` = len(layout) rounded up, whose padding rows are MASK slots that see only one another (their
    block-mask tiles are appended; `multiple` must then be a multiple of the mask's BLOCK_SIZE), and the real
    slots' feature projection, `real_rows`. What the real elements compute is unchanged."""
    if multiple <= 0:
        return plan
    if drafter_rows and multiple % BLOCK_SIZE:
        raise ValueError(f"padding the drafter's rows needs a multiple of {BLOCK_SIZE}, got {multiple}")
    forwards = []
    for f in plan.forwards:
        c = f.charged.numel()
        width = round_up(max(c, 1), multiple)
        g = replace(f, charged=_pad_to(f.charged, width), depth=_pad_to(f.depth, width),
                    weight=_pad_to(f.weight, width), teacher_row=_pad_to(f.teacher_row, width), num_charged=c)
        if drafter_rows and f.tiles:
            rows = round_up(len(f.layout), multiple)
            blocks = rows // BLOCK_SIZE
            g = replace(g, rows=rows, real_rows=round_up(max(f.depth_counts[0], 1), multiple),
                        tiles=tuple(t.padded(blocks, blocks) for t in f.tiles))
        forwards.append(g)
    r = plan.teacher_positions.numel()
    return replace(plan, forwards=tuple(forwards), num_teacher_rows=r,
                   teacher_positions=_pad_to(plan.teacher_positions, round_up(max(r, 1), multiple)))
