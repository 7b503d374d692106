"""HF-Llama-style drafter heads: the layout of AWS's published P-EAGLE heads (and of the first EAGLE-3 releases).

config.json: an HF Llama (or Qwen3) config of the drafter's layers (num_hidden_layers = drafter depth, vocab_size =
the target's) plus draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids (top level or inside
eagle_config), norm_before_residual, ptd_token_id (the mask token; its presence marks a P-EAGLE head) and
num_lookahead_tokens (vLLM's default K for the head).
Tensors: as in the speculators format, except that layer 0 is named `midlayer.*` instead of `layers.0.*`.
vLLM serves these with {"method": "eagle3", "parallel_drafting": true} for P-EAGLE heads.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from peagle.drafters.config import DEFAULT_NUM_SPECULATIVE_TOKENS, DrafterConfig
from peagle.drafters.speculators_format import MASK_HIDDEN, refuse_unsupported_flags
from peagle.models.config import ModelConfig

logger = logging.getLogger(__name__)

ARCHITECTURES = {"llama": "LlamaForCausalLMEagle3", "qwen3": "Eagle3Qwen3ForCausalLM"}
FIRST_LAYER = "midlayer."


def is_aws_layout(d: dict[str, Any], tensor_names: Iterable[str]) -> bool:
    return "ptd_token_id" in d or "draft_vocab_size" in d or any(n.startswith(FIRST_LAYER) for n in tensor_names)


def config_to_dict(cfg: DrafterConfig) -> dict[str, Any]:
    d = cfg.transformer_layer_config.to_hf_dict()
    d.update(
        architectures=[ARCHITECTURES[cfg.transformer_layer_config.family]],
        draft_vocab_size=cfg.draft_vocab_size,
        target_hidden_size=cfg.target_hidden_size,
        eagle_aux_hidden_state_layer_ids=list(cfg.aux_layer_ids) if cfg.aux_layer_ids else None,
        norm_before_residual=cfg.norm_before_residual,
        num_lookahead_tokens=cfg.num_speculative_tokens,
    )
    if cfg.mask_token_id is not None:
        d["ptd_token_id"] = cfg.mask_token_id
    return d


def config_from_dict(d: dict[str, Any], tensor_names: Iterable[str]) -> DrafterConfig:
    eagle = d.get("eagle_config") or {}
    refuse_unsupported_flags(eagle)
    refuse_unsupported_flags(d)
    method = "peagle" if "ptd_token_id" in d or MASK_HIDDEN in set(tensor_names) else "eagle3"
    layers = ModelConfig.from_hf_dict({"model_type": "llama", **d})
    k = d.get("num_lookahead_tokens")
    if k is None:
        k = DEFAULT_NUM_SPECULATIVE_TOKENS[method]
        logger.warning("the head's config does not say how many tokens it drafts; assuming K=%d", k)
    return DrafterConfig(
        method=method,
        transformer_layer_config=layers,
        draft_vocab_size=d.get("draft_vocab_size") or layers.vocab_size,
        target_hidden_size=d.get("target_hidden_size") or layers.hidden_size,
        num_speculative_tokens=k,
        aux_layer_ids=d.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids"),
        mask_token_id=d.get("ptd_token_id"),
        # vLLM reads this flag off the head's config with a False default.
        norm_before_residual=bool(d.get("norm_before_residual", False)),
    )


def to_aws_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {_rename(name, "layers.0.", FIRST_LAYER): t for name, t in tensors.items()}


def from_aws_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {_rename(name, FIRST_LAYER, "layers.0."): t for name, t in tensors.items()}


def _rename(name: str, old: str, new: str) -> str:
    return new + name[len(old):] if name.startswith(old) else name
