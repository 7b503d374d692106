"""Expanding a verified target batch into the P-EAGLE draft batch, on the GPU in one launch.

Vocabulary (as in the verifier): after verification request b has `valid_b = n_b - num_rejected[b]` valid target
rows (the rest are drafts the verifier rejected) and one `next_token_ids[b]` sampled after its last valid row (the
bonus token when every draft was accepted, else the recovered token). The draft batch gives every request its n_b
target rows followed by M = num_mask_slots MASK rows (M = K - 1 for P-EAGLE, 0 for EAGLE-3's first pass), so it has
R = T + B * M rows and request b occupies rows `[qsl[b] + b*M, qsl[b+1] + (b+1)*M)`. For row j of request b:

| rows             | input_ids               | positions                 | slot_mapping          | hidden_index |
|------------------|-------------------------|---------------------------|-----------------------|--------------|
| j < valid_b - 1  | target id of row j + 1  | target position of row j  | target slot of row j  | qsl[b] + j   |
| j == valid_b - 1 | next_token_ids[b]       | target position of row j  | target slot of row j  | qsl[b] + j   |
| valid_b <= j < n | mask_token_id (ignored) | target position of row j  | -1 (writes no KV)     | qsl[b] + j   |
| MASK row m       | mask_token_id           | last valid position+1+m   | slot of that position | -1           |

`hidden_index` says where a row's feature comes from: a target row, or `mask_hidden` for -1
(`gather_draft_features`). `sample_rows[b]` lists the K = M + 1 rows whose outputs are the drafts: the last valid
row, then the MASK rows. Requests with n_b == 0 (padding of a CUDA-graph bucket) still get their M MASK rows, at
positions 0..M-1 with slot -1 and seq_len 0; their sample rows are in range but meaningless (their own first row,
clamped to R - 1): discard their drafts. Target rows past `qsl[B]` (bucket padding) become rows past the draft
batch's `qsl[B]` with mask_token_id, position 0, slot -1 and hidden_index -1.

Worked example: block_size 4, M = 2, mask_token_id 9, three requests and one padding row (T = 6).

    target_input_ids    [100, 101, 102, 300, 301, 0]     query_start_loc [0, 3, 5, 5]
    target_positions    [  5,   6,   7,   0,   1, 0]     num_rejected    [1, 0, 0]
    target_slot_mapping [ 13,  14,  15,   4,   5, -1]    next_token_ids  [200, 400, 0]
    block_tables [[2, 3, 5], [1, 4, 0], [0, 0, 0]]

    Request 0 verified 3 rows and rejected the last (valid 2); request 1 is a prefill of 2 rows; request 2 is padding.

    input_ids    [101, 200,  9,  9,  9,   301, 400, 9, 9,   9,  9,   9]
    positions    [  5,   6,  7,  7,  8,     0,   1, 2, 3,   0,  1,   0]
    slot_mapping [ 13,  14, -1, 15, 20,     4,   5, 6, 7,  -1, -1,  -1]
    hidden_index [  0,   1,  2, -1, -1,     3,   4,-1,-1,  -1, -1,  -1]
    query_start_loc [0, 5, 9, 11]    seq_lens [9, 4, 0]    sample_rows [[1, 3, 4], [6, 7, 8], [9, 9, 10]]

The first MASK row of request 0 reuses position 7 of the rejected row: attention is causal by position, and the
rejected row writes no KV, so the MASK row's own key at position 7 is the one both see.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from peagle.kernels.kv_cache import PADDING_SLOT_ID


class DraftBatch(NamedTuple):
    input_ids: torch.Tensor  # [R] dtype of target_input_ids
    positions: torch.Tensor  # [R] dtype of target_positions
    slot_mapping: torch.Tensor  # [R] dtype of target_slot_mapping, -1 = write no KV
    hidden_index: torch.Tensor  # [R] int64, target row of the feature or -1 for mask_hidden
    query_start_loc: torch.Tensor  # [B + 1] dtype of query_start_loc
    seq_lens: torch.Tensor  # [B] int32, last MASK position + 1 (last valid position + 1 when M = 0); 0 if empty
    sample_rows: torch.Tensor  # [B, M + 1] int64, rows whose outputs are the K drafts


# Batch-dependent integers are not specialised: no new compile when the batch size changes.
@triton.jit(do_not_specialize=["num_requests", "num_target_rows", "stride_bt"])
def _expand_draft_batch_kernel(
    target_ids_ptr, target_pos_ptr, target_slot_ptr, qsl_ptr, num_rejected_ptr, next_ids_ptr, block_tables_ptr,
    ids_ptr, pos_ptr, slot_ptr, hidden_index_ptr, draft_qsl_ptr, seq_lens_ptr, sample_rows_ptr,
    num_requests, num_target_rows, stride_bt, block_size, mask_token_id,
    M: tl.constexpr, M_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    # Program b < B builds request b; program B fills the bucket padding past the last request.
    req = tl.program_id(0)
    rows = tl.arange(0, BLOCK)
    if req == num_requests:
        start = tl.load(qsl_ptr + num_requests)
        out_start = start + num_requests * M
        tl.store(draft_qsl_ptr + num_requests, out_start)
        for j0 in range(start, num_target_rows, BLOCK):
            j = j0 + rows
            ok = j < num_target_rows
            dst = j + num_requests * M
            tl.store(ids_ptr + dst, tl.full([BLOCK], mask_token_id, tl.int64), mask=ok)
            tl.store(pos_ptr + dst, tl.zeros([BLOCK], tl.int64), mask=ok)
            tl.store(slot_ptr + dst, tl.full([BLOCK], -1, tl.int64), mask=ok)
            tl.store(hidden_index_ptr + dst, tl.full([BLOCK], -1, tl.int64), mask=ok)
    else:
        start = tl.load(qsl_ptr + req)
        n = tl.load(qsl_ptr + req + 1) - start
        valid = n - tl.load(num_rejected_ptr + req)
        next_id = tl.load(next_ids_ptr + req)
        out_start = start + req * M
        tl.store(draft_qsl_ptr + req, out_start)

        # Target rows: shifted ids, the next token at the last valid row, no KV for rejected rows.
        for j0 in range(0, n, BLOCK):
            j = j0 + rows
            ok = j < n
            shifted = tl.load(target_ids_ptr + start + j + 1, mask=ok & (j < valid - 1), other=mask_token_id)
            ids = tl.where(j == valid - 1, next_id, shifted)
            slot = tl.load(target_slot_ptr + start + j, mask=ok & (j < valid), other=-1)
            tl.store(ids_ptr + out_start + j, ids, mask=ok)
            tl.store(pos_ptr + out_start + j, tl.load(target_pos_ptr + start + j, mask=ok), mask=ok)
            tl.store(slot_ptr + out_start + j, slot, mask=ok)
            tl.store(hidden_index_ptr + out_start + j, (start + j).to(tl.int64), mask=ok)

        # MASK rows continue the positions after the last valid row; an empty request gets positions 0..M-1.
        has_valid = valid > 0
        last = tl.maximum(start + valid - 1, 0)
        last_pos = tl.where(has_valid, tl.load(target_pos_ptr + last).to(tl.int64), -1)
        m = tl.arange(0, M_PAD)
        m_ok = m < M
        mask_pos = last_pos + 1 + m
        # The scalar condition goes through tl.where: Triton's interpreter mis-types `tensor & scalar` masks.
        block = tl.load(block_tables_ptr + req * stride_bt + mask_pos // block_size,
                        mask=tl.where(has_valid, m_ok, False), other=0)
        mask_slot = tl.where(has_valid, block.to(tl.int64) * block_size + mask_pos % block_size, -1)
        mask_rows = out_start + n + m
        tl.store(ids_ptr + mask_rows, tl.full([M_PAD], mask_token_id, tl.int64), mask=m_ok)
        tl.store(pos_ptr + mask_rows, mask_pos, mask=m_ok)
        tl.store(slot_ptr + mask_rows, mask_slot, mask=m_ok)
        tl.store(hidden_index_ptr + mask_rows, tl.full([M_PAD], -1, tl.int64), mask=m_ok)

        tl.store(seq_lens_ptr + req, tl.where(has_valid, last_pos + 1 + M, 0).to(tl.int32))
        num_rows = num_target_rows + num_requests * M
        first = tl.minimum(out_start + tl.maximum(valid - 1, 0), num_rows - 1)
        tl.store(sample_rows_ptr + req * (M + 1), first.to(tl.int64))
        tl.store(sample_rows_ptr + req * (M + 1) + 1 + m, mask_rows.to(tl.int64), mask=m_ok)


def _check_args(target_input_ids, target_positions, target_slot_mapping, query_start_loc, num_rejected,
                next_token_ids, block_tables, num_mask_slots):
    num_tokens = target_input_ids.shape[0]
    if num_tokens == 0:
        raise ValueError("the target batch is empty: a draft batch needs at least one target row")
    if target_positions.shape != (num_tokens,) or target_slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"target_positions and target_slot_mapping must be [{num_tokens}], got "
            f"{tuple(target_positions.shape)} and {tuple(target_slot_mapping.shape)}"
        )
    num_requests = block_tables.shape[0]
    if query_start_loc.shape != (num_requests + 1,) or num_rejected.shape != (num_requests,) \
            or next_token_ids.shape != (num_requests,):
        raise ValueError(
            f"with block_tables for {num_requests} requests, need query_start_loc [{num_requests + 1}], "
            f"num_rejected and next_token_ids [{num_requests}]; got {tuple(query_start_loc.shape)}, "
            f"{tuple(num_rejected.shape)}, {tuple(next_token_ids.shape)}"
        )
    if num_mask_slots < 0:
        raise ValueError(f"num_mask_slots must be >= 0, got {num_mask_slots}")


def _empty_batch(target_input_ids, target_positions, target_slot_mapping, query_start_loc, num_mask_slots):
    num_requests = query_start_loc.shape[0] - 1
    num_rows = target_input_ids.shape[0] + num_requests * num_mask_slots
    device = target_input_ids.device
    return DraftBatch(
        input_ids=torch.empty(num_rows, dtype=target_input_ids.dtype, device=device),
        positions=torch.empty(num_rows, dtype=target_positions.dtype, device=device),
        slot_mapping=torch.empty(num_rows, dtype=target_slot_mapping.dtype, device=device),
        hidden_index=torch.empty(num_rows, dtype=torch.int64, device=device),
        query_start_loc=torch.empty_like(query_start_loc),
        seq_lens=torch.empty(num_requests, dtype=torch.int32, device=device),
        sample_rows=torch.empty((num_requests, num_mask_slots + 1), dtype=torch.int64, device=device),
    )


def expand_draft_batch(
    target_input_ids: torch.Tensor,  # [T]
    target_positions: torch.Tensor,  # [T]
    target_slot_mapping: torch.Tensor,  # [T]
    query_start_loc: torch.Tensor,  # [B + 1] of the target batch
    num_rejected: torch.Tensor,  # [B] trailing target rows that are rejected drafts
    next_token_ids: torch.Tensor,  # [B] token sampled after the last valid row
    block_tables: torch.Tensor,  # [B, max_blocks]
    block_size: int,
    mask_token_id: int,
    num_mask_slots: int,
    padding_slot_id: int = PADDING_SLOT_ID,
) -> DraftBatch:
    """Triton: build the draft batch (see the module docstring) in one launch, without a host sync."""
    _check_args(target_input_ids, target_positions, target_slot_mapping, query_start_loc, num_rejected,
                next_token_ids, block_tables, num_mask_slots)
    if padding_slot_id != PADDING_SLOT_ID:
        raise ValueError(
            f"the kernel marks rejected slots with {PADDING_SLOT_ID}, got padding_slot_id={padding_slot_id}"
        )
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be contiguous in its last dim")
    batch = _empty_batch(target_input_ids, target_positions, target_slot_mapping, query_start_loc, num_mask_slots)
    num_requests = block_tables.shape[0]
    _expand_draft_batch_kernel[(num_requests + 1,)](
        target_input_ids, target_positions, target_slot_mapping, query_start_loc, num_rejected, next_token_ids,
        block_tables, *batch,
        num_requests, target_input_ids.shape[0], block_tables.stride(0), block_size, mask_token_id,
        M=num_mask_slots, M_PAD=max(2, triton.next_power_of_2(num_mask_slots)), BLOCK=256,
        num_warps=2,
    )
    return batch


def expand_draft_batch_ref(
    target_input_ids: torch.Tensor,  # [T]
    target_positions: torch.Tensor,  # [T]
    target_slot_mapping: torch.Tensor,  # [T]
    query_start_loc: torch.Tensor,  # [B + 1] of the target batch
    num_rejected: torch.Tensor,  # [B] trailing target rows that are rejected drafts
    next_token_ids: torch.Tensor,  # [B] token sampled after the last valid row
    block_tables: torch.Tensor,  # [B, max_blocks]
    block_size: int,
    mask_token_id: int,
    num_mask_slots: int,
    padding_slot_id: int = PADDING_SLOT_ID,
) -> DraftBatch:
    """PyTorch reference of `expand_draft_batch`: one request at a time (host-synchronising)."""
    _check_args(target_input_ids, target_positions, target_slot_mapping, query_start_loc, num_rejected,
                next_token_ids, block_tables, num_mask_slots)
    M = num_mask_slots
    device = target_input_ids.device
    out = _empty_batch(target_input_ids, target_positions, target_slot_mapping, query_start_loc, M)
    num_rows = out.input_ids.shape[0]
    qsl = query_start_loc.tolist()
    num_requests = len(qsl) - 1
    for b in range(num_requests):
        start, n = qsl[b], qsl[b + 1] - qsl[b]
        valid = n - int(num_rejected[b])
        if n > 0 and not 1 <= valid <= n:
            raise ValueError(f"request {b} has {n} target rows but num_rejected={int(num_rejected[b])}")
        lo = start + b * M  # first draft row of the request
        out.query_start_loc[b] = lo
        target = slice(start, start + n)
        ids = torch.full((n,), mask_token_id, dtype=target_input_ids.dtype, device=device)
        ids[: valid - 1] = target_input_ids[start + 1 : start + valid]  # EAGLE shift
        if valid > 0:
            ids[valid - 1] = next_token_ids[b]
        slots = target_slot_mapping[target].clone()
        slots[valid:] = padding_slot_id
        out.input_ids[lo : lo + n] = ids
        out.positions[lo : lo + n] = target_positions[target]
        out.slot_mapping[lo : lo + n] = slots
        out.hidden_index[lo : lo + n] = torch.arange(start, start + n, device=device)

        last_pos = int(target_positions[start + valid - 1]) if valid > 0 else -1
        mask_pos = torch.arange(last_pos + 1, last_pos + 1 + M, device=device)
        mask_rows = slice(lo + n, lo + n + M)
        out.input_ids[mask_rows] = mask_token_id
        out.positions[mask_rows] = mask_pos
        if valid > 0:
            blocks = block_tables[b, mask_pos // block_size].long()
            out.slot_mapping[mask_rows] = blocks * block_size + mask_pos % block_size
        else:  # a padding request: its MASK rows write nothing
            out.slot_mapping[mask_rows] = padding_slot_id
        out.hidden_index[mask_rows] = -1
        out.seq_lens[b] = last_pos + 1 + M if valid > 0 else 0
        out.sample_rows[b, 0] = min(lo + max(valid - 1, 0), num_rows - 1)
        out.sample_rows[b, 1:] = torch.arange(lo + n, lo + n + M, device=device)

    tail = slice(qsl[-1] + num_requests * M, num_rows)  # bucket padding past the last request
    out.query_start_loc[num_requests] = tail.start
    out.input_ids[tail] = mask_token_id
    out.positions[tail] = 0
    out.slot_mapping[tail] = padding_slot_id
    out.hidden_index[tail] = -1
    return out


@triton.jit
def _gather_features_kernel(
    aux_ptr, hidden_index_ptr, mask_hidden_ptr, out_ptr,
    num_features, stride_aux, stride_out,
    BLOCK_F: tl.constexpr,
):
    row = tl.program_id(0)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = f < num_features
    src = tl.load(hidden_index_ptr + row).to(tl.int64)
    real = src >= 0
    # Scalar conditions go through tl.where: Triton's interpreter mis-types `tensor & scalar` masks.
    feature = tl.load(aux_ptr + src * stride_aux + f, mask=tl.where(real, f_ok, False), other=0.0)
    mask_hidden = tl.load(mask_hidden_ptr + f, mask=tl.where(real, False, f_ok), other=0.0)
    value = tl.where(real, feature, mask_hidden)
    tl.store(out_ptr + row * stride_out + f, value.to(out_ptr.dtype.element_ty), mask=f_ok)


def _check_gather_args(aux, hidden_index, mask_hidden):
    if aux.dim() != 2 or hidden_index.dim() != 1 or mask_hidden.shape != (aux.shape[1],):
        raise ValueError(
            f"need aux [T, F], hidden_index [R] and mask_hidden [F]; got {tuple(aux.shape)}, "
            f"{tuple(hidden_index.shape)}, {tuple(mask_hidden.shape)}"
        )


def gather_draft_features(
    aux: torch.Tensor,  # [T, F] target features (or fc(features): fc is linear and bias-free)
    hidden_index: torch.Tensor,  # [R] target row or -1
    mask_hidden: torch.Tensor,  # [F]
) -> torch.Tensor:  # [R, F] dtype of aux
    """Triton: row r of the result is aux[hidden_index[r]], or mask_hidden where hidden_index[r] is -1."""
    _check_gather_args(aux, hidden_index, mask_hidden)
    if aux.stride(-1) != 1:
        raise ValueError("aux must be contiguous in its last dim")
    # Cast on the host side of the launch so that rounding is torch's (a no-op when the drafter's dtype matches).
    mask_hidden = mask_hidden.to(aux.dtype).contiguous()
    num_rows, num_features = hidden_index.shape[0], aux.shape[1]
    out = torch.empty((num_rows, num_features), dtype=aux.dtype, device=aux.device)
    if num_rows == 0 or num_features == 0:
        return out
    block_f = min(1024, triton.next_power_of_2(num_features))
    _gather_features_kernel[(num_rows, triton.cdiv(num_features, block_f))](
        aux, hidden_index, mask_hidden, out, num_features, aux.stride(0), out.stride(0),
        BLOCK_F=block_f, num_warps=4,
    )
    return out


def gather_draft_features_ref(
    aux: torch.Tensor,  # [T, F]
    hidden_index: torch.Tensor,  # [R] target row or -1
    mask_hidden: torch.Tensor,  # [F]
) -> torch.Tensor:  # [R, F] dtype of aux
    """PyTorch reference of `gather_draft_features`."""
    _check_gather_args(aux, hidden_index, mask_hidden)
    real = (hidden_index >= 0)[:, None]
    return torch.where(real, aux[hidden_index.clamp(min=0)], mask_hidden.to(aux.dtype))
