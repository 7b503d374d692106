"""Quantised checkpoint tensors, dequantised at load: peagle computes in bf16, fp16 or fp32 only.

- MXFP4 (GPT-OSS's experts): `<name>_blocks` [..., rows, groups, 16] uint8 holds two 4-bit E2M1 values a byte (low
  nibble first), `<name>_scales` [..., rows, groups] uint8 a power-of-two exponent per 32 values, biased by 127.
  The dequantised tensor is laid out as the bf16 checkpoints store it: [..., groups * 32, rows].
- FP8 with block scales (Qwen3-Coder-30B-A3B-Instruct-FP8): `<module>.weight` float8_e4m3fn [out, in] and
  `<module>.weight_scale_inv` fp32 [ceil(out / bo), ceil(in / bi)], one scale a (bo, bi) block that multiplies it.
"""

from __future__ import annotations

import torch

MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
FP8_SCALE = "weight_scale_inv"
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def mxfp4_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    *lead, rows, groups, nbytes = blocks_shape
    return (*lead, groups * nbytes * 2, rows)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # blocks: [..., rows, groups, 16] uint8, scales: [..., rows, groups] uint8 -> [..., groups * 32, rows]
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match")
    table = torch.tensor(_E2M1, dtype=torch.float32, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1)  # [..., g, 16, 2]
    values = values.flatten(-2) * torch.exp2(scales.to(torch.float32) - 127)[..., None]  # [..., rows, groups, 32]
    return values.flatten(-2).transpose(-1, -2).to(dtype).contiguous()


def is_fp8(tensor_dtype: torch.dtype) -> bool:
    return tensor_dtype in _FP8_DTYPES


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype) -> torch.Tensor:
    # weight: [out, in] fp8, scale_inv: [ceil(out / bo), ceil(in / bi)] with block = (bo, bi) -> [out, in] in dtype
    out, inp = weight.shape
    bo, bi = block
    if tuple(scale_inv.shape) != (-(-out // bo), -(-inp // bi)):
        raise ValueError(f"FP8 scales {list(scale_inv.shape)} do not tile a weight of {list(weight.shape)} in "
                         f"blocks of {list(block)}")
    scale = scale_inv.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    return (weight.float() * scale).to(dtype)
