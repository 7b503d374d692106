"""FlexAttention backend for training: the drafter's layers attend through a layout's block mask.

On CUDA the attention runs through `torch.compile(flex_attention)` (fused, block-sparse). PyTorch has no backward
for FlexAttention on the CPU, so there the same block mask drives a plain block-sparse implementation: for each
query tile only the key tiles the block mask lists are gathered, and mask_mod is evaluated on the partial ones.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention


logger = logging.getLogger(__name__)
# 64 x 64 kernel tiles over the 128 x 128 block mask: faster than the defaults at 8K-token layouts (docs/DECISIONS.md).
KERNEL_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64}
_FALLBACK = {"on": os.environ.get("PEAGLE_TRAIN_ATTENTION", "flex") == "blocksparse"}


@functools.cache
def _compiled_flex_attention():
    # Every step's layout has another number of elements: compiled for symbolic shapes from the first call (the
    # default would compile for the first shape, then again for symbolic ones at the second).
    return torch.compile(flex_attention, dynamic=True)


def _cuda_attention(q, k, v, block_mask):
    # Compiling FlexAttention can fail on a new torch/triton pair; training must not die for it.
    if not _FALLBACK["on"]:
        try:
            return _compiled_flex_attention()(q[None], k[None], v[None], block_mask=block_mask, enable_gqa=True,
                                              kernel_options=KERNEL_OPTIONS)[0]
        except Exception as e:  # noqa: BLE001 - any compile failure means: use the unfused path
            logger.warning("compiled flex_attention failed (%s: %s); using block-sparse attention instead",
                           type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            _FALLBACK["on"] = True
    return block_sparse_attention(q, k, v, block_mask)


class KVChain:
    """Keys and values of earlier passes, per layer, for chained passes (EAGLE-3's training-time test).

    Each pass appends its k/v; the next pass attends to all of them. Gradients flow into the earlier passes.
    """

    def __init__(self):
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def extend(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self._kv:
            old_k, old_v = self._kv[layer_idx]
            k, v = torch.cat([old_k, k]), torch.cat([old_v, v])
        self._kv[layer_idx] = (k, v)
        return k, v


class FlexAttention:
    """AttentionBackend: queries and keys are layout elements; the block mask decides who sees whom.

    With a `KVChain`, this pass's keys are appended to the earlier passes' and the block mask spans all of them.
    """

    def __init__(self, block_mask: BlockMask, kv_chain: KVChain | None = None):
        self.block_mask = block_mask
        self.kv_chain = kv_chain

    def __call__(self, layer_idx, q, k, v):
        # q: [Tq, Hq, D]; k, v: [Tk, Hkv, D] -> [Tq, Hq, D]
        if self.kv_chain is not None:
            k, v = self.kv_chain.extend(layer_idx, k, v)
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [H, T, D]
        if q.is_cuda:
            out = _cuda_attention(q, k, v, self.block_mask)
        else:
            out = block_sparse_attention(q, k, v, self.block_mask)
        return out.transpose(0, 1)


def block_sparse_attention(q, k, v, block_mask: BlockMask) -> torch.Tensor:
    """Unfused attention over the tiles a block mask lists. q: [Hq, Tq, D], k/v: [Hkv, Tk, D] -> [Hq, Tq, D]."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    num_q, num_kv = q.shape[1], k.shape[1]
    q_block, kv_block = block_mask.BLOCK_SIZE
    inside = torch.arange(kv_block, device=q.device)
    outs = []
    for i in range(block_mask.kv_num_blocks.shape[-1]):
        rows = torch.arange(i * q_block, min((i + 1) * q_block, num_q), device=q.device)
        partial = block_mask.kv_indices[0, 0, i, : block_mask.kv_num_blocks[0, 0, i]]
        full = block_mask.full_kv_indices[0, 0, i, : block_mask.full_kv_num_blocks[0, 0, i]]
        cols = torch.cat([partial, full]).long()[:, None] * kv_block + inside  # [tiles, kv_block]
        is_full = torch.cat([torch.zeros_like(partial, dtype=torch.bool), torch.ones_like(full, dtype=torch.bool)])
        is_full = is_full[:, None].expand_as(cols).flatten()
        cols = cols.flatten()
        real = cols < num_kv
        cols, is_full = cols[real], is_full[real]
        zero = torch.zeros((), dtype=torch.long, device=q.device)
        allowed = is_full[None, :] | block_mask.mask_mod(zero, zero, rows[:, None], cols[None, :])  # [rows, cols]
        outs.append(F.scaled_dot_product_attention(q[:, rows], k[:, cols], v[:, cols], attn_mask=allowed))
    return torch.cat(outs, dim=1)
