"""The Llama-family target model (Llama, Mistral, Qwen2, Qwen3): one file, read top to bottom.

Families that differ only inside their decoder layers (qwen3_moe.py, gpt_oss.py) subclass it and override
`make_layer`; models/registry.py maps a config's family to its class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from peagle.models.attention import AttentionBackend, LayerKV, uniform_kv
from peagle.models.config import ModelConfig
from peagle.models.layers import DecoderLayer, RMSNorm, RotaryEmbedding


@dataclass
class ModelOutput:
    hidden: torch.Tensor  # [num_tokens, hidden], after the final norm
    aux: torch.Tensor | None  # [num_tokens, len(aux_layer_ids) * hidden], residual streams entering those layers


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @staticmethod
    def make_layer(cfg: ModelConfig, layer_idx: int) -> DecoderLayer:
        return DecoderLayer(cfg, layer_idx)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def kv_layers(self) -> list[LayerKV]:
        """Each layer's entry in the engine's paged KV cache (one shape, each its own, unless a family says)."""
        c = self.config
        return uniform_kv(c.num_hidden_layers, c.num_key_value_heads, c.head_dim)

    def check_aux_layer_ids(self, aux_layer_ids: Sequence[int]) -> None:
        n = self.config.num_hidden_layers
        bad = [i for i in aux_layer_ids if not 0 <= i <= n]
        if bad:
            raise ValueError(f"aux layer ids {bad} out of range for a {n}-layer model (allowed 0..{n})")

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        attn: AttentionBackend,
        aux_layer_ids: Sequence[int] | None = None,
    ) -> ModelOutput:
        # Each layer's output stream is left as (out, residual); the next norm adds them in its fused add + norm,
        # whose sum is the stream entering that layer: one kernel fewer per layer and free aux captures.
        stream = self.embed_tokens(input_ids)  # [T, hidden]
        wanted = tuple(aux_layer_ids or ())
        captured: dict[int, torch.Tensor] = {}
        out = None
        for i, layer in enumerate(self.layers):
            entering, out, stream = layer.run(out, stream, positions, self.rope, attn)
            if i in wanted:
                captured[i] = entering
        if out is None:
            hidden = self.norm(stream)
        else:
            hidden, stream = self.norm(out, residual=stream)
        if len(self.layers) in wanted:
            captured[len(self.layers)] = stream
        aux = torch.cat([captured[i] for i in wanted], dim=-1) if wanted else None
        return ModelOutput(hidden=hidden, aux=aux)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # hidden: [num_tokens, hidden] -> [num_tokens, vocab] in fp32 (written into `out` when given: the copy is the
        # conversion to fp32)
        logits = torch.nn.functional.linear(hidden, self.output_weight)
        return logits.float() if out is None else out.copy_(logits)
