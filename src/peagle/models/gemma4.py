"""Gemma 4's text decoder (Gemma4ForCausalLM, and the text decoder of Gemma4ForConditionalGeneration), as
transformers 5.25 defines it.

Gemma 3's layer (sandwich norms, GeGLU, q/k norms, scaled embeddings, sliding and global layers with RoPE bases of
their own, soft-capped logits), with:
- plain RMSNorm (x * w, no +1); values RMS-normalised without a weight; scores not scaled (1, not head_dim ** -0.5);
- global layers with a head_dim (global_head_dim) and KV heads of their own, their keys doubling as values where
  attention_k_eq_v, rotated by "proportional" RoPE (a quarter of the head's frequency pairs, the rest unrotated);
- KV sharing: the last num_kv_shared_layers layers attend with the keys and values of the last earlier layer of their
  type and compute none (their MLP twice as wide where use_double_wide_mlp);
- per-layer input embeddings (PLE): a second embedding table and a projection of the embeddings give every layer a
  small vector, gated into the stream after its MLP;
- optionally a mixture of experts beside the dense MLP (GeGLU experts on the fused MoE kernel): its router normalises
  and scales its input and scales each chosen expert's weight;
- each layer's output stream multiplied by a learned layer_scalar.

The engine serves it: its paged KV cache gives each layer its own K/V shape (`kv_layers`), a KV-sharing layer the
cache of its source layer (which wrote the same keys and values; the sharer's store rewrites them unchanged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from peagle.kernels.moe import fused_moe, route_topk
from peagle.models.attention import AttentionBackend, LayerKV
from peagle.models.config import ModelConfig, UnsupportedModelError
from peagle.models.gemma3 import GemmaRMSNorm, ScaledEmbedding, softcap_
from peagle.models.layers import RMSNorm, RotaryEmbedding
from peagle.models.llama import LlamaModel, ModelOutput

ROPE_TYPES = ("default", "proportional")


@dataclass(frozen=True, kw_only=True, slots=True)
class Gemma4Layout:
    """What a Gemma 4 config says per layer beyond ModelConfig (read from its extra Hugging Face keys)."""

    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    kv_sources: tuple[int, ...]  # the layer whose keys and values each layer attends with (itself unless shared)
    keys_as_values: tuple[bool, ...]
    mlp_sizes: tuple[int, ...]
    per_layer_input_size: int  # 0: no per-layer inputs
    per_layer_vocab_size: int
    rope: dict[str, dict[str, Any]]  # RoPE parameters per layer type

    @classmethod
    def of(cls, cfg: ModelConfig) -> "Gemma4Layout":
        x, n, types = cfg.extra, cfg.num_hidden_layers, cfg.layer_types
        # A saved config lists what differs from the base layer; one written by hand may give the arguments instead.
        overrides = {int(i): o for i, o in (x.get("per_layer_config") or {}).items()}
        if "per_layer_config" not in x:
            full = {"head_dim": x.get("global_head_dim") or 512}
            if x.get("attention_k_eq_v") and x.get("num_global_key_value_heads"):
                full["num_key_value_heads"] = x["num_global_key_value_heads"]
            overrides = {i: full for i in range(n) if types[i] == "full_attention"}
        unknown = sorted({k for o in overrides.values() for k in o} - {"head_dim", "num_key_value_heads"})
        if unknown:
            raise UnsupportedModelError(f"Gemma 4 per-layer overrides of {unknown} are not supported")
        first_shared = n - (x.get("num_kv_shared_layers") or 0)
        sources = []
        for i in range(n):
            producers = [j for j in range(min(i + 1, first_shared)) if types[j] == types[i]]
            if not producers:
                raise ValueError(f"Gemma 4 layer {i} ({types[i]}) shares the KV states of no earlier layer of its type")
            sources.append(producers[-1])
        wide = bool(x.get("use_double_wide_mlp"))
        return cls(
            head_dims=tuple(overrides.get(i, {}).get("head_dim", cfg.head_dim) for i in range(n)),
            kv_heads=tuple(overrides.get(i, {}).get("num_key_value_heads", cfg.num_key_value_heads) for i in range(n)),
            kv_sources=tuple(sources),
            keys_as_values=tuple(bool(x.get("attention_k_eq_v")) and t == "full_attention" for t in types),
            mlp_sizes=tuple(cfg.intermediate_size * (2 if wide and sources[i] != i else 1) for i in range(n)),
            per_layer_input_size=x.get("hidden_size_per_layer_input") or 0,
            per_layer_vocab_size=x.get("vocab_size_per_layer_input") or cfg.vocab_size,
            rope=x["rope_parameters"],
        )


def _unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, in fp32 (Gemma 4's values and its router's input)."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(x)


def _rope(params: dict[str, Any], head_dim: int, max_positions: int) -> RotaryEmbedding:
    kind = params.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"Gemma 4 RoPE type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    # Computed, never loaded: made on the CPU even when the model is built on the meta device.
    with torch.device("cpu"):
        rope = RotaryEmbedding(head_dim, float(params["rope_theta"]), None, max_positions)
        if kind == "proportional":
            rope.inv_freq = _proportional_inv_freq(head_dim, params)
    return rope


def _proportional_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """transformers' "proportional" RoPE: the first partial_rotary_factor of the pairs turn at a head_dim-wide RoPE's
    frequencies, the others not at all; every frequency divided by `factor`."""
    rotated = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    exponents = torch.arange(0, 2 * rotated, 2, dtype=torch.int64).float() / head_dim
    inv_freq = torch.cat([1.0 / params["rope_theta"] ** exponents, torch.zeros(head_dim // 2 - rotated)])
    return inv_freq / params.get("factor", 1.0)


def _rotate(x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
    # x: [T, H, D] -> [T, H, D]; the rotate-half RoPE of one tensor (a KV-sharing layer rotates its queries only)
    cos, sin = rope.tables(x.device)
    c, s = cos[positions].to(x.dtype)[:, None], sin[positions].to(x.dtype)[:, None]
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: Gemma4Layout, layer_idx: int):
        super().__init__()
        self.layer_idx, self.eps = layer_idx, cfg.rms_norm_eps
        self.num_heads, self.head_dim = cfg.num_attention_heads, layout.head_dims[layer_idx]
        self.num_kv_heads, self.kv_source = layout.kv_heads[layer_idx], layout.kv_sources[layer_idx]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=cfg.qkv_bias)
        # Scores are not scaled: q carries sqrt(head_dim) against the attention backends' head_dim ** -0.5.
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, scale=math.sqrt(self.head_dim), shift=0.0)
        if self.kv_source == layer_idx:
            self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
            keys_as_values = layout.keys_as_values[layer_idx]
            self.v_proj = None if keys_as_values else nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.window = cfg.layer_window(layer_idx)
        self.shares = layer_idx in layout.kv_sources[layer_idx + 1:]  # a later layer attends with its K/V
        self.rope: RotaryEmbedding | None = None  # its layer type's (and head_dim's), set by the model

    def forward(self, x, positions, attn: AttentionBackend, shared: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        # x: [T, hidden] -> [T, hidden]; shared: layer -> the (k, v) it leaves to the layers that reuse them
        q = self.q_norm(self.q_proj(x).view(-1, self.num_heads, self.head_dim))  # [T, Hq, D]
        if self.kv_source != self.layer_idx:
            k, v = shared[self.kv_source]
            q = _rotate(q, positions, self.rope)
        else:
            k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
            v = k if self.v_proj is None else self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
            q, k = self.rope(positions, q, self.k_norm(k))
            v = _unit_rms_norm(v, self.eps)
            if self.shares:
                shared[self.layer_idx] = (k, v)
        o = attn(self.layer_idx, q, k, v, **({"window": self.window} if self.window else {}))  # [T, Hq, D]
        return self.o_proj(o.reshape(-1, self.num_heads * self.head_dim))


class Gemma4MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        # x: [T, hidden] -> [T, hidden]
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma4Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.eps = cfg.num_experts_per_tok, cfg.rms_norm_eps
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))

    def forward(self, x):
        # x: [T, hidden] -> (weights [T, k] fp32, expert ids [T, k])
        h = _unit_rms_norm(x, self.eps) * self.scale * x.shape[-1] ** -0.5
        weights, ids = route_topk(self.proj(h), self.top_k, renormalize=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4Experts(nn.Module):
    """The experts, stacked as the checkpoint holds them: gate_up_proj [E, 2I, H] (gate rows, then up rows) and
    down_proj [E, H, I]; GeGLU, through the fused MoE kernel (kernels/moe.py)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x, weights, ids):
        # x: [T, hidden], weights / ids: [T, k] -> [T, hidden]
        return fused_moe(x, self.gate_up_proj, self.down_proj, weights.float(), ids, activation="gelu_tanh")


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: Gemma4Layout, layer_idx: int):
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Gemma4Attention(cfg, layout, layer_idx)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.mlp = Gemma4MLP(hidden, layout.mlp_sizes[layer_idx])
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.experts = None
        if cfg.num_experts:
            self.router = Gemma4Router(cfg)
            self.experts = Gemma4Experts(cfg)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        if layout.per_layer_input_size:
            self.per_layer_input_gate = nn.Linear(hidden, layout.per_layer_input_size, bias=False)
            self.per_layer_projection = nn.Linear(layout.per_layer_input_size, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x, positions, attn, shared, per_layer_input):
        # x: [T, hidden], per_layer_input: [T, per_layer_input_size] or None -> [T, hidden]
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, attn, shared))
        m = self.mlp(self.pre_feedforward_layernorm(h))
        if self.experts is not None:  # the experts read the stream itself, beside the dense MLP
            weights, ids = self.router(h)
            moe = self.post_feedforward_layernorm_2(self.experts(self.pre_feedforward_layernorm_2(h), weights, ids))
            m = self.post_feedforward_layernorm_1(m) + moe
        h = h + self.post_feedforward_layernorm(m)
        if per_layer_input is not None:
            gated = F.gelu(self.per_layer_input_gate(h), approximate="tanh") * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar


class Gemma4Model(LlamaModel):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        layout = Gemma4Layout.of(cfg)
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.per_layer_input_size = p = layout.per_layer_input_size
        if p:
            self.embed_tokens_per_layer = ScaledEmbedding(layout.per_layer_vocab_size, cfg.num_hidden_layers * p,
                                                          scale=p ** 0.5)
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, cfg.num_hidden_layers * p, bias=False)
            self.per_layer_projection_norm = RMSNorm(p, cfg.rms_norm_eps)
        # One RoPE per layer type and head_dim; self.rope (LlamaModel's) only carries the positions the engine asks.
        self.ropes: dict[tuple[str, int], RotaryEmbedding] = {}
        for i, layer in enumerate(self.layers):
            key = (cfg.layer_types[i], layout.head_dims[i])
            if key not in self.ropes:
                self.ropes[key] = _rope(layout.rope[key[0]], key[1], cfg.max_position_embeddings)
            layer.self_attn.rope = self.ropes[key]

    @staticmethod
    def make_layer(cfg: ModelConfig, layer_idx: int) -> Gemma4DecoderLayer:
        return Gemma4DecoderLayer(cfg, Gemma4Layout.of(cfg), layer_idx)

    def kv_layers(self) -> list[LayerKV]:
        """Global layers with their own head_dim and KV heads; a KV-sharing layer reads its source layer's cache."""
        layout = Gemma4Layout.of(self.config)
        return [LayerKV(h, d, src) for h, d, src in zip(layout.kv_heads, layout.head_dims, layout.kv_sources)]

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Every layer's input of PLE: (norm(projected embeddings) + the per-layer embedding) / sqrt(2).
        input_ids: [T], embeds: [T, hidden] (scaled) -> [T, num_layers, per_layer_input_size]"""
        shape = (-1, len(self.layers), self.per_layer_input_size)
        token = self.embed_tokens_per_layer(input_ids).view(shape)
        context = self.per_layer_model_projection(embeds) * embeds.shape[-1] ** -0.5
        return (self.per_layer_projection_norm(context.view(shape)) + token) * 2.0 ** -0.5

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        attn: AttentionBackend,
        aux_layer_ids: Sequence[int] | None = None,
    ) -> ModelOutput:
        for rope in self.ropes.values():
            rope.max_positions = self.rope.max_positions  # the engine lengthens self.rope only
        x = self.embed_tokens(input_ids)  # [T, hidden]
        per_layer = self.per_layer_inputs(input_ids, x) if self.per_layer_input_size else None
        wanted = tuple(aux_layer_ids or ())
        captured: dict[int, torch.Tensor] = {}
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            if i in wanted:
                captured[i] = x
            x = layer(x, positions, attn, shared, None if per_layer is None else per_layer[:, i])
        captured[len(self.layers)] = x
        aux = torch.cat([captured[i] for i in wanted], dim=-1) if wanted else None
        return ModelOutput(hidden=self.norm(x), aux=aux)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # hidden: [num_tokens, hidden] -> [num_tokens, vocab] in fp32 (into `out` when given)
        return softcap_(super().compute_logits(hidden, out), self.config.final_logit_softcapping)  # a tensor of its own
