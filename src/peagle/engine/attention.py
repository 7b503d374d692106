"""The engine's attention backend: write k/v into the paged cache, then attend over it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from peagle import kernels
from peagle.models.attention import LayerKV, uniform_kv  # noqa: F401 (re-exported for the runner)


@dataclass
class AttentionMetadata:
    """Per-forward metadata for a flat batch of B requests and T query tokens."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, -1 = write nothing
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int
    # A mixed step's most rows of a decoding request (K + 1), so that the attention tiles short and long requests
    # apart (kernels.paged_attention); None: one tiling for every request.
    small_query_len: int | None = None


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """The Triton paged attention kernel's switches, from EngineConfig (kernels/paged_attention.py says what each
    does); the reference computes the same either way."""

    fused_merge: bool  # KV splits merged inside the attention kernel (one launch)
    mixed_tiles: bool  # a mixed step's short and long requests tiled apart (two launches)


class PagedAttention:
    """AttentionBackend over one model's paged KV cache (one (k, v) pair of tensors per layer, shared by the layers
    that share keys and values)."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                 scale: float | None, options: AttentionOptions):
        """`scale`: the scores' scale; None: head_dim ** -0.5 of each layer's queries (layers of several head_dims)."""
        self.kv_caches = kv_caches
        self.meta = meta
        self.scale = scale
        self.options = options
        self.tile_maps: dict = {}  # a mixed step's tile map, made by the first layer and read by the others

    def __call__(self, layer_idx, q, k, v, *, window: int = 0, sinks: torch.Tensor | None = None):
        k_cache, v_cache = self.kv_caches[layer_idx]
        kernels.store_kv(k, v, k_cache, v_cache, self.meta.slot_mapping)
        return self._attend(q, k_cache, v_cache, window, sinks)

    def rotary_attend(self, layer_idx, positions, q, k, v, rope, *, window: int = 0,
                      sinks: torch.Tensor | None = None, qk_norm: tuple | None = None):
        """q, k before RoPE (and before their norms, given as `qk_norm` = (q weight, k weight, eps)): one kernel
        normalises and rotates q and writes the rotated k and v into the cache, then attention."""
        k_cache, v_cache = self.kv_caches[layer_idx]
        cos, sin = rope.tables(q.device)
        q = kernels.rotary_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, self.meta.slot_mapping,
                                    qk_norm=qk_norm)
        return self._attend(q, k_cache, v_cache, window, sinks)

    def _attend(self, q, k_cache, v_cache, window, sinks):
        m = self.meta
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        return kernels.paged_attention(
            q, k_cache, v_cache, m.block_tables, m.query_start_loc, m.positions, scale, m.max_query_len,
            small_query_len=m.small_query_len, tile_maps=self.tile_maps, fused_merge=self.options.fused_merge,
            mixed_tiles=self.options.mixed_tiles, window=window, sinks=sinks,
        )


def allocate_kv_cache(layers: Sequence[LayerKV], num_blocks: int, block_size: int, dtype: torch.dtype,
                      device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k, v) pair of [num_blocks, block_size, heads, head_dim] tensors per layer that owns a cache; a layer that
    shares another's gets that layer's tensors (the same block tables address both)."""
    caches: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, layer in enumerate(layers):
        if layer.source != i:
            if not 0 <= layer.source < i or layers[layer.source].source != layer.source:
                raise ValueError(f"layer {i} shares the KV cache of layer {layer.source}, which owns none before it")
            caches.append(caches[layer.source])
            continue
        shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        caches.append((torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)))
    return caches


def kv_bytes_per_block(layers: Sequence[LayerKV], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block holds over every layer that owns a cache (shared layers add none)."""
    elements = sum(layer.num_kv_heads * layer.head_dim for i, layer in enumerate(layers) if layer.source == i)
    return 2 * block_size * elements * torch.empty((), dtype=dtype).element_size()
