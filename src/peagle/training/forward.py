"""The drafter's training forward over a layout, for both methods, and the loss on its charged elements.

P-EAGLE: one pass over every element. Depth-0 elements are real slots (token a+1, feature a); deeper ones are MASK
slots (mask token, mask_hidden). This is the engine's drafting pass, batched over all anchors at once.

EAGLE-3 (training-time test): one pass per depth. Depth-0 elements are the same real slots; a depth-d element
takes the true token a+d+1 and, as its hidden state, the drafter's own output at (a, d-1); it attends to the
earlier passes' keys under the same rule, as the engine's chained drafting passes do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peagle.drafters.drafter import Drafter
from peagle.models.llama import LlamaModel
from peagle.training.attention import FlexAttention, KVChain
from peagle.training.cod import Layout
from peagle.training.loss import DEFAULT_CHUNK, draft_kl_loss
from peagle.training.mask import build_block_mask
from peagle.training.teacher import TeacherPass


def peagle_forward(drafter: Drafter, teacher: TeacherPass, layout: Layout) -> torch.Tensor:
    """[num_elements, d] drafter outputs (pre-norm) for a depth-major layout."""
    num_real = int((layout.depth == 0).sum())
    assert bool((layout.depth[:num_real] == 0).all()), "layout must be depth-major"
    real = layout.anchor[:num_real]
    input_ids = torch.cat([
        teacher.token_ids[real + 1],
        torch.full((len(layout) - num_real,), drafter.config.mask_token_id, device=real.device, dtype=torch.long),
    ])
    hidden = torch.cat([
        drafter.fc(teacher.features[real].to(drafter.fc.weight.dtype)),  # [num_real, d]
        drafter.fc(drafter.mask_hidden).expand(len(layout) - num_real, -1),
    ])
    attn = FlexAttention(build_block_mask(layout))
    return drafter(input_ids, layout.position, attn, hidden)


def ttt_forward(drafter: Drafter, teacher: TeacherPass, layout: Layout) -> torch.Tensor:
    """[num_elements, d] drafter outputs for EAGLE-3's chained passes over a full depth-major layout."""
    counts = torch.bincount(layout.depth).tolist()
    chain, outs, prev_anchor = KVChain(), [], None
    start = 0
    for d, count in enumerate(counts):
        part = slice(start, start + count)
        anchor = layout.anchor[part]
        if d == 0:
            hidden = drafter.fc(teacher.features[anchor].to(drafter.fc.weight.dtype))
        else:
            # Rollouts are nested, so each anchor's parent sits in the previous pass's output.
            hidden = outs[-1][torch.searchsorted(prev_anchor, anchor)]
        attn = FlexAttention(build_block_mask(layout, start, start + count, start + count), chain)
        outs.append(drafter(teacher.token_ids[anchor + d + 1], layout.position[part], attn, hidden))
        prev_anchor, start = anchor, start + count
    return torch.cat(outs)


@dataclass
class StepStats:
    """What one or more backward passes charged: the loss (already divided by its denominator) and, per depth,
    how many charged elements there were and how many had draft argmax == target argmax."""

    loss: float
    total: torch.Tensor  # [K] int64
    correct: torch.Tensor  # [K] int64

    @classmethod
    def zero(cls, k: int) -> "StepStats":
        return cls(0.0, torch.zeros(k, dtype=torch.long), torch.zeros(k, dtype=torch.long))

    def __add__(self, other: "StepStats") -> "StepStats":
        return StepStats(self.loss + other.loss, self.total + other.total, self.correct + other.correct)

    def accuracy(self) -> list[float]:
        return [c / t if t else float("nan") for c, t in zip(self.correct.tolist(), self.total.tolist())]


def charged_loss(
    drafter: Drafter,
    target: LlamaModel,
    teacher: TeacherPass,
    layout: Layout,
    hidden_out: torch.Tensor,  # [num_elements, d]
    charged: torch.Tensor,  # [num_elements] bool: elements this forward pays for
    denominator: float,
    k: int,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, StepStats, torch.Tensor]:
    """(loss, stats, correct): loss over the charged elements with weight > 0; correct is per such element."""
    sel = torch.nonzero(charged & (layout.weight > 0)).flatten()
    draft_to_target = torch.arange(drafter.d2t.numel(), device=drafter.d2t.device) + drafter.d2t
    loss, correct = draft_kl_loss(
        hidden_out[sel], teacher.hidden[layout.target[sel]], layout.weight[sel], denominator,
        drafter.compute_logits, target.compute_logits, draft_to_target, chunk_size,
    )
    depth = layout.depth[sel].cpu()
    stats = StepStats(
        float(loss.detach()),
        torch.bincount(depth, minlength=k)[:k],
        torch.bincount(depth, weights=correct.cpu().double(), minlength=k)[:k].long(),
    )
    return loss, stats, correct
