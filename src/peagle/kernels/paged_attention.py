"""Attention of a flat batch of query rows over a paged KV cache (prefill, decode, verify and draft batches).

Token t belongs to request b when `query_start_loc[b] <= t < query_start_loc[b + 1]`; it attends the cached keys of
request b at positions `0 .. positions[t]` inclusive. Causality is by POSITION, not by row order: within a request
the query rows' positions need not be increasing or distinct (the P-EAGLE draft batch repeats a rejected row's
position in its first MASK row). Cache position j of request b lives at slot
`block_tables[b, j // block_size] * block_size + j % block_size`; the keys of the current rows must already be in
the cache (`store_kv` first). Rows that belong to no request (padding past `query_start_loc[-1]`) are not written
by the Triton kernel and are zero in the reference.

Sliding windows and sinks (the local layers of Gemma 3 and GPT-OSS). With `window` w > 0 a row at position p sees
only the keys p - w < j <= p, its last w positions (Hugging Face's `sliding_window`), and the kernel reads no key
below the lowest window of its tile: a local layer costs its window, whatever the context. `sinks` ([num_heads],
GPT-OSS's learned logits) add a column of value sinks[h] to each row's softmax, dropped after it (it has no value
vector): the output is scaled by 1 / (1 + exp(sinks[h] - lse)), lse the logsumexp of the row's scaled scores. Both
are static per call (the window a compile-time constant), so a CUDA graph captures them.

Tiling (Triton). The grid is `(num_requests * num_query_tiles, num_kv_heads, num_splits)`. A program owns up to
BLOCK_Q query rows of one request and all GROUP = num_heads // num_kv_heads query heads of one KV head, flattened
into BLOCK_M = BLOCK_Q * GROUP (query, head) pairs, so each KV tile is read once for the whole group rather than
once per query head, and the pairs fill the MMA's rows even at one query row (decode with GQA). BLOCK_M is the next
power of two of max_query_len * GROUP, at least 16 (the smallest MMA tile) and at most 128 (64 for head_dim > 64, 32
beyond 128, to bound the fp32 accumulator's registers). The program walks the KV blocks up to the largest position
in its tile with an online softmax in fp32 and masks per pair by position; a sink joins the softmax's denominator
when the output is normalised (by the single split, or by the merge).

Mixed steps (`small_query_len`, `mixed_tiles`). A step that prefills a prompt beside decoding requests has a large
max_query_len, so every request would get its tiles: 64 decodes of 8 rows beside a 75-token prompt, padded to 640
tokens, make 64 x 16 tiles of 128 (query, head) pairs, one in sixteen used and that one a quarter full. With
`small_query_len` (K + 1) two launches share the work: the requests of at most that many rows, one small tile each
(MAP 1), and the longer ones in max_query_len's tiles, listed on the device by `mixed_tile_map` (MAP 2) within a
static bound, so a CUDA graph captures both.

Split KV. Decode and verify at small batch launch few programs (batch 1 of a 3-KV-head model: 3), and one program
walking a 2K-token context alone is latency-bound. When the grid is small for the GPU, the keys a tile sees (from
its lowest window's start, 0 without a window) are split evenly into `num_splits` chunks (static per call, so a CUDA
graph captures it); each split writes an unnormalised partial (acc, running max, running sum) and a second small
kernel merges them, or (`fused_merge`) the last split of each tile to arrive merges them inside the attention
kernel, counted in a per-device buffer of arrival counters that it leaves at zero: one launch instead of two. Both
kernels take only tensors besides static Python ints, so the call can be captured in a CUDA graph.

Latency, not bandwidth, bounds most engine sizes. Each program loads a tile's block numbers one iteration ahead of
its keys and values, so a tile costs one global-memory round trip rather than two dependent ones; the merge kernel
issues all its partial loads at once; query tiles run last-first, so a causal prefill starts its longest tiles
first. Measured on an H200 (bf16, 9 query / 3 KV heads, head_dim 64, CUDA-graph replay of one call, both kernels):
decode at batch 1 over 1K tokens 5.7 us (contiguous SDPA of the same shape: 5.7 us), over 2K 7.5 us; verify of
8 tokens at batch 1 over 2K 8.9 us, at batch 64 over 1K 25 us; a 2K-token prefill 42 us. See `kv_tile` and
`default_num_splits` for the tile and split choices.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from peagle.kernels import pdl

_LOG2E = 1.4426950408889634
_LOG2E_JIT = tl.constexpr(_LOG2E)  # the same, readable inside kernels
_MAX_SPLITS = 8


@triton.jit
def _tile_rows(query_start_loc_ptr, tile_map_ptr, tile, num_q_tiles, small_q, kv_head,
               GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, MAP: tl.constexpr):
    # The (query row, query head) pairs of one program and whether each belongs to the request. MAP 0: every request
    # has num_q_tiles tiles; 1 (mixed steps' short requests): one tile per request, rows only for requests of at
    # most small_q rows; 2 (mixed steps' long requests): the tile's (request, query tile) from tile_map, -1: none.
    if MAP == 2:
        req = tl.load(tile_map_ptr + 2 * tile)
        q_tile = tl.load(tile_map_ptr + 2 * tile + 1)
        valid = req >= 0
        req = tl.maximum(req, 0)
    elif MAP == 1:
        req = tile
        q_tile = 0
    else:
        req = tile // num_q_tiles
        # Last query tile first: in a causal prefill it sees the most keys, and programs start in grid order.
        q_tile = num_q_tiles - 1 - tile % num_q_tiles
    q_start = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    if MAP == 2:
        q_end = tl.where(valid, q_end, q_start)  # no tile: no row
    elif MAP == 1:
        q_end = tl.where(q_end - q_start <= small_q, q_end, q_start)  # a long request: the other launch's
    pair = tl.arange(0, BLOCK_M)
    row = q_start + q_tile * BLOCK_Q + pair // GROUP
    head = kv_head * GROUP + pair % GROUP
    row_ok = (pair < BLOCK_Q * GROUP) & (row < q_end)
    return req, row, head, row_ok


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # Triton's interpreter multiplies bf16 operands as raw 16-bit integers; there (UPCAST), multiply their exact fp32
    # values instead, which is what the GPU's bf16 MMA with fp32 accumulation computes.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


# Batch-dependent integers are not specialised (Triton would compile a variant per value class: == 1,
# divisible by 16, other), so a new batch shape never compiles a kernel inside a serving step.
@triton.jit(do_not_specialize=["num_tokens", "num_q_tiles", "small_q", "stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, arrivals_ptr,
    block_tables_ptr, query_start_loc_ptr, positions_ptr, tile_map_ptr, sinks_ptr,
    qk_scale, num_tokens, num_q_tiles, small_q,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, MAP: tl.constexpr,
    NUM_SPLITS: tl.constexpr, WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, FUSED_MERGE: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # programmatic dependent launch (kernels/pdl.py): nothing is touched before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req, row, head, row_ok = _tile_rows(query_start_loc_ptr, tile_map_ptr, tl.program_id(0), num_q_tiles, small_q,
                                        kv_head, GROUP, BLOCK_M, BLOCK_Q, MAP)
    pos = tl.load(positions_ptr + row, mask=row_ok, other=-1).to(tl.int32)  # [BLOCK_M]
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]

    kv_len = tl.max(pos, axis=0) + 1  # keys .. largest position in the tile; 0 for an empty tile
    if WINDOW > 0:
        # Keys below the lowest row's window are never read: a local layer's cost is its window, not the context.
        lowest = tl.min(tl.where(row_ok, pos, kv_len), axis=0)
        kv_start = tl.maximum(lowest - WINDOW + 1, 0)
    else:
        kv_start = 0
    if NUM_SPLITS == 1:
        lo = kv_start
        hi = kv_len
    else:
        chunk = tl.cdiv(kv_len - kv_start, NUM_SPLITS * BLOCK_N) * BLOCK_N
        lo = kv_start + split * chunk
        hi = tl.minimum(lo + chunk, kv_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    block_table = block_tables_ptr + req * stride_bt
    # Each tile's block numbers are loaded one iteration ahead, so that the cache loads of a tile never wait on
    # their block-table load: one global-memory latency per tile instead of two dependent ones.
    offs_n = tl.arange(0, BLOCK_N)
    block = tl.load(block_table + (lo + offs_n) // PAGE_SIZE, mask=lo + offs_n < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        key = start + offs_n
        key_ok = key < hi
        page = block.to(tl.int64)
        in_page = key % PAGE_SIZE
        k = tl.load(k_cache_ptr + (page * stride_kb + in_page * stride_ks + kv_head * stride_kh)[:, None] + d[None, :],
                    mask=key_ok[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
        v = tl.load(v_cache_ptr + (page * stride_vb + in_page * stride_vs + kv_head * stride_vh)[:, None] + d[None, :],
                    mask=key_ok[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
        block = tl.load(block_table + (key + BLOCK_N) // PAGE_SIZE, mask=key + BLOCK_N < hi, other=0)

        s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = (key[None, :] <= pos[:, None]) & key_ok[None, :]
        if WINDOW > 0:
            visible &= key[None, :] > pos[:, None] - WINDOW
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A pair may see no key of this tile (its position is below the tile): keep exp2 away from -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = _normalise(acc, m_i, l_i, sinks_ptr, head, row_ok, HAS_SINKS)
        tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = (split * num_tokens + row) * NUM_HEADS + head  # [BLOCK_M] index into [splits, tokens, heads]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        if FUSED_MERGE:
            # The last of the tile's splits to arrive merges them all: no second kernel. Every thread's stores
            # are done (barrier) before the counter's release; the last arrival acquires them, reads the
            # partials past its own L1, and leaves the counter at zero for the next call (a graph replays it).
            tl.debug_barrier()
            arrival = arrivals_ptr + tl.program_id(0) * tl.num_programs(1) + kv_head
            if tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
                tl.debug_barrier()
                _merge_partials(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, sinks_ptr, row, head, row_ok,
                                num_tokens, stride_ot, stride_oh, NUM_HEADS, HEAD_DIM, BLOCK_M, NUM_SPLITS, HAS_SINKS,
                                ".cg")
                tl.atomic_xchg(arrival, 0, sem="relaxed", scope="gpu")


@triton.jit
def _normalise(acc, m_i, l_i, sinks_ptr, head, row_ok, HAS_SINKS: tl.constexpr):
    # acc [BLOCK_M, HEAD_DIM] / the softmax's denominator. A sink is one more logit of the row, without a value:
    # it adds exp(sink - max) to the denominator; sinks are natural logits, the running max is in log2 units.
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * _LOG2E_JIT
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)  # a row that saw no key: only the sink, out 0
        l_i = l_i + tl.exp2(sink - m_safe)
    return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]


@triton.jit
def _merge_partials(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, sinks_ptr, row, head, row_ok, num_tokens,
                    stride_ot, stride_oh, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr, CACHE: tl.constexpr):
    # The splits' (acc, running max, running sum) of the (row, head) pairs, combined and normalised into out.
    d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for split in tl.static_range(NUM_SPLITS):  # unrolled: all partial loads are issued at once
        part = (split * num_tokens + row) * NUM_HEADS + head
        m_s = tl.load(part_max_ptr + part, mask=row_ok, other=float("-inf"), cache_modifier=CACHE)
        l_s = tl.load(part_sum_ptr + part, mask=row_ok, other=0.0, cache_modifier=CACHE)
        acc_s = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0,
                        cache_modifier=CACHE)
        m_new = tl.maximum(m_i, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split past the context saw no key
        alpha = tl.exp2(m_i - m_safe)
        beta = tl.exp2(m_s - m_safe)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m_i = m_new
    out = _normalise(acc, m_i, l_i, sinks_ptr, head, row_ok, HAS_SINKS)
    tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_tokens", "num_q_tiles", "small_q"])
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, query_start_loc_ptr, tile_map_ptr, sinks_ptr,
    num_tokens, num_q_tiles, small_q, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, MAP: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Same tiling as the attention kernel, so exactly the rows of requests are read and written.
    if USE_PDL:  # programmatic dependent launch (kernels/pdl.py): nothing is touched before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    req, row, head, row_ok = _tile_rows(query_start_loc_ptr, tile_map_ptr, tl.program_id(0), num_q_tiles, small_q,
                                        tl.program_id(1), GROUP, BLOCK_M, BLOCK_Q, MAP)
    _merge_partials(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, sinks_ptr, row, head, row_ok, num_tokens,
                    stride_ot, stride_oh, NUM_HEADS, HEAD_DIM, BLOCK_M, NUM_SPLITS, HAS_SINKS, "")


def _check_args(q, k_cache, v_cache, block_tables, query_start_loc, positions, max_query_len, window, sinks):
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [T, Hq, D] and caches [num_blocks, block_size, Hkv, D]; got q {tuple(q.shape)}, "
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"q has {num_heads} heads of dim {head_dim}, cache has {num_kv_heads} heads of dim {k_cache.shape[3]}: "
            "head dims must match and num_heads must be a multiple of num_kv_heads"
        )
    if block_tables.dim() != 2 or query_start_loc.shape != (block_tables.shape[0] + 1,):
        raise ValueError(
            f"need block_tables [B, max_blocks] and query_start_loc [B + 1]; got {tuple(block_tables.shape)} and "
            f"{tuple(query_start_loc.shape)}"
        )
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions must be [{q.shape[0]}], got {tuple(positions.shape)}")
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: full attention), got {window!r}")
    if sinks is not None and (sinks.shape != (num_heads,) or not sinks.is_floating_point()
                              or sinks.device != q.device or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be a contiguous float tensor [{num_heads}] on {q.device}, got "
                         f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")


def query_tile(max_query_len: int, group: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): (query, head) pairs and query rows per program; see the module docstring."""
    max_m = 128 if head_dim <= 64 else 64 if head_dim <= 128 else 32
    block_m = max(16, triton.next_power_of_2(group), min(max_m, triton.next_power_of_2(max_query_len * group)))
    return block_m, block_m // group


def kv_tile(head_dim: int, num_splits: int) -> dict[str, int]:
    """KV tile and pipelining, measured on an H200 with the testbed's shape (head_dim 64): 128-key tiles with three
    stages were fastest or within 5% everywhere (decode at batch 64 over 1K tokens: 21 us, against 32 us with
    64-key tiles and two stages). head_dim 128 keeps 64-key tiles to bound shared memory and registers; the wide heads
    of Gemma (256, and Gemma 4's 512-wide global heads) take 32-key tiles in two stages, which keeps a tile's keys and
    values (and the 32-row query tile) within a Hopper SM's 228 KB of shared memory (not yet timed)."""
    if head_dim > 128:
        return {"BLOCK_N": 32, "num_stages": 2}
    return {"BLOCK_N": 128 if head_dim <= 64 else 64, "num_stages": 3}


# Whether split-KV calls merge their splits inside the attention kernel (one launch) rather than in a second kernel.
# On: faster decode and admitting steps, P-EAGLE's rounds unchanged (docs/DECISIONS.md; scripts/device/
# engine_timing.py "+fused-merge" times it). The GPU tests check both. The default of calls that do not say; the
# engine says, from EngineConfig.fused_merge.
FUSED_MERGE = True
# Whether a mixed step (a `small_query_len` given, and longer requests present) tiles its short and long requests in
# two launches (`paged_attention`). On: a step that admits a prompt among many decodes takes less GPU time, steps
# without prompts are unchanged (docs/DECISIONS.md; scripts/device/engine_timing.py "+mixed-tiles" times it). The
# default of calls that do not say; the engine says, from EngineConfig.mixed_tiles.
MIXED_TILES = True
_ARRIVALS_MIN = 1 << 16
_arrivals_buffers: dict[str, list[torch.Tensor]] = {}  # per device, every buffer made (graphs keep pointers to them)


def _arrivals(device: torch.device, needed: int) -> torch.Tensor | None:
    """A zeroed int32 counter per (query tile, KV head) of a call: each split's program adds one when its partial is
    written, and the last to arrive merges the partials and sets the counter back to zero, so the buffer is zero
    between calls and one buffer per device serves every call made on one stream at a time, CUDA-graph replays
    included. Allocated (or grown) outside graph capture only, and never freed (a captured graph keeps its
    pointer); a call captured before there is room merges in the second kernel instead (None)."""
    made = _arrivals_buffers.setdefault(str(device), [])
    if not made or made[-1].numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        made.append(torch.zeros(max(_ARRIVALS_MIN, needed), dtype=torch.int32, device=device))
    return made[-1]


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(device: torch.device, num_programs: int, max_query_len: int) -> int:
    """Split the context into a power of two of chunks, at most 8, to reach about four waves of programs for
    decode (one query row per tile: little compute to hide memory latency) and two for multi-row tiles. On an H200
    (3 KV heads, 1-2K tokens) this picked the fastest split count, or one within 2%, from batch 1 to batch 64 for
    decode, verify (8 rows) and draft (16 rows) batches; prefills of 2K tokens stay unsplit."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    waves = 4 if max_query_len == 1 else 2
    splits = min(_MAX_SPLITS, (waves * sms) // num_programs)
    return 1 << (splits.bit_length() - 1) if splits > 1 else 1


def mixed_tile_map(query_start_loc: torch.Tensor, small_q: int, block_q: int, num_tiles: int) -> torch.Tensor:
    """[num_tiles, 2] int32 (request, query tile) of the requests of more than `small_q` rows, `block_q` rows a
    tile, each request's last tile first (a causal prefill's longest); rows past the last tile are (-1, 0). Built
    on the device from `query_start_loc` (a few small ops, captured with the step in a CUDA graph)."""
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    tiles = torch.where(q_lens > small_q, (q_lens + block_q - 1) // block_q, 0)
    ends = tiles.cumsum(0)
    p = torch.arange(num_tiles, device=query_start_loc.device)
    req = torch.searchsorted(ends, p, right=True)
    valid = req < len(q_lens)
    r = req.clamp(max=max(len(q_lens) - 1, 0))
    q_tile = ends[r] - 1 - p  # the request's tiles from its last down to 0
    return torch.stack([torch.where(valid, req, -1), torch.where(valid, q_tile, 0)], 1).to(torch.int32)


def mixed_tiles_bound(num_tokens: int, num_requests: int, small_q: int, block_q: int) -> int:
    """The most tiles the requests of more than `small_q` rows can need among `num_tokens` rows: one per `block_q`
    rows plus a partial tile for each such request."""
    return triton.cdiv(num_tokens, block_q) + min(num_requests, num_tokens // (small_q + 1))


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_requests, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_requests + 1] int32
    positions: torch.Tensor,  # [num_tokens] int32/int64
    scale: float,
    max_query_len: int,
    *,
    num_splits: int | None = None,
    fused_merge: bool | None = None,
    small_query_len: int | None = None,
    mixed_tiles: bool | None = None,
    tile_maps: dict | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,  # [num_heads], any float dtype
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Triton paged attention; see the module docstring (`window` and `sinks` too). `num_splits` overrides the
    split-KV heuristic; `fused_merge` (default FUSED_MERGE) merges the splits in the attention kernel itself (see
    `_arrivals`).

    `small_query_len`: in a mixed step, the most rows a decoding request feeds (K + 1). With `mixed_tiles` (default
    MIXED_TILES) and longer requests present, two launches: the requests of at most that many rows in one small tile
    each, and the longer ones (prompts, chunks) in tiles of `max_query_len`'s size listed by `mixed_tile_map`,
    instead of every request in `max_query_len`'s tiles (64 decodes of 8 rows beside one prompt in a 640-token
    bucket: 16 tiles of 128 pairs each, 15 of them empty, against one of 32 pairs). `tile_maps`: a dict that keeps
    the tile map between calls on the same batch (the layers of one forward)."""
    _check_args(q, k_cache, v_cache, block_tables, query_start_loc, positions, max_query_len, window, sinks)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim >= 16, got {head_dim}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride {t.stride(-1)})")
    if small_query_len is not None and small_query_len < 1:
        raise ValueError(f"small_query_len must be >= 1, got {small_query_len}")
    out = torch.empty_like(q)
    num_requests = block_tables.shape[0]
    if num_tokens == 0 or num_requests == 0:
        return out
    group = num_heads // num_kv_heads
    fused = FUSED_MERGE if fused_merge is None else fused_merge
    launch = functools.partial(_launch, q, k_cache, v_cache, out, block_tables, query_start_loc, positions, scale,
                               group=group, num_splits=num_splits, fused_merge=fused, window=window, sinks=sinks)
    mixed = small_query_len is not None and (MIXED_TILES if mixed_tiles is None else mixed_tiles)
    if mixed:
        # Short: the rows one small tile holds (at least small_query_len, unless the tile's pair cap binds: then the
        # requests between go to the long launch). Every request that short: one launch as usual.
        small_m, small_q = query_tile(small_query_len, group, head_dim)
        mixed = small_q < max_query_len
    if not mixed:
        block_m, block_q = query_tile(max_query_len, group, head_dim)
        num_q_tiles = triton.cdiv(max_query_len, block_q)
        launch(num_requests * num_q_tiles, block_m, block_q, max_query_len, num_q_tiles=num_q_tiles)
        return out
    launch(num_requests, small_m, small_q, small_q, map_mode=1, small_q=small_q)
    block_m, block_q = query_tile(max_query_len, group, head_dim)
    bound = mixed_tiles_bound(num_tokens, num_requests, small_q, block_q)
    key = (small_q, block_q, bound)
    tile_map = None if tile_maps is None else tile_maps.get(key)
    if tile_map is None:
        tile_map = mixed_tile_map(query_start_loc, small_q, block_q, bound)
        if tile_maps is not None:
            tile_maps[key] = tile_map
    launch(bound, block_m, block_q, max_query_len, map_mode=2, small_q=small_q, tile_map=tile_map)
    return out


def _launch(q, k_cache, v_cache, out, block_tables, query_start_loc, positions, scale, num_programs, block_m,
            block_q, max_query_len, *, group, num_splits, fused_merge, window, sinks, num_q_tiles=1, map_mode=0,
            small_q=0, tile_map=None):
    """One attention launch over `num_programs` query tiles (`_tile_rows`' MAP `map_mode`), and the merge of its
    KV splits where they are merged by a second kernel."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    splits = num_splits
    if splits is None:
        splits = default_num_splits(q.device, num_programs * num_kv_heads, max_query_len)
        if window:  # a tile sees at most window + block_q - 1 keys: no more splits than their KV tiles
            splits = min(splits, triton.cdiv(window + block_q - 1, kv_tile(head_dim, 1)["BLOCK_N"]))
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")
    kv = kv_tile(head_dim, splits)
    arrivals = None
    if splits > 1:
        part_acc = torch.empty((splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device)
        part_max = torch.empty((splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        if fused_merge:
            arrivals = _arrivals(q.device, num_programs * num_kv_heads)
    else:  # unused by the single-pass kernel
        part_acc = part_max = part_sum = out
    tile_map = query_start_loc if tile_map is None else tile_map  # unread unless map_mode == 2
    sinks_arg = out if sinks is None else sinks  # unread without sinks
    consts = dict(NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_Q=block_q,
                  MAP=map_mode, NUM_SPLITS=splits, HAS_SINKS=sinks is not None)
    _paged_attention_kernel[(num_programs, num_kv_heads, splits)](
        q, k_cache, v_cache, out, part_acc, part_max, part_sum, out if arrivals is None else arrivals,
        block_tables, query_start_loc, positions, tile_map, sinks_arg,
        scale * _LOG2E, num_tokens, num_q_tiles, small_q,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        PAGE_SIZE=k_cache.shape[1], BLOCK_N=kv["BLOCK_N"], WINDOW=window,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DOT_UPCAST=q.device.type != "cuda",
        num_warps=8 if block_m > 64 or head_dim > 128 else 4, num_stages=kv["num_stages"],
        FUSED_MERGE=arrivals is not None,
        **consts, **pdl.options(q.device),
    )
    if splits > 1 and arrivals is None:
        _merge_splits_kernel[(num_programs, num_kv_heads)](
            out, part_acc, part_max, part_sum, query_start_loc, tile_map, sinks_arg,
            num_tokens, num_q_tiles, small_q, out.stride(0), out.stride(1),
            num_warps=4, **consts, **pdl.options(q.device),
        )


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_requests, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_requests + 1] int32
    positions: torch.Tensor,  # [num_tokens] int32/int64
    scale: float,
    max_query_len: int,
    window: int = 0,
    sinks: torch.Tensor | None = None,  # [num_heads], any float dtype
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """PyTorch reference of `paged_attention`: one request at a time, fp32 softmax (host-synchronising). Like the
    kernel, it reads no key below the window of a request's lowest row."""
    _check_args(q, k_cache, v_cache, block_tables, query_start_loc, positions, max_query_len, window, sinks)
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    bounds = query_start_loc.tolist()
    for req, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end - start > max_query_len:
            raise ValueError(f"request {req} has {end - start} query rows, more than max_query_len={max_query_len}")
        if end == start:
            continue
        pos = positions[start:end].long()  # [n]
        lowest = max(int(pos.min()) - window + 1, 0) if window else 0
        keys = torch.arange(lowest, int(pos.max()) + 1, device=q.device)  # [kv_len] cache positions
        blocks = block_tables[req, keys // block_size].long()
        k = k_cache[blocks, keys % block_size].repeat_interleave(group, dim=1).float()  # [kv_len, Hq, D]
        v = v_cache[blocks, keys % block_size].repeat_interleave(group, dim=1).float()
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale  # [Hq, n, kv_len]
        hidden = keys[None, :] > pos[:, None]  # [n, kv_len]
        if window:
            hidden |= keys[None, :] <= pos[:, None] - window
        scores = scores.masked_fill(hidden, -math.inf)
        if sinks is not None:  # one more logit per row, its probability dropped: it has no value
            sink = sinks.float()[:, None, None].expand(-1, end - start, 1)  # [Hq, n, 1]
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
