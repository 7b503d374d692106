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

from dataclasses import dataclass, fields

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


def layout_mask_mod(layout: Layout, q_offset: int = 0, length: int = 0):
    """FlexAttention mask_mod for queries `layout[q_offset:]` against keys `layout[:]` (and, up to `length`, padding
    elements after them, which see only one another)."""
    padded_len = round_up(max(len(layout), length), BLOCK_SIZE) + BLOCK_SIZE
    anchor, depth, doc = _padded(layout, padded_len)

    def mask_mod(b, h, q_idx, kv_idx):
        q = q_idx + q_offset
        return visible(anchor[q], depth[q], doc[q], anchor[kv_idx], depth[kv_idx], doc[kv_idx])

    return mask_mod


@dataclass(frozen=True, slots=True)
class Tiles:
    """Which BLOCK_SIZE x BLOCK_SIZE tiles of one attention pass hold visible pairs, as `BlockMask.from_kv_blocks`
    takes them: per row of query tiles, the number of partial tiles and their column indices first (ascending),
    and the same for the full tiles (every pair visible: mask_mod is skipped there)."""

    kv_num: torch.Tensor  # [1, 1, q_blocks] int32
    kv_idx: torch.Tensor  # [1, 1, q_blocks, kv_blocks] int32
    full_num: torch.Tensor  # [1, 1, q_blocks] int32
    full_idx: torch.Tensor  # [1, 1, q_blocks, kv_blocks] int32

    def map(self, fn) -> "Tiles":
        return Tiles(*(fn(getattr(self, f.name)) for f in fields(Tiles)))

    def padded(self, q_blocks: int, kv_blocks: int) -> "Tiles":
        """The tiles of the same pass over a layout followed by padding elements, `q_blocks` x `kv_blocks` tiles in
        all: each new row of query tiles touches its diagonal tile only (padding elements see one another there:
        `layout_mask_mod` gives them document -1), the old rows' tiles are kept. For `pad_shapes`; on the host."""
        old_q, old_kv = self.kv_num.shape[-1], self.kv_idx.shape[-1]
        if q_blocks < old_q or kv_blocks < old_kv or q_blocks - old_q > kv_blocks - old_kv:
            raise ValueError(f"cannot pad {old_q} x {old_kv} tiles to {q_blocks} x {kv_blocks}")

        def grow(num, idx, new_rows_touch):
            extra_cols = torch.arange(old_kv, kv_blocks, dtype=idx.dtype).expand(old_q, -1)
            idx = torch.cat([idx[0, 0], extra_cols], dim=1)  # the old rows' lists, the new columns after
            new = torch.arange(kv_blocks, dtype=idx.dtype).expand(q_blocks - old_q, -1).clone()
            rows = torch.arange(old_q, q_blocks)
            diagonal = rows + (kv_blocks - q_blocks)  # the tile of the new rows' own columns
            new[:, 0], new[torch.arange(len(rows)), diagonal] = diagonal.to(idx.dtype), 0
            touch = torch.full((q_blocks - old_q,), int(new_rows_touch), dtype=num.dtype)
            return (torch.cat([num[0, 0], touch])[None, None].contiguous(),
                    torch.cat([idx, new])[None, None].contiguous())

        return Tiles(*grow(self.kv_num, self.kv_idx, True), *grow(self.full_num, self.full_idx, False))


def build_block_mask(layout: Layout, q_start: int = 0, q_stop: int | None = None, kv_stop: int | None = None,
                     tiles: Tiles | None = None, rows: int | None = None) -> BlockMask:
    """Block mask for queries `layout[q_start:q_stop]` against keys `layout[:kv_stop]`.

    `tiles` (from `block_tiles`, made on the host ahead of the step) saves the classification; without them the
    tiles are classified on the layout's device from the rule (`dense_tiles`). `rows`: the whole layout's one pass
    over `rows` >= len(layout) elements, the layout followed by padding elements (`Tiles.padded` tiles).
    """
    q_stop = len(layout) if q_stop is None else q_stop
    kv_stop = len(layout) if kv_stop is None else kv_stop
    lengths = (q_stop - q_start, kv_stop)
    if rows is not None and rows != len(layout):
        if (q_start, q_stop, kv_stop) != (0, len(layout), len(layout)) or tiles is None:
            raise ValueError("padding rows apply to one pass over the whole layout, with planned tiles")
        lengths = (rows, rows)
    if tiles is None:
        tiles = dense_tiles(layout, q_start, q_stop, kv_stop)
    return BlockMask.from_kv_blocks(
        tiles.kv_num, tiles.kv_idx, tiles.full_num, tiles.full_idx,
        BLOCK_SIZE=BLOCK_SIZE, mask_mod=layout_mask_mod(layout, q_start, lengths[1]), seq_lengths=lengths,
    )


def block_tiles(layout: Layout, q_start: int = 0, q_stop: int | None = None, kv_stop: int | None = None) -> Tiles:
    """The tiles of queries `layout[q_start:q_stop]` against keys `layout[:kv_stop]`, from the layout's structure
    instead of the rule evaluated pair by pair (the host can do this ahead of the step in a few milliseconds).

    In a depth-major layout whose depth-0 elements are ordered by anchor (documents contiguous, as COD sampling,
    `Layout.concat` and `Layout.select` of ascending indices leave them) and whose deeper blocks are each ordered by
    anchor, a query (a, d) sees one contiguous run of depth-0 keys, [first element of its document, its anchor],
    plus one key per depth 1..d, (a, d'), found by binary search. A tile is touched if one query's run or key falls
    in it, full if every query of a whole tile row spans it. Any other layout is classified by `dense_tiles`.
    """
    layout = layout.to("cpu")
    q_stop = len(layout) if q_stop is None else q_stop
    kv_stop = len(layout) if kv_stop is None else kv_stop
    if not _ordered_by_anchor(layout):
        return dense_tiles(layout, q_start, q_stop, kv_stop)
    num_q = q_stop - q_start
    q_blocks, kv_blocks = _cdiv(num_q, BLOCK_SIZE), _cdiv(kv_stop, BLOCK_SIZE)
    counts = torch.bincount(layout.depth, minlength=1)
    starts = torch.cumsum(counts, 0) - counts
    n0 = int(counts[0])
    anchor0, doc0 = layout.anchor[:n0], layout.doc[:n0]
    qa, qd, qdoc = (t[q_start:q_stop] for t in (layout.anchor, layout.depth, layout.doc))
    row_block = torch.arange(num_q) // BLOCK_SIZE

    # The depth-0 run of each query: [lo, hi) in key indices, cut at kv_stop.
    hi = torch.searchsorted(anchor0, qa, right=True).clamp(max=kv_stop)
    lo = torch.minimum(torch.searchsorted(doc0, qdoc), hi)
    touched = torch.zeros(q_blocks, kv_blocks + 1, dtype=torch.int32)  # a difference array along the columns
    some = lo < hi
    ones = torch.ones(int(some.sum()), dtype=torch.int32)
    touched.index_put_((row_block[some], lo[some] // BLOCK_SIZE), ones, accumulate=True)
    touched.index_put_((row_block[some], (hi[some] - 1) // BLOCK_SIZE + 1), -ones, accumulate=True)
    touched = torch.cumsum(touched, 1)[:, :kv_blocks] > 0
    # Its own rollout: one key per depth 1..d.
    for d in range(1, len(counts)):
        rows = torch.nonzero(qd >= d).flatten()
        block = layout.anchor[int(starts[d]):int(starts[d]) + int(counts[d])]
        if not rows.numel() or not block.numel():
            continue
        at = torch.searchsorted(block, qa[rows]).clamp(max=block.numel() - 1)
        key = int(starts[d]) + at
        there = (block[at] == qa[rows]) & (key < kv_stop)
        touched[row_block[rows[there]], key[there] // BLOCK_SIZE] = True
    # Full tiles: inside every query's depth-0 run, in a tile row of real queries and a column of real keys.
    maxlo = torch.zeros(q_blocks, dtype=torch.long).scatter_reduce(0, row_block, lo, "amax", include_self=False)
    minhi = torch.zeros(q_blocks, dtype=torch.long).scatter_reduce(0, row_block, hi, "amin", include_self=False)
    whole_row = (torch.arange(q_blocks) + 1) * BLOCK_SIZE <= num_q
    column = torch.arange(kv_blocks)
    full = ((column[None, :] * BLOCK_SIZE >= maxlo[:, None])
            & ((column[None, :] + 1) * BLOCK_SIZE <= torch.clamp(minhi, max=min(n0, kv_stop))[:, None])
            & whole_row[:, None])
    partial = touched & ~full
    return Tiles(*_ordered(partial), *_ordered(full))


def _ordered_by_anchor(layout: Layout) -> bool:
    depth, anchor, doc = layout.depth, layout.anchor, layout.doc
    if len(layout) < 2:
        return True
    if bool((depth[1:] < depth[:-1]).any()):
        return False
    same_depth = depth[1:] == depth[:-1]
    if bool((same_depth & (anchor[1:] <= anchor[:-1])).any()):
        return False
    n0 = int((depth == 0).sum())
    return not bool((doc[1:n0] < doc[:n0 - 1]).any())


def dense_tiles(layout: Layout, q_start: int = 0, q_stop: int | None = None, kv_stop: int | None = None) -> Tiles:
    """The tiles from the rule evaluated on every (query, key) pair, a few hundred rows at a time (memory stays
    O(rows x keys) instead of the (num_elements)^2 that `create_block_mask` would materialise), on the layout's
    device. The reference `block_tiles` is tested against."""
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
    return Tiles(*_ordered(torch.cat(partial)), *_ordered(torch.cat(full)))


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


def round_up(a: int, b: int) -> int:
    """a rounded up to a multiple of b."""
    return _cdiv(a, b) * b
