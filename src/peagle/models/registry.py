"""Which model class serves a config's family."""

from __future__ import annotations

from torch import nn

from peagle.models.config import ModelConfig
from peagle.models.gemma3 import Gemma3Model
from peagle.models.gemma4 import Gemma4Model
from peagle.models.gpt_oss import GptOssModel
from peagle.models.llama import LlamaModel
from peagle.models.qwen3_moe import Qwen3MoeModel

MODEL_CLASSES: dict[str, type[LlamaModel]] = {
    "llama": LlamaModel, "mistral": LlamaModel, "qwen2": LlamaModel, "qwen3": LlamaModel,
    "qwen3_moe": Qwen3MoeModel, "gpt_oss": GptOssModel, "gemma3": Gemma3Model, "gemma4": Gemma4Model,
}


def build_model(cfg: ModelConfig) -> nn.Module:
    """The target model of `cfg`'s family, its parameters uninitialised (on the current default device)."""
    return MODEL_CLASSES[cfg.family](cfg)
