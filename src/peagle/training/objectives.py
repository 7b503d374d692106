"""What a training step does for each method: which elements it trains, how it runs the drafter, how it is scored.

Both methods train on the same elements (anchor, depth) with the same loss and the same attention rule; they
differ in the inputs of depth >= 1 (MASK slots in one pass vs the drafter's own states in K chained passes) and in
how elements are chosen (COD sampling and the sequence partition vs every element in one forward).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace

import torch

from peagle.drafters.drafter import Drafter
from peagle.models.llama import LlamaModel
from peagle.training.cod import Layout, cod_sample, full_layout
from peagle.training.data import PackedSequence
from peagle.training.forward import StepStats, charged_loss, peagle_forward, peagle_passes, ttt_forward, ttt_passes
from peagle.training.mask import Tiles, block_tiles
from peagle.training.metrics import EvalStats
from peagle.training.plan import StepPlan, pad_shapes, plan_step
from peagle.training.teacher import TeacherPass, TeacherTable, teacher_table


def draft_to_target_ids(drafter: Drafter) -> torch.Tensor | None:
    """[draft_vocab] target id of each draft id, or None when the draft vocabulary is the target's, in order (the
    teacher table then needs no gather). Reads the map from the device once: call it outside the hot loop."""
    if drafter.config.draft_vocab_size == drafter.config.target_vocab_size and not bool(drafter.d2t.any()):
        return None
    return torch.arange(drafter.d2t.numel(), device=drafter.d2t.device) + drafter.d2t


class Objective(ABC):
    method: str
    num_segments = 1

    pads_drafter_rows = False  # whether `plan` pads the drafter's rows too (one pass over the whole layout)

    def __init__(self, k_train: int, loss_chunk: int, depth_decay: float = 1.0, shape_multiple: int = 0):
        if k_train < 1:
            raise ValueError(f"--k-train must be at least 1, got {k_train}")
        self.k = k_train
        self.loss_chunk = loss_chunk
        self.depth_decay = depth_decay
        self.shape_multiple = shape_multiple  # plan.pad_shapes of every training step's plan (0: none)

    @abstractmethod
    def sample_layout(self, sequence: PackedSequence, generator: torch.Generator) -> Layout:
        """The elements one sequence trains on this step."""

    @abstractmethod
    def forward(self, drafter: Drafter, teacher: TeacherPass, layout: Layout, depth_counts: tuple[int, ...],
                tiles: tuple[Tiles, ...] = ()) -> torch.Tensor:
        """[num_elements, d] drafter outputs for a depth-major layout (`tiles`: those of `passes`, planned)."""

    @abstractmethod
    def passes(self, depth_counts: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """The forward's attention passes as (q_start, q_stop, kv_stop) over its layout."""

    def plan(self, sequence: PackedSequence, layout: Layout) -> StepPlan:
        """The host-side plan of one micro-batch (its sequence and sampled layout), block-mask tiles included, its
        shapes padded to `shape_multiple`."""
        plan = self._with_tiles(plan_step(sequence, layout, self.k, self.num_segments, self.depth_decay))
        return pad_shapes(plan, self.shape_multiple, self.pads_drafter_rows)

    def _with_tiles(self, plan: StepPlan) -> StepPlan:
        return replace(plan, forwards=tuple(
            replace(f, tiles=tuple(block_tiles(f.layout, *span) for span in self.passes(f.depth_counts)))
            for f in plan.forwards))

    def table(self, target: LlamaModel, teacher: TeacherPass, plan: StepPlan, vocab_map: torch.Tensor | None
              ) -> TeacherTable:
        return teacher_table(target, teacher.hidden[plan.teacher_positions], vocab_map, self.loss_chunk)

    def backward(self, drafter: Drafter, target: LlamaModel, teacher: TeacherPass, plan: StepPlan,
                 denominator: float | torch.Tensor, vocab_map: torch.Tensor | None = None) -> StepStats:
        """Runs every forward of the plan and back-propagates each at once (only one forward's activations are
        alive at a time); gradients accumulate in the parameters' .grad. `plan` is on the training device."""
        table = self.table(target, teacher, plan, vocab_map)
        stats = StepStats(torch.zeros((), device=plan.charged_per_depth.device), plan.charged_per_depth,
                          torch.zeros_like(plan.charged_per_depth))
        for part in plan.forwards:
            padding = {} if part.rows is None else {"rows": part.rows, "real_rows": part.real_rows}
            hidden = self.forward(drafter, teacher, part.layout, part.depth_counts, part.tiles, **padding)
            loss, by_depth, _ = charged_loss(drafter, table, part, hidden, denominator, self.k, self.loss_chunk)
            if loss.requires_grad:
                loss.backward()
            stats = StepStats(stats.loss + loss.detach(), stats.total, stats.correct + by_depth)
        return stats

    @torch.no_grad()
    def score(self, drafter: Drafter, target: LlamaModel, teacher: TeacherPass,
              vocab_map: torch.Tensor | None = None) -> tuple[Layout, StepStats, torch.Tensor]:
        """Every element to depth K of a sequence, in one forward: (its full layout, the summed loss and per-depth
        counts, whether each charged element's draft equals the target's argmax)."""
        seq = teacher.sequence
        host = PackedSequence(seq.token_ids.cpu(), seq.loss_mask.cpu(), seq.doc_ids.cpu())
        layout = full_layout(host.doc_ids, host.loss_mask, self.k)
        plan = self._with_tiles(plan_step(host, layout, self.k)).to(seq.token_ids.device)
        table = self.table(target, teacher, plan, vocab_map)
        stats = StepStats.zero(self.k, seq.token_ids.device)
        correct = torch.zeros(0, dtype=torch.bool)
        for part in plan.forwards:  # one: no partition
            hidden = self.forward(drafter, teacher, part.layout, part.depth_counts, part.tiles)
            loss, by_depth, correct = charged_loss(drafter, table, part, hidden, 1.0, self.k, self.loss_chunk)
            stats = StepStats(loss, plan.charged_per_depth, by_depth)
        return layout, stats, correct

    def evaluate(self, drafter: Drafter, target: LlamaModel, teacher: TeacherPass,
                 vocab_map: torch.Tensor | None = None, doc_groups: list[int] | None = None, num_groups: int = 0,
                 walk_tokens: int | None = None) -> EvalStats:
        """Held-out scores of one sequence; the loss is summed (denominator 1) for pooling. `doc_groups`: the group
        (data source) of each of its documents, for the walk per group; `walk_tokens`: see `EvalStats.of`."""
        layout, stats, correct = self.score(drafter, target, teacher, vocab_map)
        seq = teacher.sequence
        return EvalStats.of(stats, layout, correct, seq.loss_mask.cpu(), seq.doc_ids.cpu(), self.k, doc_groups,
                            num_groups, walk_tokens)


class PEagleObjective(Objective):
    method = "peagle"

    pads_drafter_rows = True

    def __init__(self, k_train: int, r: float, r_min: float, num_segments: int, loss_chunk: int,
                 depth_decay: float = 1.0, shape_multiple: int = 0):
        super().__init__(k_train, loss_chunk, depth_decay, shape_multiple)
        self.r, self.r_min, self.num_segments = r, r_min, num_segments

    def sample_layout(self, sequence, generator):
        return cod_sample(sequence.doc_ids, sequence.loss_mask, self.k, self.r, self.r_min, generator)

    def forward(self, drafter, teacher, layout, depth_counts, tiles=(), rows=None, real_rows=None):
        return peagle_forward(drafter, teacher, layout, depth_counts, tiles, rows, real_rows)

    def passes(self, depth_counts):
        return peagle_passes(depth_counts)


class Eagle3Objective(Objective):
    """Training-time test: K chained passes over every element (no sampling: each pass needs its parents)."""

    method = "eagle3"

    def sample_layout(self, sequence, generator):
        return full_layout(sequence.doc_ids, sequence.loss_mask, self.k)

    def forward(self, drafter, teacher, layout, depth_counts, tiles=()):
        return ttt_forward(drafter, teacher, layout, depth_counts, tiles)

    def passes(self, depth_counts):
        return ttt_passes(depth_counts)
