"""Fused element-wise kernels of the decoder layer: RMSNorm (alone or after the residual add), rotary embedding (alone,
or with the paged KV-cache write of k and v), and SiLU-and-mul. Each replaces three to eight PyTorch kernels with one
launch, which is what decoding at batch 1 pays for.

The `*_ref` functions are the model's own arithmetic (that of Hugging Face transformers). The kernels follow them
rounding for rounding: every intermediate PyTorch keeps in the activations' dtype is rounded to that dtype here too
(products of two bf16 or fp16 values are exact in fp32, so such a step rounds once, as PyTorch's does). What remains
is fp32 noise: the order of the RMSNorm sum and the hardware's rsqrt and exp.

All launchers allocate their outputs (CUDA-graph safe), never synchronise with the host, launch nothing for zero
tokens, and accept row-strided inputs (slices of a fused projection output) as long as the last dim is contiguous.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from peagle.kernels import pdl
from peagle.kernels.kv_cache import _check_args as _check_kv_args
from peagle.kernels.kv_cache import store_kv_ref

MAX_ROW = 32768  # widest row held in one tile (rms_norm); Llama-3.1-8B needs 4096
SILU_TILE = 1024  # columns per program of silu_and_mul
# Warps per program, measured on an H200 with CUDA graphs at SmolLM2-135M and Llama-3.1-8B sizes, T = 1..512: every
# choice within 0.2 us of the best below T = 512, where wider RMSNorm rows want more warps.
ROTARY_WARPS = 4
SILU_WARPS = 4


def _norm_warps(block: int) -> int:
    return max(1, min(16, block // 1024))


# rms_norm and fused_add_rms_norm

@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr,
    num_heads, d, stride_xt, stride_xh, stride_rt, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program normalises one row: row = token * num_heads + head (num_heads is 1 for [T, d] inputs).
    if USE_PDL:  # programmatic dependent launch (kernels/pdl.py): nothing is touched before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < d
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + (row // num_heads) * stride_xt + (row % num_heads) * stride_xh + cols, mask=ok, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_rt + cols, mask=ok, other=0.0).to(tl.float32)
        summed = (x + residual).to(dtype)
        tl.store(summed_ptr + row * d + cols, summed, mask=ok)
        x = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / d + eps)
    normed = (x * inv_rms).to(dtype).to(tl.float32)  # cast back before the weight, as the reference does
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * d + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=ok)


def _check_norm_args(x, weight):
    if x.dim() not in (2, 3) or weight.shape != (x.shape[-1],):
        raise ValueError(
            f"need x [T, d] or [T, heads, d] and weight [d]; got {tuple(x.shape)} and {tuple(weight.shape)}"
        )


def _launch_rms_norm(x, residual, weight, eps, summed):
    # [T, d] or [T, heads, d]; the output is contiguous in the promoted dtype, as `weight * x` would be.
    if x.stride(-1) != 1:
        raise ValueError(f"x must be contiguous in its last dim (stride {x.stride(-1)})")
    if x.shape[-1] > MAX_ROW:
        raise ValueError(f"rows of {x.shape[-1]} exceed the {MAX_ROW} one tile holds")
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    num_heads = x.shape[1] if x.dim() == 3 else 1
    num_rows = x.shape[0] * num_heads
    if num_rows == 0:
        return out
    d = x.shape[-1]
    block = triton.next_power_of_2(d)
    stride_rt = residual.stride(0) if residual is not None else 0
    _rms_norm_kernel[(num_rows,)](
        x, residual, weight.contiguous(), out, summed,
        num_heads, d, x.stride(0), x.stride(1) if x.dim() == 3 else 0, stride_rt, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_norm_warps(block), **pdl.options(x.device),
    )
    return out


def rms_norm(
    x: torch.Tensor,  # [T, d] or [T, heads, d] (per-head norms), last dim contiguous
    weight: torch.Tensor,  # [d]
    eps: float,
) -> torch.Tensor:  # like x, contiguous, dtype promote(weight, x)
    """Triton: RMSNorm of each row, one program per row."""
    _check_norm_args(x, weight)
    return _launch_rms_norm(x, None, weight, eps, None)


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, d], last dim contiguous
    residual: torch.Tensor,  # [T, d], dtype of x, last dim contiguous
    weight: torch.Tensor,  # [d]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, d], summed [T, d]
    """Triton: summed = x + residual (in x's dtype), normed = rms_norm(summed), in one launch; inputs untouched."""
    _check_add_args(x, residual, weight)
    if residual.stride(-1) != 1:
        raise ValueError(f"residual must be contiguous in its last dim (stride {residual.stride(-1)})")
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _launch_rms_norm(x, residual, weight, eps, summed), summed


def _check_add_args(x, residual, weight):
    if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"need x and residual of one shape [T, d] and one dtype; got {tuple(x.shape)} {x.dtype} and "
            f"{tuple(residual.shape)} {residual.dtype}"
        )
    _check_norm_args(x, weight)


def rms_norm_ref(
    x: torch.Tensor,  # [..., d]
    weight: torch.Tensor,  # [d]
    eps: float,
) -> torch.Tensor:  # [..., d]
    """PyTorch reference of `rms_norm` (Hugging Face's LlamaRMSNorm)."""
    # Normalise in fp32 and cast back before the weight, as the reference implementations do.
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor,  # [T, d]
    residual: torch.Tensor,  # [T, d]
    weight: torch.Tensor,  # [d]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, d], summed [T, d]
    """PyTorch reference of `fused_add_rms_norm`."""
    _check_add_args(x, residual, weight)
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


# rotary

@triton.jit
def _rotate_heads_to(
    x_ptr, dst_ptr, token, stride_t, stride_h, dst_stride_h, num_heads, half, cos1, cos2, sin1, sin2, valid,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, w_ptr, eps, NORM: tl.constexpr,
):
    # Rotate one token's heads: [num_heads, 2 * half] read through strides, head h written at dst + h * dst_stride_h
    # (nothing is written where `valid` is false). NORM: each head RMS-normalised first, with weight w (Qwen3's q/k
    # norm), rounded as `rms_norm_ref` rounds.
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    ok = (h < num_heads) & (i < half)
    src = x_ptr + token * stride_t + h * stride_h + i
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=ok, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x1 * x1 + x2 * x2, axis=1)[:, None] / (2 * half) + eps)  # [BLOCK_H, 1]
        w1 = tl.load(w_ptr + i, mask=i < half, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + i, mask=i < half, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), with each product rounded as PyTorch rounds it.
    out1 = (x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)
    out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    # The scalar condition goes through tl.where: Triton's interpreter mis-types `tensor & scalar` masks.
    write = tl.where(valid, ok, False)
    dst = dst_ptr + h * dst_stride_h + i
    out_dtype = dst_ptr.dtype.element_ty
    tl.store(dst, out1.to(dtype).to(out_dtype), mask=write)
    tl.store(dst + half, out2.to(dtype).to(out_dtype), mask=write)


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, token, stride_t, stride_h, num_heads, half, cos1, cos2, sin1, sin2,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # Rotate one token's heads into a contiguous [T, num_heads, 2 * half] output.
    _rotate_heads_to(x_ptr, out_ptr + token * num_heads * 2 * half, token, stride_t, stride_h, 2 * half, num_heads,
                     half, cos1, cos2, sin1, sin2, True, BLOCK_H, BLOCK_HALF, x_ptr, 0.0, False)


@triton.jit
def _rope_row(cos_ptr, sin_ptr, pos, stride_cos, stride_sin, half, act_ptr, BLOCK_HALF: tl.constexpr):
    # A position's cos/sin halves as [1, BLOCK_HALF] rows. The fp32 tables are cast to the activations' dtype (that
    # of act_ptr) first, as the reference does.
    dtype = act_ptr.dtype.element_ty
    i = tl.arange(0, BLOCK_HALF)[None, :]
    ok = i < half
    cos1 = tl.load(cos_ptr + pos * stride_cos + i, mask=ok, other=0.0).to(dtype).to(tl.float32)
    cos2 = tl.load(cos_ptr + pos * stride_cos + half + i, mask=ok, other=0.0).to(dtype).to(tl.float32)
    sin1 = tl.load(sin_ptr + pos * stride_sin + i, mask=ok, other=0.0).to(dtype).to(tl.float32)
    sin2 = tl.load(sin_ptr + pos * stride_sin + half + i, mask=ok, other=0.0).to(dtype).to(tl.float32)
    return cos1, cos2, sin1, sin2


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    num_q_heads, num_kv_heads, half,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program rotates one token's q and k heads.
    if USE_PDL:  # programmatic dependent launch (kernels/pdl.py): nothing is touched before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos1, cos2, sin1, sin2 = _rope_row(cos_ptr, sin_ptr, pos, stride_cos, stride_sin, half, q_out_ptr, BLOCK_HALF)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, num_q_heads, half, cos1, cos2, sin1, sin2,
                  BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, num_kv_heads, half, cos1, cos2, sin1, sin2,
                  BLOCK_HKV, BLOCK_HALF)


def _check_rotary_args(positions, q, k, cos, sin):
    if q.dim() != 3 or k.dim() != 3 or positions.shape != (q.shape[0],) or k.shape[0] != q.shape[0]:
        raise ValueError(
            f"need positions [T], q [T, Hq, D] and k [T, Hkv, D]; got {tuple(positions.shape)}, {tuple(q.shape)} "
            f"and {tuple(k.shape)}"
        )
    head_dim = q.shape[2]
    if k.shape[2] != head_dim or head_dim % 2 or k.dtype != q.dtype:
        raise ValueError(f"q and k need one even head_dim and one dtype; got {q.shape[2]}, {k.shape[2]}, "
                         f"{q.dtype}, {k.dtype}")
    if cos.dim() != 2 or cos.shape[1] != head_dim or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [max_positions, {head_dim}], got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")


def rotary(
    positions: torch.Tensor,  # [T] int32/int64
    q: torch.Tensor,  # [T, Hq, D], any token/head strides, last dim contiguous
    k: torch.Tensor,  # [T, Hkv, D], same
    cos: torch.Tensor,  # [max_positions, D] fp32
    sin: torch.Tensor,  # [max_positions, D] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # q_out [T, Hq, D], k_out [T, Hkv, D], contiguous
    """Triton: rotate-half RoPE of q and k in one launch, one program per token. Positions are not bounds-checked."""
    _check_rotary_args(positions, q, k, cos, sin)
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride {t.stride(-1)})")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return q_out, k_out
    num_kv_heads = k.shape[1]
    block_hq, block_half = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(head_dim // 2)
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos, sin, q_out, k_out,
        num_q_heads, num_kv_heads, head_dim // 2,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        BLOCK_HQ=block_hq, BLOCK_HKV=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=block_half,
        num_warps=ROTARY_WARPS, **pdl.options(q.device),
        enable_fp_fusion=False,  # a fused multiply-add would skip the rounding of the fp32 products
    )
    return q_out, k_out


@triton.jit
def _rotary_store_kv_kernel(
    positions_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    q_weight_ptr, k_weight_ptr, eps,
    num_q_heads, num_kv_heads, half, block_size,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    QK_NORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program per token: rotate its q heads into q_out, rotate its k heads straight into the paged cache and
    # copy its v heads there (the cache writes only where the slot is not -1); QK_NORM: q and k heads RMS-normalised
    # before they turn.
    if USE_PDL:  # programmatic dependent launch (kernels/pdl.py): nothing is touched before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    valid = slot >= 0
    block = tl.where(valid, slot // block_size, 0)
    offset = tl.where(valid, slot % block_size, 0)
    cos1, cos2, sin1, sin2 = _rope_row(cos_ptr, sin_ptr, pos, stride_cos, stride_sin, half, q_out_ptr, BLOCK_HALF)
    _rotate_heads_to(q_ptr, q_out_ptr + token * num_q_heads * 2 * half, token, stride_qt, stride_qh, 2 * half,
                     num_q_heads, half, cos1, cos2, sin1, sin2, True, BLOCK_HQ, BLOCK_HALF, q_weight_ptr, eps, QK_NORM)
    _rotate_heads_to(k_ptr, k_cache_ptr + block * stride_kcb + offset * stride_kcs, token, stride_kt, stride_kh,
                     stride_kch, num_kv_heads, half, cos1, cos2, sin1, sin2, valid, BLOCK_HKV, BLOCK_HALF,
                     k_weight_ptr, eps, QK_NORM)
    h = tl.arange(0, BLOCK_HKV)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    vmask = tl.where(valid, (h < num_kv_heads) & (d < 2 * half), False)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=vmask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=vmask)


def rotary_store_kv(
    positions: torch.Tensor,  # [T] int32/int64
    q: torch.Tensor,  # [T, Hq, D], any token/head strides, last dim contiguous
    k: torch.Tensor,  # [T, Hkv, D], same
    v: torch.Tensor,  # [T, Hkv, D], same
    cos: torch.Tensor,  # [max_positions, D] fp32
    sin: torch.Tensor,  # [max_positions, D] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64, -1 = write nothing
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # (q weight [D], k weight [D], eps)
) -> torch.Tensor:  # q_out [T, Hq, D], contiguous
    """Triton: `rotary` and `store_kv` in one launch: q rotated into a new tensor, k rotated into the paged cache
    and v copied there. The cache holds exactly what `rotary` then `store_kv` would write. With `qk_norm`, q's and
    k's heads are RMS-normalised first (Qwen3's q/k norm), as `rms_norm` would, in the same launch."""
    _check_rotary_args(positions, q, k, cos, sin)
    _check_kv_args(k, v, k_cache, v_cache, slot_mapping)
    if qk_norm is not None and any(w.shape != (q.shape[-1],) or not w.is_contiguous() for w in qk_norm[:2]):
        raise ValueError(f"qk_norm's weights must be contiguous [{q.shape[-1]}] tensors")
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_cache", k_cache),
                    ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride {t.stride(-1)})")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return q_out
    num_kv_heads = k.shape[1]
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (q, k, 0.0)  # unread without the norm
    _rotary_store_kv_kernel[(num_tokens,)](
        positions, q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping, q_weight, k_weight, float(eps),
        num_q_heads, num_kv_heads, head_dim // 2, k_cache.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), BLOCK_D=triton.next_power_of_2(head_dim),
        QK_NORM=qk_norm is not None, num_warps=ROTARY_WARPS, **pdl.options(q.device),
        enable_fp_fusion=False,  # a fused multiply-add would skip the rounding of the fp32 products
    )
    return q_out


def rotary_store_kv_ref(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, qk_norm=None) -> torch.Tensor:
    """PyTorch reference of `rotary_store_kv`: (`rms_norm_ref` of q and k,) `rotary_ref`, then `store_kv_ref` of the
    rotated k and of v."""
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    q_out, k_out = rotary_ref(positions, q, k, cos, sin)
    store_kv_ref(k_out, v, k_cache, v_cache, slot_mapping)
    return q_out


def rotary_ref(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [max_positions, D] fp32
    sin: torch.Tensor,  # [max_positions, D] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hq, D], [T, Hkv, D]
    """PyTorch reference of `rotary` (Hugging Face's apply_rotary_pos_emb)."""
    _check_rotary_args(positions, q, k, cos, sin)
    c = cos[positions].to(q.dtype)[:, None, :]  # [T, 1, D]
    s = sin[positions].to(q.dtype)[:, None, :]
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# silu_and_mul

@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # Program (row, tile) computes silu(gate) * up over one tile of columns of one row.
    if USE_PDL:  # programmatic dependent launch (kernels/pdl.py): nothing is touched before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # PyTorch rounds silu's output first
    tl.store(out_ptr + row * inter + cols, (act * up).to(dtype), mask=ok)


def _check_silu_args(x):
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"need x [T, 2 * intermediate], got {tuple(x.shape)}")


def silu_and_mul(
    x: torch.Tensor,  # [T, 2 * I] gate then up, last dim contiguous
) -> torch.Tensor:  # [T, I], contiguous
    """Triton: silu(gate) * up, one program per row and tile of SILU_TILE columns."""
    _check_silu_args(x)
    if x.stride(-1) != 1:
        raise ValueError(f"x must be contiguous in its last dim (stride {x.stride(-1)})")
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or inter == 0:
        return out
    block = min(SILU_TILE, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), BLOCK=block, num_warps=SILU_WARPS, **pdl.options(x.device),
    )
    return out


def silu_and_mul_ref(
    x: torch.Tensor,  # [T, 2 * I]
) -> torch.Tensor:  # [T, I]
    """PyTorch reference of `silu_and_mul` (the Llama MLP's activation)."""
    _check_silu_args(x)
    gate, up = x.split(x.shape[1] // 2, dim=-1)
    return F.silu(gate) * up
