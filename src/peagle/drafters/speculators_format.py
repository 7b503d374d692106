"""The speculators checkpoint format (what vLLM serves natively), which is also peagle's own format.

config.json, as speculators 0.9's Eagle3SpeculatorConfig / PEagleSpeculatorConfig write it (every field with a
default is written, so speculators and vLLM read no default of their own):
    speculators_model_type "eagle3" | "peagle", architectures ["Eagle3Speculator"] | ["PEagleSpeculator"],
    speculators_version, transformer_layer_config (an HF Llama/Qwen3 config of the drafter's layers; vocab_size =
    the target's), draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids, norm_before_residual,
    norm_before_fc, fc_norm, norm_output (all False here), embed_requires_grad, mask_token_id (peagle; vLLM turns it
    into its pard_token), tie_word_embeddings, dtype,
    speculators_config {algorithm, proposal_methods [{proposal_type "greedy", speculative_tokens, ...}],
                        default_proposal_method "greedy", verifier {name_or_path, architectures}}.
    Both spellings of the dtype and of RoPE are written, top level and in transformer_layer_config: transformers 5's
    `dtype` / `rope_parameters` and the older `torch_dtype` / `rope_theta` + `rope_scaling` (transformers 5 reads
    the pair without a warning; older readers ignore the keys they do not know). Reading accepts either.
    verifier.name_or_path: the target as an absolute path when it was given as a local directory (speculators and
    `vllm serve HEAD_DIR` resolve a relative one against their working directory, not the head's, and then look
    on the hub); a hub id stays as it is.
model.safetensors, HF names without a `model.` prefix:
    embed_tokens.weight (may be absent: vLLM then shares the target's), fc.weight, layers.N.* (separate
    q/k/v/gate/up projections; layer 0 adds hidden_norm), norm.weight, lm_head.weight, mask_hidden [1, 1, 3*d_target]
    (peagle), and d2t, t2d only for a reduced draft vocabulary: with the whole target vocabulary vLLM builds no
    map and refuses the tensors, and speculators writes none (reading restores the identity map).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from peagle.drafters.config import DEFAULT_NUM_SPECULATIVE_TOKENS, METHODS, DrafterConfig
from peagle.models.config import ModelConfig
from peagle.models.weights import hf_names, to_hf_state_dict

logger = logging.getLogger(__name__)

ARCHITECTURES = {"eagle3": "Eagle3Speculator", "peagle": "PEagleSpeculator"}
# The speculators release whose config layout is written (speculators records its own version in this field).
SPECULATORS_VERSION = "0.9.0"
# vLLM's translators fill these in when a config leaves them out; reading follows them so a head runs the same here.
DEFAULT_NORM_BEFORE_RESIDUAL = {"eagle3": True, "peagle": False}
# Feature-normalisation variants of newer heads; this drafter implements none of them.
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")
MASK_HIDDEN = "mask_hidden"
VOCAB_MAPS = ("d2t", "t2d")


def is_speculators_config(d: dict[str, Any]) -> bool:
    return "speculators_model_type" in d


def config_to_dict(cfg: DrafterConfig) -> dict[str, Any]:
    layer = layer_config_dict(cfg.transformer_layer_config)
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.method]],
        "speculators_model_type": cfg.method,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids) if cfg.aux_layer_ids else None,
        "norm_before_residual": cfg.norm_before_residual,
        **{flag: False for flag in UNSUPPORTED_FLAGS},
        # peagle's trainer trains the embedding of both methods (speculators' defaults: peagle yes, eagle3 no).
        "embed_requires_grad": True,
        "tie_word_embeddings": False,
        "dtype": layer["dtype"],
        "torch_dtype": layer["dtype"],
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
                "name_or_path": verifier_path(cfg.target_name_or_path),
                "architectures": [cfg.target_architecture] if cfg.target_architecture else [],
            },
        },
    }
    if cfg.mask_token_id is not None:
        d["mask_token_id"] = cfg.mask_token_id
    return d


def layer_config_dict(layers: ModelConfig) -> dict[str, Any]:
    """The drafter layers' HF config in transformers 5's spelling plus the older one (see the module docstring)."""
    d = layers.to_hf_dict()
    scaling = {k: v for k, v in (layers.rope_scaling or {}).items() if k != "type"}
    kind = (layers.rope_scaling or {}).get("rope_type", (layers.rope_scaling or {}).get("type", "default"))
    d["rope_parameters"] = {**scaling, "rope_type": kind, "rope_theta": layers.rope_theta}
    d["dtype"] = layers.torch_dtype
    return d


def verifier_path(name_or_path: str | None) -> str | None:
    """A local target directory as an absolute path; a hub id (no such directory here) unchanged."""
    if name_or_path and Path(name_or_path).is_dir():
        return str(Path(name_or_path).resolve())
    return name_or_path


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
    # speculators' own heads name their dtype at the top level only (transformers leaves a default one out).
    dtype = d.get("dtype") or d.get("torch_dtype") or "bfloat16"
    layers = ModelConfig.from_hf_dict({"model_type": "llama", "dtype": dtype, **d["transformer_layer_config"]})
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


def without_identity_maps(tensors: dict[str, torch.Tensor], cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    """The tensors to write: d2t / t2d left out when the draft vocabulary is the whole target vocabulary."""
    if cfg.draft_vocab_size != cfg.target_vocab_size:
        return tensors
    if "d2t" in tensors and bool(tensors["d2t"].any()):
        raise ValueError("d2t maps a draft vocabulary as large as the target's onto other ids; the head is corrupt")
    return {name: t for name, t in tensors.items() if name not in VOCAB_MAPS}


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
