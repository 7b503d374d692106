"""KL(p_target || q_draft) over the draft vocabulary, in chunks of positions.

Full-vocabulary logits are the memory problem of long-sequence training (68K elements x 49K ids x 4 bytes = 13 GB
per copy), so both logit tensors only ever exist for one chunk: each chunk runs under activation checkpointing,
keeping just its hidden states for the backward pass and recomputing its logits there.

The loss of a batch is sum(weight * KL) / denominator. The denominator is an argument because one optimizer step
spans several forwards (sequence segments, gradient accumulation, data-parallel ranks) that must share it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # hidden [N, d] -> logits [N, vocab], fp32
DEFAULT_CHUNK = 4096


def draft_kl_loss(
    draft_hidden: torch.Tensor,  # [N, d], the drafter's output at the charged elements
    teacher_hidden: torch.Tensor,  # [N, d_target], the target's final-normed hidden state at each element's target
    weight: torch.Tensor,  # [N] float
    denominator: float,
    draft_logits: LogitsFn,  # the drafter's compute_logits: -> [N, draft_vocab]
    teacher_logits: LogitsFn,  # the target's compute_logits: -> [N, target_vocab]
    draft_to_target: torch.Tensor,  # [draft_vocab] int64, the target id of each draft id
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (loss, correct): the weighted KL summed over the elements / denominator, and per element whether the
    draft argmax (as a target id) equals the target's argmax over its full vocabulary (the greedy acceptance test).
    """
    if denominator <= 0:
        raise ValueError(f"the loss denominator must be positive, got {denominator}")
    losses, correct = [], []
    for start in range(0, draft_hidden.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        args = (draft_hidden[part], teacher_hidden[part].detach(), weight[part])
        fn = _ChunkLoss(draft_logits, teacher_logits, draft_to_target)
        if torch.is_grad_enabled() and draft_hidden.requires_grad:
            loss, ok = checkpoint(fn, *args, use_reentrant=False)
        else:
            loss, ok = fn(*args)
        losses.append(loss)
        correct.append(ok)
    if not losses:
        return draft_hidden.sum() * 0.0, torch.zeros(0, dtype=torch.bool, device=draft_hidden.device)
    return torch.stack(losses).sum() / denominator, torch.cat(correct)


class _ChunkLoss:
    def __init__(self, draft_logits: LogitsFn, teacher_logits: LogitsFn, draft_to_target: torch.Tensor):
        self.draft_logits = draft_logits
        self.teacher_logits = teacher_logits
        self.draft_to_target = draft_to_target

    def __call__(self, hidden, teacher_hidden, weight):
        with torch.no_grad():
            full = self.teacher_logits(teacher_hidden)  # [c, target_vocab]
            teacher_argmax = full.argmax(-1)
            # Restricted to the draft vocabulary and renormalised there.
            teacher_logp = torch.log_softmax(full[:, self.draft_to_target], dim=-1)  # [c, draft_vocab]
            del full
        draft = self.draft_logits(hidden)  # [c, draft_vocab]
        draft_logp = torch.log_softmax(draft, dim=-1)
        kl = F.kl_div(draft_logp, teacher_logp, log_target=True, reduction="none").sum(-1)  # [c]
        correct = self.draft_to_target[draft.detach().argmax(-1)] == teacher_argmax
        return (kl * weight).sum(), correct
