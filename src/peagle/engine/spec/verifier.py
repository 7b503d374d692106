"""Lossless verification of K drafts against the target.

Vocabulary (used exactly so below): for request b the verifier sees `num_drafts[b]` DRAFT tokens and K+1 target
distributions. Drafts are ACCEPTED left to right; at the first rejection the target's token at that position is the
RECOVERED token, sampled from the target distribution with the rejected draft removed (renormalised); if every draft
is accepted, the BONUS token is sampled from the distribution after the last draft. Either way each round emits the
accepted drafts plus exactly one more token, the NEXT token.

A draft id < 0 is a pad (a step laid out for more drafts than it has): fed, never accepted; the greedy verifier needs
no test for it (no argmax is negative), the others mask it.

Drafts are the drafter's argmax (a one-hot draft distribution), so the acceptance probability of draft d is
p_target(d) (Leviathan et al. 2023 with q = one-hot). Greedy requests get one-hot target distributions, which makes
this plain "accept while equal to the target argmax".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VerifyOutput:
    output_tokens: torch.Tensor  # [B, K+1] accepted drafts then the next token, -1 after
    num_accepted: torch.Tensor  # [B]
    next_tokens: torch.Tensor  # [B] recovered or bonus token


def verify_greedy(
    target_argmax: torch.Tensor,  # [B, K+1]
    drafts: torch.Tensor,  # [B, K] target ids (any value where j >= num_drafts)
    num_drafts: torch.Tensor,  # [B]
) -> VerifyOutput:
    k = drafts.shape[1]
    in_range = torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]
    accepted = (drafts == target_argmax[:, :k]) & in_range
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)
    next_tokens = target_argmax.gather(1, num_accepted[:, None].long()).squeeze(1)
    return VerifyOutput(_emit(drafts, num_accepted, next_tokens), num_accepted, next_tokens)


def verify_sampled(
    probs: torch.Tensor,  # [B, K+1, V] target distributions (one-hot rows for greedy requests)
    drafts: torch.Tensor,  # [B, K]
    num_drafts: torch.Tensor,  # [B]
    uniforms: torch.Tensor,  # [B, K] U(0, 1)
    exp_noise: torch.Tensor,  # [B, V] Exp(1) noise for the next token
) -> VerifyOutput:
    b, k = drafts.shape
    if k == 0:  # no drafts: plain sampling of the next token
        next_tokens = (probs[:, 0] / exp_noise).argmax(dim=-1)
        return VerifyOutput(next_tokens[:, None], torch.zeros_like(num_drafts), next_tokens)
    in_range = (torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]) & (drafts >= 0)
    p_draft = probs[:, :k].gather(2, drafts.clamp(min=0)[:, :, None].long()).squeeze(2)  # [B, K]
    accepted = (uniforms < p_draft) & in_range
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(b, device=probs.device)
    p_next = probs[rows, num_accepted.long()]  # [B, V]
    rejected = num_accepted < in_range.sum(dim=1)  # a real draft was turned down (not: the drafts, pads aside, ran out)
    rejected_draft = drafts[rows, num_accepted.clamp(max=k - 1).long()].clamp(min=0)
    # Recovered token: the target distribution with the rejected draft removed. Bonus: the plain distribution.
    remove = torch.zeros_like(p_next, dtype=torch.bool)
    remove[rows, rejected_draft.long()] = rejected
    residual = p_next.masked_fill(remove, 0.0)
    # argmax(p / Exp(1)) samples from p without normalising it (the exponential race).
    next_tokens = (residual / exp_noise).argmax(dim=-1)
    return VerifyOutput(_emit(drafts, num_accepted, next_tokens), num_accepted, next_tokens)


def verify_synthetic(
    target_argmax: torch.Tensor,  # [B, K+1]
    drafts: torch.Tensor,  # [B, K]
    num_drafts: torch.Tensor,  # [B]
    rates: tuple[float, ...],  # accepted at position i / rounds, non-increasing
) -> VerifyOutput:
    """Benchmarking only: accept draft i with the measured per-position rate instead of asking the target.

    rates[i] is unconditional (as the metrics report it), so draft i is accepted, given drafts 0..i-1 were, with
    probability rates[i] / rates[i-1]. The emitted tokens are the accepted drafts and the target's argmax after them.
    """
    k = drafts.shape[1]
    conditional = _conditional_rates(tuple(rates[:k]), drafts.device)
    in_range = (torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]) & (drafts >= 0)
    accepted = (torch.rand(drafts.shape, device=drafts.device) < conditional) & in_range
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)
    next_tokens = target_argmax.gather(1, num_accepted[:, None].long()).squeeze(1)
    return VerifyOutput(_emit(drafts, num_accepted, next_tokens), num_accepted, next_tokens)


_CONDITIONAL_RATES: dict[tuple, torch.Tensor] = {}


def _conditional_rates(rates: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """rates[i] / rates[i-1] on the device, made once per (rates, device): a host-to-device copy from pageable
    memory waits for the stream, so making it every step would stall the host behind the target's forward."""
    key = (rates, str(device))
    if key not in _CONDITIONAL_RATES:
        r = torch.tensor(rates, dtype=torch.float32, device=device)
        prev = torch.cat([r.new_ones(1), r[:-1]])
        _CONDITIONAL_RATES[key] = torch.where(prev > 0, r / prev.clamp(min=1e-12), torch.zeros_like(r))
    return _CONDITIONAL_RATES[key]


def _emit(drafts, num_accepted, next_tokens):
    b, k = drafts.shape
    j = torch.arange(k + 1, device=drafts.device)[None, :]
    padded = torch.cat([drafts, drafts.new_zeros(b, 1)], dim=1)
    out = torch.where(j < num_accepted[:, None], padded, torch.full_like(padded, -1))
    return torch.where(j == num_accepted[:, None], next_tokens[:, None].to(out.dtype), out)
