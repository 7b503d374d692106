"""The engine's Triton kernels, each with a PyTorch reference beside it, behind one small dispatch.

Callers use the functions here (`store_kv`, `paged_attention`, `expand_draft_batch`, `gather_draft_features`,
and the decoder layer's fused element-wise ops `rms_norm`, `fused_add_rms_norm`, `rotary`, `rotary_store_kv`,
`silu_and_mul`; `advance_decode_inputs` for async scheduling (`compact_decode_inputs`, PyTorch only, for drafts cut by
confidence); `linear`, the small-batch GEMV, with the decoder
layer's norms (`rms_norm_linear`) or the MLP's activation (`silu_and_mul_linear`) inside it);
each runs the Triton kernel or the `*_ref` reference, chosen by the environment variable PEAGLE_KERNELS:
- `auto` (default): Triton for CUDA tensors, the reference otherwise (the CPU path of the engine);
- `triton`: Triton everywhere; for CPU tensors this needs TRITON_INTERPRET=1 (Triton's interpreter, for tests);
- `torch`: the references everywhere (debugging on the GPU).

Note: the function `peagle.kernels.paged_attention` shadows the submodule of the same name as an attribute of this
package; reach the module with `from peagle.kernels.paged_attention import ...`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from types import ModuleType

import torch

from peagle.kernels.decode_inputs import advance_decode_inputs_ref, compact_decode_inputs
from peagle.kernels.draft_batch import DraftBatch, expand_draft_batch_ref, gather_draft_features_ref
from peagle.kernels.fused import (fused_add_rms_norm_ref, rms_norm_ref, rotary_ref, rotary_store_kv_ref,
                                  silu_and_mul_ref)
from peagle.kernels.gemv import GemvLinear, linear_ref, use_gemv_linears
from peagle.kernels.kv_cache import PADDING_SLOT_ID, store_kv_ref
from peagle.kernels.paged_attention import paged_attention_ref  # the function defined below replaces the module name

BACKEND_ENV = "PEAGLE_KERNELS"
_BACKENDS = ("auto", "triton", "torch")

__all__ = [
    "BACKEND_ENV", "PADDING_SLOT_ID", "DraftBatch", "use_triton", "triton_module",
    "store_kv", "store_kv_ref", "paged_attention", "paged_attention_ref",
    "expand_draft_batch", "expand_draft_batch_ref", "gather_draft_features", "gather_draft_features_ref",
    "rms_norm", "rms_norm_ref", "fused_add_rms_norm", "fused_add_rms_norm_ref", "rotary", "rotary_ref",
    "rotary_store_kv", "rotary_store_kv_ref",
    "silu_and_mul", "silu_and_mul_ref", "advance_decode_inputs", "advance_decode_inputs_ref", "compact_decode_inputs",
    "linear", "linear_ref", "rms_norm_linear", "silu_and_mul_linear", "GemvLinear", "use_gemv_linears",
]


def use_triton(device: torch.device) -> bool:
    """Whether tensors on `device` go to the Triton kernels (see the module docstring)."""
    backend = os.environ.get(BACKEND_ENV, "auto")
    if backend not in _BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={backend!r}: expected one of {', '.join(_BACKENDS)}")
    if backend == "torch":
        return False
    return device.type == "cuda" or backend == "triton"


def triton_module(name: str, device: torch.device) -> ModuleType:
    """The kernel module `peagle.kernels.<name>` whose Triton launchers run on `device` (tests, benchmarks)."""
    if device.type == "cuda":
        return sys.modules[f"peagle.kernels.{name}"]
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"Triton kernels on {device.type} tensors need TRITON_INTERPRET=1 (Triton's interpreter)")
    return _interpreted(name)


@functools.cache
def _interpreted(name: str) -> ModuleType:
    # Triton decides at decoration time whether a kernel runs in its interpreter, so a kernel module imported before
    # TRITON_INTERPRET=1 was set holds compiled kernels. Load a private copy, decorated now, for CPU tensors.
    origin = importlib.util.find_spec(f"peagle.kernels.{name}").origin
    spec = importlib.util.spec_from_file_location(f"peagle.kernels._interpreted_{name}", origin)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = write nothing
) -> None:
    fn = triton_module("kv_cache", k.device).store_kv if use_triton(k.device) else store_kv_ref
    fn(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_requests, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_requests + 1] int32
    positions: torch.Tensor,  # [num_tokens]
    scale: float,
    max_query_len: int,
    *,
    small_query_len: int | None = None,
    tile_maps: dict | None = None,
    fused_merge: bool | None = None,
    mixed_tiles: bool | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """`small_query_len` and `tile_maps`: a mixed step's tiling hints for the Triton kernel; `fused_merge` and
    `mixed_tiles`: its switches (None: the kernel module's defaults). The reference computes the same either way.
    `window` (0: full attention) and `sinks`: a sliding window and learned sink logits (see the kernel module)."""
    if use_triton(q.device):
        return triton_module("paged_attention", q.device).paged_attention(
            q, k_cache, v_cache, block_tables, query_start_loc, positions, scale, max_query_len,
            small_query_len=small_query_len, tile_maps=tile_maps, fused_merge=fused_merge, mixed_tiles=mixed_tiles,
            window=window, sinks=sinks)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, positions, scale, max_query_len,
                               window=window, sinks=sinks)


def expand_draft_batch(
    target_input_ids: torch.Tensor,  # [T]
    target_positions: torch.Tensor,  # [T]
    target_slot_mapping: torch.Tensor,  # [T]
    query_start_loc: torch.Tensor,  # [B + 1]
    num_rejected: torch.Tensor,  # [B]
    next_token_ids: torch.Tensor,  # [B]
    block_tables: torch.Tensor,  # [B, max_blocks]
    block_size: int,
    mask_token_id: int,
    num_mask_slots: int,
    padding_slot_id: int = PADDING_SLOT_ID,
) -> DraftBatch:
    device = target_input_ids.device
    fn = triton_module("draft_batch", device).expand_draft_batch if use_triton(device) else expand_draft_batch_ref
    return fn(target_input_ids, target_positions, target_slot_mapping, query_start_loc, num_rejected,
              next_token_ids, block_tables, block_size, mask_token_id, num_mask_slots, padding_slot_id)


def gather_draft_features(
    aux: torch.Tensor,  # [T, F]
    hidden_index: torch.Tensor,  # [R], -1 = mask_hidden
    mask_hidden: torch.Tensor,  # [F]
) -> torch.Tensor:  # [R, F]
    if not use_triton(aux.device):
        return gather_draft_features_ref(aux, hidden_index, mask_hidden)
    return triton_module("draft_batch", aux.device).gather_draft_features(aux, hidden_index, mask_hidden)


def rms_norm(
    x: torch.Tensor,  # [T, d] (or [T, heads, d] on the Triton path)
    weight: torch.Tensor,  # [d]
    eps: float,
) -> torch.Tensor:  # [T, d]
    fn = triton_module("fused", x.device).rms_norm if use_triton(x.device) else rms_norm_ref
    return fn(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, d]
    residual: torch.Tensor,  # [T, d]
    weight: torch.Tensor,  # [d]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, d], summed = x + residual [T, d]
    fn = triton_module("fused", x.device).fused_add_rms_norm if use_triton(x.device) else fused_add_rms_norm_ref
    return fn(x, residual, weight, eps)


def rotary(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [max_positions, D] fp32
    sin: torch.Tensor,  # [max_positions, D] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hq, D], [T, Hkv, D]
    fn = triton_module("fused", q.device).rotary if use_triton(q.device) else rotary_ref
    return fn(positions, q, k, cos, sin)


def rotary_store_kv(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [max_positions, D] fp32
    sin: torch.Tensor,  # [max_positions, D] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T], -1 = write nothing
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # q and k heads RMS-normalised first
) -> torch.Tensor:  # rotated q [T, Hq, D]; rotated k and v written into the caches
    fn = triton_module("fused", q.device).rotary_store_kv if use_triton(q.device) else rotary_store_kv_ref
    return fn(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, qk_norm=qk_norm)


def silu_and_mul(
    x: torch.Tensor,  # [T, 2 * I]
) -> torch.Tensor:  # [T, I]
    fn = triton_module("fused", x.device).silu_and_mul if use_triton(x.device) else silu_and_mul_ref
    return fn(x)


def advance_decode_inputs(
    packed: torch.Tensor,  # [B_prev, (k_prev + 1) + 1 + D] int64 answer of the step in flight
    src: torch.Tensor,  # [B] int64 packed row per request, -1 = padding
    base: torch.Tensor,  # [B] int64 token count per request when the step in flight was launched
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    k_prev: int,
    k: int,
    block_size: int,
    scratch_block: int,
    out: dict[str, torch.Tensor],  # input_ids, positions, slot_mapping [B * (k + 1)], drafts [B, k], num_drafts [B]
) -> None:
    device = packed.device
    fn = (triton_module("decode_inputs", device).advance_decode_inputs if use_triton(device)
          else advance_decode_inputs_ref)
    fn(packed, src, base, block_tables, k_prev, k, block_size, scratch_block, out)


def linear(
    x: torch.Tensor,  # [M, K], M small (decode)
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    fn = triton_module("gemv", x.device).gemv if use_triton(x.device) else linear_ref
    return fn(x, weight, bias)


def rms_norm_linear(
    x: torch.Tensor,  # [M, K], M small (decode)
    residual: torch.Tensor | None,  # [M, K] or None
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> tuple[torch.Tensor, torch.Tensor | None]:  # linear(rms_norm(x (+ residual))), x + residual (or None)
    if use_triton(x.device):
        return triton_module("gemv", x.device).rms_norm_gemv(x, residual, norm_weight, eps, weight, bias)
    if residual is None:
        return linear_ref(rms_norm_ref(x, norm_weight, eps), weight, bias), None
    h, summed = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    return linear_ref(h, weight, bias), summed


def silu_and_mul_linear(
    x: torch.Tensor,  # [M, 2K] gate then up, M small (decode)
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]: linear(silu_and_mul(x), weight, bias), the MLP's activation and down projection
    if use_triton(x.device):
        return triton_module("gemv", x.device).silu_and_mul_gemv(x, weight, bias)
    return linear_ref(silu_and_mul_ref(x), weight, bias)
