"""The next decode step's inputs from the answer of the step in flight, on the device (async scheduling).

The step in flight answers, per request, a packed row `[output tokens (k_prev + 1, -1 after), num_accepted,
drafts (D)]` (model_runner's layout). Before the host has seen it, the next step feeds each request its NEXT token
(the output token at index num_accepted) and its first k drafts, at positions `base + num_accepted + 0..k`, where
`base` is the request's token count when the step in flight was launched (its fed span ended there, and the
accepted drafts plus the next token follow it). Slots come from the request's block table, which the host has grown
for the most tokens the answer can add.

Row r of the next batch reads packed row `src[r]`; `src[r] = -1` is bucket padding: input ids 0, positions 0..k,
slots in the scratch block (as model_runner pads a graph bucket).

Worked example: block_size 4, k_prev = k = 2, packed (width 3 + 1 + 2) and one padding row, scratch block 7:

    packed [[11, 12, 40, 2, 50, 51],      src  [1, 0, -1]     block_tables [[3, 5, 1], [2, 6, 4], [7, 7, 7]]
            [30, -1, -1, 0, 31, 32]]      base [6, 5, 0]

    Row 0 is packed row 1 (no draft accepted: next token 30, drafts 31, 32) at positions 6..8;
    row 1 is packed row 0 (both accepted: next token 40, drafts 50, 51) at positions 7..9.

    input_ids    [30, 31, 32,  40, 50, 51,   0,  0,  0]
    positions    [ 6,  7,  8,   7,  8,  9,   0,  1,  2]
    slot_mapping [22, 23,  4,  27, 16, 17,  28, 29, 30]
    drafts [[31, 32], [50, 51], [0, 0]]    num_drafts [2, 2, 2]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def advance_decode_inputs_ref(
    packed: torch.Tensor,  # [B_prev, (k_prev + 1) + 1 + D] int64 answer of the step in flight
    src: torch.Tensor,  # [B] int64 packed row of each request, -1 = padding
    base: torch.Tensor,  # [B] int64 token count of each request when the step in flight was launched
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    k_prev: int,
    k: int,  # drafts fed per request, <= D
    block_size: int,
    scratch_block: int,
    out: dict[str, torch.Tensor],  # input_ids, positions, slot_mapping [B * (k + 1)]; drafts [B, k]; num_drafts [B]
) -> None:
    b = src.shape[0]
    real = src >= 0
    rows = packed.index_select(0, src.clamp(min=0))  # [B, W]
    num_accepted = rows[:, k_prev + 1]
    next_token = rows.gather(1, num_accepted[:, None]).squeeze(1)
    drafts = rows[:, k_prev + 2:k_prev + 2 + k]
    j = torch.arange(k + 1, device=src.device)
    ids = torch.cat([next_token[:, None], drafts], dim=1)
    pos = torch.where(real[:, None], (base + num_accepted)[:, None] + j, j.expand(b, -1))
    block = block_tables.gather(1, (pos // block_size).clamp(max=block_tables.shape[1] - 1)).long()
    scratch = scratch_block * block_size + j % block_size
    slot = torch.where(real[:, None], block * block_size + pos % block_size, scratch)
    out["input_ids"].copy_(torch.where(real[:, None], ids, 0).reshape(-1))
    out["positions"].copy_(pos.reshape(-1))
    out["slot_mapping"].copy_(slot.reshape(-1))
    out["drafts"].copy_(torch.where(real[:, None], drafts, 0))
    out["num_drafts"].fill_(k)


@triton.jit(do_not_specialize=["stride_packed", "stride_bt", "k_prev", "scratch_block"])
def _advance_kernel(
    packed_ptr, src_ptr, base_ptr, tables_ptr, ids_ptr, pos_ptr, slot_ptr, drafts_ptr, num_drafts_ptr,
    stride_packed, stride_bt, k_prev, block_size, scratch_block,
    K: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    row_ok = j <= K
    src = tl.load(src_ptr + r)
    real = src >= 0
    row = packed_ptr + tl.maximum(src, 0) * stride_packed
    num_accepted = tl.load(row + k_prev + 1)
    next_token = tl.load(row + num_accepted)
    draft = tl.load(row + k_prev + 1 + j, mask=(j >= 1) & row_ok, other=0)  # draft j - 1 sits at k_prev + 1 + j
    ids = tl.where(j == 0, next_token, draft)
    start = tl.load(base_ptr + r) + num_accepted
    pos = tl.where(real, start + j, j)
    block = tl.load(tables_ptr + r * stride_bt + pos // block_size, mask=row_ok, other=0)  # padding: positions 0..K
    slot = tl.where(real, block.to(tl.int64) * block_size + pos % block_size,
                    scratch_block.to(tl.int64) * block_size + j % block_size)
    out = r * (K + 1) + j
    tl.store(ids_ptr + out, tl.where(real, ids, 0), mask=row_ok)
    tl.store(pos_ptr + out, pos, mask=row_ok)
    tl.store(slot_ptr + out, slot, mask=row_ok)
    tl.store(drafts_ptr + r * K + j - 1, tl.where(real, draft, 0), mask=(j >= 1) & row_ok)
    tl.store(num_drafts_ptr + r, K)


def advance_decode_inputs(packed, src, base, block_tables, k_prev: int, k: int, block_size: int,
                          scratch_block: int, out: dict[str, torch.Tensor]) -> None:
    """Triton version of `advance_decode_inputs_ref`: one program per request of the next batch."""
    b = src.shape[0]
    assert packed.is_contiguous() or packed.stride(1) == 1, "packed rows must be contiguous"
    assert k + k_prev + 2 <= packed.shape[1], (packed.shape, k_prev, k)
    assert all(out[name].is_contiguous() for name in ("input_ids", "positions", "slot_mapping", "drafts"))
    _advance_kernel[(b,)](
        packed, src, base, block_tables, out["input_ids"], out["positions"], out["slot_mapping"], out["drafts"],
        out["num_drafts"], packed.stride(0), block_tables.stride(0), k_prev, block_size, scratch_block,
        K=k, BLOCK=triton.next_power_of_2(k + 1),
    )


def compact_decode_inputs(
    packed: torch.Tensor,  # [B_prev, (k_prev + 1) + 1 + D ...] int64 answer of the step in flight
    src: torch.Tensor,  # [B] int64 packed row of each request, -1 = padding (after the real ones)
    base: torch.Tensor,  # [B] int64 token count of each request when the step in flight was launched
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    k_prev: int,
    k: int,  # drafts verified per request at most, <= D
    block_size: int,
    scratch_block: int,
    row_start: int,  # the step's row where these requests' rows begin (prompts admitted beside them come first)
    out: dict[str, torch.Tensor],
) -> None:
    """`advance_decode_inputs` for drafts cut by confidence: each request feeds its next token and only the drafts
    it holds (the first k of its drafts up to the first PAD_DRAFT, which spec/confidence.py writes), its rows packed
    one after another. In PyTorch (a few small launches, no host synchronisation; captured nowhere).

    `out` holds views of the step's buffers: input_ids, positions, slot_mapping [R] (the step's rows from row_start
    on: R rows for these requests, the rest padding), query_start_loc [B + 1] (its first entry, row_start, is the
    caller's; the rest are written), logit_rows [B, k + 1] (the step's row indices: request b's row after its j-th
    draft, its last row repeated past its drafts), drafts [B, k] and num_drafts [B] (the drafts it verifies).

    When the requests' rows would not fit R, every request is cut to the same most drafts c, the largest that fits
    (the deepest drafts go first: the least likely to be accepted); that depends on the drafter's output and R
    alone, never on the target's, so it is lossless too. Padding rows (after the last request's) belong to no
    request and write the scratch block; padding requests (src -1) get no rows.

    Worked example: block_size 4, k_prev = k = 2, R = 5, row_start 0, packed (width 3 + 1 + 2), scratch block 7:

        packed [[11, 12, 40, 2, 50, 51],      src  [1, 0]      base [6, 5]
                [30, -1, -1, 0, 31, -1]]      block_tables [[3, 5, 1], [2, 6, 4]]

        Row 0 is packed row 1 (one draft held: 31), row 1 packed row 0 (two held: 50, 51). 2 + 3 rows fit R = 5.

        input_ids [30, 31, 40, 50, 51]   positions [6, 7, 7, 8, 9]   slot_mapping [22, 23, 27, 16, 17]
        query_start_loc [0, 2, 5]   logit_rows [[0, 1, 1], [2, 3, 4]]   drafts [[31, 0], [50, 51]]
        num_drafts [1, 2]

    With R = 4, the two requests are cut to one draft each: rows [30, 31, 40, 50], num_drafts [1, 1].
    """
    b = src.shape[0]
    rows_out = out["input_ids"].shape[0]
    dev = src.device
    real = src >= 0
    rows = packed.index_select(0, src.clamp(min=0))  # [B, W]
    num_accepted = rows[:, k_prev + 1]
    next_token = rows.gather(1, num_accepted[:, None]).squeeze(1)
    drafts = rows[:, k_prev + 2:k_prev + 2 + k]  # [B, k]
    held = (drafts >= 0).long().cumprod(dim=1).sum(dim=1) * real
    c = torch.arange(k + 1, device=dev)
    need = (real[:, None] * (1 + held[:, None].clamp(max=c[None, :]))).sum(dim=0)  # [k + 1] rows at most c drafts
    cap = ((need <= rows_out).sum() - 1).clamp(min=0)  # the caller's R holds every request's first row
    n = torch.minimum(held, cap)
    lens = real * (1 + n)
    ends = row_start + lens.cumsum(0)  # [B]
    starts = ends - lens
    t = row_start + torch.arange(rows_out, device=dev)
    req = torch.searchsorted(ends, t, right=True).clamp(max=b - 1)  # each row's request (any, for padding rows)
    used = t < ends[-1]
    j = t - starts[req]
    ids = torch.where(j == 0, next_token[req], drafts[req, (j - 1).clamp(min=0, max=max(k - 1, 0))] if k else 0)
    pos_real = base[req] + num_accepted[req] + j
    pad_pos = (t - ends[-1]) % block_size
    pos = torch.where(used, pos_real, pad_pos)
    block = block_tables[req, (pos_real // block_size).clamp(max=block_tables.shape[1] - 1)].long()
    slot = torch.where(used, block * block_size + pos_real % block_size, scratch_block * block_size + pad_pos)
    jj = torch.arange(k + 1, device=dev)
    last = (ends[-1] - 1).clamp(min=0)
    logit_rows = torch.where(real[:, None], starts[:, None] + torch.minimum(jj[None, :], n[:, None]), last)
    out["input_ids"].copy_(torch.where(used, ids, 0))
    out["positions"].copy_(pos)
    out["slot_mapping"].copy_(slot)
    out["query_start_loc"][1:].copy_(ends)
    out["logit_rows"].copy_(logit_rows)
    out["drafts"].copy_(torch.where(jj[None, :k] < n[:, None], drafts, 0))
    out["num_drafts"].copy_(n)
