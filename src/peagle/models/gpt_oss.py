"""GPT-OSS (20B, 120B): every layer a mixture of experts (32 or 128 experts, top 4) with a biased router, biased
experts and a clamped SwiGLU; attention with q/k/v/o biases and a learned sink logit per head, alternating a
128-token sliding window with full attention; YaRN RoPE. The released checkpoints store the experts in MXFP4, which
weights.py dequantises at load."""

from __future__ import annotations

from peagle.models.config import ModelConfig
from peagle.models.layers import DecoderLayer
from peagle.models.llama import LlamaModel
from peagle.models.moe import MoE


class GptOssModel(LlamaModel):
    @staticmethod
    def make_layer(cfg: ModelConfig, layer_idx: int) -> DecoderLayer:
        return DecoderLayer(cfg, layer_idx, mlp=MoE(cfg, biases=True))
