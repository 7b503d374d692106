"""The P-EAGLE attention rule over a layout, as a FlexAttention mask_mod and block mask.

Query element (a_q, d_q) sees key element (a_k, d_k) iff they are in the same document and
    (d_k == 0 and a_k <= a_q)      the real slots up to and including its anchor (the context), or
    (a_k == a_q and d_k <= d_q)    its own rollout's MASK slots up to itself.
That is what the drafter sees at inference: the real slots of the context, then the MASK slots after the last one.

Example, one document, anchors 0..2 at depth 0 and the rollout of anchor 1 to depth 2 (depth-major order):
    elements  (0,0) (1,0) (2,0) (1,1) (1,2)
    (0,0)       x
    (1,0)       x     x
    (2,0)       x     x     x
    (1,1)       x     x           x
    (1,2)       x     x           x     x
Depth-major order keeps the depth-0 block lower-triangular and the rollouts' rows sparse, so most 128 x 128 tiles
are empty and FlexAttention skips them.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from peagle.training.cod import Layout

BLOCK_SIZE = 128
# Rows of the visibility matrix evaluated at once while classifying tiles: bounds the builder's memory.
_MAX_CHUNK_ELEMENTS = 1 << 26


def visible(q_anchor, q_depth, q_doc, k_anchor, k_depth, k_doc) -> torch.Tensor:
    """The rule, on broadcastable index tensors."""
    context = (k_depth == 0) & (k_anchor <= q_anchor)
    own_rollout = (k_anchor == q_anchor) & (k_depth <= q_depth)
    return (q_doc == k_doc) & (context | own_rollout)


def _padded(layout: Layout, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Kernels evaluate mask_mod on whole tiles, so index tensors must cover the rounded-up length. Padding
    # elements get document -1 (no real element has it), so they see and are seen by nothing real.
    pad = length - len(layout)
    anchor = torch.nn.functional.pad(layout.anchor, (0, pad), value=-1)
    depth = torch.nn.functional.pad(layout.depth, (0, pad), value=-1)
    doc = torch.nn.functional.pad(layout.doc, (0, pad), value=-1)
    return anchor, depth, doc


def layout_mask_mod(layout: Layout, q_offset: int = 0):
    """FlexAttention mask_mod for queries `layout[q_offset:]` against keys `layout[:]`."""
    padded_len = _round_up(len(layout), BLOCK_SIZE) + BLOCK_SIZE
    anchor, depth, doc = _padded(layout, padded_len)

    def mask_mod(b, h, q_idx, kv_idx):
        q = q_idx + q_offset
        return visible(anchor[q], depth[q], doc[q], anchor[kv_idx], depth[kv_idx], doc[kv_idx])

    return mask_mod


def build_block_mask(layout: Layout, q_start: int = 0, q_stop: int | None = None, kv_stop: int | None = None
                     ) -> BlockMask:
    """Block mask for queries `layout[q_start:q_stop]` against keys `layout[:kv_stop]`.

    Tiles are classified (empty / partial / full) from the rule evaluated a few hundred rows at a time, so memory
    stays O(rows x keys) instead of the (num_elements)^2 that `create_block_mask` would materialise.
    """
    q_stop = len(layout) if q_stop is None else q_stop
    kv_stop = len(layout) if kv_stop is None else kv_stop
    num_q, num_kv = q_stop - q_start, kv_stop
    q_blocks, kv_blocks = _cdiv(num_q, BLOCK_SIZE), _cdiv(num_kv, BLOCK_SIZE)
    anchor, depth, doc = _padded(layout, max(q_start + q_blocks * BLOCK_SIZE, kv_blocks * BLOCK_SIZE))
    keys = slice(0, kv_blocks * BLOCK_SIZE)
    k_anchor, k_depth, k_doc = anchor[keys][None, :], depth[keys][None, :], doc[keys][None, :]
    k_real = (torch.arange(kv_blocks * BLOCK_SIZE, device=anchor.device) < kv_stop)[None, :]

    rows_per_chunk = max(1, _MAX_CHUNK_ELEMENTS // (kv_blocks * BLOCK_SIZE * BLOCK_SIZE)) * BLOCK_SIZE
    partial, full = [], []
    for row0 in range(0, q_blocks * BLOCK_SIZE, rows_per_chunk):
        rows = torch.arange(row0, min(row0 + rows_per_chunk, q_blocks * BLOCK_SIZE), device=anchor.device)
        q = (rows + q_start)[:, None]
        seen = visible(anchor[q], depth[q], doc[q], k_anchor, k_depth, k_doc) & k_real & (rows < num_q)[:, None]
        counts = seen.view(-1, BLOCK_SIZE, kv_blocks, BLOCK_SIZE).sum(dim=(1, 3))  # [row blocks, kv_blocks]
        full.append(counts == BLOCK_SIZE * BLOCK_SIZE)
        partial.append((counts > 0) & (counts < BLOCK_SIZE * BLOCK_SIZE))
    kv_num, kv_idx = _ordered(torch.cat(partial))
    full_num, full_idx = _ordered(torch.cat(full))
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx,
        BLOCK_SIZE=BLOCK_SIZE, mask_mod=layout_mask_mod(layout, q_start), seq_lengths=(num_q, num_kv),
    )


def dense_mask_reference(layout: Layout) -> torch.Tensor:
    """[num_elements, num_elements] bool, True = may attend. For tests only: it is quadratic in memory.

    Built from the inference picture instead of the formula: each query sees its document's real slots up to its
    anchor, then its own rollout up to its depth.
    """
    n = len(layout)
    mask = torch.zeros(n, n, dtype=torch.bool)
    anchor, depth, doc = layout.anchor.tolist(), layout.depth.tolist(), layout.doc.tolist()
    real_slot = {(doc[i], anchor[i]): i for i in range(n) if depth[i] == 0}
    mask_slot = {(doc[i], anchor[i], depth[i]): i for i in range(n) if depth[i] > 0}
    for i in range(n):
        for (d, a), j in real_slot.items():
            if d == doc[i] and a <= anchor[i]:
                mask[i, j] = True
        for step in range(1, depth[i] + 1):
            mask[i, mask_slot[(doc[i], anchor[i], step)]] = True
    return mask


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # [q_blocks, kv_blocks] bool -> per row: count and the column indices of True tiles first (ascending).
    blocks = blocks.to(torch.int32)
    num = blocks.sum(-1).to(torch.int32)
    idx = torch.argsort(blocks, dim=-1, descending=True, stable=True).to(torch.int32)
    return num[None, None].contiguous(), idx[None, None].contiguous()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b
