"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention (q/k norm, grouped KV heads) with a mixture of
experts in place of the dense MLP (128 experts, top 8, renormalised where norm_topk_prob), except in the config's
dense layers (mlp_only_layers, decoder_sparse_step), which keep a dense MLP."""

from __future__ import annotations

from peagle.models.config import ModelConfig
from peagle.models.layers import DecoderLayer
from peagle.models.llama import LlamaModel
from peagle.models.moe import MoE


class Qwen3MoeModel(LlamaModel):
    @staticmethod
    def make_layer(cfg: ModelConfig, layer_idx: int) -> DecoderLayer:
        return DecoderLayer(cfg, layer_idx, mlp=MoE(cfg) if cfg.is_moe_layer(layer_idx) else None)
