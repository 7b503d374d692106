"""Held-out acceptance: per-depth accuracy, the simulated acceptance length, and the walk that serving does.

Both acceptance numbers start from the same facts: for every anchor a of a held-out sequence and every depth d,
whether draft d + 1 of the rollout at a (element (a, d), predicting token a + d + 2) equals the target's argmax.
`lead[a]` is the number of leading right drafts of that rollout.

- The simulated acceptance length averages 1 + min(lead[a], K) over every anchor with a complete rollout.
- The walk does what the engine does on a greedy document: the first response token comes from the prefill; each
  round drafts from the last accepted token, accepts the right prefix (m = min(lead, K) tokens), emits the target's
  own token after it, and starts the next round after that. So rounds start where the previous round failed, and
  they crowd into the hard stretches the average skips: on greedy data the walk predicts what serving measures.

Worked example of the walk, one response of tokens 4..11 (prompt 0..3), K = 3: the prefill gives token 4, the first
round drafts from anchor 3 (token 4, feature 3) for tokens 5, 6, 7. With lead[3] = 1 it accepts token 5, the target
gives 6, and the next round drafts from anchor 5 for 7, 8, 9; lead[5] = 3 accepts all three, the target gives 10;
the round from anchor 9 has only token 11 left: lead[9] >= 1 accepts it and the response is done. Three rounds,
accepted 1 + 3 + 1: walk AL = 1 + 5 / 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from peagle.training.cod import Layout
from peagle.training.forward import StepStats


def leading_right(layout: Layout, correct: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lead [n] int64, complete [n] bool) from the per-element results of a full layout to depth k.

    correct: per charged element (weight > 0) in layout order. complete[a]: every depth of anchor a was charged.
    """
    sel = torch.nonzero(layout.weight > 0).flatten().cpu()
    anchor, depth = layout.anchor.cpu()[sel], layout.depth.cpu()[sel]
    present = torch.zeros(n, k, dtype=torch.bool)
    ok = torch.zeros(n, k, dtype=torch.bool)
    present[anchor, depth] = True
    ok[anchor, depth] = correct.cpu()
    return torch.cumprod(ok.long(), dim=1).sum(dim=1), present.all(dim=1)


def response_spans(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)) of every maximal run of response tokens within one document."""
    mask, docs = loss_mask.cpu().tolist(), doc_ids.cpu().tolist()
    spans, start = [], None
    for i, on in enumerate(mask):
        if start is not None and (not on or docs[i] != docs[start]):
            spans.append((start, i))
            start = None
        if on and start is None:
            start = i
    if start is not None:
        spans.append((start, len(mask)))
    return spans


def walk(lead: list[int], spans: list[tuple[int, int]], k: int, cap: bool = True) -> tuple[int, int]:
    """(accepted drafts, rounds) of greedy serving with k drafts per round over the response spans.

    With `cap`, a round accepts nothing past the end of its span. The engine counts what the verifier accepted
    before it cuts the output at max_tokens (vLLM's convention), so a walk that is compared with it round for
    round over a response cut short of its document runs with cap=False."""
    accepted = rounds = 0
    for start, end in spans:
        u = max(start + 1, 2)  # the next token to produce; the first response token came from the prefill
        while u < end:
            m = min(lead[u - 2], k, end - u) if cap else min(lead[u - 2], k)
            accepted, rounds, u = accepted + m, rounds + 1, u + m + 1
    return accepted, rounds


@dataclass
class EvalStats:
    """Held-out scores. `leading[j]` counts anchors (with all K drafts on response tokens) whose first j drafts
    match the target's argmax and whose draft j+1 does not (j = K: all matched). `walked[j - 1]` holds (accepted,
    rounds) of the walk with j drafts per round."""

    stats: StepStats
    leading: torch.Tensor  # [K + 1] int64
    walked: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.long))  # [K, 2] int64
    # the walk per group of documents (the data source each came from): [G, K, 2] int64
    walked_groups: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, 2, dtype=torch.long))

    def __add__(self, other: "EvalStats") -> "EvalStats":
        return EvalStats(self.stats + other.stats, self.leading + other.leading, _sum(self.walked, other.walked),
                         _sum(self.walked_groups, other.walked_groups))

    @classmethod
    def of(cls, stats: StepStats, layout: Layout, correct: torch.Tensor, loss_mask: torch.Tensor,
           doc_ids: torch.Tensor, k: int, doc_groups: list[int] | None = None, num_groups: int = 0,
           walk_tokens: int | None = None) -> "EvalStats":
        """`doc_groups[i]`: the group of the sequence's document i (its data source), for `walked_groups`.
        `walk_tokens`: the walk covers at most that many tokens of each response, as serving with max_tokens does
        (greedy answers of a small target end in loops that a speculator accepts whole: past the benchmarks'
        horizon they would inflate the walk)."""
        lead, complete = leading_right(layout, correct, loss_mask.numel(), k)
        spans, lead_list = response_spans(loss_mask, doc_ids), lead.tolist()
        if walk_tokens:
            spans = [(start, min(end, start + walk_tokens)) for start, end in spans]
        groups = torch.zeros(num_groups, k, 2, dtype=torch.long)
        if doc_groups is not None and num_groups:  # the walk is a sum over spans: walk each group's, then add up
            docs = doc_ids.cpu().tolist()
            for g in range(num_groups):
                mine = [span for span in spans if doc_groups[docs[span[0]]] == g]
                if mine:
                    groups[g] = torch.tensor([walk(lead_list, mine, j) for j in range(1, k + 1)], dtype=torch.long)
            walked = groups.sum(0)
        else:
            walked = torch.tensor([walk(lead_list, spans, j) for j in range(1, k + 1)], dtype=torch.long)
        return cls(stats, torch.bincount(lead[complete], minlength=k + 1), walked.view(k, 2), groups)

    def acceptance_length(self, k: int) -> float:
        """Simulated acceptance length with k drafts: 1 + E[min(matched prefix, k)] (the bonus token counts)."""
        n = int(self.leading.sum())
        if n == 0:
            return float("nan")
        matched = torch.arange(self.leading.numel()).clamp(max=k)
        return 1.0 + float((matched * self.leading).sum()) / n

    def walk_acceptance_length(self, k: int, group: int | None = None) -> float:
        """1 + accepted / rounds of the walk with k drafts per round (the engine's definition), over every document
        or those of one group."""
        accepted, rounds = (self.walked[k - 1] if group is None else self.walked_groups[group, k - 1]).tolist()
        return 1.0 + accepted / rounds if rounds else float("nan")

    def conditional_accuracy(self) -> list[float]:
        """P(draft j correct | drafts 1..j-1 correct), j = 1..K: the chain that the acceptance length multiplies."""
        reach = torch.flip(torch.cumsum(torch.flip(self.leading, [0]), 0), [0])  # reach[j] = #(leading >= j)
        return [float(reach[j + 1] / reach[j]) if reach[j] else float("nan") for j in range(self.leading.numel() - 1)]


def _sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return b if not a.numel() else (a if not b.numel() else a + b)
