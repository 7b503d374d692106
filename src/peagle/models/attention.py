"""The attention interface between models and whoever owns the KV state.

A model computes q, k, v (RoPE applied) for a flat batch of tokens and hands them to an `AttentionBackend`. The
backend decides what the tokens may see: the engine's backend writes k/v into a paged cache and attends over it,
training's backend applies a FlexAttention block mask, and `DenseAttention` here is the plain reference used by
tests and by one-off forwards. A backend may also offer `rotary_attend(layer_idx, positions, q, k, v, rope)`, taking
q and k before RoPE (the engine's fuses the rotation with its KV-cache write); models use it when no gradient is
needed.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


class AttentionBackend(Protocol):
    def __call__(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


# cuDNN attention is left out: allowed, it made the slowest training step of the variants timed (the teacher calls
# this once per document, at every length; docs/DECISIONS.md).
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa(q, k, v, mask=None, causal=False):
    # q: [T, Hq, D], k/v: [S, Hkv, D] -> [T, Hq, D]. The fused kernels (flash, memory-efficient) take only 4-D
    # [batch, heads, T, D] inputs: with 3-D ones PyTorch falls back to the math path, which materialises the T x S
    # scores in fp32.
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    with sdpa_kernel(_BACKENDS):
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
            is_causal=causal and mask is None,
        )
    return out[0].transpose(0, 1)


class DenseAttention:
    """Reference attention without a cache.

    With `seq_lens`, the flat token batch is a concatenation of independent sequences, each causal.
    With `mask` ([num_tokens, num_tokens], True = may attend), the mask decides alone.
    """

    def __init__(self, seq_lens: Sequence[int] | None = None, mask: torch.Tensor | None = None):
        if seq_lens is not None and mask is not None:
            raise ValueError("give DenseAttention either seq_lens or mask, not both")
        self.seq_lens = list(seq_lens) if seq_lens is not None else None
        self.mask = mask

    def __call__(self, layer_idx, q, k, v):
        if self.mask is not None:
            return _sdpa(q, k, v, mask=self.mask)
        if self.seq_lens is None:
            return _sdpa(q, k, v, causal=True)
        outs, start = [], 0
        for n in self.seq_lens:
            outs.append(_sdpa(q[start:start + n], k[start:start + n], v[start:start + n], causal=True))
            start += n
        if start != q.shape[0]:
            raise ValueError(f"seq_lens sum to {start} but the batch has {q.shape[0]} tokens")
        return torch.cat(outs)


class VarlenAttention:
    """Causal attention over a flat batch of independent sequences in one kernel per layer (training's teacher).

    On CUDA this is flash attention's variable-length form (cumulative sequence offsets; grouped KV heads served
    natively), one launch per layer instead of one per sequence. Elsewhere, or where that kernel is missing, it is
    `DenseAttention(seq_lens)`, which gives the same result up to rounding.
    """

    def __init__(self, seq_lens: Sequence[int], device: torch.device | str):
        self.seq_lens = list(seq_lens)
        self.max_len = max(self.seq_lens, default=0)
        offsets = torch.tensor([0, *self.seq_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self.offsets = offsets.to(device, non_blocking=True)  # [num_seqs + 1] int32
        self._dense = DenseAttention(seq_lens=self.seq_lens)

    def __call__(self, layer_idx, q, k, v):
        # q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and not _VARLEN_BROKEN:
            try:
                return torch.ops.aten._flash_attention_forward(
                    q, k, v, self.offsets, self.offsets, self.max_len, self.max_len, 0.0, True, False)[0]
            except (RuntimeError, TypeError) as e:  # an older build without this kernel or signature
                _varlen_failed(e)
        return self._dense(layer_idx, q, k, v)


_VARLEN_BROKEN = False


def _varlen_failed(error: Exception) -> None:
    global _VARLEN_BROKEN
    import logging

    logging.getLogger(__name__).warning("variable-length flash attention failed (%s); attending per sequence",
                                        str(error).splitlines()[0] if str(error) else type(error).__name__)
    _VARLEN_BROKEN = True
