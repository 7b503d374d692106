"""Turning target logits into probabilities under each request's sampling parameters, on the device.

Greedy rows get an exact one-hot distribution on their argmax, so one rejection-sampling path (spec/verifier.py)
serves greedy and sampled requests alike and greedy output stays identical to plain argmax decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    """Per-request sampling parameters as device tensors, built once per step on the host."""

    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] fp32, 1 = off
    all_greedy: bool
    needs_filter: bool
    generators: list[torch.Generator | None]  # per request, for seeded requests


def target_probs(logits: torch.Tensor, st: SamplingTensors, rows_per_request: int) -> torch.Tensor:
    """logits: [B * R, V] fp32 -> probabilities [B * R, V] (one-hot argmax for greedy rows)."""
    greedy_onehot = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if st.all_greedy:
        return greedy_onehot
    temp = st.temperature.repeat_interleave(rows_per_request)[:, None]  # [B*R, 1]
    greedy = temp == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp)
    if st.needs_filter:
        scaled = _top_k_top_p(scaled, st.top_k.repeat_interleave(rows_per_request),
                              st.top_p.repeat_interleave(rows_per_request))
    probs = torch.softmax(scaled, dim=-1)
    return torch.where(greedy, greedy_onehot, probs)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # logits: [N, V]; top_k: [N] (0 = off); top_p: [N] (1 = off)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))[:, None]
    drop = rank >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    before = probs.cumsum(-1) - probs
    drop |= before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def exponential_like(probs: torch.Tensor, generators: list[torch.Generator | None], rows_per_request: int):
    """Exp(1) noise [N, V]; rows of a seeded request come from its own generator so its output is reproducible."""
    q = torch.empty_like(probs).exponential_()
    for b, gen in enumerate(generators):
        if gen is not None:
            rows = slice(b * rows_per_request, (b + 1) * rows_per_request)
            q[rows] = torch.empty_like(q[rows]).exponential_(generator=gen)
    return q


def uniform_like(shape, device, generators: list[torch.Generator | None]) -> torch.Tensor:
    u = torch.rand(shape, device=device)
    for b, gen in enumerate(generators):
        if gen is not None:
            u[b] = torch.rand(shape[1:], device=device, generator=gen)
    return u
