"""KL(p_target || q_draft) over the draft vocabulary, fused with the draft head, in chunks of elements.

Full-vocabulary logits are the memory problem of long-sequence training (68K elements x 49K ids x 4 bytes = 13 GB
per copy), so they only ever exist for one chunk. For each chunk the forward computes the draft logits, the loss
and, at once, the loss's gradient with respect to those logits, `scale * (softmax(z) - p)`, and multiplies it back
through the head: the backward pass then only scales the stored gradients. That is one head GEMM fewer per chunk
than recomputing the logits under activation checkpointing, and the element-wise work of a chunk runs as one
compiled kernel on CUDA.

The teacher's distribution comes from a `TeacherTable` (one row per supervising position, shared by the elements
that position supervises), gathered row by row inside the chunk.

The loss of a batch is sum(weight * KL) / denominator. The denominator is part of `scale` because one optimizer
step spans several forwards (sequence segments, gradient accumulation, data-parallel ranks) that must share it.
`draft_kl_loss_reference` is the plain autograd formulation the fused one is tested against.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

DEFAULT_CHUNK = 4096
_COMPILE = {"on": True}  # turned off for the process once compiling the chunk kernel fails


def _kl_chunk(
    logits: torch.Tensor,  # [c, V] draft logits in the head's compute dtype (bf16 on CUDA), taken to fp32 here
    table_logp: torch.Tensor,  # [R, V] fp32 teacher log-probabilities
    rows: torch.Tensor,  # [c] int64 rows of table_logp
    scale: torch.Tensor,  # [c] fp32: weight / denominator
    grad_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d loss / d logits [c, V], sum of scale * KL, draft argmax [c]) for one chunk.

    The fp32 copy of the logits is made inside: compiled, it is a register upcast in the fused kernel rather than a
    [c, V] fp32 tensor written and read again (at a 4096-element chunk of the 49K vocabulary, 0.8 GB each way)."""
    logits = logits.float()
    teacher_logp = table_logp[rows]
    logq = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    p = teacher_logp.exp()
    kl = (p * (teacher_logp - logq)).sum(-1)  # [c]
    grad = ((logq.exp() - p) * scale[:, None]).to(grad_dtype)  # teacher p sums to 1 over the draft vocabulary
    return grad, (kl * scale).sum(), logits.argmax(-1)


@functools.cache
def _compiled_chunk():
    return torch.compile(_kl_chunk, dynamic=True)


def _chunk(logits, table_logp, rows, scale, grad_dtype):
    if logits.is_cuda and _COMPILE["on"]:
        try:
            return _compiled_chunk()(logits, table_logp, rows, scale, grad_dtype)
        except Exception as e:  # noqa: BLE001 - any compile failure means: run the same ops eagerly
            logger.warning("compiling the loss kernel failed (%s: %s); running it eagerly", type(e).__name__,
                           str(e).splitlines()[0] if str(e) else "")
            _COMPILE["on"] = False
    return _kl_chunk(logits, table_logp, rows, scale, grad_dtype)


def _chunks(n: int, size: int):
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


class _FusedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, head_weight, table_logp, rows, scale, chunk_size, compute_dtype):
        # hidden [N, d] normed drafter output; head_weight [V, d]; table_logp [R, V]; rows [N]; scale [N]
        need_head = ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):
            w = head_weight.to(compute_dtype)
            grad_hidden = torch.empty_like(hidden)
            grad_head = torch.zeros_like(head_weight) if need_head else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            argmax = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
            for part in _chunks(hidden.shape[0], chunk_size):
                h = hidden[part].to(compute_dtype)
                logits = h @ w.t()  # [c, V] in compute_dtype; _chunk computes in fp32
                grad, loss, argmax[part] = _chunk(logits, table_logp, rows[part], scale[part], compute_dtype)
                del logits
                grad_hidden[part] = grad @ w
                if need_head:
                    grad_head += (grad.t() @ h).to(grad_head.dtype)
                total += loss
        ctx.save_for_backward(grad_hidden, grad_head)
        ctx.mark_non_differentiable(argmax)
        return total, argmax

    @staticmethod
    def backward(ctx, grad_total, grad_argmax):
        grad_hidden, grad_head = ctx.saved_tensors
        return (grad_hidden * grad_total, None if grad_head is None else grad_head * grad_total,
                None, None, None, None, None)


def draft_kl_loss(
    hidden: torch.Tensor,  # [N, d], the drafter's final-normed output at the charged elements
    head_weight: torch.Tensor,  # [draft_vocab, d], the draft lm_head
    table_logp: torch.Tensor,  # [R, draft_vocab] fp32, the teacher's log-probabilities per supervising position
    rows: torch.Tensor,  # [N] int64, the table row of each element
    scale: torch.Tensor,  # [N] fp32, weight / denominator
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, draft_argmax): sum(scale * KL) over the elements and each element's draft argmax (a draft id).

    Under CUDA autocast the head's matrix products run in its dtype (bf16), as `F.linear` would; the softmax and
    the loss in fp32.
    """
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0, torch.zeros(0, dtype=torch.long, device=hidden.device)
    dtype = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(dtype) if torch.is_autocast_enabled(dtype) else hidden.dtype
    return _FusedKL.apply(hidden, head_weight, table_logp, rows, scale.float(), chunk_size, compute_dtype)


LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # hidden [N, d] -> logits [N, vocab], fp32


def draft_kl_loss_reference(
    draft_hidden: torch.Tensor,  # [N, d], the drafter's output (before its final norm) at the charged elements
    teacher_hidden: torch.Tensor,  # [N, d_target], the target's final-normed hidden state at each element's target
    weight: torch.Tensor,  # [N] float
    denominator: float,
    draft_logits: LogitsFn,  # the drafter's compute_logits: -> [N, draft_vocab]
    teacher_logits: LogitsFn,  # the target's compute_logits: -> [N, target_vocab]
    draft_to_target: torch.Tensor,  # [draft_vocab] int64, the target id of each draft id
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same loss by plain autograd, the teacher computed per element: (loss, correct per element)."""
    with torch.no_grad():
        full = teacher_logits(teacher_hidden)
        teacher_argmax = full.argmax(-1)
        teacher_logp = torch.log_softmax(full[:, draft_to_target], dim=-1)
    draft = draft_logits(draft_hidden)
    kl = F.kl_div(torch.log_softmax(draft, dim=-1), teacher_logp, log_target=True, reduction="none").sum(-1)
    correct = draft_to_target[draft.detach().argmax(-1)] == teacher_argmax
    return (kl * weight).sum() / denominator, correct
