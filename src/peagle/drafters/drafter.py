"""The drafter head: EAGLE-3 and P-EAGLE share this one module; P-EAGLE only adds the two MASK placeholders.

    features [T, 3*d_target] --fc--> hidden [T, d]
    layer 0:  residual = hidden (or hidden_norm(hidden) with norm_before_residual)
              x = residual + attn(cat(input_layernorm(embed(ids)), hidden_norm(hidden)))   # qkv input width 2d
              x = x + mlp(post_attention_layernorm(x))
    layers 1..N-1: ordinary decoder layers of the target's family
    output: x (pre-norm; EAGLE-3 feeds it back as the next pass's hidden), logits = lm_head(norm(x)) over the
    draft vocabulary, mapped to target ids by d2t.
P-EAGLE's MASK slots take `mask_token_id` as their token and `mask_hidden` (pre-fc width) as their feature, so
they go through embed_tokens and fc exactly like real slots.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from peagle.drafters.config import (DEFAULT_NUM_LAYERS, DEFAULT_NUM_SPECULATIVE_TOKENS, DrafterConfig,
                                    layer_family_for)
from peagle.drafters.target import TargetParts, choose_mask_token_id
from peagle.drafters.vocab import DraftVocab
from peagle.models.attention import AttentionBackend
from peagle.models.config import ModelConfig
from peagle.models.layers import MLP, Attention, DecoderLayer, RMSNorm, RotaryEmbedding
from peagle.models.llama import LlamaModel
from peagle.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

INIT_STD = 0.02  # the initializer_range of Hugging Face Llama/Qwen configs


class FirstLayer(nn.Module):
    """Drafter layer 0: attends over the token embedding and the projected target feature side by side."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool):
        super().__init__()
        d = cfg.hidden_size
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx=0, input_size=2 * d)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = MLP(d, cfg.intermediate_size)

    def forward(self, embeds, hidden, positions, rope, attn):
        # embeds, hidden: [T, d] -> [T, d]
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [T, 2d]
        x = residual + self.self_attn(x, positions, rope, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig, vocab: DraftVocab | None = None):
        super().__init__()
        self.config = config
        lc = config.transformer_layer_config
        d = lc.hidden_size
        self.embed_tokens = nn.Embedding(config.target_vocab_size, d)
        self.fc = nn.Linear(config.feature_size, d, bias=False)
        self.layers = nn.ModuleList(
            [FirstLayer(lc, config.norm_before_residual), *(DecoderLayer(lc, i) for i in range(1, config.num_layers))]
        )
        self.norm = RMSNorm(d, lc.rms_norm_eps)
        self.lm_head = nn.Linear(d, config.draft_vocab_size, bias=False)
        self.rope = RotaryEmbedding(lc.head_dim, lc.rope_theta, lc.rope_scaling, lc.max_position_embeddings)
        vocab = vocab or DraftVocab.identity(config.target_vocab_size)
        if (vocab.size, vocab.target_vocab_size) != (config.draft_vocab_size, config.target_vocab_size):
            raise ValueError(
                f"draft vocabulary maps {vocab.size} draft ids onto {vocab.target_vocab_size} target ids, but the "
                f"config says {config.draft_vocab_size} onto {config.target_vocab_size}"
            )
        self.register_buffer("d2t", vocab.d2t.clone())  # [draft_vocab] int64
        self.register_buffer("t2d", vocab.t2d.clone())  # [target_vocab] bool
        # Shared by every MASK slot at every depth; lives before fc, in the target's feature space.
        self.mask_hidden = nn.Parameter(torch.zeros(config.feature_size)) if config.parallel_drafting else None

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        attn: AttentionBackend,
        hidden: torch.Tensor,  # [num_tokens, d]: fc(features), for real and MASK slots alike
    ) -> torch.Tensor:  # [num_tokens, d], before the final norm
        x = self.layers[0](self.embed_tokens(input_ids), hidden, positions, self.rope, attn)
        for layer in self.layers[1:]:
            x = layer(x, positions, self.rope, attn)
        return x

    def compute_logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        # hidden_out: [num_tokens, d] -> [num_tokens, draft_vocab] in fp32
        return F.linear(self.norm(hidden_out), self.lm_head.weight).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab(d2t=self.d2t.cpu(), t2d=self.t2d.cpu())

    @classmethod
    def for_target(
        cls,
        target: LlamaModel | TargetParts | str | Path,
        method: str,
        num_layers: int | None = None,
        *,
        draft_vocab: DraftVocab | int | None = None,
        vocab_corpus: Iterable[Sequence[int]] | None = None,
        aux_layer_ids: Sequence[int] | None = None,
        mask_token_id: int | None = None,
        num_speculative_tokens: int | None = None,
        norm_before_residual: bool = False,
        tokenizer: Tokenizer | None = None,
        seed: int = 0,
    ) -> "Drafter":
        """A freshly initialised drafter for `target` (a loaded model or a checkpoint directory), in fp32.

        Layers copy the target's shape (hidden, heads, KV heads, head_dim, FFN, RoPE); embed_tokens is a copy of
        the target's embedding and lm_head of the target's output rows of the draft vocabulary; the rest is
        random (seeded). `draft_vocab`: None = every target id; an int N = the N most frequent ids of
        `vocab_corpus` (token-id sequences) plus the target's end-of-sequence ids; or a ready DraftVocab.
        A peagle head's mask token defaults to a reserved id of the target's tokenizer (`choose_mask_token_id`).
        """
        parts = target if isinstance(target, TargetParts) else TargetParts.of(target, tokenizer)
        tcfg = parts.config
        vocab = _draft_vocab(parts, draft_vocab, vocab_corpus)
        aux = tuple(aux_layer_ids) if aux_layer_ids is not None else tcfg.default_aux_layer_ids
        bad = [i for i in aux if not 0 <= i <= tcfg.num_hidden_layers]
        if bad:
            raise ValueError(
                f"aux layer ids {bad} out of range for a {tcfg.num_hidden_layers}-layer target "
                f"(allowed 0..{tcfg.num_hidden_layers})"
            )
        if method == "peagle" and mask_token_id is None:
            mask_token_id = choose_mask_token_id(parts.tokenizer, tcfg.vocab_size)
        config = DrafterConfig(
            method=method,
            transformer_layer_config=drafter_layer_config(tcfg, num_layers or DEFAULT_NUM_LAYERS.get(method, 1)),
            draft_vocab_size=vocab.size,
            target_hidden_size=tcfg.hidden_size,
            num_speculative_tokens=num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS.get(method, 1),
            aux_layer_ids=aux,
            mask_token_id=mask_token_id,
            norm_before_residual=norm_before_residual,
            target_architecture=tcfg.architecture,
            target_name_or_path=parts.name_or_path,
        )
        drafter = cls(config, vocab)
        _initialise(drafter, parts, vocab, seed)
        return drafter


def drafter_layer_config(target: ModelConfig, num_layers: int) -> ModelConfig:
    """The target's layer shape for a `num_layers`-deep drafter, in a layer family vLLM serves."""
    family = layer_family_for(target.family)
    # Dense full-attention layers whatever the target's: a drafter attends a few hundred positions of its own.
    return dataclasses.replace(
        target, family=family, num_hidden_layers=num_layers, tie_word_embeddings=False,
        qkv_bias=False, o_bias=False, qk_norm=family == "qwen3", layer_types=(), sliding_window=0,
        attention_sinks=False, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, norm_topk_prob=False,
        dense_layers=(), swiglu_limit=0.0, sliding_rope_theta=0.0, query_pre_attn_scalar=0,
        final_logit_softcapping=0.0, extra={},
    )


def _draft_vocab(parts: TargetParts, draft_vocab, corpus) -> DraftVocab:
    vocab_size = parts.config.vocab_size
    if isinstance(draft_vocab, DraftVocab):
        if draft_vocab.target_vocab_size != vocab_size:
            raise ValueError(
                f"the draft vocabulary was built for {draft_vocab.target_vocab_size} target ids, "
                f"the target has {vocab_size}"
            )
        return draft_vocab
    if draft_vocab is None or draft_vocab == vocab_size:
        return DraftVocab.identity(vocab_size)
    if corpus is None:
        logger.warning("no vocabulary corpus: the draft vocabulary is the %d lowest token ids (fine for timing, "
                       "useless for training)", draft_vocab)
        return DraftVocab.from_counts(torch.zeros(vocab_size), draft_vocab, parts.eos_token_ids)
    return DraftVocab.from_corpus(corpus, vocab_size, draft_vocab, parts.eos_token_ids)


@torch.no_grad()
def _initialise(drafter: Drafter, parts: TargetParts, vocab: DraftVocab, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for module in drafter.modules():
        if isinstance(module, nn.Linear):
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * INIT_STD)
            if module.bias is not None:
                module.bias.zero_()
    if drafter.mask_hidden is not None:  # speculators starts it from a standard normal too
        drafter.mask_hidden.copy_(torch.randn(drafter.mask_hidden.shape, generator=gen))
    drafter.embed_tokens.weight.copy_(parts.embedding)
    # As speculators does: start the draft lm_head from the target's own output rows.
    drafter.lm_head.weight.copy_(parts.output_weight[vocab.target_ids])
