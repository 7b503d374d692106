"""Gemma 3 (270M to 27B; Gemma3ForCausalLM, and the text decoder of Gemma3ForConditionalGeneration).

Where it differs from Llama, all inside a layer or at the ends of the model:
- RMSNorm scales by (1 + w), every norm, computed in fp32;
- four norms a layer: before and after attention, before and after the MLP (sandwich norms);
- q/k norm; attention scores scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5;
- five sliding-window layers to one global one, the sliding layers with a RoPE base of their own (10,000 against
  1,000,000, the global layers possibly with linear scaling);
- GeGLU (tanh-approximated GELU) in place of SwiGLU;
- embeddings multiplied by sqrt(hidden_size), rounded to the model's dtype as transformers rounds it;
- final logits optionally soft-capped: cap * tanh(logits / cap).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from peagle.models.config import ModelConfig
from peagle.models.layers import MLP, Attention, RMSNorm, RotaryEmbedding, norm_linear
from peagle.models.llama import LlamaModel


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm, x_normed * (shift + w) * scale (Gemma 3: shift 1; Gemma 4: 0), with (shift + w) * scale held as
    the weight so that the shared RMSNorm kernels serve it: the checkpoint's w is folded in as it is loaded and
    unfolded in `state_dict`. In fp32 this is exact up to rounding; in bf16 the folded weight is rounded once
    (transformers rounds the product instead). `scale` (q_norm only) carries the family's score scale into q, so that
    the attention backends keep their head_dim ** -0.5."""

    def __init__(self, dim: int, eps: float, scale: float = 1.0, shift: float = 1.0):
        super().__init__(dim, eps)
        self.scale, self.shift = scale, shift
        self.register_load_state_dict_pre_hook(_fold)
        self.register_state_dict_post_hook(_unfold)


def _fold(norm: GemmaRMSNorm, state_dict, prefix, *args):
    key = prefix + "weight"
    if key in state_dict:
        w = state_dict[key]
        state_dict[key] = ((norm.shift + w.float()) * norm.scale).to(w.dtype)


def _unfold(norm: GemmaRMSNorm, state_dict, prefix, *args):
    w = state_dict[prefix + "weight"]
    state_dict[prefix + "weight"] = (w.float() / norm.scale - norm.shift).to(w.dtype)


class GemmaAttention(Attention):
    """Attention with Gemma's q/k norms, the query pre-scaled by sqrt(head_dim / query_pre_attn_scalar)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, scale=math.sqrt(cfg.head_dim / scalar))
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)


class GegluMLP(MLP):
    """gelu_tanh(gate) * up, then the down projection."""

    def down(self, h):
        # h: [T, 2 * intermediate] -> [T, hidden]
        gate, up = h.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """x + post_ffn_norm(mlp(pre_ffn_norm(h))), h = x + post_attn_norm(attn(input_norm(x)))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GemmaAttention(cfg, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GegluMLP(cfg.hidden_size, cfg.intermediate_size)
        self.rope: RotaryEmbedding | None = None  # a sliding layer's own RoPE (the model's, shared); None: the global

    def run(self, out, stream, positions, rope, attn):
        """DecoderLayer.run's contract: the stream the previous layer left as out + stream (out None: the
        embeddings) -> (the stream entering this layer, the MLP's normed output, the stream after attention)."""
        x, residual = (stream, None) if out is None else (out, stream)
        qkv, entering = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, x, residual)
        entering = stream if entering is None else entering
        o = self.self_attn.attend(qkv, positions, rope if self.rope is None else self.rope, attn)
        o = self.post_attention_layernorm(o)
        h, after = norm_linear(self.pre_feedforward_layernorm, self.mlp.gate_up_proj, o, entering)
        return entering, self.post_feedforward_layernorm(self.mlp.down(h)), after


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times `scale` (default sqrt(embedding_dim)), the factor rounded to the weights' dtype first
    (as transformers)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float | None = None):
        super().__init__(num_embeddings, embedding_dim)
        self.scale = embedding_dim ** 0.5 if scale is None else scale

    def forward(self, input_ids):
        # input_ids: [T] -> [T, embedding_dim]
        return super().forward(input_ids) * _rounded(self.scale, self.weight.dtype)


@functools.cache
def _rounded(x: float, dtype: torch.dtype) -> float:
    # A Python number, so that no tensor is made per call (CUDA graphs capture this forward).
    return torch.tensor(x, dtype=torch.float32, device="cpu").to(dtype).item()


class Gemma3Model(LlamaModel):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # self.rope serves the global layers. The sliding layers' frequencies are computed, never loaded: made on
        # the CPU even when the model is built on the meta device.
        with torch.device("cpu"):
            self.local_rope = RotaryEmbedding(cfg.head_dim, cfg.sliding_rope_theta or cfg.rope_theta, None,
                                              cfg.max_position_embeddings)
        for i, layer in enumerate(self.layers):
            if cfg.layer_window(i) and cfg.sliding_rope_theta:
                layer.rope = self.local_rope

    @staticmethod
    def make_layer(cfg: ModelConfig, layer_idx: int) -> Gemma3DecoderLayer:
        return Gemma3DecoderLayer(cfg, layer_idx)

    def forward(self, input_ids, positions, attn, aux_layer_ids=None):
        self.local_rope.max_positions = self.rope.max_positions  # the engine lengthens self.rope only
        return super().forward(input_ids, positions, attn, aux_layer_ids)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # hidden: [num_tokens, hidden] -> [num_tokens, vocab] in fp32 (into `out` when given)
        return softcap_(super().compute_logits(hidden, out), self.config.final_logit_softcapping)  # a tensor of its own


def softcap_(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap), in place; cap 0: the logits unchanged."""
    return logits.div_(cap).tanh_().mul_(cap) if cap else logits
