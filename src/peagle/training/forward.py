"""The drafter's training forward over a layout, for both methods, and the loss on its charged elements.

P-EAGLE: one pass over every element. Depth-0 elements are real slots (token a+1, feature a); deeper ones are MASK
slots (mask token, mask_hidden). This is the engine's drafting pass, batched over all anchors at once.

EAGLE-3 (training-time test): one pass per depth. Depth-0 elements are the same real slots; a depth-d element
takes the true token a+d+1 and, as its hidden state, the drafter's own output at (a, d-1); it attends to the
earlier passes' keys under the same rule, as the engine's chained drafting passes do.

Nothing here waits for the device: the per-depth element counts come from the host (`ForwardPlan.depth_counts`),
and the statistics stay on the device until the trainer reads them once per logging interval.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from peagle.drafters.drafter import Drafter
from peagle.training.attention import FlexAttention, KVChain
from peagle.training.cod import Layout
from peagle.training.loss import DEFAULT_CHUNK, draft_kl_loss
from peagle.training.mask import Tiles, build_block_mask
from peagle.training.plan import ForwardPlan
from peagle.training.teacher import TeacherPass, TeacherTable


def peagle_passes(depth_counts: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """The attention passes of P-EAGLE's forward as (q_start, q_stop, kv_stop): one over every element."""
    n = sum(depth_counts)
    return [(0, n, n)]


def ttt_passes(depth_counts: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """EAGLE-3's chained passes: the elements of depth d against every element of depth <= d."""
    return [(end - count, end, end) for end, count in zip(itertools.accumulate(depth_counts), depth_counts)]


def peagle_forward(drafter: Drafter, teacher: TeacherPass, layout: Layout, depth_counts: tuple[int, ...],
                   tiles: tuple[Tiles, ...] = (), rows: int | None = None, real_rows: int | None = None
                   ) -> torch.Tensor:
    """[num_elements, d] drafter outputs (pre-norm) for a depth-major layout with `depth_counts` per depth.
    `tiles`: the pass's block-mask tiles planned on the host (else they are classified here). `rows`, `real_rows`
    (`plan.pad_shapes`): the pass runs over `rows` elements, the layout followed by MASK slots that see only one
    another, and projects `real_rows` feature rows (the real slots', then position 0's, dropped); [rows, d] out."""
    num_real, n = depth_counts[0], len(layout)
    rows = rows or n
    real = layout.anchor[:num_real]
    projected = real  # the rows of the feature projection: the real slots, then position 0's
    if real_rows and real_rows > num_real:
        projected = torch.cat([real, real.new_zeros(real_rows - num_real)])
    input_ids = torch.cat([
        teacher.token_ids[real + 1],
        torch.full((rows - num_real,), drafter.config.mask_token_id, device=real.device, dtype=torch.long),
    ])
    hidden = torch.cat([
        drafter.fc(teacher.features[projected].to(drafter.fc.weight.dtype))[:num_real],  # [num_real, d]
        drafter.fc(drafter.mask_hidden).expand(rows - num_real, -1),
    ])
    position = layout.position if rows == n else torch.cat([layout.position, layout.position.new_zeros(rows - n)])
    attn = FlexAttention(build_block_mask(layout, tiles=tiles[0] if tiles else None, rows=rows))
    return drafter(input_ids, position, attn, hidden)


def ttt_forward(drafter: Drafter, teacher: TeacherPass, layout: Layout, depth_counts: tuple[int, ...],
                tiles: tuple[Tiles, ...] = ()) -> torch.Tensor:
    """[num_elements, d] drafter outputs for EAGLE-3's chained passes over a full depth-major layout."""
    chain, outs, prev_anchor = KVChain(), [], None
    start = 0
    for d, count in enumerate(depth_counts):
        part = slice(start, start + count)
        anchor = layout.anchor[part]
        if d == 0:
            hidden = drafter.fc(teacher.features[anchor].to(drafter.fc.weight.dtype))
        else:
            # Rollouts are nested, so each anchor's parent sits in the previous pass's output.
            hidden = outs[-1][torch.searchsorted(prev_anchor, anchor)]
        attn = FlexAttention(build_block_mask(layout, start, start + count, start + count,
                                              tiles=tiles[d] if tiles else None), chain)
        outs.append(drafter(teacher.token_ids[anchor + d + 1], layout.position[part], attn, hidden))
        prev_anchor, start = anchor, start + count
    return torch.cat(outs)


@dataclass
class StepStats:
    """What one or more backward passes charged, kept on the device: the loss (already divided by its
    denominator) and, per depth, how many charged elements there were and how many had draft argmax == target
    argmax."""

    loss: torch.Tensor  # [] fp32
    total: torch.Tensor  # [K] int64
    correct: torch.Tensor  # [K] int64

    @classmethod
    def zero(cls, k: int, device: torch.device | str = "cpu") -> "StepStats":
        return cls(torch.zeros((), device=device), torch.zeros(k, dtype=torch.long, device=device),
                   torch.zeros(k, dtype=torch.long, device=device))

    def __add__(self, other: "StepStats") -> "StepStats":
        return StepStats(self.loss + other.loss, self.total + other.total, self.correct + other.correct)

    def accuracy(self) -> list[float]:
        return [c / t if t else float("nan") for c, t in zip(self.correct.tolist(), self.total.tolist())]


def charged_loss(
    drafter: Drafter,
    table: TeacherTable,
    plan: ForwardPlan,
    hidden_out: torch.Tensor,  # [num_elements, d], the drafter's output over plan.layout
    denominator: float | torch.Tensor,
    k: int,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, correct per depth [K], correct per charged element) over the plan's charged elements (the padding
    ones of `plan.pad_shapes` have weight 0 and are left out of the counts)."""
    normed = drafter.norm(hidden_out[plan.charged])  # [C, d]
    loss, draft_ids = draft_kl_loss(normed, drafter.lm_head.weight, table.logp, plan.teacher_row,
                                    plan.weight / denominator, chunk_size)
    real = plan.charged.numel() if plan.num_charged is None else plan.num_charged
    correct = (drafter.to_target_ids(draft_ids) == table.argmax[plan.teacher_row])[:real]
    by_depth = torch.zeros(k, dtype=torch.long, device=correct.device).scatter_add_(0, plan.depth[:real],
                                                                                     correct.long())
    return loss, by_depth, correct
