"""Writing new keys and values into the paged KV cache.

The cache of one layer is a pair of tensors `[num_blocks, block_size, num_kv_heads, head_dim]`. A token's slot is
`block * block_size + offset`; the model runner computes it from the block table. Slot -1 (PADDING_SLOT_ID) marks
a row that must write nothing: padding rows of a CUDA-graph bucket and draft rows the verifier rejected.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from peagle.kernels import pdl

PADDING_SLOT_ID = -1


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program copies one token's [num_kv_heads, head_dim] rows of k and v.
    if USE_PDL:  # programmatic dependent launch (kernels/pdl.py): nothing is touched before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # Masking every access on `slot >= 0` (rather than returning early) keeps the kernel branch-free. The scalar
    # condition goes through tl.where: Triton's interpreter mis-types `tensor & scalar` masks.
    mask = tl.where(slot >= 0, (h < NUM_KV_HEADS) & (d < HEAD_DIM), False)
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_args(k, v, k_cache, v_cache, slot_mapping):
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"k and v must both be [num_tokens, num_kv_heads, head_dim], got {k.shape} and {v.shape}")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"caches must be [num_blocks, block_size, {k.shape[1]}, {k.shape[2]}], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [{k.shape[0]}], got {tuple(slot_mapping.shape)}")


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = write nothing
) -> None:
    """Triton: k_cache/v_cache[slot // block_size, slot % block_size] = k/v[t] for every t whose slot is not -1."""
    _check_args(k, v, k_cache, v_cache, slot_mapping)
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride {t.stride(-1)})")
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4, **pdl.options(k.device),
    )


def store_kv_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = write nothing
) -> None:
    """PyTorch reference of `store_kv` (host-synchronising: boolean indexing)."""
    _check_args(k, v, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    k_cache[slots // block_size, slots % block_size] = k[keep].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = v[keep].to(v_cache.dtype)
