"""The sequence partition: one long sequence trained in S segments whose gradients sum to the unpartitioned one.

Ownership: a depth-0 element belongs to the segment of its anchor; a rollout element (depth >= 1) to the segment of
anchor + 1, so a rollout never spans segments. Segment s runs the drafter over
    every depth-0 element whose anchor lies before segment s+1 (its own plus the cumulative prefix, recomputed
    with grad, because its elements attend to them), and the rollouts it owns,
and charges loss only for the elements it owns, against the denominator shared by the whole step (`plan.py` turns
the segments into the step's forwards). Every charged
element sees exactly the keys it sees in the unpartitioned forward (the rule only looks back to depth-0 elements
with smaller anchors and along its own rollout), so the per-segment gradients add up to the full gradient while
peak activation memory holds the depth-0 prefix plus 1/S of the rollouts.

Example: depth-0 anchors 0..7, S = 2, boundary at anchor 4. Segment 0 runs anchors 0..3 at depth 0 and the
rollouts of anchors 0..2 (anchor + 1 <= 3); segment 1 runs anchors 0..7 at depth 0, charging only 4..7, and the
rollouts of anchors 3..7.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from peagle.training.cod import Layout


@dataclass(frozen=True, slots=True)
class Segment:
    elements: torch.Tensor  # [num_elements_s] ascending indices into the layout (depth-major order kept)
    owned: torch.Tensor  # [num_elements_s] bool, the elements this segment charges


def plan_partition(layout: Layout, num_segments: int) -> list[Segment]:
    """Splits the depth-0 anchors into `num_segments` contiguous runs of (nearly) equal size."""
    real_anchor = layout.anchor[layout.depth == 0]
    if num_segments < 1:
        raise ValueError(f"the number of segments must be at least 1, got {num_segments}")
    if num_segments > max(1, real_anchor.numel()):
        raise ValueError(
            f"cannot split a sequence of {real_anchor.numel()} positions into {num_segments} segments; "
            "use fewer segments"
        )
    cuts = [int(real_anchor[s * real_anchor.numel() // num_segments]) for s in range(1, num_segments)]
    bounds = torch.tensor(cuts, dtype=torch.long, device=layout.anchor.device)
    # Index of the segment each element belongs to: anchor (depth 0) or anchor + 1 (depth >= 1) against the cuts.
    key = layout.anchor + (layout.depth > 0).long()
    owner = torch.searchsorted(bounds, key, right=True)
    upper = [*cuts, torch.iinfo(torch.long).max]
    segments = []
    for s in range(num_segments):
        member = ((layout.depth == 0) & (layout.anchor < upper[s])) | ((owner == s) & (layout.depth > 0))
        elements = torch.nonzero(member).flatten()
        segments.append(Segment(elements, owner[elements] == s))
    return segments
