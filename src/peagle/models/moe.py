"""The mixture-of-experts block: a router picks each token's top-k experts, one fused kernel runs them.

Every family's routing is the same rule with two switches: softmax over the router's logits in fp32, the top-k
experts, their weights renormalised to sum to one where the family asks (Qwen3-MoE's norm_topk_prob; GPT-OSS's
softmax over the top-k logits is the same thing). GPT-OSS adds a router bias, expert biases and its clamped SwiGLU.
The experts' weights are stacked: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]; weights.py maps each
family's checkpoint layout onto them.
"""

from __future__ import annotations

import torch
from torch import nn

from peagle.kernels.moe import fused_moe, route_topk
from peagle.models.config import ModelConfig


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, biases: bool = False):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.activation = "swiglu_limit" if cfg.swiglu_limit else "silu"
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.router = nn.Linear(h, e, bias=biases)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))
        self.b13 = nn.Parameter(torch.zeros(e, 2 * i)) if biases else None
        self.b2 = nn.Parameter(torch.zeros(e, h)) if biases else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, hidden] -> (weights [T, k] fp32, expert ids [T, k])
        return route_topk(self.router(x), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        weights, ids = self.route(x)
        return fused_moe(x, self.w13, self.w2, weights, ids, b13=self.b13, b2=self.b2, activation=self.activation,
                         alpha=self.alpha, limit=self.limit)
