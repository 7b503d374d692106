"""The attention interface between models and whoever owns the KV state.

A model computes q, k, v (RoPE applied) for a flat batch of tokens and hands them to an `AttentionBackend`. The
backend decides what the tokens may see: the engine's backend writes k/v into a paged cache and attends over it,
training's backend applies a FlexAttention block mask, and `DenseAttention` here is the plain reference used by
tests and by one-off forwards. A backend may also offer `rotary_attend(layer_idx, positions, q, k, v, rope)`, taking
q and k before RoPE (the engine's fuses the rotation with its KV-cache write); models use it when no gradient is
needed.

Both take two per-layer options, keyword-only: `window` w > 0, a sliding window (a query at position p sees the keys
p - w < j <= p, Hugging Face's `sliding_window`; 0: full causal attention), and `sinks` ([num_heads], GPT-OSS's
learned logits: each row's softmax gets one more column of value sinks[h], dropped after it, so the output is scaled
by 1 / (1 + exp(sinks[h] - lse)), lse the logsumexp of the row's scaled scores). A backend that cannot honour one
raises rather than ignoring it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import math

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
        *,
        window: int = 0,
        sinks: torch.Tensor | None = None,  # [num_heads]
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


def causal_mask(n: int, window: int, device) -> torch.Tensor:
    """[n, n] bool, True = may attend: query i sees keys i - window < j <= i (window 0: every j <= i)."""
    i = torch.arange(n, device=device)
    behind = i[:, None] - i[None, :]  # [n, n] how far key j lies behind query i
    return (behind >= 0) & (behind < window) if window else behind >= 0


def _sink_attention(q, k, v, allowed, sinks):
    # q: [T, Hq, D], k/v: [S, Hkv, D], allowed: [T, S] bool, sinks: [Hq] -> [T, Hq, D]. In fp32, with the sink as
    # one more softmax column dropped after it, as transformers' GPT-OSS eager attention.
    group = q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("thd,shd->hts", q.float(), k) / math.sqrt(q.shape[-1])  # [Hq, T, S]
    scores = scores.masked_fill(~allowed, -math.inf)
    sink = sinks.float()[:, None, None].expand(-1, q.shape[0], 1)  # [Hq, T, 1]
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("hts,shd->thd", probs, v).to(q.dtype)


def _attend(q, k, v, *, mask=None, window=0, sinks=None):
    # One sequence: causal (within `window`) unless `mask` ([T, S], True = may attend) is given.
    if mask is None and not window and sinks is None:
        return _sdpa(q, k, v, causal=True)  # flash attention where it runs
    if mask is None:
        mask = causal_mask(q.shape[0], window, q.device)
    if sinks is None:
        return _sdpa(q, k, v, mask=mask)
    return _sink_attention(q, k, v, mask, sinks)


def _check_options(q, window, sinks):
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: full attention), got {window!r}")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [num_heads] = [{q.shape[1]}], got {tuple(sinks.shape)}")


class DenseAttention:
    """Reference attention without a cache.

    With `seq_lens`, the flat token batch is a concatenation of independent sequences, each causal.
    With `mask` ([num_tokens, num_tokens], True = may attend), the mask decides alone (no `window` then).
    A `window` or `sinks` leave flash attention for a masked kernel (sinks: fp32 math); correctness over speed.
    """

    def __init__(self, seq_lens: Sequence[int] | None = None, mask: torch.Tensor | None = None):
        if seq_lens is not None and mask is not None:
            raise ValueError("give DenseAttention either seq_lens or mask, not both")
        self.seq_lens = list(seq_lens) if seq_lens is not None else None
        self.mask = mask

    def __call__(self, layer_idx, q, k, v, *, window: int = 0, sinks: torch.Tensor | None = None):
        _check_options(q, window, sinks)
        if self.mask is not None:
            if window:
                raise ValueError("DenseAttention(mask=...) decides alone: put the window into the mask")
            return _attend(q, k, v, mask=self.mask, sinks=sinks)
        if self.seq_lens is None:
            return _attend(q, k, v, window=window, sinks=sinks)
        outs, start = [], 0
        for n in self.seq_lens:
            part = slice(start, start + n)
            outs.append(_attend(q[part], k[part], v[part], window=window, sinks=sinks))
            start += n
        if start != q.shape[0]:
            raise ValueError(f"seq_lens sum to {start} but the batch has {q.shape[0]} tokens")
        return torch.cat(outs)


class VarlenAttention:
    """Causal attention over a flat batch of independent sequences in one kernel per layer (training's teacher).

    On CUDA this is flash attention's variable-length form (cumulative sequence offsets; grouped KV heads served
    natively), one launch per layer instead of one per sequence; a window is its left window, sinks rescale its
    output by its logsumexp. Elsewhere, or where that kernel is missing, it is `DenseAttention(seq_lens)`, which
    gives the same result up to rounding.
    """

    def __init__(self, seq_lens: Sequence[int], device: torch.device | str):
        self.seq_lens = list(seq_lens)
        self.max_len = max(self.seq_lens, default=0)
        offsets = torch.tensor([0, *self.seq_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self.offsets = offsets.to(device, non_blocking=True)  # [num_seqs + 1] int32
        self._dense = DenseAttention(seq_lens=self.seq_lens)

    def __call__(self, layer_idx, q, k, v, *, window: int = 0, sinks: torch.Tensor | None = None):
        # q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]
        _check_options(q, window, sinks)
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and not _VARLEN_BROKEN:
            try:
                # flash's left window counts the keys before the query's own: Hugging Face's window minus one
                out, lse, *_ = torch.ops.aten._flash_attention_forward(
                    q, k, v, self.offsets, self.offsets, self.max_len, self.max_len, 0.0, True, False,
                    window_size_left=window - 1 if window else None, window_size_right=0 if window else None)
            except (RuntimeError, TypeError) as e:  # an older build without this kernel or signature
                _varlen_failed(e)
            else:
                if sinks is None:
                    return out
                # lse [Hq, T], natural log: the sink's share of each row's softmax leaves the output
                keep = torch.sigmoid(lse.float().transpose(0, 1) - sinks.float())  # [T, Hq]
                return (out.float() * keep[..., None]).to(out.dtype)
        return self._dense(layer_idx, q, k, v, window=window, sinks=sinks)


_VARLEN_BROKEN = False


def _varlen_failed(error: Exception) -> None:
    global _VARLEN_BROKEN
    import logging

    logging.getLogger(__name__).warning("variable-length flash attention failed (%s); attending per sequence",
                                        str(error).splitlines()[0] if str(error) else type(error).__name__)
    _VARLEN_BROKEN = True


@dataclass(frozen=True, slots=True)
class LayerKV:
    """One layer's entry in the paged KV cache: its K/V shape, or the earlier layer whose keys and values it reads."""

    num_kv_heads: int
    head_dim: int
    source: int  # the layer whose cache it uses: its own index, or an earlier layer's (KV shared across layers)


def uniform_kv(num_layers: int, num_kv_heads: int, head_dim: int) -> list[LayerKV]:
    """Every layer with a cache of its own, of one shape."""
    return [LayerKV(num_kv_heads, head_dim, i) for i in range(num_layers)]
