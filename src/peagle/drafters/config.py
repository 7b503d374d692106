"""DrafterConfig: what a drafter head is and which target it belongs to."""

from __future__ import annotations

from dataclasses import dataclass

from peagle.models.config import SUPPORTED_ARCHITECTURES, ModelConfig

METHODS = ("eagle3", "peagle")
# The drafter reads the residual streams entering three target layers, concatenated (fc input = 3 * d_target).
NUM_AUX_LAYERS = 3
DEFAULT_NUM_LAYERS = {"eagle3": 1, "peagle": 4}
# Best K of each method in the published measurements; used when a checkpoint does not say what it was trained for.
DEFAULT_NUM_SPECULATIVE_TOKENS = {"eagle3": 3, "peagle": 7}
# vLLM serves drafter layers of these two kinds only (Eagle3/Peagle Llama and Qwen3 models).
LAYER_FAMILIES = ("llama", "qwen3")


def layer_family_for(target_family: str) -> str:
    """The family of a new drafter's layers: Qwen3 layers (q/k norms) for Qwen3 targets, Llama layers otherwise.

    Mistral dense layers are Llama layers; Qwen2's only difference is the q/k/v bias, which a freshly trained
    drafter does not need and vLLM's Llama-based drafter would not load.
    """
    return "qwen3" if target_family == "qwen3" else "llama"


@dataclass(frozen=True, kw_only=True, slots=True)
class DrafterConfig:
    """A drafter head.

    `transformer_layer_config` describes the drafter's own decoder layers as a target-family ModelConfig: its
    `num_hidden_layers` is the drafter depth and its `vocab_size` the target vocabulary (the embedding covers every
    target id, the lm_head only the draft vocabulary).
    `aux_layer_ids` None means the target's default (2, L//2, L-3), resolved when the head is loaded for a target.
    """

    method: str
    transformer_layer_config: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    num_speculative_tokens: int
    aux_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    norm_before_residual: bool = False
    target_architecture: str | None = None
    target_name_or_path: str | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown drafter method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not 1 <= self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in 1..{self.target_vocab_size} (the target vocabulary), "
                f"got {self.draft_vocab_size}"
            )
        if self.target_hidden_size <= 0:
            raise ValueError(f"target_hidden_size must be positive, got {self.target_hidden_size}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if self.aux_layer_ids is not None:
            ids = tuple(int(i) for i in self.aux_layer_ids)
            if len(ids) != NUM_AUX_LAYERS or min(ids) < 0:
                raise ValueError(
                    f"aux_layer_ids must be {NUM_AUX_LAYERS} non-negative target layer ids, got {list(ids)}"
                )
            object.__setattr__(self, "aux_layer_ids", ids)
        if self.method == "peagle" and self.mask_token_id is None:
            raise ValueError("a peagle drafter needs mask_token_id (the reserved token id of its MASK slots)")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.target_vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the target vocabulary 0..{self.target_vocab_size - 1}"
            )

    @property
    def num_layers(self) -> int:
        return self.transformer_layer_config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.transformer_layer_config.hidden_size

    @property
    def target_vocab_size(self) -> int:
        return self.transformer_layer_config.vocab_size

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features that `fc` (and `mask_hidden`) live in."""
        return NUM_AUX_LAYERS * self.target_hidden_size

    @property
    def target_family(self) -> str | None:
        return SUPPORTED_ARCHITECTURES.get(self.target_architecture) if self.target_architecture else None

    @property
    def parallel_drafting(self) -> bool:
        return self.method == "peagle"
