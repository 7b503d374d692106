"""Building blocks of the Llama family. Every tensor is token-flat: [num_tokens, ...].

The element-wise steps (RMSNorm, add + RMSNorm, RoPE, SiLU-and-mul) go through `peagle.kernels`, which runs fused
Triton kernels on the GPU and the PyTorch references elsewhere. The kernels have no backward, so whenever autograd
is recording (training) the references run instead, or what the trainer installed in TRAINING_OPS.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from peagle import kernels
from peagle.models.attention import AttentionBackend
from peagle.models.config import ModelConfig


# Differentiable implementations to use instead of the references while autograd records (training): the trainer
# installs compiled ones here (peagle.training.compiled_ops); empty, the references run.
TRAINING_OPS: dict[str, Callable] = {}


def _op(name: str):
    """The fused kernel dispatch when no gradient is needed, else the differentiable reference (or the training
    implementation installed for it)."""
    if not torch.is_grad_enabled():
        return getattr(kernels, name)
    return TRAINING_OPS.get(name) or getattr(kernels, f"{name}_ref")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, returns (norm(x + residual), x + residual) in one fused step."""
        if residual is None:
            return _op("rms_norm")(x, self.weight, self.eps)
        return _op("fused_add_rms_norm")(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if kind == "linear":  # positions divided by `factor` (position interpolation)
        return inv_freq / scaling["factor"]
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    # YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated (divided by
    # factor), those that turn more than beta_fast times kept, with a linear ramp between (transformers' formula).
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations):
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor on cos and sin: YaRN's 0.1 ln(factor) + 1 (or its mscale form, or attention_factor), else 1."""
    if scaling is None or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]

    def mscale(m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale()


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE, the Hugging Face layout."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)  # fp32 on purpose: not a buffer, never cast
        self.attention_factor = rope_attention_factor(scaling)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tables:
            pos = torch.arange(self.max_positions, dtype=torch.float32)
            freqs = torch.outer(pos, self.inv_freq.cpu())
            emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
            f = self.attention_factor
            self._tables[device] = ((emb.cos() * f).to(device), (emb.sin() * f).to(device))
        return self._tables[device]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]
        cos_t, sin_t = self.tables(q.device)  # [max_positions, D] fp32
        return _op("rotary")(positions, q, k, cos_t, sin_t)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, input_size: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        in_size = input_size or cfg.hidden_size
        self.qkv_proj = nn.Linear(in_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        # A sliding layer's window and the learned sinks go to the backend only when set, so that backends which
        # never meet them (the drafters') keep the plain call.
        self.window = cfg.layer_window(layer_idx)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if cfg.attention_sinks else None

    def forward(self, x, positions, rope: RotaryEmbedding, attn: AttentionBackend):
        # x: [T, in_size] -> [T, hidden]
        return self.attend(self.qkv_proj(x), positions, rope, attn)

    def attend(self, qkv, positions, rope: RotaryEmbedding, attn: AttentionBackend):
        """Everything after the qkv projection: qkv [T, q_size + 2 * kv_size] -> [T, hidden]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        options = {}
        if self.window:
            options["window"] = self.window
        if self.sinks is not None:
            options["sinks"] = self.sinks
        fused = getattr(attn, "rotary_attend", None)  # a backend that rotates and stores k/v in one kernel
        if fused is not None and not torch.is_grad_enabled():
            if self.qk_norm:  # normalised in the same kernel
                options["qk_norm"] = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            o = fused(self.layer_idx, positions, q, k, v, rope, **options)
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rope(positions, q, k)
            o = attn(self.layer_idx, q, k, v, **options)  # [T, Hq, D]
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down(self.gate_up_proj(x))

    def down(self, h):
        """silu(gate) * up, then the down projection: h [T, 2 * intermediate] -> [T, hidden]."""
        if isinstance(self.down_proj, kernels.GemvLinear) and self.down_proj.takes(h):  # decode_gemv: one kernel fewer
            return kernels.silu_and_mul_linear(h, self.down_proj.weight, self.down_proj.bias)
        return self.down_proj(_op("silu_and_mul")(h))


def norm_linear(norm: RMSNorm, linear: nn.Linear, x, residual=None):
    """(linear(norm(x + residual)), x + residual), or without `residual` (linear(norm(x)), None). With a GemvLinear
    at decode sizes (decode_gemv) the norm runs inside the projection's kernel: one kernel fewer."""
    if isinstance(linear, kernels.GemvLinear) and linear.takes(x):
        return kernels.rms_norm_linear(x, residual, norm.weight, norm.eps, linear.weight, linear.bias)
    if residual is None:
        return linear(norm(x)), None
    h, summed = norm(x, residual=residual)
    return linear(h), summed


class DecoderLayer(nn.Module):
    """Pre-norm attention then MLP. `mlp` is the dense MLP unless given (a family's mixture of experts)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size) if mlp is None else mlp

    def forward(self, x, positions, rope, attn):
        # x: [T, hidden] -> [T, hidden]
        out, residual = self.body(self.input_layernorm(x), x, positions, rope, attn)
        return residual + out

    def run(self, out, stream, positions, rope, attn):
        """The layer on the stream that the previous one left as out + stream (out None: stream alone, the
        embeddings). Returns (the stream entering this layer, the MLP's output, the stream after attention): the
        layer's output stream is the sum of the last two, which the next layer's input norm adds (`body`'s
        convention); each norm runs inside the projection after it where `norm_linear` can."""
        x, residual = (stream, None) if out is None else (out, stream)
        qkv, entering = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, x, residual)
        entering = stream if entering is None else entering
        o = self.self_attn.attend(qkv, positions, rope, attn)
        if not isinstance(self.mlp, MLP):
            h, after = self.post_attention_layernorm(o, residual=entering)
            return entering, self.mlp(h), after
        h, after = norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, o, entering)
        return entering, self.mlp.down(h), after

    def body(self, h, residual, positions, rope, attn):
        """Everything after the input norm. h = input_layernorm(stream), residual = the stream entering the layer.
        Returns (mlp output, stream after attention): the layer's output stream is their sum, which the caller may
        leave to the next layer's fused add + norm instead of a separate add."""
        h = self.self_attn(h, positions, rope, attn)
        h, residual = self.post_attention_layernorm(h, residual=residual)  # h = norm(res + attn), res = res + attn
        return self.mlp(h), residual
