"""COD sampling: which (anchor, depth) training elements a packed sequence contributes, in depth-major order.

Vocabulary (used the same way in every file of this package):
- A packed sequence holds n tokens `t[0..n)` of one or more documents, with the frozen target's features
  `f[0..n)` (aux hidden states) and its logits `L[0..n)`; `L[i]` is the target's distribution for token i+1.
- An element (a, d) is one drafter slot. Its anchor a is a position of the packed sequence, its depth d in
  [0, K_train). Depth 0 is a real slot: token `t[a+1]` paired with feature `f[a]` (the EAGLE shift). Depth d >= 1 is
  a MASK slot: the mask token with `mask_hidden`. Either way the slot sits at RoPE position `a + d` (counted from
  its document's start) and predicts token `a + d + 2`; it is supervised by `L[a + d + 1]` (its `target`) and
  charged loss iff token `a + d + 2` is a response token (`loss_mask`) of the same document.
- This is the engine's drafting pass exactly: with context tokens `t[0..c]` the real slot at position c-1
  (token c, feature c-1) outputs draft 1 and the MASK slots at positions c..c+K-2 output drafts 2..K, i.e. the
  rollout of anchor c-1.

COD (conditional drop, from PARD) bounds the n x K blow-up: depth d keeps about `n_roll * max(r^d, r_min)`
elements, where n_roll counts the anchors whose rollout can carry loss at all, and a depth-d element survives only
if its depth d-1 parent (same anchor) did, so every kept rollout is a prefix of the inference-time rollout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True, slots=True)
class Layout:
    """Training elements of one packed sequence, depth-major: all depth-0 elements by anchor, then depth 1, ..."""

    anchor: torch.Tensor  # [num_elements] int64, index into the packed sequence
    depth: torch.Tensor  # [num_elements] int64
    doc: torch.Tensor  # [num_elements] int64, document id of the anchor
    position: torch.Tensor  # [num_elements] int64, RoPE position: anchor - document start + depth
    target: torch.Tensor  # [num_elements] int64, anchor + depth + 1: the position whose target logits supervise
    weight: torch.Tensor  # [num_elements] float32, 1.0 where the predicted token is a response token, else 0.0

    def __len__(self) -> int:
        return self.anchor.numel()

    def depth_counts(self, k: int) -> list[int]:
        return torch.bincount(self.depth, minlength=k).tolist()

    def select(self, index: torch.Tensor) -> "Layout":
        """The sub-layout of `index` (ascending indices keep the depth-major order)."""
        return Layout(*(getattr(self, f.name)[index] for f in fields(Layout)))

    def to(self, device: torch.device | str) -> "Layout":
        return Layout(*(getattr(self, f.name).to(device) for f in fields(Layout)))

    @staticmethod
    def concat(layouts: "list[Layout]", lengths: list[int], num_docs: list[int]) -> "Layout":
        """The layout of sequences laid side by side (as `PackedSequence.concat` does), depth-major again.

        lengths / num_docs: tokens and documents of each sequence, to shift anchors and document ids.
        """
        shift = torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0).tolist()
        doc_shift = torch.cumsum(torch.tensor([0, *num_docs[:-1]]), 0).tolist()
        parts = [Layout(lay.anchor + s, lay.depth, lay.doc + ds, lay.position, lay.target + s, lay.weight)
                 for lay, s, ds in zip(layouts, shift, doc_shift)]
        joined = Layout(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(Layout)))
        # A stable sort by depth keeps anchors ascending within each depth (the sequences come in order).
        return joined.select(torch.sort(joined.depth, stable=True).indices)


def document_starts(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each position, the start and end (exclusive) of its document. doc_ids: [n], non-decreasing."""
    n = doc_ids.numel()
    idx = torch.arange(n)
    is_start = torch.ones(n, dtype=torch.bool)
    is_start[1:] = doc_ids[1:] != doc_ids[:-1]
    start = torch.cummax(torch.where(is_start, idx, 0), 0).values
    is_end = torch.ones(n, dtype=torch.bool)
    is_end[:-1] = is_start[1:]
    end = torch.flip(torch.cummin(torch.flip(torch.where(is_end, idx + 1, n), [0]), 0).values, [0])
    return start, end


def cod_sample(
    doc_ids: torch.Tensor,  # [n] int64, non-decreasing document id of each position
    loss_mask: torch.Tensor,  # [n] bool, True for response tokens
    k_train: int,
    r: float,
    r_min: float,
    generator: torch.Generator | None = None,
) -> Layout:
    """Samples the training elements of one packed sequence.

    Worked example: one document of 8 tokens whose response is tokens 4..7; K_train=3, r=0.5, r_min=0.
    - Depth 0: anchors 0..6 (anchor 7 has no token 8 to pair with), all kept. Element a predicts token a+2, so the
      ones with loss are a = 2..5 (anchor 6 would predict token 8, past the end).
    - Rollout candidates: anchors with an element at depth >= 1 that exists (token a+d+2 in the document) and
      predicts a response token: a = 0..4 (a = 0 predicts the prompt token 3 at depth 1 but the response token 4 at
      depth 2, so its rollout counts): n_roll = 5.
    - Depth 1 keeps floor(5 * 0.5 + 0.5) = 3 of them, say {0, 1, 4}.
    - Depth 2 keeps floor(5 * 0.25 + 0.5) = 1 among the surviving parents whose token a+4 exists ({0, 1}): say {1}.
    - Layout (depth-major): (0,0) (1,0) ... (6,0) | (0,1) (1,1) (4,1) | (1,2); element (1,2) sits at RoPE position 3,
      has the mask token, is supervised by the target logits at position 4 and predicts token 5 (loss on).
    With r = 1 (or r_min = 1) every candidate is kept: the full expansion, used for evaluation.
    """
    if k_train < 1:
        raise ValueError(f"K_train must be at least 1, got {k_train}")
    if not (0.0 < r <= 1.0 and 0.0 <= r_min <= 1.0):
        raise ValueError(f"COD needs 0 < r <= 1 and 0 <= r_min <= 1, got r={r}, r_min={r_min}")
    n = doc_ids.numel()
    if loss_mask.shape != (n,):
        raise ValueError(f"loss_mask has shape {tuple(loss_mask.shape)}, expected ({n},)")
    doc_ids = doc_ids.long().cpu()
    loss_mask = loss_mask.bool().cpu()
    start, end = document_starts(doc_ids)
    anchors = torch.arange(n)
    # charged[a, d]: element (a, d) exists in its document and predicts a response token.
    depths = torch.arange(k_train)
    predicted = anchors[:, None] + depths[None, :] + 2  # [n, K]
    exists = predicted < end[:, None]
    charged = exists & loss_mask[predicted.clamp(max=n - 1)]
    # useful[a, d]: some element of the rollout at depth >= d carries loss (reverse cumulative OR over depth).
    useful = torch.flip(torch.cummax(torch.flip(charged.int(), [1]), 1).values, [1]).bool() & exists

    alive = anchors + 1 < end  # depth 0: every anchor with a next token in its document
    # Every later candidate set is a subset of the depth-1 one, so r = 1 keeps everything.
    n_roll = int(useful[:, 1].sum()) if k_train > 1 else 0
    kept = [anchors[alive]]
    for d in range(1, k_train):
        candidates = torch.nonzero(alive & useful[:, d]).flatten()
        quota = math.floor(n_roll * max(r**d, r_min) + 0.5)
        if quota < candidates.numel():
            pick = torch.randperm(candidates.numel(), generator=generator)[:quota]
            candidates = candidates[pick].sort().values
        alive = torch.zeros(n, dtype=torch.bool)
        alive[candidates] = True
        kept.append(candidates)
        if candidates.numel() == 0:
            break
    anchor = torch.cat(kept)
    depth = torch.cat([torch.full_like(a, d) for d, a in enumerate(kept)])
    return Layout(
        anchor=anchor,
        depth=depth,
        doc=doc_ids[anchor],
        position=anchor - start[anchor] + depth,
        target=anchor + depth + 1,
        weight=charged[anchor, depth].float(),
    )


def full_layout(doc_ids: torch.Tensor, loss_mask: torch.Tensor, k: int) -> Layout:
    """Every useful element to depth k-1 (COD with r = 1): evaluation and EAGLE-3's training-time test."""
    return cod_sample(doc_ids, loss_mask, k, r=1.0, r_min=1.0)
