"""The speculators checkpoint format (what vLLM serves natively), which is also peagle's own format.

config.json (the fields speculators' Eagle3SpeculatorConfig / PEagleSpeculatorConfig define and vLLM reads):
    speculators_model_type "eagle3" | "peagle", architectures ["Eagle3Speculator"] | ["PEagleSpeculator"],
    transformer_layer_config (an HF Llama/Qwen3 config of the drafter's layers; vocab_size = the target's),
    draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids, norm_before_residual, norm_before_fc,
    mask_token_id (peagle; vLLM turns it into its pard_token),
    speculators_config {algorithm, proposal_methods [{proposal_type "greedy", speculative_tokens, ...}],
                        default_proposal_method "greedy", verifier {name_or_path, architectures}}.
model.safetensors, HF names without a `model.` prefix:
    embed_tokens.weight (may be absent: vLLM then shares the target's), fc.weight, layers.N.* (separate
    q/k/v/gate/up projections; layer 0 adds hidden_norm), norm.weight, lm_head.weight, d2t, t2d,
    mask_hidden [1, 1, 3*d_target] (peagle).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from peagle.drafters.config import DEFAULT_NUM_SPECULATIVE_TOKENS, METHODS, DrafterConfig
from peagle.models.config import ModelConfig
from peagle.models.weights import hf_names, to_hf_state_dict

logger = logging.getLogger(__name__)

ARCHITECTURES = {"eagle3": "Eagle3Speculator", "peagle": "PEagleSpeculator"}
# vLLM's translators fill these in when a config leaves them out; reading follows them so a head runs the same here.
DEFAULT_NORM_BEFORE_RESIDUAL = {"eagle3": True, "peagle": False}
# Feature-normalisation variants of newer heads; this drafter implements none of them.
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")
MASK_HIDDEN = "mask_hidden"


def is_speculators_config(d: dict[str, Any]) -> bool:
    return "speculators_model_type" in d


def config_to_dict(cfg: DrafterConfig) -> dict[str, Any]:
    layer = cfg.transformer_layer_config.to_hf_dict()
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.method]],
        "speculators_model_type": cfg.method,
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids) if cfg.aux_layer_ids else None,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": False,
        "torch_dtype": layer["torch_dtype"],
        "speculators_config": {
            "algorithm": cfg.method,
            "proposal_methods": [{
                "proposal_type": "greedy",
                "speculative_tokens": cfg.num_speculative_tokens,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": cfg.target_name_or_path,
                "architectures": [cfg.target_architecture] if cfg.target_architecture else [],
            },
        },
    }
    if cfg.mask_token_id is not None:
        d["mask_token_id"] = cfg.mask_token_id
    return d


def config_from_dict(d: dict[str, Any]) -> DrafterConfig:
    method = d["speculators_model_type"]
    if method not in METHODS:
        raise ValueError(
            f"speculators_model_type {method!r} is not a drafter peagle runs; supported: {', '.join(METHODS)}"
        )
    refuse_unsupported_flags(d)
    if not isinstance(d.get("transformer_layer_config"), dict):
        raise ValueError("a speculators config needs transformer_layer_config (the drafter layers' HF config)")
    spec = d.get("speculators_config") or {}
    proposals = spec.get("proposal_methods") or [{}]
    verifier = spec.get("verifier") or {}
    layers = ModelConfig.from_hf_dict({"model_type": "llama", **d["transformer_layer_config"]})
    return DrafterConfig(
        method=method,
        transformer_layer_config=layers,
        draft_vocab_size=d.get("draft_vocab_size") or layers.vocab_size,
        target_hidden_size=d.get("target_hidden_size") or layers.hidden_size,
        num_speculative_tokens=proposals[0].get("speculative_tokens") or DEFAULT_NUM_SPECULATIVE_TOKENS[method],
        aux_layer_ids=d.get("eagle_aux_hidden_state_layer_ids") or None,
        mask_token_id=d.get("mask_token_id"),
        norm_before_residual=bool(d.get("norm_before_residual", DEFAULT_NORM_BEFORE_RESIDUAL[method])),
        target_architecture=next(iter(verifier.get("architectures") or []), None),
        target_name_or_path=verifier.get("name_or_path"),
    )


def refuse_unsupported_flags(d: dict[str, Any]) -> None:
    on = [flag for flag in UNSUPPORTED_FLAGS if d.get(flag)]
    if on:
        raise ValueError(
            f"this drafter head sets {', '.join(on)} (extra RMSNorms on the target features); peagle's drafter does "
            "not implement them, so it would compute something else than the head was trained for"
        )


def tensors_from_state_dict(state_dict: dict[str, torch.Tensor], cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    """Drafter module tensors -> on-disk names and shapes (fused projections split)."""
    state = dict(state_dict)
    mask_hidden = state.pop(MASK_HIDDEN, None)
    out = {name.removeprefix("model."): t for name, t in to_hf_state_dict(state, cfg.transformer_layer_config).items()}
    if mask_hidden is not None:
        out[MASK_HIDDEN] = mask_hidden.reshape(1, 1, -1).contiguous()
    return out


def disk_names(module_name: str) -> list[str]:
    """The on-disk tensor(s) one drafter module tensor is stored as."""
    return [n.removeprefix("model.") for n in hf_names(module_name)]


def state_dict_from_tensors(
    tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """On-disk tensors -> the drafter module's state dict (`expected` gives its names and shapes).

    Raises ValueError naming the missing tensors or the first tensor of the wrong shape.
    """
    state, missing = {}, []
    for name, like in expected.items():
        parts = disk_names(name)
        if not all(p in tensors for p in parts):
            missing += [p for p in parts if p not in tensors]
            continue
        tensor = tensors[parts[0]] if len(parts) == 1 else torch.cat([tensors[p] for p in parts], dim=0)
        if name == MASK_HIDDEN:
            tensor = tensor.reshape(-1)
        if tuple(tensor.shape) != tuple(like.shape):
            raise ValueError(
                f"tensor {name} has shape {list(tensor.shape)} but the config implies {list(like.shape)}; "
                "do config.json and the weights belong together?"
            )
        state[name] = tensor
    if missing:
        raise ValueError(f"the drafter checkpoint lacks {len(missing)} tensor(s): {', '.join(missing[:6])}")
    extra = sorted(set(tensors) - {n for name in expected for n in disk_names(name)})
    if extra:
        logger.warning("ignoring %d checkpoint tensor(s) the drafter does not use: %s", len(extra), extra[:5])
    return state
