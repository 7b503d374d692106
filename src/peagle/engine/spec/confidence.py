"""Draft confidence: which of its drafts a request has the target verify this round.

The drafter's CONFIDENCE in draft i of a request is the product of its probabilities of drafts 0..i (each the
drafter's softmax at its argmax, under the draft vocabulary): the chance, by the drafter's own account, that the
whole chain up to i is right. A request verifies its drafts up to the first whose confidence falls below the
step's CUTOFF; the drafts after it are proposed but not verified (they become PAD_DRAFT, which the verifiers skip
and the compact layouts leave out). The running product is monotone, so the verified drafts are a prefix: the
count of confidences at or above the cutoff.

Worked example, cutoff 0.5: probabilities [0.9, 0.8, 0.95, 0.3] give confidences [0.9, 0.72, 0.684, 0.205]:
three drafts verified, the fourth not.

Lossless by construction: the decision reads the drafter's distributions only, never the target's answer for
these drafts, so a verified prefix is verified exactly as it would be without the rest (greedy output unchanged,
speculative sampling's emitted distribution the target's, with the bonus token drawn after the last verified
draft). Why the product and not each position's own probability: docs/DECISIONS.md (the CPU measurement on the
testbed heads).
"""

from __future__ import annotations

import torch

from peagle.engine.draft_plan import PAD_DRAFT


def draft_probability(logits: torch.Tensor) -> torch.Tensor:  # [N, draft_vocab] fp32 -> [N]
    """The drafter's probability of its argmax at each row: exp(max - logsumexp), without the softmax's [N, V]."""
    return (logits.amax(dim=-1) - logits.logsumexp(dim=-1)).exp()


def confidence(probs: torch.Tensor) -> torch.Tensor:  # [B, K] -> [B, K]
    """Per request, the confidence of each draft position: the running product of the drafter's probabilities."""
    return probs.cumprod(dim=1)


def confident_count(probs: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:  # [B, K], [] -> [B] int64
    """Drafts each request verifies: those whose confidence is at or above the cutoff (a prefix)."""
    return (confidence(probs) >= cutoff).sum(dim=1)


def truncate_drafts(drafts: torch.Tensor, probs: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    """drafts [B, K] (target ids) with those past each request's confident prefix replaced by PAD_DRAFT."""
    j = torch.arange(drafts.shape[1], device=drafts.device)
    keep = j[None, :] < confident_count(probs, cutoff)[:, None]
    return torch.where(keep, drafts, torch.full_like(drafts, PAD_DRAFT))
